"""The masked-diffusion hooks of a `transformers.Trainer`, written once for every diffusion trainer
(`DLMTrainer`, `DLMSFTTrainer`, later ones): they override narrow hooks, not the loop.

- model set-up (`_prepare_diffusion_model`, before the parent's `__init__`): a device-mesh layout from the
  arguments (`tp_size`, `cp_size`, ... through `hf_dlm.parallel.trainer_parallel`), else float8 / per-block
  compile / low-precision residual through `parallelize_dlm`, before accelerate wraps the model;
- `get_batch_samples`: corrupts every micro-batch of an optimizer step with `MaskedDiffusionObjective` (noise
  keyed by each sample's global index, plus the epoch for map-style data) and counts the supervised items over
  all of them and all ranks: the loss normaliser, so 4 micro-batches of 1 equal 1 micro-batch of 4, and N
  ranks equal one;
- `compute_loss`: the model's masked-only, chunked head with that global normaliser;
- `training_step` / `log`: tokens/s, MFU, masked fraction and masked-token cross-entropy by t bucket. The
  per-token cross-entropy is read, for free, from the gradient of the loss with respect to the per-position
  weights: d loss / d w_i = CE_i / normaliser;
- `evaluate`: the seeded, stratified ELBO bound (`hf_dlm.diffusion.elbo.elbo_nll`) over the scored tokens of
  the evaluation batches (real tokens outside `prompt_mask`: the completion in SFT, as its loss), not the
  training loss on corrupted batches.
"""

from __future__ import annotations

import math
import time

import torch

from ..data.collator import DATA_STATE_KEY
from ..diffusion.elbo import elbo_nll
from ..parallel.expert_parallel import expert_bias_callback
from ..parallel.trainer_parallel import install_accelerator_hooks, setup_parallel_training

STATS_KEY = "_dlm_stats"  # per-micro-batch statistics riding along in the batch dict


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


