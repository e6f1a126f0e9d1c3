"""Shared helpers of the trainer tests (also imported by the DDP worker script)."""

from __future__ import annotations

import torch
from transformers import TrainerCallback

from hf_dlm.data.memory_dataset import TokenWindowDataset
from hf_dlm.training.trainer import DLMTrainer
from hf_dlm.training.training_args import DLMTrainingArguments
from tests.conftest import VOCAB, tiny_model

SEQ_LEN = 16


def random_dataset(n: int = 24, seed: int = 0) -> TokenWindowDataset:
    generator = torch.Generator().manual_seed(seed)
    return TokenWindowDataset(torch.randint(0, VOCAB - 1, (n, SEQ_LEN), generator=generator))


class StepRecorder:
    """Mixed into a diffusion trainer (DLMTrainer, DLMSFTTrainer): records the loss of every optimizer step
    (sum of its micro-batch losses, as the Trainer does), the sample indices it drew, its batches and the
    gradients just before each optimizer step."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.step_losses, self.sample_indices, self.grads, self.batches = [], [], [], []
        self._step_loss = 0.0

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        self.batches.append(batches)
        return batches, num_items

    def _corrupt(self, batch, device, t_group=None):
        self.sample_indices.extend(int(i) for i in batch["sample_index"])
        return super()._corrupt(batch, device, t_group)

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        self._step_loss += float(loss)
        if self.accelerator.sync_gradients:
            self.step_losses.append(self._step_loss)
            self._step_loss = 0.0
            model = self.accelerator.unwrap_model(self.model)
            self.grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
        return loss


class RecordingTrainer(StepRecorder, DLMTrainer):
    pass


def window_stream(ids: torch.Tensor, seed: int = 0):
    """The production stream stack (`build_pretraining_dataset` without the files): windows shuffled per
    epoch with (seed, epoch), endless, position in `state_dict()`; accelerate shards it over ranks."""
    from hf_dlm.data.streams import DistributedSampleStream, ShuffledSamples

    return DistributedSampleStream(ShuffledSamples(TokenWindowDataset(ids), seed=seed, num_epochs=None))


def make_args(output_dir, **overrides) -> DLMTrainingArguments:
    options = dict(output_dir=str(output_dir), use_cpu=True, report_to="none", disable_tqdm=True, seed=0,
                   per_device_train_batch_size=4, learning_rate=1e-2, lr_scheduler_type="cosine", warmup_steps=2,
                   logging_steps=1, save_strategy="no", max_steps=10, dataloader_num_workers=0)
    options.update(overrides)
    return DLMTrainingArguments(**options)


def make_trainer(output_dir, dataset=None, model_seed: int = 0, trainer_class=RecordingTrainer, eval_dataset=None,
                 **overrides):
    model = tiny_model(seed=model_seed).train()
    return trainer_class(model=model, args=make_args(output_dir, **overrides),
                         train_dataset=random_dataset() if dataset is None else dataset, eval_dataset=eval_dataset)


def flat_params(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


class StopAfter(TrainerCallback):
    """Ends training after `step` optimizer steps, as an interruption would (the schedule still spans max_steps)."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True
        return control
