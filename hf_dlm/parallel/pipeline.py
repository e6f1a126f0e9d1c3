"""Pipeline parallelism for `DLMForDiffusionLM` on `torch.distributed.pipelining`.

- `split_layers` / `DLMPipelineStageModule`: the model cut at decoder-layer boundaries, following the
  config's `base_model_pp_plan` (the modules before `layers` go to the first stage, those after it and
  the model's `_pp_plan` head to the last) or explicit split points. A stage keeps the full model's
  parameter names (`model.layers.5.mlp.up_proj.weight`: layers sit in a `ModuleDict` keyed by their index),
  so a stage's state dict holds `save_pretrained` keys. The last stage runs the final norm and the
  masked-only head and returns the loss itself: the head gathers a data-dependent number of rows, which
  no fixed-shape activation between stages could carry.
- `DLMPipeline`: this rank's stages (optionally FSDP2-sharded over a data-parallel mesh), wrapped in
  `PipelineStage`s, and a GPipe, 1F1B or interleaved-1F1B schedule whose micro-batches are the gradient
  accumulation micro-batches. The loss is normalised by one global count of supervised items (all
  micro-batches, all ranks) and the schedule's own 1 / micro-batches scaling is off, so the gradients equal
  the single-process ones; the noise is made before the pipeline (keyed by sample index), so every
  stage sees the same corrupted batch.
- Mixture-of-experts stages: a stage's router losses (load-balancing and z, over its MoE layers) never
  travel between stages; they join the backward through `_RouterLossGrad` on the stage's hidden states (the
  way Megatron-LM's aux-loss scaler does), weighted as the unsplit model's router loss averaged over the
  micro-batches. Their values come back from `DLMPipeline.router_totals` for logging.
- `pipeline_schedule_terms`: the bubble and memory terms of a layout (for the planner).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from transformers.utils import logging

from ..modeling.loss import masked_lm_loss
from ..modeling.modeling_dlm import decoder_layer_inputs, router_token_mask
from ..modeling.moe import DLMSparseMoeBlock

logger = logging.get_logger(__name__)

PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
_SCHEDULE_CLASSES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B"}
# inputs every micro-batch may carry; each stage gets all of them (masks and positions are rebuilt per stage)
_STAGE_KWARGS = ("attention_mask", "position_ids", "labels", "label_weights", "clean_input_ids")


# -- splitting --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PipelinePlan:
    """Module names from a `base_model_pp_plan`: `first` run before the repeated `layers` (first stage),
    `last` after them (last stage); `head` is the task head on top of the base model (last stage)."""

    first: tuple[str, ...]
    layers: str
    last: tuple[str, ...]
    head: tuple[str, ...]

    @classmethod
    def from_model(cls, model) -> "PipelinePlan":
        plan = getattr(model.config, "base_model_pp_plan", None)
        if not plan:
            raise ValueError(f"{type(model.config).__name__} has no base_model_pp_plan: pass split_points to cut "
                             "the model explicitly")
        base = getattr(model, model.base_model_prefix)
        names = list(plan)
        repeated = [name for name in names if isinstance(getattr(base, name, None), nn.ModuleList)]
        missing = [name for name in names if not hasattr(base, name)]
        if missing or len(repeated) != 1:
            raise ValueError(f"base_model_pp_plan {names} must name modules of {type(base).__name__} with exactly one "
                             f"ModuleList of layers (missing: {missing}, lists: {repeated})")
        at = names.index(repeated[0])
        # the model's `_pp_plan` also holds the base model's entries, prefixed ("model.norm"): keep the head's
        head = tuple(name for name in getattr(model, "_pp_plan", None) or () if "." not in name)
        return cls(tuple(names[:at]), repeated[0], tuple(names[at + 1:]), head)


def split_layers(num_layers: int, num_stages: int, split_points: list[int] | None = None) -> list[range]:
    """Decoder-layer ranges of each stage. split_points: the first layer of stages 1..S-1 (ascending);
    default: as even as possible, the earlier stages taking the remainder."""
    if num_stages < 1 or num_stages > num_layers:
        raise ValueError(f"cannot cut {num_layers} decoder layers into {num_stages} pipeline stages "
                         "(every stage needs at least one layer)")
    if split_points is None:
        base, extra = divmod(num_layers, num_stages)
        sizes = [base + (1 if stage < extra else 0) for stage in range(num_stages)]
        split_points = [sum(sizes[: stage + 1]) for stage in range(num_stages - 1)]
    split_points = list(split_points)
    bounds = [0, *split_points, num_layers]
    if len(split_points) != num_stages - 1 or any(b <= a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"split_points {split_points} must be {num_stages - 1} ascending layer indices in "
                         f"(0, {num_layers}) for {num_stages} stages")
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


class _RouterLossGrad(torch.autograd.Function):
    """Identity on `hidden_states` whose backward also gives `router_loss` (a weighted scalar) the gradient 1:
    the loss enters the backward without being an output of the stage (hand-written: torch has no such op)."""

    @staticmethod
    def forward(ctx, hidden_states, router_loss):
        ctx.save_for_backward(router_loss)
        return hidden_states.view_as(hidden_states)

    @staticmethod
    def backward(ctx, grad):
        (router_loss,) = ctx.saved_tensors
        return grad, torch.ones_like(router_loss)


class DLMPipelineStageModule(nn.Module):
    """Decoder layers `layer_indices` of a `DLMForDiffusionLM` (plus the embeddings on the first stage, the
    final norm and the head on the last), under the full model's parameter names.

    forward(inputs, **batch): inputs are the noisy token ids (B, L) on the first stage and the hidden states
    (B, L or 2L, H) elsewhere; the batch's attention_mask / position_ids / clean_input_ids rebuild the mask
    and RoPE on every stage. Returns the hidden states, or on the last stage the loss as a (1,) tensor:
    sum of weighted masked CE / `loss_normaliser` (set before each step)."""

    def __init__(self, model, layer_indices, is_first: bool, is_last: bool, plan: PipelinePlan):
        super().__init__()
        self.config = model.config
        base = getattr(model, model.base_model_prefix)
        self.model = nn.Module()
        for name in plan.first if is_first else ():
            setattr(self.model, name, getattr(base, name))
        self.model.layers = nn.ModuleDict({str(i): getattr(base, plan.layers)[i] for i in layer_indices})
        for name in plan.last if is_last else ():
            setattr(self.model, name, getattr(base, name))
        for name in plan.head if is_last else ():
            setattr(self, name, getattr(model, name))
        self.model.rotary_emb = base.rotary_emb  # buffers only, shared by the stages of a rank
        self.is_first, self.is_last = is_first, is_last
        self.loss_normaliser: torch.Tensor | None = None
        # MoE: the unsplit model averages the router losses over all its MoE layers and the trainer over the
        # micro-batches; router_loss_weight (1 / micro-batches) is set by DLMPipeline.step
        self.moe_blocks = [layer.mlp for layer in self.model.layers.values() if isinstance(layer.mlp, DLMSparseMoeBlock)]
        self.total_moe_layers = sum(model.config.is_moe_layer(i) for i in range(model.config.num_hidden_layers))
        self.router_loss_weight = 1.0
        self.router_values: list[torch.Tensor] = []  # (aux, z) of this stage's layers / total_moe_layers, per forward
        self.compile_loss_head = getattr(model, "compile_loss_head", False)
        self.loss_grad_in_forward = getattr(model, "loss_grad_in_forward", True)
        self.suppressed_token_id = None  # the objective's subs=True (DLMPipeline.step sets it)

    def forward(self, inputs, attention_mask=None, position_ids=None, labels=None, label_weights=None,
                clean_input_ids=None):
        two_stream = clean_input_ids is not None
        if self.is_first:
            hidden_states = self.model.embed_tokens(inputs)  # (B, L, H)
            if two_stream:
                hidden_states = torch.cat([hidden_states, self.model.embed_tokens(clean_input_ids)], dim=1)
        else:
            hidden_states = inputs
        mask, position_embeddings = decoder_layer_inputs(
            self.config, self.model.rotary_emb, hidden_states, attention_mask, position_ids, two_stream
        )
        token_mask = router_token_mask(attention_mask, two_stream) if self.moe_blocks else None
        for block in self.moe_blocks:  # padding stays out of the router losses, as in DLMModel.forward
            block.token_mask = token_mask
        for layer in self.model.layers.values():
            hidden_states = layer(hidden_states, attention_mask=mask, position_embeddings=position_embeddings)
        if self.moe_blocks:
            hidden_states = self._with_router_losses(hidden_states)
        if not self.is_last:
            return hidden_states
        if labels is None or self.loss_normaliser is None:
            raise ValueError("the last pipeline stage needs labels and a loss_normaliser (DLMPipeline.step sets it)")
        hidden_states = self.model.norm(hidden_states[:, : labels.shape[1]])
        loss, _ = masked_lm_loss(hidden_states, self.lm_head, labels, label_weights, self.loss_normaliser,
                                 self.config.loss_chunk_size, compiled=self.compile_loss_head,
                                 grad_in_forward=self.loss_grad_in_forward,
                                 suppressed_token_id=self.suppressed_token_id)
        return loss.reshape(1)  # (1,): the schedule concatenates the micro-batches' outputs

    def _with_router_losses(self, hidden_states):
        """Read this stage's router losses (the blocks clear them) and tie them into the backward."""
        losses = [block.router_losses for block in self.moe_blocks if block.router_losses is not None]
        for block in self.moe_blocks:
            block.router_losses = block.token_mask = None
        if not losses:
            return hidden_states
        aux = torch.stack([balance for balance, _ in losses]).sum() / self.total_moe_layers
        z = torch.stack([z for _, z in losses]).sum() / self.total_moe_layers
        if not aux.is_meta:  # shape inference: meta tensors, or one more real forward (router_totals skips it)
            self.router_values.append(torch.stack([aux, z]).detach().float())
        if not torch.is_grad_enabled():
            return hidden_states
        weighted = (self.config.router_aux_loss_coef * aux + self.config.router_z_loss_coef * z) * self.router_loss_weight
        return _RouterLossGrad.apply(hidden_states, weighted)


