"""The diffusion trainers under a named device mesh: layouts from the training arguments (`tp_size`, `cp_size`,
`dp_shard_size`, `dp_replicate_size`, `ep_size`: the one spelling; transformers' `parallelism_config` is
accepted and turned into these fields when the arguments are built), applied by `parallelize_dlm` itself, on CPU (torchrun + gloo, where accelerate's FSDP cannot run) and GPU alike;
accelerate then runs the loop, the optimizer and the data loaders (its loaders give every TP / CP rank of
a data-parallel group the same batches, read from the mesh's dimension names).

Checkpoints: model and optimizer through `torch.distributed.checkpoint` (one `dcp/` folder per checkpoint,
each rank writing its shards), so a run resumes under any other layout; `save_model` outside
checkpoints gathers full weights into a plain `save_pretrained` folder.
"""

from __future__ import annotations

import math
import os
import types
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..utils.transformers_compat import hand_activation_checkpointing_over
from .mesh import ParallelDims, build_parallel_dims

DCP_DIR = "dcp"
LAYOUT_FIELDS = ("tp_size", "cp_size", "dp_shard_size", "dp_replicate_size", "ep_size")


def wants_parallel_layout(args) -> bool:
    return any((getattr(args, name, None) or 1) > 1 for name in LAYOUT_FIELDS)


def check_layout_supported(model, args, dims: ParallelDims) -> None:
    """Refuse up front what this layout cannot train, naming the option and the reason."""
    from .context_parallel import check_context_parallel_supported

    def refuse(message):
        raise ValueError(f"DLMTrainer with {dims.describe()}: {message}")

    config = model.config
    if getattr(args, "fsdp", None) or getattr(args, "fsdp_config", None) and args.fsdp_config.get("fsdp_version"):
        refuse("`fsdp` (accelerate's FSDP) and hf-dlm's layout options both shard the model; use dp_shard_size")
    if getattr(args, "deepspeed", None):
        refuse("DeepSpeed cannot be combined with hf-dlm's device mesh")
    if dims.pp > 1:
        refuse("pipeline parallel (pp_size > 1) composes with FSDP2 only (the processes beyond pp_size shard every "
               "stage, hf_dlm.parallel.pipeline); tensor / context / expert parallel and dp_replicate inside stages "
               "are not built yet: leave tp_size, cp_size, ep_size, dp_replicate_size at 1 and dp_shard_size at -1")
    if dims.tp > 1 and (config.num_attention_heads % dims.tp or config.num_key_value_heads % dims.tp):
        refuse(f"tp_size {dims.tp} must divide num_attention_heads ({config.num_attention_heads}) and "
               f"num_key_value_heads ({config.num_key_value_heads})")
    if dims.cp > 1:
        check_context_parallel_supported(config, config._attn_implementation or "eager")
    if dims.ep > 1 and not (getattr(config, "num_experts", 0) or getattr(config, "num_local_experts", 0)):
        refuse(f"ep_size {dims.ep} needs a mixture-of-experts model (config.num_experts)")
    if dims.tp > 1 and args.fp8_recipe == "delayed":
        refuse("fp8_recipe='delayed' does not take DTensor weights; use 'tensorwise' or 'rowwise' with tp_size")


@dataclass
class ParallelTraining:
    dims: ParallelDims

    @property
    def replicas(self) -> int:
        """Ranks of one data-parallel group: they see the same batches (TP) or shares of them (CP)."""
        return self.dims.tp * self.dims.cp

    @property
    def loss_scale(self) -> float:
        """The loss is this rank's share over the global normaliser; FSDP2 averages gradients over the
        dp x cp ranks, so each rank's loss is scaled by their number (as DDP's by the world size)."""
        return float(self.dims.loss_parallel_size)