class DiffusionBatchMixin:
    """Mixed in before the `transformers.Trainer` subclass. The arguments need the fields of
    `training_args.DiffusionTrainingFields` and `parallel.trainer_parallel.ParallelArguments`."""

    _pipeline = None  # PipelineTrainingMixin's pipeline (DLMTrainer with pp_size > 1)
    _parallel = None
    _epoch_stride: int | None = None  # map-style data: noise key = epoch * stride + dataset index
    _data_state = None

    # -- set-up ----------------------------------------------------------------------------------------
    def _prepare_diffusion_model(self, model, args) -> None:
        """Before the parent's __init__ (accelerate must wrap the result): a device-mesh layout, or float8 /
        compile / low-precision residual alone, in torchtitan's order (hf_dlm.parallel.parallelize)."""
        self._parallel = setup_parallel_training(model, args)
        if self._parallel is None and (args.compile_blocks or args.fp8_recipe or args.low_precision_residual):
            from ..parallel.parallelize import ParallelOptions, parallelize_dlm

            parallelize_dlm(model, ParallelOptions.from_args(args))

    def _finish_diffusion_setup(self, model, objective) -> None:
        """After the parent's __init__: accelerate's hooks for a mesh, MoE balancing, the objective."""
        if self._parallel is not None:
            install_accelerator_hooks(self.accelerator, self._parallel)
        if (bias_callback := expert_bias_callback(model, self._parallel)) is not None:
            self.add_callback(bias_callback)  # MoE routers' aux-loss-free balancing, once per optimizer step
        config = self.accelerator.unwrap_model(self.model).config
        self.objective = objective if objective is not None else self.args.build_objective(config)
        # our loss is normalised over the whole accumulated, global batch: never divide it again
        self.model_accepts_loss_kwargs = True
        self.loss_is_scaled_for_ga = True
        self._staging_root = None
        self._pending_weights: list = []
        self._reset_window()
        self._flops_per_token_fixed = None if self._pipeline is None else 6 * self._pipeline.num_parameters

    # -- batches ------------------------------------------------------------------------------------
    def _corrupt(self, batch: dict, device, t_group: tuple | None = None) -> dict:
        """Clean batch -> the model's inputs (+ statistics under STATS_KEY). t_group: see `antithetic_group`."""
        config = self.accelerator.unwrap_model(self.model).config
        model_inputs, inputs = corrupted_model_inputs(self.objective, batch, device, t_group,
                                                      getattr(config, "attention_mode", None))
        input_ids = batch["input_ids"]  # (B, L)
        attention_mask = inputs["attention_mask"]
        real = input_ids.numel() if attention_mask is None else attention_mask.sum()
        masked_rows = None if self.objective.mode == "ar" else inputs["masked"].sum(1)  # (B,)
        prompt_mask = batch.get("prompt_mask")
        supervised = real if prompt_mask is None else (
            (attention_mask.bool() if attention_mask is not None else torch.ones_like(prompt_mask, dtype=torch.bool))
            & ~prompt_mask.to(device).bool()).sum()
        items = self.objective.loss_items(inputs)
        model_inputs[STATS_KEY] = {"t": inputs["t"], "masked_rows": masked_rows, "tokens": real,
                                   "supervised": supervised,
                                   "items": torch.as_tensor(items, device=device, dtype=torch.float32),
                                   "length": input_ids.shape[1]}
        return model_inputs

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """The micro-batches of one optimizer step, corrupted together, and their global number of loss items."""
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
        num_items = sum(b[STATS_KEY]["items"] for b in batch_samples)
        if self.accelerator.num_processes > 1:
            num_items = self.accelerator.gather(num_items.reshape(1)).sum()
            if self._parallel is not None:  # the TP / CP ranks of a data-parallel group counted the same batch
                num_items = num_items / self._parallel.replicas
        if self._pipeline is not None:
            num_items = num_items / self._pipeline.pp_size  # the pp ranks of a group pooled the same micro-batches
            self._pipeline_window = batch_samples
        return batch_samples, num_items.clamp(min=1)

    def _keyed(self, batch: dict) -> dict:
        """A batch of a map-style dataset carries dataset indices: key its noise by the epoch too, so every
        pass over the data draws new noise, the same on any topology and after a resume."""
        if self._epoch_stride is not None:
            epoch = math.floor(self.state.epoch or 0)  # passes completed before this step
            batch["sample_index"] = batch["sample_index"] + epoch * self._epoch_stride
        return batch

    # -- loss -----------------------------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if STATS_KEY not in inputs:  # a clean batch (prediction_step, direct calls): corrupt it here
            inputs = self._corrupt(inputs, self.args.device)
        inputs = dict(inputs)
        stats = inputs.pop(STATS_KEY)
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
        self._batch_metrics(stats, model.training)
        return (loss, outputs) if return_outputs else loss

    def _batch_metrics(self, stats: dict, training: bool) -> None:
        """Further per-micro-batch metrics of a trainer (trl's `_metrics` for DLMSFTTrainer); none here."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self._pipeline is not None:
            return self._pipeline_training_step(model, inputs, num_items_in_batch, STATS_KEY)
        loss = super().training_step(model, inputs, num_items_in_batch)
        self._collect_t_buckets()
        return loss

    # -- evaluation -----------------------------------------------------------------------------------
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict:
        """ELBO bound on the NLL of the evaluation set (nats per scored token, summed over ranks); batch k's
        masks are drawn with seed `eval_seed + k`, so evaluations of one model on one set agree. A dict of
        sets (given or the trainer's) is evaluated set by set, with `{prefix}_{name}_` metrics."""
        if self._pipeline is not None:
            raise NotImplementedError("evaluate with pp_size > 1: the ELBO runs the whole model; evaluate a saved "
                                      "checkpoint with pp_size=1 (the checkpoints load in any layout)")
        sets = eval_dataset if eval_dataset is not None else self.eval_dataset
        if isinstance(sets, dict):
            metrics = {}
            for name, dataset in sets.items():  # the trainer's own sets by name: get_eval_dataloader caches them
                metrics.update(self.evaluate(dataset if eval_dataset is not None else name, ignore_keys,
                                             f"{metric_key_prefix}_{name}"))
            return metrics
        start = time.perf_counter()
        dataloader = self.get_eval_dataloader(self._evaluation_set(eval_dataset))
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
        totals = torch.stack([nll_sum, num_tokens])
        if self.accelerator.num_processes > 1:
            totals = self.accelerator.reduce(totals, reduction="sum")
        nll = float(totals[0] / totals[1].clamp(min=1))
        runtime = time.perf_counter() - start
        metrics = {f"{metric_key_prefix}_loss": nll, f"{metric_key_prefix}_nll_per_token": nll,
                   f"{metric_key_prefix}_perplexity_bound": math.exp(min(nll, 700.0)),
                   f"{metric_key_prefix}_num_tokens": float(totals[1]), f"{metric_key_prefix}_runtime": runtime}
        self.log(metrics)  # still in eval mode: trl's log reads the mode from model.training
        model.train(was_training)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        self._paused += runtime  # evaluation time is not training throughput
        return metrics

    def _evaluation_set(self, eval_dataset):
        """A set handed to `evaluate`, ready for `get_eval_dataloader` (DLMSFTTrainer: trl's preparation)."""
        return eval_dataset

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