class DLMPipelineModel(nn.Module):
    """All parameters this rank holds, under `save_pretrained` names (what the optimizer and the Trainer
    see); `stages` are the `DLMPipelineStageModule`s that share them."""

    def __init__(self, config, stages: list[DLMPipelineStageModule]):
        super().__init__()
        self.config = config
        self.model = nn.Module()
        self.model.layers = nn.ModuleDict()
        for stage in stages:
            for name, module in stage.model.named_children():
                if name == "layers":
                    self.model.layers.update(module)
                else:
                    setattr(self.model, name, module)
            if stage.is_last:
                self.lm_head = stage.lm_head
        self.stages = tuple(stages)  # a tuple is not registered: the parameters appear once, under model / lm_head

    def activation_checkpointing_enable(self, activation_checkpointing_kwargs=None, every_n_layers: int = 1,
                                        offload: bool = False):
        """Recompute every `every_n_layers`-th decoder layer (by its index in the full model) in backward, through
        the layers' own `GradientCheckpointingLayer` hook; what `Trainer` calls for `gradient_checkpointing`."""
        from torch.utils.checkpoint import checkpoint

        if offload:
            raise NotImplementedError("activation offloading with pipeline parallelism is not supported")
        kwargs = {"use_reentrant": False, **(activation_checkpointing_kwargs or {})}
        for index, layer in self.model.layers.items():
            layer.gradient_checkpointing = int(index) % every_n_layers == 0
            layer._gradient_checkpointing_func = functools.partial(checkpoint, **kwargs)

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None, **kwargs):
        """transformers < 5.19's name of `activation_checkpointing_enable`."""
        self.activation_checkpointing_enable(gradient_checkpointing_kwargs, **kwargs)

    def forward(self, *args, **kwargs):
        raise RuntimeError("a pipeline-parallel model runs through DLMPipeline.step (its schedule), not forward")


