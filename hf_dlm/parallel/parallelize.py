"""Parallelism and speed-ups applied to a plain `DLMForDiffusionLM`, in torchtitan's order:

1. float8 conversion (a converter: it swaps modules, so it must see the unsharded model);
2. tensor parallel (DTensor `parallelize_module` with the config's `base_model_tp_plan`);
3. activation checkpointing, one checkpoint per decoder layer;
4. per-block `torch.compile` (regional compilation: identical decoder layers reuse one compiled graph,
   so 28 layers compile about as fast as one);
5. FSDP2 `fully_shard` per decoder layer, then the root, with a `MixedPrecisionPolicy`.

Used directly where accelerate cannot (accelerate's FSDP does not run on CPU, and this is what the
multi-process CPU tests run), and by the trainer for float8 / compile / checkpointing before
accelerate wraps the model with its own FSDP2 on GPU (call it then with `fsdp=False`).
Module names and state-dict keys are unchanged by every step (`nn.Module.compile` compiles in place,
checkpointing goes through the model's own `GradientCheckpointingLayer`), so the result still saves
and loads with `save_pretrained` / `from_pretrained` key names.
"""

from __future__ import annotations

import fnmatch

import torch
import torch.distributed as dist
from torch import nn

from .float8 import convert_to_float8

# base_model_tp_plan strings -> torch.distributed.tensor.parallel styles; "replicated_with_grad_allreduce"
# layers (per-head q/k norms) keep a full weight whose gradient is summed over the tensor-parallel group
_TP_STYLES = ("colwise", "rowwise", "replicated_with_grad_allreduce")


def parallelize_dlm(
    model: nn.Module,
    *,
    dp_mesh=None,
    tp_mesh=None,
    ep_mesh=None,
    fsdp: bool = False,
    float8_recipe: str | None = None,
    float8_min_features: int = 2048,
    float8_fast_accum: bool = False,
    float8_fsdp_all_gather: bool = False,
    activation_checkpointing: bool = False,
    low_precision_residual: bool = False,
    compile: bool = False,
    compile_options: dict | None = None,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = torch.float32,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """Apply float8, tensor parallel, activation checkpointing, per-block compile and FSDP2 in place.

    model: a `DLMForDiffusionLM` (or anything with `model.model.layers`), unsharded, any device.
    dp_mesh: 1-D `DeviceMesh` that FSDP2 shards over; default (with `fsdp=True`): all ranks of the
        default process group on the model's device type.
    tp_mesh: 1-D `DeviceMesh` for tensor parallel; None = no tensor parallel. Attention and KV heads
        must divide by its size. Not combined with FSDP here (that needs a 2-D mesh; use one or the other).
    ep_mesh: 1-D `DeviceMesh` for expert parallelism (`expert_parallel.apply_expert_parallel`): MoE experts
        sharded over it, tokens dispatched by all-to-all. With FSDP, the experts stay out of `fully_shard`
        and `ep_mesh` must span the same ranks as `dp_mesh` (EP borrows the data-parallel ranks).
    fsdp: shard parameters, gradients and optimizer state with FSDP2 `fully_shard` (one unit per decoder
        layer, plus the root for embeddings, final norm and head). Implied by passing `dp_mesh`.
    float8_recipe: None (off), a torchao recipe ("tensorwise", "rowwise") or "delayed" (hf-dlm's delayed
        scaling, `float8_delayed`): float8 training for linears whose in and out features are both at least
        `float8_min_features` (`lm_head` never). Needs an sm_89+ GPU; "delayed" is not combined with tp_mesh.
        `float8_fast_accum`: fast accumulation in the backward GEMMs too; `float8_fsdp_all_gather`: with FSDP
        and "tensorwise", all-gather weights already in float8 (`float8.convert_to_float8`; then call
        `float8.precompute_float8_scales(model)` after every optimizer step).
    activation_checkpointing: recompute each decoder layer in backward (non-reentrant checkpoint).
    low_precision_residual: under autocast, the embeddings are cast to the autocast dtype, so the residual
        stream between layers is bf16 rather than fp32 (fp32 weights make it fp32 under autocast). This is
        what bf16 weights give (FSDP2 `param_dtype=torch.bfloat16`, Megatron-LM's default), without
        their weight copies; it halves the activation traffic of norms, residual adds and float8 casts.
    compile: `torch.compile` each decoder layer in place, and the masked head's loss chunks;
        `compile_options` go to the layers' `torch.compile` (e.g. `{"mode": "max-autotune-no-cudagraphs"}`).
    param_dtype / reduce_dtype: FSDP2 `MixedPrecisionPolicy`: the dtype parameters are all-gathered and
        computed in (None: as stored), and the gradient reduce-scatter dtype (fp32 by default).
    reshard_after_forward: FSDP2: free gathered parameters after forward (ZeRO-3) rather than keep them
        to backward (ZeRO-2, more memory, less communication). The root is never resharded after forward.
    Returns `model` (the same object).
    """
    layers = model.model.layers
    fsdp = fsdp or dp_mesh is not None
    if fsdp and tp_mesh is not None:
        raise NotImplementedError(
            "parallelize_dlm: tp_mesh together with FSDP needs a 2-D mesh with DTensor-aware norms, "
            "which is not built yet; use tensor parallel or FSDP"
        )

    if float8_recipe == "delayed" and tp_mesh is not None:
        raise NotImplementedError("parallelize_dlm: float8_recipe='delayed' does not take DTensor weights; "
                                  "with tp_mesh use a torchao recipe ('tensorwise' or 'rowwise')")

    # 1. float8: before sharding, so FSDP2 / DTensor wrap the float8 modules' weights
    if float8_recipe is not None:
        convert_to_float8(model, recipe=float8_recipe, min_features=float8_min_features,
                          fast_accum=float8_fast_accum, fsdp_all_gather=float8_fsdp_all_gather)

    if low_precision_residual:
        embeddings = model.get_input_embeddings()
        if getattr(embeddings, "_autocast_output_hook", None) is None:
            embeddings._autocast_output_hook = embeddings.register_forward_hook(_output_to_autocast_dtype)

    # 2. tensor parallel over the decoder layers
    if tp_mesh is not None:
        apply_tensor_parallel(model, tp_mesh)

    # 2b. expert parallel: experts sharded over ep_mesh before FSDP sees the model
    ignored_params = set()
    if ep_mesh is not None:
        from .expert_parallel import apply_expert_parallel, expert_parameters

        apply_expert_parallel(model, ep_mesh)
        ignored_params = set(expert_parameters(model))

    # 3. activation checkpointing through the layers' own GradientCheckpointingLayer hook, so that
    #    parameter names stay as saved (a checkpoint_wrapper would insert `_checkpoint_wrapped_module.`)
    if activation_checkpointing:
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.24
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)

    # 4. regional compile: in place, so state-dict keys keep no `_orig_mod.` prefix
    if compile:
        for layer in layers:
            layer.compile(**(compile_options or {}))
        if hasattr(model, "compile_loss_head"):  # the masked head's linear + cross-entropy chunks too
            model.compile_loss_head = True

    # 5. FSDP2: each decoder layer is one all-gather / reduce-scatter unit, the root holds the rest
    if fsdp:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if dp_mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            device_type = next(model.parameters()).device.type
            dp_mesh = init_device_mesh(device_type, (dist.get_world_size(),))
        if ep_mesh is not None and sorted(dist.get_process_group_ranks(ep_mesh.get_group())) != sorted(
                dist.get_process_group_ranks(dp_mesh.get_group())):
            raise NotImplementedError(
                "parallelize_dlm: ep_mesh must span the ranks of dp_mesh; experts replicated over further data-"
                "parallel ranks would need their own FSDP mesh (torchtitan's dp_shard_mod_ep), not built yet"
            )
        # experts are sharded by expert parallelism already: FSDP2 leaves them out (ignored_params)
        shard_options = {"ignored_params": ignored_params} if ignored_params else {}
        mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        for index, layer in enumerate(layers):
            # the last layer's parameters are needed again at once by backward: keep them gathered
            reshard = reshard_after_forward and index < len(layers) - 1
            fully_shard(layer, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=reshard, **shard_options)
        fully_shard(model, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=False, **shard_options)
    return model


