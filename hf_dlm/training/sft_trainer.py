"""`DLMSFTTrainer`: trl's `SFTTrainer` with the masked-diffusion loss (trl's diffusion SFT example, made whole).

trl prepares the data exactly as for an AR model (language modelling, prompt-completion, conversational with
the chat template, packing); three hooks change:
- `_prepare_dataset` adds `sample_index` (the row number), the key of the row's diffusion noise.
- the collator (`DLMSFTCollator`, wrapping trl's) turns trl's labels into `prompt_mask` (real tokens trl does
  not supervise: never noised, no loss), applies the EOS-padding policy and keeps packed rows as rows with
  restarting `position_ids` (the DLM masks attention per document) instead of trl's single flattened row.
- `get_batch_samples` corrupts an optimizer step's micro-batches together (`MaskedDiffusionObjective.corrupt`;
  antithetic t over the step's global batch) and counts the loss normaliser over all of them and all ranks,
  as `DLMTrainer` does: 2 micro-batches of 8 give 1 micro-batch of 16's update under every normalisation.
- `compute_loss`: the DLM's masked-only head with that normaliser. trl's causal fused LM head is never
  installed (`without_causal_lm_head`); handing a DLM to trl's plain `SFTTrainer` raises.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..utils.import_utils import require

require("trl", "DLMSFTTrainer")

from trl import SFTTrainer  # noqa: E402

from ..modeling.loss import IGNORE_INDEX  # noqa: E402
from .sft_config import DLMSFTConfig  # noqa: E402
from .trainer import antithetic_group, corrupted_model_inputs, rescale_router_loss  # noqa: E402
from .trl_compat import ensure_mask_token, load_dlm, without_causal_lm_head  # noqa: E402


@dataclass
class DLMSFTCollator:
    """trl's collator output -> the DLM batch: input_ids, attention_mask, prompt_mask (B, L) bool,
    sample_index (B,), position_ids for packed rows. padding_policy 'eos': right padding becomes EOS, attended
    and supervised (LLaDA); 'exclude': padding stays out of attention and loss."""

    inner: Any
    eos_token_id: int
    padding_policy: str = "eos"

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
        return out


_CORRUPTED = "_dlm_corrupted"  # statistics of a micro-batch corrupted by get_batch_samples


class DLMSFTTrainer(SFTTrainer):
    """SFT of masked-diffusion LMs with trl's data pipeline. Arguments as `trl.SFTTrainer`; `args` is a
    `DLMSFTConfig`; `objective` defaults to `args.build_objective(model.config)`."""

    _tag_names = ["trl", "sft", "hf-dlm", "diffusion"]
    # compute_loss divides by the optimizer step's global normaliser: no further division by the accumulation
    loss_is_scaled_for_ga = True

    def __init__(self, model, args: DLMSFTConfig | None = None, data_collator=None, train_dataset=None,
                 eval_dataset=None, processing_class=None, objective=None, **kwargs):
        if args is None:
            args = DLMSFTConfig(output_dir="outputs/dlm-sft")
        if not isinstance(args, DLMSFTConfig):
            raise TypeError(f"DLMSFTTrainer needs a DLMSFTConfig, got {type(args).__name__}")
        if kwargs.get("compute_loss_func") is not None:
            raise ValueError("DLMSFTTrainer: compute_loss_func is not supported; the loss is the diffusion objective")
        model = load_dlm(model, args.model_init_kwargs, "DLMSFTTrainer")
        with without_causal_lm_head("trl.trainer.sft_trainer"):
            super().__init__(model=model, args=args, data_collator=data_collator, train_dataset=train_dataset,
                             eval_dataset=eval_dataset, processing_class=processing_class, **kwargs)
        config = self.accelerator.unwrap_model(self.model).config
        ensure_mask_token(self._tokenizer, self.accelerator.unwrap_model(self.model))
        inner = self.data_collator
        if hasattr(inner, "padding_free"):  # trl's DataCollatorForLanguageModeling: keep packed rows as rows
            inner.padding_free = False
            inner.return_position_ids = args.packing
        eos = self._tokenizer.eos_token_id
        if eos is None:
            raise ValueError("DLMSFTTrainer needs a tokenizer with an EOS token (padding and the sampler's stop)")
        self.data_collator = DLMSFTCollator(inner, eos, args.padding_policy)
        self.objective = objective if objective is not None else args.build_objective(config)

    def _set_signature_columns_if_needed(self):
        super()._set_signature_columns_if_needed()
        if "sample_index" not in self._signature_columns:
            self._signature_columns = [*self._signature_columns, "sample_index"]

    def _prepare_dataset(self, dataset, processing_class, args, packing, formatting_func, dataset_name):
        dataset = super()._prepare_dataset(dataset, processing_class, args, packing, formatting_func, dataset_name)
        if "sample_index" in (dataset.column_names or []):
            return dataset
        return dataset.map(lambda _, index: {"sample_index": index}, with_indices=True)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """The micro-batches of one optimizer step, corrupted together, and their global number of loss items."""
        batches = []
        for _ in range(num_batches):
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        if not batches:
            return batches, None
        for batch in batches:
            batch["sample_index"] = self._epoch_keyed(batch["sample_index"].to(device))
        t_group = antithetic_group(self.objective, self.accelerator, [b["sample_index"] for b in batches], device)
        samples = [self._corrupt(batch, device, t_group) for batch in batches]
        items = sum(sample[_CORRUPTED]["items"] for sample in samples)
        if self.accelerator.num_processes > 1:
            items = self.accelerator.gather(items.reshape(1)).sum()
        return samples, items.clamp(min=1)

    def _epoch_keyed(self, sample_index):
        """A new epoch draws new noise: the global index of the draw, not only of the row."""
        if self.train_dataset is not None and hasattr(self.train_dataset, "__len__"):
            sample_index = sample_index + int(self.state.epoch or 0) * len(self.train_dataset)
        return sample_index

    def _corrupt(self, inputs, device, t_group=None) -> dict:
        """A clean micro-batch -> the model's inputs, with this micro-batch's statistics under _CORRUPTED."""
        config = self.accelerator.unwrap_model(self.model).config
        model_inputs, corrupted = corrupted_model_inputs(self.objective, inputs, device, t_group,
                                                         getattr(config, "attention_mode", None))
        attention_mask, prompt_mask = inputs["attention_mask"].to(device), inputs["prompt_mask"].to(device)
        model_inputs[_CORRUPTED] = {
            "items": torch.as_tensor(self.objective.loss_items(corrupted), dtype=torch.float32, device=device),
            "real": attention_mask.sum(), "masked": corrupted["masked"].sum(),
            "supervised": (attention_mask.bool() & ~prompt_mask).sum(),
        }
        return model_inputs

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if _CORRUPTED not in inputs:  # a clean batch (evaluation, direct calls): corrupt it here
            inputs = self._corrupt(inputs, self.args.device)
        inputs = dict(inputs)
        stats = inputs.pop(_CORRUPTED)
        loss_scale = 1
        if num_items_in_batch is None:
            num_items_in_batch = stats["items"].clamp(min=1)
        elif self.accelerator.num_processes > 1:
            loss_scale = self.accelerator.num_processes  # a global normaliser, gradients averaged over ranks
        outputs = model(**inputs, num_items_in_batch=num_items_in_batch)
        loss = outputs.loss * loss_scale
        router_loss = getattr(outputs, "router_loss", None)
        if router_loss is not None and model.training:
            loss = rescale_router_loss(self, loss, router_loss, loss_scale)
        mode = "train" if model.training else "eval"
        real = stats["real"].clamp(min=1)
        self._metrics[mode]["masked_fraction"].append(float(stats["masked"] / real))
        self._metrics[mode]["supervised_fraction"].append(float(stats["supervised"] / real))
        if mode == "train":
            self._total_train_tokens += int(self.accelerator.gather_for_metrics(stats["real"].reshape(1)).sum())
            self._metrics[mode]["num_tokens"] = [self._total_train_tokens]
        return (loss, outputs) if return_outputs else loss


__all__ = ["DLMSFTTrainer", "DLMSFTCollator"]
