"""`DLMTrainer`: `transformers.Trainer` for masked-diffusion LMs, overriding narrow hooks, not the loop.

The diffusion hooks (batch corruption and the global loss normaliser, the loss, throughput / MFU / CE-by-t
statistics, device-mesh set-up, `evaluate` with the ELBO bound) are `diffusion_batch.DiffusionBatchMixin`,
shared with `DLMSFTTrainer`;
checkpoints (atomic staged saves, DCP routing, data-position and float8 resume) are
`checkpointing.CheckpointingMixin`. Here: the pretraining data path (map-style datasets get sample indices,
streams report their position) and pipeline parallelism (`PipelineTrainingMixin`, shared with `DLMSFTTrainer`).
The final save's model card is `CheckpointingMixin`'s.
"""

from __future__ import annotations

from torch.utils.data import Dataset, IterableDataset
from transformers import Trainer
from transformers.utils import logging

from ..data.collator import DLMDataCollator
from ..diffusion.objective import MaskedDiffusionObjective
from .checkpointing import DATA_STATE_NAME, FLOAT8_STATE_NAME, OBJECTIVE_NAME, STAGING_DIR, CheckpointingMixin
from .diffusion_batch import STATS_KEY, DiffusionBatchMixin, antithetic_group, corrupted_model_inputs
from .pipeline_training import PipelineTrainingMixin
from .training_args import DLMTrainingArguments

logger = logging.get_logger(__name__)

_STATS = STATS_KEY  # the name tests and older code import
__all__ = ["DLMTrainer", "DATA_STATE_NAME", "FLOAT8_STATE_NAME", "OBJECTIVE_NAME", "STAGING_DIR",
           "antithetic_group", "corrupted_model_inputs"]


class DLMTrainer(DiffusionBatchMixin, CheckpointingMixin, PipelineTrainingMixin, Trainer):
    """Trainer of `DLMForDiffusionLM` (or any model taking `labels`, `label_weights` and
    `num_items_in_batch`). `objective` defaults to `args.build_objective(model.config)`."""

    card_trainer = "hf_dlm.DLMTrainer"  # the model card's "trainer" field

    def __init__(self, model=None, args: DLMTrainingArguments | None = None, data_collator=None, train_dataset=None,
                 eval_dataset=None, objective: MaskedDiffusionObjective | None = None, **kwargs):
        if args is None:
            args = DLMTrainingArguments(output_dir="outputs/dlm")
        if not isinstance(args, DLMTrainingArguments):
            raise TypeError(f"DLMTrainer needs DLMTrainingArguments, got {type(args).__name__}")
        if model is None:
            raise ValueError("DLMTrainer needs a model")
        self._epoch_stride = None
        if _needs_sample_index(train_dataset):
            train_dataset = _IndexedSamples(train_dataset)
            self._epoch_stride = len(train_dataset)  # noise key = epoch * len(dataset) + dataset index
        # a plain eval dataset (or a dict of them) gets its dataset index as the key: the same masks at every
        # evaluation, so evaluations compare
        if isinstance(eval_dataset, dict):
            eval_dataset = {name: _IndexedSamples(d) if _needs_sample_index(d) else d for name, d in eval_dataset.items()}
        elif _needs_sample_index(eval_dataset):
            eval_dataset = _IndexedSamples(eval_dataset)
        if data_collator is None:
            data_collator = DLMDataCollator(pad_token_id=getattr(model.config, "pad_token_id", None) or 0)
        if (isinstance(data_collator, DLMDataCollator) and data_collator.state_source is None
                and isinstance(train_dataset, IterableDataset) and hasattr(train_dataset, "state_dict")):
            data_collator.state_source = train_dataset  # batches carry the stream position
            if args.dataloader_num_workers > 1:
                logger.warning("the position of an iterable train dataset is exact with dataloader_num_workers <= 1: "
                               "each worker holds its own copy of the stream")
        self._prepare_diffusion_model(model, args)
        model = self._setup_pipeline(model, args, eval_dataset)  # pp_size > 1: this rank's stages only
        super().__init__(model=model, args=args, data_collator=data_collator, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, **kwargs)
        self._finish_diffusion_setup(model, objective)


class _IndexedSamples(Dataset):
    """An ordinary map-style dataset (a tokenized `datasets.Dataset`, a list of dicts) whose items have
    `input_ids` but no `sample_index`: each item gets its dataset index (the trainer adds the epoch)."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict:
        item = self.dataset[index]
        if not isinstance(item, dict) or "input_ids" not in item:
            raise ValueError(f"DLMTrainer: train_dataset[{index}] must be a dict with 'input_ids', got "
                             f"{type(item).__name__}{' with keys ' + str(sorted(item)) if isinstance(item, dict) else ''}")
        return {**item, "sample_index": int(index)}


def _needs_sample_index(dataset) -> bool:
    if dataset is None or isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__") or len(dataset) == 0:
        return False
    first = dataset[0]
    return isinstance(first, dict) and "sample_index" not in first
