"""`DLMTrainer`: `transformers.Trainer` for masked-diffusion LMs, overriding narrow hooks, not the loop.

- `get_batch_samples`: corrupts every micro-batch of an optimizer step with `MaskedDiffusionObjective`
  (noise keyed by each sample's global index) and counts the supervised items over all of them and all
  ranks: the loss normaliser, so 4 micro-batches of 1 equal 1 micro-batch of 4, and N ranks equal one.
- `compute_loss`: the model's masked-only, chunked head with that global normaliser.
- `training_step` / `log`: tokens/s, MFU, masked fraction and masked-token cross-entropy by t bucket.
  The per-token cross-entropy is read, for free, from the gradient of the loss with respect to the
  per-position weights: d loss / d w_i = CE_i / normaliser.
- `evaluate`: the ELBO bound (`elbo.elbo_nll`) instead of the training loss.
- `_save_checkpoint`: atomic (staged in `_checkpoint-staging/`, then renamed), with the data position of the
  last consumed batch; `train` restores it on resume. With `push_to_hub`, the published folder is pushed.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time

import torch
from torch.utils.data import Dataset, IterableDataset
from transformers import Trainer
from transformers.trainer import SCHEDULER_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint, rotate_checkpoints
from transformers.utils import logging

from ..data.collator import DATA_STATE_KEY, DLMDataCollator
from ..diffusion.elbo import elbo_nll
from ..parallel.expert_parallel import expert_bias_callback
from ..parallel.float8_delayed import float8_state_dict, load_float8_state_dict
from ..parallel.trainer_parallel import (has_sharded_checkpoint, install_accelerator_hooks, load_scheduler_state,
                                         load_sharded_checkpoint, save_full_model, save_sharded_checkpoint,
                                         setup_parallel_training)
from ..diffusion.objective import MaskedDiffusionObjective
from .pipeline_training import PipelineTrainingMixin
from .training_args import DLMTrainingArguments

logger = logging.get_logger(__name__)

# not matched by get_last_checkpoint's `^checkpoint-\d+$` nor rotation's `checkpoint-*`; the leading "_" is
# the Trainer's own "never upload" pattern (`ignore_patterns=["_*", ...]` when it pushes output_dir to the Hub)
STAGING_DIR = "_checkpoint-staging"
DATA_STATE_NAME = "data_state_rank{rank}.pt"
OBJECTIVE_NAME = "dlm_objective.json"
FLOAT8_STATE_NAME = "float8_state_rank{rank}.pt"  # delayed-scaling amax histories (each rank sees its own data)
_STATS = "_dlm_stats"  # per-micro-batch statistics riding along in the batch dict


def antithetic_group(objective, accelerator, keys: list, device) -> tuple | None:
    """Antithetic t is stratified over the optimizer step's global batch (MDLM stratifies over its batch):
    the sorted, distinct sample keys of all micro-batches (`keys`: their sample_index tensors) on all
    ranks. A sample's slot is its key's rank there, so it does not depend on world size, micro-batch split
    or data-loader order. -> (sorted keys, group size) or None when t is not antithetic."""
    if objective.mode != "diffusion" or objective.t_sampling != "antithetic":
        return None
    keys = torch.cat(keys).to(device)
    if accelerator.num_processes > 1:
        keys = accelerator.gather(accelerator.pad_across_processes(keys, pad_index=-1))
        keys = keys[keys >= 0]
    keys = torch.unique(keys)  # sorted; replicas of a batch (tensor/context parallel ranks) count once
    return keys, keys.numel()


def corrupted_model_inputs(objective, batch: dict, device, t_group: tuple | None, attention_mode) -> tuple[dict, dict]:
    """A clean micro-batch (input_ids, sample_index; attention_mask, prompt_mask, position_ids if present) ->
    (the model's keyword arguments, `objective.corrupt`'s output). t_group: (sorted keys of the step's global
    batch, its size) for antithetic t (`antithetic_group`)."""
    def take(key):
        return None if batch.get(key) is None else batch[key].to(device)

    input_ids, sample_index = take("input_ids"), take("sample_index")
    t_slot = None if t_group is None else torch.searchsorted(t_group[0], sample_index)
    corrupted = objective.corrupt(input_ids, sample_index, take("attention_mask"), take("prompt_mask"), t_slot,
                                  None if t_group is None else t_group[1])
    model_inputs = {k: corrupted[k] for k in ("input_ids", "labels", "label_weights", "attention_mask")
                    if corrupted[k] is not None}
    if corrupted.get("suppressed_token_id") is not None:
        model_inputs["suppressed_token_id"] = corrupted["suppressed_token_id"]  # MDLM's SUBS (subs=True)
    if batch.get("position_ids") is not None:
        model_inputs["position_ids"] = take("position_ids")
    if attention_mode == "block" and objective.mode == "diffusion":
        model_inputs["clean_input_ids"] = input_ids  # two-stream block-diffusion training
    return model_inputs, corrupted


def rescale_router_loss(trainer, loss, router_loss, loss_scale):
    """MoE router losses are means over one micro-batch's tokens, not sums over the global normaliser: take
    them out of the rank scaling and average them over the accumulated micro-batches."""
    accumulation = getattr(trainer, "current_gradient_accumulation_steps", trainer.args.gradient_accumulation_steps)
    return loss - router_loss * loss_scale + router_loss / accumulation


class DLMTrainer(PipelineTrainingMixin, Trainer):
    """Trainer of `DLMForDiffusionLM` (or any model taking `labels`, `label_weights` and
    `num_items_in_batch`). `objective` defaults to `args.build_objective(model.config)`."""

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
        if data_collator is None:
            data_collator = DLMDataCollator(pad_token_id=getattr(model.config, "pad_token_id", None) or 0)
        if (isinstance(data_collator, DLMDataCollator) and data_collator.state_source is None
                and isinstance(train_dataset, IterableDataset) and hasattr(train_dataset, "state_dict")):
            data_collator.state_source = train_dataset  # batches carry the stream position
            if args.dataloader_num_workers > 1:
                logger.warning("the position of an iterable train dataset is exact with dataloader_num_workers <= 1: "
                               "each worker holds its own copy of the stream")
        # a device-mesh layout (tp_size, cp_size, dp_shard_size, ...): parallelised here, not by accelerate
        self._parallel = setup_parallel_training(model, args)
        if self._parallel is None and (args.compile_blocks or args.fp8_recipe or args.low_precision_residual):
            # before accelerate wraps the model (DDP / FSDP2): torchtitan's order, float8 then compile
            from ..parallel.parallelize import parallelize_dlm

            parallelize_dlm(model, float8_recipe=args.fp8_recipe, float8_fast_accum=args.fp8_fast_accum,
                            float8_min_features=args.fp8_min_features,
                            low_precision_residual=args.low_precision_residual, compile=args.compile_blocks)
        model = self._setup_pipeline(model, args, eval_dataset)  # pp_size > 1: this rank's stages only
        super().__init__(model=model, args=args, data_collator=data_collator, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, **kwargs)
        if self._parallel is not None:
            install_accelerator_hooks(self.accelerator, self._parallel)
        if (bias_callback := expert_bias_callback(model, self._parallel)) is not None:
            self.add_callback(bias_callback)  # MoE routers' aux-loss-free balancing, once per optimizer step
        self.objective = objective if objective is not None else args.build_objective(model.config)
        # our loss is normalised over the whole accumulated, global batch: never divide it again
        self.model_accepts_loss_kwargs = True
        self.loss_is_scaled_for_ga = True
        self._staging_root: str | None = None
        self._data_state = None
        self._pending_weights: list = []
        self._reset_window()
        self._flops_per_token_fixed = None if self._pipeline is None else 6 * self._pipeline.num_parameters

    # -- batches ------------------------------------------------------------------------------------
    def _corrupt(self, batch: dict, device, t_group: tuple | None = None) -> dict:
        """Clean batch -> the model's inputs (+ statistics under _STATS). t_group: see `antithetic_group`."""
        config = self.accelerator.unwrap_model(self.model).config
        model_inputs, inputs = corrupted_model_inputs(self.objective, batch, device, t_group,
                                                      getattr(config, "attention_mode", None))
        input_ids = batch["input_ids"]  # (B, L)
        real = input_ids.numel() if inputs["attention_mask"] is None else inputs["attention_mask"].sum()
        masked_rows = None if self.objective.mode == "ar" else inputs["masked"].sum(1)  # (B,)
        items = self.objective.loss_items(inputs)
        model_inputs[_STATS] = {"t": inputs["t"], "masked_rows": masked_rows, "tokens": real,
                                "items": torch.as_tensor(items, device=device, dtype=torch.float32),
                                "length": input_ids.shape[1]}
        return model_inputs

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """The micro-batches of one optimizer step, corrupted, and their global number of loss items."""
        if self._window_start is None:
            self._window_start = time.perf_counter()
        batches = []
        for _ in range(num_batches):
            try:
                batch = next(epoch_iterator)
            except StopIteration:
                break
            state = batch.pop(DATA_STATE_KEY, None)
            if state is not None:
                self._data_state = state
            batch = self._keyed(batch)
            if self._pipeline is not None:
                batch = self._pool_pipeline_batch(batch)
            batches.append(batch)
        if not batches:
            return batches, None
        t_group = antithetic_group(self.objective, self.accelerator, [b["sample_index"] for b in batches], device)
        batch_samples = [self._corrupt(batch, device, t_group) for batch in batches]
        num_items = sum(b[_STATS]["items"] for b in batch_samples)
        if self.accelerator.num_processes > 1:
            num_items = self.accelerator.gather(num_items.reshape(1)).sum()
            if self._parallel is not None:  # the TP / CP ranks of a data-parallel group counted the same batch
                num_items = num_items / self._parallel.replicas
        if self._pipeline is not None:
            num_items = num_items / self._pipeline.pp_size  # the pp ranks of a group pooled the same micro-batches
            self._pipeline_window = batch_samples
        return batch_samples, num_items.clamp(min=1)

    def _keyed(self, batch: dict) -> dict:
        """A batch of an ordinary map-style dataset carries dataset indices: key its noise by the epoch too,
        so every pass over the data draws new noise, the same on any topology and after a resume."""
        if self._epoch_stride is not None:
            epoch = math.floor(self.state.epoch or 0)  # passes completed before this step
            batch["sample_index"] = batch["sample_index"] + epoch * self._epoch_stride
        return batch

    # -- loss -----------------------------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if _STATS not in inputs:  # a clean batch (prediction_step, direct calls): corrupt it here
            inputs = self._corrupt(inputs, self.args.device)
        inputs = dict(inputs)
        stats = inputs.pop(_STATS, None)
        loss_scale = 1
        if num_items_in_batch is None:
            num_items_in_batch = stats["items"].clamp(min=1)
        elif self.accelerator.num_processes > 1:
            # the normaliser is global and gradients are averaged over ranks: undo the average
            loss_scale = self._parallel.loss_scale if self._parallel is not None else self.accelerator.num_processes
        track_t = (model.training and torch.is_grad_enabled() and self.args.t_buckets > 0
                   and stats["t"] is not None and "label_weights" in inputs)
        if track_t:
            inputs["label_weights"] = inputs["label_weights"].detach().requires_grad_(True)
        outputs = model(**inputs, num_items_in_batch=num_items_in_batch)
        loss = outputs.loss * loss_scale
        router_loss = getattr(outputs, "router_loss", None)
        if router_loss is not None and model.training:
            loss = rescale_router_loss(self, loss, router_loss, loss_scale)
            self._add("router_batches", 1)
            self._add("aux_loss", outputs.aux_loss.detach())
            self._add("router_z_loss", outputs.router_z_loss.detach())
        if model.training:
            self._record(stats, inputs, num_items_in_batch, loss_scale, track_t)
        return (loss, outputs) if return_outputs else loss

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self._pipeline is not None:
            return self._pipeline_training_step(model, inputs, num_items_in_batch, _STATS)
        loss = super().training_step(model, inputs, num_items_in_batch)
        self._collect_t_buckets()
        return loss

    # -- statistics -----------------------------------------------------------------------------------
    def _reset_window(self):
        self._window_start = None
        self._paused = 0.0
        self._window = {}

    def _add(self, name, value):
        value = torch.as_tensor(value, dtype=torch.float64, device=self.args.device)
        self._window[name] = self._window[name] + value if name in self._window else value

    def _flops_per_token(self, length: int) -> float:
        """6N + 12 * layers * hidden * seq (PaLM's count; full attention, right for bidirectional models);
        N counts the parameters a token runs through (an MoE layer's top-k experts, not all of them)."""
        if self._flops_per_token_fixed is None:
            from ..modeling.moe import active_parameter_count

            self._flops_per_token_fixed = 6 * active_parameter_count(self.accelerator.unwrap_model(self.model))
        config = self.accelerator.unwrap_model(self.model).config
        return self._flops_per_token_fixed + 12 * config.num_hidden_layers * config.hidden_size * length

    def _record(self, stats, inputs, normaliser, loss_scale, track_t):
        tokens = stats["tokens"] / (self._parallel.replicas if self._parallel is not None else 1)
        self._add("tokens", tokens)
        self._add("flops", tokens * self._flops_per_token(stats["length"]))
        if stats["masked_rows"] is not None:
            self._add("masked", stats["masked_rows"].sum() / (self._parallel.replicas if self._parallel else 1))
        if track_t:
            self._pending_weights.append((inputs["label_weights"], stats["t"], stats["masked_rows"],
                                          normaliser, loss_scale))

    def _collect_t_buckets(self):
        """Masked-token CE per row from d loss / d label_weights, summed into t buckets."""
        n = self.args.t_buckets
        for weights, t, masked_rows, normaliser, loss_scale in self._pending_weights:
            if weights.grad is None:
                continue
            grad_scale = loss_scale
            if getattr(self.accelerator, "scaler", None) is not None:
                grad_scale = grad_scale * self.accelerator.scaler.get_scale()
            ce_rows = weights.grad.double().sum(1) * normaliser.double() / grad_scale  # (B,)
            if self._parallel is not None:  # TP ranks repeat these sums; CP ranks each hold a chunk's share
                ce_rows, masked_rows = ce_rows / self._parallel.dims.tp, masked_rows / self._parallel.replicas
            bucket = (t * n).long().clamp(0, n - 1)
            self._add("ce_sum", torch.zeros(n, dtype=torch.float64, device=ce_rows.device).index_add(0, bucket, ce_rows))
            self._add("ce_count", torch.zeros(n, dtype=torch.float64, device=ce_rows.device)
                      .index_add(0, bucket, masked_rows.double()))
        self._pending_weights = []

    def _window_logs(self) -> dict:
        if self._window_start is None or "tokens" not in self._window:
            return {}
        elapsed = max(time.perf_counter() - self._window_start - self._paused, 1e-9)
        names = sorted(self._window)
        flat = torch.cat([self._window[k].reshape(-1) for k in names])
        if self.accelerator.num_processes > 1:
            flat = self.accelerator.reduce(flat, reduction="sum")
        totals, offset = {}, 0
        for k in names:
            size = self._window[k].numel()
            totals[k] = flat[offset: offset + size].cpu()
            offset += size
        world = self.accelerator.num_processes
        tokens = float(totals["tokens"])
        logs = {"tokens_per_second": tokens / elapsed, "tokens_per_second_per_device": tokens / elapsed / world,
                "mfu": float(totals["flops"]) / elapsed / (self.args.peak_flops * world)}
        if "masked" in totals:
            logs["masked_fraction"] = float(totals["masked"]) / max(tokens, 1.0)
        if "router_batches" in totals:  # MoE: the routers' unweighted losses, mean over micro-batches and ranks
            for name in ("aux_loss", "router_z_loss"):
                logs[name] = float(totals[name] / totals["router_batches"])
        if "ce_sum" in totals:
            n = self.args.t_buckets
            for k in range(n):
                if totals["ce_count"][k] > 0:
                    logs[f"ce_t/{k / n:.2f}-{(k + 1) / n:.2f}"] = float(totals["ce_sum"][k] / totals["ce_count"][k])
        self._reset_window()
        self._window_start = time.perf_counter()
        return logs

    def log(self, logs: dict, start_time: float | None = None) -> None:
        if "learning_rate" in logs and "loss" in logs:  # a training log
            logs.update(self._window_logs())
        passes = self._passes_over_data()
        if passes is None:
            return super().log(logs, start_time)
        trainer_epoch, self.state.epoch = self.state.epoch, passes  # the parent writes state.epoch into logs
        try:
            super().log(logs, start_time)
        finally:
            self.state.epoch = trainer_epoch

    def _passes_over_data(self) -> float | None:
        """An endless stream has no length, so the Trainer's `epoch` would count fractions of max_steps: with
        a stream of known epoch size (`DistributedSampleStream`), `epoch` is the passes over the data."""
        samples = getattr(self.train_dataset, "samples", None)
        per_epoch = getattr(samples, "samples_per_epoch", None)
        if not per_epoch or not isinstance(self._data_state, dict) or "consumed_samples" not in self._data_state:
            return None
        return round(int(self._data_state["consumed_samples"]) / per_epoch, 4)

    # -- evaluation -----------------------------------------------------------------------------------
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict:
        """ELBO bound on the NLL of the evaluation set (nats per scored token, summed over ranks)."""
        if self._pipeline is not None:
            raise NotImplementedError("evaluate with pp_size > 1: the ELBO runs the whole model; evaluate a saved "
                                      "checkpoint with pp_size=1 (the checkpoints load in any layout)")
        start = time.perf_counter()
        dataloader = self.get_eval_dataloader(eval_dataset)
        model = self.accelerator.unwrap_model(self.model)
        was_training = model.training
        model.eval()
        nll_sum = torch.zeros((), dtype=torch.float64, device=self.args.device)
        num_tokens = torch.zeros((), dtype=torch.float64, device=self.args.device)
        with self.accelerator.autocast():
            for step, batch in enumerate(dataloader):
                batch.pop(DATA_STATE_KEY, None)
                result = elbo_nll(model, batch["input_ids"], batch.get("attention_mask"), batch.get("prompt_mask"),
                                  mc_num=self.args.eval_mc_num, seed=self.args.eval_seed + step,
                                  batch_size=batch["input_ids"].shape[0], position_ids=batch.get("position_ids"),
                                  subs=self.objective.subs)
                nll_sum += result["per_sequence"].sum().to(nll_sum.device)
                num_tokens += result["num_tokens"]
        model.train(was_training)
        totals = torch.stack([nll_sum, num_tokens])
        if self.accelerator.num_processes > 1:
            totals = self.accelerator.reduce(totals, reduction="sum")
        nll = float(totals[0] / totals[1].clamp(min=1))
        runtime = time.perf_counter() - start
        metrics = {f"{metric_key_prefix}_loss": nll, f"{metric_key_prefix}_nll_per_token": nll,
                   f"{metric_key_prefix}_perplexity_bound": math.exp(min(nll, 700.0)),
                   f"{metric_key_prefix}_num_tokens": float(totals[1]), f"{metric_key_prefix}_runtime": runtime}
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        self._paused += runtime  # evaluation time is not training throughput
        return metrics

    # -- checkpoints ----------------------------------------------------------------------------------
    def _get_output_dir(self, trial) -> str:
        run_dir = super()._get_output_dir(trial)
        return os.path.join(run_dir, STAGING_DIR) if self._staging_root is not None else run_dir

    def _save_checkpoint(self, model, trial) -> None:
        """Write the checkpoint into the staging folder, then rename it into place: a crash while
        saving leaves the previous checkpoints untouched and `get_last_checkpoint` never sees a partial one."""
        start = time.perf_counter()
        run_dir = self._get_output_dir(trial)
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        staging_root = os.path.join(run_dir, STAGING_DIR)
        staging, final = os.path.join(staging_root, name), os.path.join(run_dir, name)
        if self.args.should_save and os.path.isdir(staging):
            shutil.rmtree(staging)  # left over by a save that crashed
        self.accelerator.wait_for_everyone()
        self._staging_root = staging_root
        try:
            super()._save_checkpoint(model, trial)
            self._save_extras(staging)
        finally:
            self._staging_root = None
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            _publish(staging, final)
            if self.state.best_model_checkpoint and self.state.best_model_checkpoint.startswith(staging_root):
                self.state.best_model_checkpoint = os.path.join(run_dir, os.path.basename(self.state.best_model_checkpoint))
                state_path = os.path.join(final, "trainer_state.json")
                self.state.save_to_json(state_path + ".tmp")
                os.replace(state_path + ".tmp", state_path)
            if self.args.push_to_hub:  # the parent's upload runs in the background: give it the final folder
                self._push_from_checkpoint(final)
            rotate_checkpoints(output_dir=run_dir, save_total_limit=self.args.save_total_limit,
                               best_model_checkpoint=self.state.best_model_checkpoint)
        self.accelerator.wait_for_everyone()
        self._paused += time.perf_counter() - start

    def training_details(self) -> dict:
        """What the model card's "Training details" table records about this run."""
        args, objective = self.args, self.objective
        details = {"trainer": "hf_dlm.DLMTrainer", "objective_preset": args.objective_preset,
                   **{name: getattr(objective, name) for name in ("mode", "schedule", "weighting", "t_sampling",
                                                                  "eps", "normalization", "label_alignment")},
                   "global_step": self.state.global_step, "epochs": round(float(self.state.epoch or 0), 4),
                   "learning_rate": args.learning_rate, "lr_scheduler_type": str(getattr(args.lr_scheduler_type,
                                                                                      "value", args.lr_scheduler_type)),
                   "global_batch_size": args.per_device_train_batch_size * args.gradient_accumulation_steps
                   * args.world_size, "world_size": args.world_size, "seed": args.seed,
                   "precision": "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"}
        if args.fp8_recipe:
            details["fp8_recipe"] = args.fp8_recipe
        return details

    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        """The parent's save, then the training record and a model card that shows it."""
        super()._save(output_dir, state_dict)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if self.args.should_save and self._staging_root is None:  # final models, not every checkpoint
            from ..utils.publishing import publisher  # hub/ sits above training

            publisher().write_final_card(output_dir, self.accelerator.unwrap_model(self.model).config,
                                         self.training_details())

    # -- device-mesh checkpoints (torch.distributed.checkpoint; hf_dlm.parallel.trainer_parallel) ---------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if self._parallel is None:
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir or self.args.output_dir
        if _internal_call:  # a checkpoint: the sharded model is saved with the optimizer, in dcp/
            if self.args.should_save:
                self.accelerator.unwrap_model(self.model).config.save_pretrained(output_dir)
            return
        save_full_model(self.accelerator.unwrap_model(self.model), output_dir, self.args.should_save)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self._parallel is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        save_sharded_checkpoint(self.model, self.optimizer.optimizer, output_dir)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        if self._parallel is None and not has_sharded_checkpoint(resume_from_checkpoint):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        # loaded with the optimizer (_load_optimizer_and_scheduler), once it exists

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        # a mesh checkpoint loads into any layout, one process included
        if checkpoint is None or (self._parallel is None and not has_sharded_checkpoint(checkpoint)):
            return super()._load_optimizer_and_scheduler(checkpoint)
        load_sharded_checkpoint(self.model, self.optimizer.optimizer, checkpoint)
        load_scheduler_state(self.lr_scheduler, self.optimizer, os.path.join(checkpoint, SCHEDULER_NAME))

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        if self._staging_root is not None:
            return  # called by the parent's save with the staging folder, renamed away before the upload reads it
        super()._push_from_checkpoint(checkpoint_folder)

    def _issue_warnings_after_load(self, load_result) -> None:
        """A tied lm_head is not saved (it is the embedding, which loading keeps shared): not a missing key."""
        model = self.accelerator.unwrap_model(self.model)
        tied = set(getattr(model, "_tied_weights_keys", None) or ())
        if getattr(model.config, "tie_word_embeddings", False) and tied & set(load_result.missing_keys):
            load_result = load_result._replace(missing_keys=[k for k in load_result.missing_keys if k not in tied])
        super()._issue_warnings_after_load(load_result)

    def _rank_file(self, checkpoint_dir: str, name: str) -> str:
        return os.path.join(checkpoint_dir, name.format(rank=self.args.process_index))

    def _load_rank_file(self, checkpoint_dir: str, name: str):
        """This rank's file `name` of a checkpoint, loaded; None if the checkpoint has none."""
        path = self._rank_file(checkpoint_dir, name)
        return torch.load(path, weights_only=True) if os.path.isfile(path) else None

    def _save_extras(self, checkpoint_dir: str) -> None:
        os.makedirs(checkpoint_dir, exist_ok=True)
        if self._data_state is not None:
            torch.save(self._data_state, self._rank_file(checkpoint_dir, DATA_STATE_NAME))
        float8_state = float8_state_dict(self.accelerator.unwrap_model(self.model))
        if float8_state:
            torch.save(float8_state, self._rank_file(checkpoint_dir, FLOAT8_STATE_NAME))
        if self.args.should_save:
            with open(os.path.join(checkpoint_dir, OBJECTIVE_NAME), "w") as f:
                json.dump(self.objective.to_dict(), f, indent=2)

    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, ignore_keys_for_eval=None, **kwargs):
        """As `Trainer.train`; on resume, a train dataset with `load_state_dict` gets its saved position
        back (an iterable one then is not fast-forwarded batch by batch)."""
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"no valid checkpoint found in output_dir {self.args.output_dir!r}")
        if not resume_from_checkpoint and not self.args.overwrite_output_dir and self.args.should_save:
            existing = get_last_checkpoint(self.args.output_dir) if os.path.isdir(self.args.output_dir) else None
            if existing is not None:
                raise ValueError(f"output_dir {self.args.output_dir!r} already holds {os.path.basename(existing)}: "
                                 "pass resume_from_checkpoint=True to continue it, or overwrite_output_dir=True "
                                 "(or another output_dir) to start a new run")
        restore_skip = self.args.ignore_data_skip
        if resume_from_checkpoint:
            data_state = (self._load_rank_file(resume_from_checkpoint, DATA_STATE_NAME)
                          if hasattr(self.train_dataset, "load_state_dict") else None)
            if data_state is not None:
                self.train_dataset.load_state_dict(data_state)
                self._data_state = None
                if isinstance(self.train_dataset, IterableDataset):
                    self.args.ignore_data_skip = True
            float8_state = self._load_rank_file(resume_from_checkpoint, FLOAT8_STATE_NAME)
            if float8_state is not None:
                load_float8_state_dict(self.accelerator.unwrap_model(self.model), float8_state)
        self._reset_window()
        try:
            return super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial,
                                 ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)
        finally:
            self.args.ignore_data_skip = restore_skip


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


def _fsync_tree(path: str) -> None:
    for root, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())


def _publish(staging: str, final: str) -> None:
    """Rename a fully written checkpoint folder into place (replacing one of the same step)."""
    _fsync_tree(staging)
    previous = None
    if os.path.exists(final):
        previous = f"{os.path.dirname(final)}/{STAGING_DIR}/replaced-{os.path.basename(final)}"
        if os.path.exists(previous):
            shutil.rmtree(previous)
        os.rename(final, previous)
    os.rename(staging, final)
    dir_fd = os.open(os.path.dirname(final), os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    if previous is not None:
        shutil.rmtree(previous, ignore_errors=True)
    try:
        os.rmdir(os.path.dirname(staging))
    except OSError:
        pass  # other (stale) staging content stays for inspection