def _output_to_autocast_dtype(module, args, output):
    device_type = output.device.type
    if torch.is_autocast_enabled(device_type) and output.is_floating_point():
        return output.to(torch.get_autocast_dtype(device_type))
    return output


def apply_tensor_parallel(model: nn.Module, tp_mesh) -> None:
    """Shard the decoder layers with DTensor following `config.base_model_tp_plan` (Megatron layout:
    q/k/v and gate/up column-wise, o/down row-wise, one all-reduce after attention and one after the
    MLP). Embeddings, norms and the head stay replicated; their gradients come out identical on every
    rank because the column-wise layers all-reduce their input gradients."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    config = model.config
    size = tp_mesh.size()
    if config.num_attention_heads % size or config.num_key_value_heads % size:
        raise ValueError(
            f"tensor parallel size {size} must divide num_attention_heads ({config.num_attention_heads}) "
            f"and num_key_value_heads ({config.num_key_value_heads})"
        )
    plan, replicated = {}, []
    for pattern, style in config.base_model_tp_plan.items():
        if style not in _TP_STYLES:
            raise ValueError(f"base_model_tp_plan[{pattern!r}] = {style!r}: parallelize_dlm knows {_TP_STYLES}")
        if style == "colwise":
            plan[pattern] = ColwiseParallel()
        elif style == "rowwise":
            plan[pattern] = RowwiseParallel()
        else:
            replicated.append(pattern)
    parallelize_module(model.model, tp_mesh, plan)

    # per-head norms see only this rank's heads: sum each backward's weight gradient over the group
    # (a tensor hook, before accumulation, so gradient accumulation stays right)
    group = tp_mesh.get_group()

    def sum_over_group(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad, group=group)
        return grad

    for name, parameter in model.model.named_parameters():
        if any(fnmatch.fnmatch(name.rsplit(".", 1)[0], pattern) for pattern in replicated):
            parameter.register_hook(sum_over_group)