def setup_parallel_training(model, args) -> ParallelTraining | None:
    """Build the mesh and parallelise `model` in place when the arguments ask for a layout; None otherwise."""
    if not wants_parallel_layout(args):
        return None
    device = args.device  # initialises the process group (accelerate's PartialState)
    world = dist.get_world_size() if dist.is_initialized() else 1
    dims = build_parallel_dims(args, world)
    check_layout_supported(model, args, dims)
    dims.build_mesh(device.type)
    from .parallelize import ParallelOptions, parallelize_dlm

    model.to(device)
    parallelize_dlm(model, ParallelOptions.from_args(args, dims))
    # checkpointing is applied above, non-reentrant; the Trainer would re-enable it with its own defaults
    hand_activation_checkpointing_over(args)  # both spellings: transformers >= 5.24 reads only the new one
    args.parallelism_config = None  # the layout is applied here: accelerate must not apply its own
    return ParallelTraining(dims)


def install_accelerator_hooks(accelerator, parallel: ParallelTraining) -> None:
    """accelerate must not wrap the parallelised model (its DDP rejects DTensor parameters), its gradient
    clipping must handle DTensors on several meshes, and its data loaders shard over data-parallel ranks."""
    def prepare_model(self, model, device_placement=None, evaluation_mode=False):
        if model not in self._models:
            self._models.append(model)
        return model

    accelerator.prepare_model = types.MethodType(prepare_model, accelerator)
    accelerator.clip_grad_norm_ = lambda parameters, max_norm, norm_type=2: clip_grad_norm_(parameters, max_norm)
    accelerator.state.device_mesh = parallel.dims.world_mesh


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float) -> torch.Tensor:
    """Global 2-norm of the gradients (DTensors reduced over their meshes; plain tensors are replicated),
    and in-place scaling to `max_norm`. Returns the norm before clipping."""
    grads = [p.grad for p in parameters if p.grad is not None]
    squares = []
    for grad in grads:
        norm = torch.linalg.vector_norm(grad, dtype=torch.float32)
        squares.append((norm.full_tensor() if hasattr(norm, "full_tensor") else norm) ** 2)
    if not squares:
        return torch.zeros(())
    total = torch.stack(squares).sum().sqrt()
    if max_norm and max_norm > 0 and math.isfinite(float(total)):
        scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for grad in grads:
            grad.mul_(scale.to(grad.device) if not hasattr(grad, "device_mesh") else float(scale))
    return total


def save_sharded_checkpoint(model, optimizer, output_dir: str) -> None:
    """Model and optimizer state as a `torch.distributed.checkpoint` folder `output_dir/dcp` (every rank)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=os.path.join(output_dir, DCP_DIR))


def has_sharded_checkpoint(checkpoint_dir: str) -> bool:
    return os.path.isdir(os.path.join(checkpoint_dir, DCP_DIR))


def load_sharded_checkpoint(model, optimizer, checkpoint_dir: str) -> None:
    """Load `checkpoint_dir/dcp` into `model` and `optimizer`, whatever layout saved it (DCP reshards)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = os.path.join(checkpoint_dir, DCP_DIR)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{checkpoint_dir} has no {DCP_DIR}/ folder: it was not saved under a device mesh "
                                "(resume it without tp_size / cp_size / dp_shard_size, or from a mesh checkpoint)")
    model_state, optimizer_state = get_state_dict(model, optimizer)
    # only the per-parameter state (keyed by parameter name): the param groups are this layout's own, since
    # transformers gives every mesh its own group and the count differs between layouts
    state = {"model": model_state, "optimizer": {"state": optimizer_state["state"]}}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict={"state": state["optimizer"]["state"], "param_groups": optimizer_state["param_groups"]})


