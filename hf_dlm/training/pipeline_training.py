"""The Trainer hooks of a pipeline-parallel run (`pp_size > 1`), mixed into `DLMTrainer` and `DLMSFTTrainer`.

Without a pipeline every hook defers to `transformers.Trainer`. With one:
- the model the Trainer holds is this rank's `DLMPipelineModel` (its stages' parameters, `save_pretrained`
  names); accelerate must not wrap it in DDP (`_wrap_model` hands the loop a thin holder instead);
- the pp ranks of a data-parallel group pool the batches they read (`_pool_pipeline_batch`), so each stage
  sees the same micro-batch and the Trainer's batch accounting (per device x world x accumulation) holds;
- the first micro-batch of an accumulation window runs the whole window through the schedule
  (`_pipeline_training_step`), the others return 0; gradient norms span every stage (`_clip_grad_norm`);
- checkpoints: per-stage safetensors shards under `save_pretrained` keys plus the optimizer through DCP
  (`hf_dlm.parallel.pipeline_checkpoint`), which any layout, pipelined or not, resumes from.
"""

from __future__ import annotations

import os

import torch
from torch import nn

SCHEDULER_NAME = "scheduler.pt"


class _PipelineHolder(nn.Module):
    """What the training loop calls `model`: holds the pipeline's parameters (train / zero_grad / parameters)
    and is not the Trainer's `self.model`, so accelerate prepares only the optimizer, never a DDP wrapper."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        raise RuntimeError("a pipeline-parallel model runs through DLMPipeline.step, not forward")


class PipelineTrainingMixin:
    _pipeline = None
    _pipeline_window: list | None = None

    def _setup_pipeline(self, model, args, eval_dataset=None):
        """Cut `model` into this rank's stages when args.pp_size > 1; returns what the Trainer should hold."""
        if args.pp_size <= 1:
            return model
        if eval_dataset is not None:
            raise ValueError("eval_dataset with pp_size > 1: the ELBO evaluation runs the whole model; evaluate a "
                             "saved checkpoint with pp_size=1 (in a YAML config: data.eval_windows: 0)")
        from ..parallel.pipeline import pipeline_for_training

        self._pipeline = pipeline_for_training(model, args)
        return self._pipeline.model

    def _wrap_model(self, model, training=True, dataloader=None):
        if self._pipeline is None:
            return super()._wrap_model(model, training, dataloader)
        return model if isinstance(model, _PipelineHolder) or not training else _PipelineHolder(model)

    # -- batches --------------------------------------------------------------------------------------
    def _pool_pipeline_batch(self, batch: dict) -> dict:
        """This data-parallel group's micro-batch: the batches its pp ranks read, in pp-rank order."""
        import torch.distributed as dist

        parts: list = [None] * self._pipeline.pp_size
        dist.all_gather_object(parts, {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in batch.items()},
                               group=self._pipeline.group)
        keys = parts[0].keys()
        if any(part.keys() != keys for part in parts):
            raise ValueError(f"pipeline ranks read batches with different inputs {[sorted(p) for p in parts]}")
        try:
            return {k: torch.cat([part[k] for part in parts]) for k in keys}
        except RuntimeError as error:
            raise ValueError(f"pipeline ranks read batches of different shapes ({error}): a pipeline sends "
                             "fixed-shape activations, so pad every batch to one length") from None

    def _pipeline_training_step(self, model, inputs: dict, num_items_in_batch, stats_key: str):
        """Run the accumulation window that starts with `inputs` through the schedule; 0 for its other members.
        Returns the loss to log (summed over the window; the Trainer averages logged losses over all ranks)."""
        window = self._pipeline_window
        zero = torch.zeros((), device=self.args.device)
        if not window or inputs is not window[0]:
            return zero
        pipeline = self._pipeline
        model.train()
        stats = [micro_batch.pop(stats_key) for micro_batch in window]
        # per-t cross-entropy statistics from d loss / d label_weights, read on the last stage
        track_t = self.args.t_buckets > 0 and stats[0]["t"] is not None and "label_weights" in window[0]
        if track_t and pipeline.has_last_stage:
            for micro_batch in window:
                micro_batch["label_weights"] = micro_batch["label_weights"].detach().requires_grad_(True)
        # FSDP2 averages gradients over the dp ranks: the normaliser is divided so that they sum
        with self.accelerator.autocast():
            loss = pipeline.step(window, num_items_in_batch / pipeline.dp_size)
        for micro_stats, micro_batch in zip(stats, window):
            self._batch_metrics(micro_stats, True)  # a trainer's own per-batch metrics (trl's, for DLMSFTTrainer)
            if pipeline.has_last_stage:  # the statistics are counted once per data-parallel group
                self._record(micro_stats, micro_batch, num_items_in_batch, pipeline.dp_size, track_t)
            else:
                for name in ("tokens", "flops") + (("masked",) if micro_stats["masked_rows"] is not None else ()):
                    self._add(name, 0.0)
        if track_t and not pipeline.has_last_stage:  # every rank reduces the same statistics
            self._add("ce_sum", torch.zeros(self.args.t_buckets))
            self._add("ce_count", torch.zeros(self.args.t_buckets))
        self._collect_t_buckets()
        self._pipeline_window = None
        routers = pipeline.router_totals()  # MoE: summed over the micro-batches, the same on every pp rank
        if routers is not None:
            self._add("router_batches", len(window))
            self._add("aux_loss", routers[0])
            self._add("router_z_loss", routers[1])
            config = pipeline.model.config  # the logged loss holds the router losses, as DLMTrainer's does
            router_loss = (config.router_aux_loss_coef * routers[0] + config.router_z_loss_coef * routers[1]) / len(window)
            loss = None if loss is None else loss + router_loss
        # the logged loss is averaged over all pp x dp ranks, of which the dp last-stage ranks hold a loss each
        return zero if loss is None else loss.detach().to(zero.device).reshape(()) * pipeline.pp_size

    # -- gradient norm ------------------------------------------------------------------------------------
    def _clip_grad_norm(self, model):
        if self._pipeline is None:
            return super()._clip_grad_norm(model)
        return self._pipeline.clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        if self._pipeline is None or grad_norm is not None:
            return super()._get_grad_norm(model, grad_norm=grad_norm)
        return self._pipeline.clip_grad_norm_(float("inf"))

    # -- checkpoints ----------------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if self._pipeline is None:
            return super().save_model(output_dir, _internal_call)
        from transformers.trainer import TRAINING_ARGS_NAME

        from ..parallel.pipeline_checkpoint import save_pipeline_pretrained

        output_dir = output_dir or self.args.output_dir
        save_pipeline_pretrained(self._pipeline, output_dir, self.args.should_save, self._pipeline.dp_rank)
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self._pipeline is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        from ..parallel.pipeline_checkpoint import save_optimizer_dcp

        save_optimizer_dcp(self.model, _raw_optimizer(self.optimizer), output_dir)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        if self._pipeline is None:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        from ..parallel.pipeline_checkpoint import load_pipeline_weights

        load_pipeline_weights(self._pipeline, resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        from ..parallel.pipeline_checkpoint import OPTIMIZER_DCP_DIR, has_optimizer_dcp, load_optimizer_dcp

        if checkpoint is None or not has_optimizer_dcp(checkpoint):
            if self._pipeline is not None and checkpoint is not None:
                raise ValueError(f"{checkpoint}: resuming with pp_size > 1 needs the optimizer state as a distributed "
                                 f"checkpoint ({OPTIMIZER_DCP_DIR}/, written by pipeline runs); this one was written "
                                 "without pipeline parallelism: resume it with pp_size=1")
            return super()._load_optimizer_and_scheduler(checkpoint)
        # a distributed checkpoint (from a pipeline run) loads into this layout, whatever it is
        model = self.model if self._pipeline is not None else self.accelerator.unwrap_model(self.model)
        load_optimizer_dcp(model, _raw_optimizer(self.optimizer), checkpoint)
        scheduler_path = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(scheduler_path):
            self.lr_scheduler.load_state_dict(torch.load(scheduler_path, weights_only=True))


def _raw_optimizer(optimizer):
    """The torch optimizer inside accelerate's AcceleratedOptimizer."""
    return getattr(optimizer, "optimizer", optimizer)