def _sum_loss(output: torch.Tensor, target) -> torch.Tensor:
    """The schedule's loss_fn: the last stage already returned the normalised loss."""
    return output.sum()


# -- the pipeline -----------------------------------------------------------------------------------
class DLMPipeline:
    """This rank's part of a pipeline-parallel `DLMForDiffusionLM`.

    model: the full model (every rank builds it; this rank keeps its stages' modules).
    pp_group / pp_mesh: the process group of the pipeline (or a 1-D `DeviceMesh`); ranks in group order
        hold the stages. schedule: one of PIPELINE_SCHEDULES. stages_per_rank: virtual stages per rank
        (interleaved 1F1B only, default 2; rank r holds stages r, r + pp, ...). split_points: first layer
        of stages 1..S-1 (default: even). dp_mesh: FSDP2-shard every stage over this mesh (each decoder
        layer one unit, then the stage; `fsdp_options`: a `ParallelOptions` for the rest, e.g. param_dtype);
        its ranks run the same stages on different data.
    """

    def __init__(self, model, *, pp_group=None, pp_mesh=None, schedule: str = "1f1b",
                 stages_per_rank: int | None = None,
                 split_points: list[int] | None = None, dp_mesh=None, device: torch.device | str | None = None,
                 fsdp_options=None):
        check_pipeline_model(model)
        if schedule not in PIPELINE_SCHEDULES:
            raise ValueError(f"pipeline schedule must be one of {PIPELINE_SCHEDULES}, got {schedule!r}")
        if stages_per_rank is None:
            stages_per_rank = 2 if schedule == "interleaved_1f1b" else 1
        if schedule != "interleaved_1f1b" and stages_per_rank != 1:
            raise ValueError(f"schedule {schedule!r} runs one stage per rank; stages_per_rank > 1 needs "
                             "'interleaved_1f1b'")
        self.group = pp_mesh.get_group() if pp_mesh is not None else (pp_group or dist.group.WORLD)
        self.pp_size, self.pp_rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        self.schedule_name, self.stages_per_rank = schedule, stages_per_rank
        self.dp_mesh = dp_mesh
        self.dp_size = dp_mesh.size() if dp_mesh is not None else 1
        self.dp_rank = dp_mesh.get_local_rank() if dp_mesh is not None else 0
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.num_parameters = sum(p.numel() for p in model.parameters())
        plan = PipelinePlan.from_model(model)
        num_stages = self.pp_size * stages_per_rank
        ranges = split_layers(model.config.num_hidden_layers, num_stages, split_points)
        self.stage_indices = [self.pp_rank + k * self.pp_size for k in range(stages_per_rank)]
        modules = [DLMPipelineStageModule(model, ranges[i], i == 0, i == num_stages - 1, plan)
                   for i in self.stage_indices]
        for module in modules:
            module.to(self.device)
            if dp_mesh is not None:
                _fully_shard_stage(module, dp_mesh, fsdp_options)
        self.model = DLMPipelineModel(model.config, modules)
        self.layer_ranges = [ranges[i] for i in self.stage_indices]
        from torch.distributed.pipelining import PipelineStage

        self.stages = [PipelineStage(module, index, num_stages, self.device, group=self.group)
                       for module, index in zip(modules, self.stage_indices)]
        self._schedule, self._n_microbatches = None, None

    @property
    def has_first_stage(self) -> bool:
        return any(stage.is_first for stage in self.stages)

    @property
    def has_last_stage(self) -> bool:
        return any(stage.is_last for stage in self.stages)

    def _schedule_for(self, n_microbatches: int):
        """The schedule for this many micro-batches (rebuilt when the count changes: the stages' buffers are
        laid out per micro-batch)."""
        if n_microbatches != self._n_microbatches:
            from torch.distributed import pipelining

            name = self.schedule_name
            if name == "1f1b" and n_microbatches < self.pp_size:
                # 1F1B needs m >= p; a short window (the end of an epoch) runs the same math through GPipe
                logger.warning(f"{n_microbatches} micro-batches < pp_size={self.pp_size}: this step runs through "
                               "the GPipe schedule (1F1B needs at least pp_size)")
                name = "gpipe"
            cls = getattr(pipelining, _SCHEDULE_CLASSES[name])
            stages = self.stages if name == "interleaved_1f1b" else self.stages[0]
            # scale_grads=False: the loss already carries the global normaliser
            self._schedule = cls(stages, n_microbatches, loss_fn=_sum_loss, scale_grads=False)
            self._n_microbatches = n_microbatches
        return self._schedule

    def step(self, micro_batches: list[dict], loss_normaliser: torch.Tensor | float) -> torch.Tensor | None:
        """Forward and backward of every micro-batch through the schedule; gradients accumulate in the stages'
        parameters. micro_batches: the model inputs (input_ids, labels, label_weights, attention_mask, ...),
        all of the same shapes, the same on every rank of the pipeline. loss_normaliser: the loss's divisor
        (the global number of supervised items, divided by the data-parallel size when gradients are averaged
        over it). Returns the summed loss on the rank of the last stage, None elsewhere."""
        # a Python int, not a tensor the schedule could split: the same for every micro-batch
        suppressed = [micro_batch.pop("suppressed_token_id", None) for micro_batch in micro_batches]
        batch = _concatenate(micro_batches)
        for stage in self.stages:
            stage.submod.suppressed_token_id = suppressed[0]
            stage.submod.loss_normaliser = torch.as_tensor(loss_normaliser, device=self.device)
            stage.submod.router_loss_weight = 1.0 / len(micro_batches)
            stage.submod.router_values = []
        schedule = self._schedule_for(len(micro_batches))
        kwargs = {k: batch[k] for k in _STAGE_KWARGS if k in batch}
        args = (batch["input_ids"],) if self.has_first_stage else ()
        losses = [] if self.has_last_stage else None
        schedule.step(*args, target=batch["labels"], losses=losses, **kwargs)
        return torch.stack(losses).sum() if losses is not None else None

    def router_totals(self) -> torch.Tensor | None:
        """MoE: (load-balancing, z) losses of the last step, each the unsplit model's mean over its MoE layers,
        summed over the step's micro-batches; the same on every rank of the pipeline. None without MoE layers."""
        if not self.model.config.num_experts:
            return None
        # the last m forwards of each stage: the first step's metadata inference runs the stage once more before them
        m = self._n_microbatches
        values = [v for stage in self.stages for v in stage.submod.router_values[-m:]]
        total = torch.stack(values).sum(0) if values else torch.zeros(2, device=self.device)
        dist.all_reduce(total, group=self.group)  # the stages hold disjoint layers
        return total

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Total gradient norm over every stage and shard (clipped to max_norm unless it is inf)."""
        from torch.distributed.tensor import DTensor
        from torch.nn.utils import clip_grads_with_norm_, get_total_norm

        parameters = [p for p in self.model.parameters() if p.grad is not None]
        norm = get_total_norm([p.grad for p in parameters])  # FSDP: a DTensor partial over the dp mesh
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squared = norm.to(torch.float32) ** 2
        dist.all_reduce(squared, group=self.group)
        total = squared.sqrt()
        if max_norm != float("inf"):
            clip_grads_with_norm_(parameters, max_norm, total)
        return total


def pipeline_for_training(model, args) -> DLMPipeline:
    """The pipeline of a `DLMTrainingArguments` run: a (pp, dp_shard) device mesh over all processes (pp outermost,
    as torchtitan orders it), the stages FSDP2-sharded over dp_shard when there are more processes than stages."""
    from torch.distributed.device_mesh import init_device_mesh

    world = args.world_size  # sets up torch.distributed under torchrun / accelerate launch
    if world < args.pp_size or not dist.is_initialized():
        raise RuntimeError(f"pp_size={args.pp_size} needs that many processes or a multiple: launch with torchrun / "
                           f"accelerate launch (world size here: {world})")
    if world % args.pp_size:
        raise ValueError(f"pp_size={args.pp_size} must divide the number of processes ({world}); the quotient is "
                         "the data-parallel (FSDP2) size")
    dp = world // args.pp_size
    mesh = init_device_mesh(args.device.type, (args.pp_size, dp), mesh_dim_names=("pp", "dp_shard"))
    return DLMPipeline(model, pp_mesh=mesh["pp"], schedule=args.pp_schedule, stages_per_rank=args.pp_stages_per_rank,
                       split_points=args.pp_split_points, dp_mesh=mesh["dp_shard"] if dp > 1 else None,
                       device=args.device)


def check_pipeline_model(model) -> None:
    """Refuse what the stages cannot split, with the reason."""
    config = model.config
    if getattr(config, "tie_word_embeddings", False):
        raise NotImplementedError("pipeline parallelism with tie_word_embeddings=True: the embedding (first stage) and "
                                  "lm_head (last stage) would be one weight on two ranks; untie them first")
    if not hasattr(getattr(model, getattr(model, "base_model_prefix", "model"), None), "rotary_emb"):
        raise TypeError(f"pipeline parallelism splits a DLMForDiffusionLM, got {type(model).__name__}")
    if any(p.device.type == "meta" for p in model.parameters()):
        raise ValueError("pipeline parallelism needs materialised weights (build or load the model first)")


def _fully_shard_stage(module: DLMPipelineStageModule, dp_mesh, options=None) -> None:
    """FSDP2 over the data-parallel ranks (`parallelize.apply_fsdp`, `options` a `ParallelOptions`): every decoder
    layer one unit, the stage (embeddings / norm / head) the root. `PipelineStage` drives the gradient
    reduction itself (after the last micro-batch)."""
    import dataclasses

    from .parallelize import ParallelOptions, apply_fsdp

    options = dataclasses.replace(options or ParallelOptions(), dp_mesh=dp_mesh, fsdp=True)
    apply_fsdp(module, options, layers=module.model.layers.values())


def _concatenate(micro_batches: list[dict]) -> dict:
    """One batch of the micro-batches in order (the schedule splits it back into equal chunks)."""
    keys = micro_batches[0].keys()
    for index, micro_batch in enumerate(micro_batches):
        if micro_batch.keys() != keys:
            raise ValueError(f"pipeline micro-batch {index} has inputs {sorted(micro_batch)}, micro-batch 0 "
                             f"{sorted(keys)}: every micro-batch of a step must carry the same inputs")
        shapes = {k: tuple(v.shape) for k, v in micro_batch.items()}
        first = {k: tuple(v.shape) for k, v in micro_batches[0].items()}
        if shapes != first:
            raise ValueError(f"pipeline micro-batch {index} has shapes {shapes}, micro-batch 0 {first}: a pipeline "
                             "sends fixed-shape activations, so pad every batch to one length (packed windows, "
                             "or a collator with a fixed max length)")
    return {k: torch.cat([mb[k] for mb in micro_batches]) for k in keys}


# -- planning terms ---------------------------------------------------------------------------------
def pipeline_schedule_terms(num_layers: int, pp_size: int, n_microbatches: int, schedule: str = "1f1b",
                            stages_per_rank: int | None = None, layer_state_bytes: float = 0.0,
                            layer_activation_bytes: float = 0.0) -> dict:
    """Bubble and memory terms of a pipeline layout, for a planner.

    bubble_fraction: idle share of a step with equal forward/backward times per stage:
        GPipe and 1F1B (p - 1) / (m + p - 1); interleaved 1F1B with v stages per rank
        (p - 1) / (v m + p - 1) (Narayanan et al. 2021, "Efficient large-scale language model training").
    layers_per_rank: decoder layers on the busiest rank (scale the per-layer parameter / optimizer bytes);
    in_flight_layers: layer-activations held at once on rank 0, the peak (scale the per-layer, per-micro-batch
        activation bytes): GPipe keeps all m micro-batches, 1F1B min(p, m), interleaved 1F1B the warm-up of
        torch's schedule (2 (p - 1) + (v - 1) * m/rounds forward chunks, plus the one in flight).
    p2p_per_microbatch: activation sends per micro-batch and direction (each of B x L x H elements).
    memory_bytes: layers_per_rank x layer_state_bytes (one layer's weights, gradients and optimizer state on
        this rank, after any FSDP sharding) + in_flight_layers x layer_activation_bytes (one layer's saved
        activations for one micro-batch); the embeddings and head of the end stages come on top.
    """
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"schedule must be one of {PIPELINE_SCHEDULES}, got {schedule!r}")
    v = stages_per_rank or (2 if schedule == "interleaved_1f1b" else 1)
    p, m = pp_size, n_microbatches
    num_stages = p * v
    layers_per_stage = -(-num_layers // num_stages)
    if schedule == "gpipe":
        in_flight_chunks = m
    elif schedule == "1f1b":
        in_flight_chunks = min(p, m)
    else:
        rounds = max(1, m // p)
        in_flight_chunks = min((v - 1) * (m // rounds) + 2 * (p - 1) + 1, m * v)
    bubble = (p - 1) / (v * m + p - 1)
    layers_per_rank, in_flight_layers = layers_per_stage * v, in_flight_chunks * layers_per_stage
    return {"bubble_fraction": bubble, "layers_per_rank": layers_per_rank, "in_flight_layers": in_flight_layers,
            "num_stages": num_stages, "p2p_per_microbatch": num_stages - 1,
            "memory_bytes": layers_per_rank * layer_state_bytes + in_flight_layers * layer_activation_bytes}


__all__ = ["pipeline_for_training", "DLMPipeline", "DLMPipelineModel", "DLMPipelineStageModule", "PipelinePlan",
           "PIPELINE_SCHEDULES", "check_pipeline_model", "pipeline_schedule_terms", "split_layers"]
