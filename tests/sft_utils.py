"""Shared pieces of the DLMSFTTrainer tests (single process and the torchrun worker): the toy 'reverse the
digits' task of `hf_dlm.training.post_training`, a tiny model, and a trainer that records what it did."""

from __future__ import annotations

import torch

from hf_dlm import DLMConfig, DLMForDiffusionLM
from hf_dlm.training.post_training import toy_rows, toy_tokenizer
from hf_dlm.training.sft_config import DLMSFTConfig
from hf_dlm.training.sft_trainer import DLMSFTTrainer
from tests.utils import flat_params  # noqa: F401  (re-exported for the SFT tests)


def sft_model(tokenizer, seed: int = 0) -> DLMForDiffusionLM:
    torch.manual_seed(seed)
    config = DLMConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, mask_token_id=tokenizer.mask_token_id,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                       max_position_embeddings=64, attn_implementation="sdpa")
    return DLMForDiffusionLM(config).train()


def sft_rows(n: int, seed: int = 3):
    from datasets import Dataset

    return Dataset.from_list([{"prompt": r["prompt"], "completion": r["completion"]} for r in toy_rows(n, seed)])


class RecordingSFTTrainer(DLMSFTTrainer):
    """Records each optimizer step's loss (sum over its micro-batches), the noise keys it drew, and the
    gradients of the first step."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.step_losses, self.sample_indices, self.grads = [], [], []
        self._step_loss = 0.0

    def _corrupt(self, batch, device, t_group=None):
        self.sample_indices.extend(int(i) for i in batch["sample_index"])
        return super()._corrupt(batch, device, t_group)

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        self._step_loss += float(loss)
        if self.accelerator.sync_gradients:
            self.step_losses.append(self._step_loss)
            self._step_loss = 0.0
            if not self.grads:
                model = self.accelerator.unwrap_model(self.model)
                self.grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()
                                   if p.grad is not None})
        return loss


def sft_config(output_dir, **overrides) -> DLMSFTConfig:
    """Adam with a constant, non-zero learning rate; EOS padding off (the padded length, so the data, would
    depend on how rows are split into micro-batches and ranks)."""
    options = dict(output_dir=str(output_dir), use_cpu=True, report_to="none", bf16=False, save_strategy="no",
                   disable_tqdm=True, seed=0, logging_steps=1, max_steps=4, per_device_train_batch_size=4,
                   learning_rate=1e-2, lr_scheduler_type="constant", max_length=16, padding_policy="exclude",
                   dataloader_num_workers=0, max_grad_norm=0.5)
    options.update(overrides)
    return DLMSFTConfig(**options)


def sft_trainer(output_dir, rows: int = 16, model_seed: int = 0, tokenizer=None, **overrides) -> RecordingSFTTrainer:
    tokenizer = tokenizer or toy_tokenizer()
    return RecordingSFTTrainer(model=sft_model(tokenizer, model_seed), args=sft_config(output_dir, **overrides),
                               train_dataset=sft_rows(rows), processing_class=tokenizer)


def logged(trainer, key: str, after_step: int = 0) -> list:
    return [log[key] for log in trainer.state.log_history if key in log and log.get("step", 0) > after_step]