def load_scheduler_state(scheduler, optimizer, path: str) -> None:
    """A learning-rate scheduler saved under another layout (another number of param groups, one learning
    rate for all of them, as the Trainer creates them), then the restored rate set on every group."""
    state = torch.load(path, weights_only=False)
    groups = len(optimizer.param_groups)
    for key in ("base_lrs", "_last_lr", "lr_lambdas"):
        values = state.get(key)
        if isinstance(values, list) and len(values) != groups:
            if any(value != values[0] for value in values):
                raise ValueError(f"{path}: the scheduler's {key} differ between param groups; it cannot be loaded "
                                 f"into {groups} groups")
            state[key] = values[:1] * groups
    scheduler.load_state_dict(state)
    for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr()):
        group["lr"] = lr


def save_full_model(model, output_dir: str, is_main_process: bool) -> None:
    """Gather full weights (collective) and write a plain `save_pretrained` folder from the main process."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if is_main_process:
        model.save_pretrained(output_dir, state_dict=state)


@dataclass
class ParallelArguments:
    """The device-mesh fields of `DLMTrainingArguments` (a mixin: the fields live with the code that reads them)."""

    tp_size: int = field(
        default=1, metadata={"help": "Tensor-parallel size (sequence-parallel norms, vocabulary-parallel head); "
                                     "must divide the attention and KV heads. Applied by hf_dlm.parallel."})
    cp_size: int = field(
        default=1, metadata={"help": "Context-parallel size: each rank runs 1/cp_size of every sequence "
                                     "(all-gathered keys and values, or ring attention: cp_backend)."})
    dp_shard_size: int = field(
        default=-1, metadata={"help": "FSDP2 sharding size (parameters, gradients and optimizer state sharded over "
                                      "dp_shard x cp). -1: what the world size leaves after the other sizes."})
    dp_replicate_size: int = field(
        default=1, metadata={"help": "Replicated data-parallel groups of dp_shard ranks (HSDP when both > 1)."})
    ep_size: int = field(
        default=1, metadata={"help": "Expert-parallel size of mixture-of-experts layers, borrowed from dp_shard x cp."})
    cp_backend: str = field(
        default="all_gather", metadata={"help": "Context-parallel attention: 'all_gather' (any mask, any device) or "
                                                "'ring' (PyTorch's ring attention; CUDA, sdpa, unpadded batches)."})

    def _validate_layout_fields(self) -> None:
        self._adopt_parallelism_config()
        for name in ("tp_size", "cp_size", "dp_replicate_size", "ep_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"DLMTrainingArguments.{name} must be a positive integer, got {getattr(self, name)!r}")
        if not isinstance(self.dp_shard_size, int) or (self.dp_shard_size < 1 and self.dp_shard_size != -1):
            raise ValueError(f"DLMTrainingArguments.dp_shard_size must be a positive integer or -1, got {self.dp_shard_size!r}")
        if self.cp_backend not in ("all_gather", "ring"):
            raise ValueError(f"DLMTrainingArguments.cp_backend must be 'all_gather' or 'ring', got {self.cp_backend!r}")

    def _adopt_parallelism_config(self) -> None:
        """transformers' / accelerate's `parallelism_config` -> the fields above (one spelling from here on;
        accelerate then applies no layout of its own: hf-dlm's `parallelize_dlm` does)."""
        config = getattr(self, "parallelism_config", None)
        if config is None:
            return
        from ..utils.errors import FieldError

        if (getattr(config, "sp_size", None) or 1) > 1:
            raise FieldError("parallelism_config", "ParallelismConfig.sp_size (DeepSpeed Ulysses) is not supported by "
                             "hf-dlm; use cp_size", config)
        defaults = {"tp_size": 1, "cp_size": 1, "dp_shard_size": -1, "dp_replicate_size": 1}
        for name, default in defaults.items():
            value = getattr(config, name, None) or default
            if getattr(self, name) not in (default, value):
                raise FieldError(name, f"{type(self).__name__}.{name}={getattr(self, name)!r} disagrees with "
                                       f"parallelism_config.{name}={value!r}; set the layout once", getattr(self, name))
            setattr(self, name, value)
        self.parallelism_config = None

