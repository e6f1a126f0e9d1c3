"""`DLMSFTTrainer`: trl's `SFTTrainer` with the masked-diffusion loss (trl's diffusion SFT example, made whole).

trl prepares the data exactly as for an AR model (language modelling, prompt-completion, conversational with
the chat template, packing); these hooks change:
- `_prepare_dataset` adds `sample_index` (the row number), the key of the row's diffusion noise; a streaming
  (`datasets.IterableDataset`) train set is read through `HFRowStream`: rows keyed by pass and row number,
  its position saved in every checkpoint and restored on resume (no batches skipped by re-reading them).
- the collator (`DLMSFTCollator`, wrapping trl's) turns trl's labels into `prompt_mask` (real tokens trl does
  not supervise: never noised, no loss), applies the EOS-padding policy and keeps packed rows as rows with
  restarting `position_ids` (the DLM masks attention per document) instead of trl's single flattened row.
- the diffusion hooks are `DLMTrainer`'s own (`diffusion_batch.DiffusionBatchMixin`): an optimizer step's
  micro-batches corrupted together with the loss normaliser counted over all of them and all ranks, device
  meshes, float8 and per-block compile, tokens/s, MFU and CE-by-t logging, and `evaluate` reporting the ELBO
  bound over the completion tokens (not trl's loss on corrupted batches); checkpoints are
  `checkpointing.CheckpointingMixin`'s (atomic, DCP under a mesh, data position and float8 resume).
  trl's causal fused LM head is never installed (`without_causal_lm_head`); handing a DLM to trl's plain
  `SFTTrainer` raises.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ..utils.import_utils import require

require("trl", "DLMSFTTrainer")

from datasets import IterableDataset  # noqa: E402
from transformers.utils import logging  # noqa: E402
from trl import SFTTrainer  # noqa: E402

from ..data.collator import DATA_STATE_KEY  # noqa: E402
from ..data.hf_stream import HFRowStream  # noqa: E402
from ..modeling.loss import IGNORE_INDEX  # noqa: E402
from .sft_config import DLMSFTConfig  # noqa: E402
from .checkpointing import CheckpointingMixin  # noqa: E402
from .diffusion_batch import DiffusionBatchMixin  # noqa: E402
from .pipeline_training import PipelineTrainingMixin  # noqa: E402
from .trl_compat import ensure_mask_token, load_dlm, without_causal_lm_head  # noqa: E402

logger = logging.get_logger(__name__)


@dataclass
class DLMSFTCollator:
    """trl's collator output -> the DLM batch: input_ids, attention_mask, prompt_mask (B, L) bool,
    sample_index (B,), position_ids for packed rows. padding_policy 'eos': right padding becomes EOS, attended
    and supervised (LLaDA); 'exclude': padding stays out of attention and loss."""

    inner: Any
    eos_token_id: int
    padding_policy: str = "eos"
    state_source: Any = None  # a stream with state_dict(): batches carry its position (as DLMDataCollator's)

    def __call__(self, examples: list[dict]) -> dict:
        indices = torch.tensor([int(example.pop("sample_index")) for example in examples], dtype=torch.long)
        batch = self.inner(examples)
        input_ids, labels = batch["input_ids"], batch["labels"]
        attention_mask = batch.get("attention_mask", torch.ones_like(input_ids)).bool()
        packed = "position_ids" in batch and bool((batch["position_ids"][:, 1:] == 0).any())
        out = {"input_ids": input_ids, "sample_index": indices}
        if self.padding_policy == "eos" and not packed:
            padding = ~attention_mask
            out["input_ids"] = input_ids.masked_fill(padding, self.eos_token_id)
            supervised = (labels != IGNORE_INDEX) | padding
            attention_mask = torch.ones_like(attention_mask)
        else:
            supervised = labels != IGNORE_INDEX
        out["attention_mask"] = attention_mask.long()
        out["prompt_mask"] = attention_mask & ~supervised  # (B, L): real tokens trl does not train on
        if packed:
            out["position_ids"] = batch["position_ids"]
        if self.state_source is not None:
            out[DATA_STATE_KEY] = self.state_source.state_dict()
        return out


class DLMSFTTrainer(DiffusionBatchMixin, CheckpointingMixin, PipelineTrainingMixin, SFTTrainer):
    """SFT of masked-diffusion LMs with trl's data pipeline. Arguments as `trl.SFTTrainer`; `args` is a
    `DLMSFTConfig`; `objective` defaults to `args.build_objective(model.config)`."""

    _tag_names = ["trl", "sft", "hf-dlm", "diffusion"]
    card_trainer = "hf_dlm.DLMSFTTrainer"

    def __init__(self, model, args: DLMSFTConfig | None = None, data_collator=None, train_dataset=None,
                 eval_dataset=None, processing_class=None, objective=None, **kwargs):
        if args is None:
            args = DLMSFTConfig(output_dir="outputs/dlm-sft")
        if not isinstance(args, DLMSFTConfig):
            raise TypeError(f"DLMSFTTrainer needs a DLMSFTConfig, got {type(args).__name__}")
        if kwargs.get("compute_loss_func") is not None:
            raise ValueError("DLMSFTTrainer: compute_loss_func is not supported; the loss is the diffusion objective")
        model = load_dlm(model, args.model_init_kwargs, "DLMSFTTrainer")
        self._prepare_diffusion_model(model, args)
        full_model = model
        model = self._setup_pipeline(model, args, eval_dataset)  # pp_size > 1: this rank's stages only
        if model is not full_model:  # trl writes the pad id and its tags through the model it holds: the full one's
            model.generation_config, model.add_model_tags = full_model.generation_config, full_model.add_model_tags
        with without_causal_lm_head("trl.trainer.sft_trainer"):
            super().__init__(model=model, args=args, data_collator=data_collator, train_dataset=train_dataset,
                             eval_dataset=eval_dataset, processing_class=processing_class, **kwargs)
        ensure_mask_token(self._tokenizer, full_model)
        inner = self.data_collator
        if hasattr(inner, "padding_free"):  # trl's DataCollatorForLanguageModeling: keep packed rows as rows
            inner.padding_free = False
            inner.return_position_ids = args.packing
        if self._parallel is not None and hasattr(inner, "pad_to_multiple_of"):
            # sequence-parallel norms split every sequence over tp ranks, context parallel over cp ranks
            multiple = math.lcm(inner.pad_to_multiple_of or 1, self._parallel.dims.tp * self._parallel.dims.cp)
            inner.pad_to_multiple_of = None if multiple == 1 else multiple
        if self._pipeline is not None:  # a pipeline sends fixed-shape activations: every batch max_length long
            if not hasattr(inner, "pad_to_multiple_of"):
                raise ValueError(f"DLMSFTTrainer with pp_size > 1 pads every batch to max_length through the "
                                 f"collator's pad_to_multiple_of; {type(inner).__name__} has none")
            inner.pad_to_multiple_of = args.max_length
        eos = self._tokenizer.eos_token_id
        if eos is None:
            raise ValueError("DLMSFTTrainer needs a tokenizer with an EOS token (padding and the sampler's stop)")
        self.data_collator = DLMSFTCollator(inner, eos, args.padding_policy)
        if self.train_dataset is not None and hasattr(self.train_dataset, "__len__"):
            self._epoch_stride = len(self.train_dataset)  # rows are keyed by row number: add the epoch's offset
        elif isinstance(self.train_dataset, IterableDataset):
            if args.dataloader_num_workers > 1:
                logger.warning("DLMSFTTrainer: a streaming train dataset resumes from its saved position with "
                               "dataloader_num_workers <= 1; with more, a resume skips the consumed batches")
            else:  # rows keyed by pass and row number; checkpoints save the stream position
                self.train_dataset = HFRowStream(self.train_dataset)
                self.data_collator.state_source = self.train_dataset
        self._finish_diffusion_setup(self.model, objective)

    def _set_signature_columns_if_needed(self):
        super()._set_signature_columns_if_needed()
        if "sample_index" not in self._signature_columns:
            self._signature_columns = [*self._signature_columns, "sample_index"]

    def _prepare_dataset(self, dataset, processing_class, args, packing, formatting_func, dataset_name):
        dataset = super()._prepare_dataset(dataset, processing_class, args, packing, formatting_func, dataset_name)
        if "sample_index" in (dataset.column_names or []):
            return dataset
        return dataset.map(lambda _, index: {"sample_index": index}, with_indices=True)

    def _evaluation_set(self, eval_dataset):
        """A set handed to `evaluate` is prepared as trl prepares the trainer's own (tokenized, templated, packed
        with eval_packing), as `SFTTrainer.evaluate` does; a name picks one prepared at __init__."""
        if eval_dataset is None or isinstance(eval_dataset, str) or self._skip_prepare_dataset:
            return eval_dataset
        packing = self.args.packing if self.args.eval_packing is None else self.args.eval_packing
        return self._prepare_dataset(eval_dataset, self.processing_class, self.args, packing, self._formatting_func,
                                     "eval")

    def _batch_metrics(self, stats: dict, training: bool) -> None:
        """trl's per-mode metrics: the supervised fraction and trl's token count (training), the masked
        fraction of evaluation batches (training logs get the token-weighted one of the mixin's window)."""
        mode = "train" if training else "eval"
        real = stats["tokens"].clamp(min=1) if torch.is_tensor(stats["tokens"]) else max(stats["tokens"], 1)
        self._metrics[mode]["supervised_fraction"].append(float(stats["supervised"] / real))
        if training:  # TP / CP ranks share a batch, and so do the pp ranks of a pipeline (they pool one)
            replicas = (self._parallel.replicas if self._parallel is not None
                        else self._pipeline.pp_size if self._pipeline is not None else 1)
            tokens = torch.as_tensor(stats["tokens"] / replicas, device=self.args.device).reshape(1)
            self._total_train_tokens += round(float(self.accelerator.gather_for_metrics(tokens).sum()))
            self._metrics[mode]["num_tokens"] = [self._total_train_tokens]
        elif stats["masked_rows"] is not None:
            self._metrics[mode]["masked_fraction"].append(float(stats["masked_rows"].sum() / real))


__all__ = ["DLMSFTTrainer", "DLMSFTCollator"]
