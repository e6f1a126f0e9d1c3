"""Parallelism and speed-ups applied to a plain `DLMForDiffusionLM`, in torchtitan's order:

1. float8 conversion (a converter: it swaps modules, so it must see the unsharded model);
2. tensor parallel with sequence-parallel norms and a vocabulary-parallel head (`tensor_parallel`),
   then expert parallel of MoE layers (`expert_parallel`, over the `ep` mesh);
3. context parallel (`context_parallel`: the model takes whole sequences and runs its chunk);
4. activation checkpointing, one checkpoint per decoder layer;
5. per-block `torch.compile` (regional compilation: identical decoder layers reuse one compiled graph,
   so 28 layers compile about as fast as one);
6. FSDP2 `fully_shard` per decoder layer, then the root, with a `MixedPrecisionPolicy`, over
   dp_shard x cp (2-D with dp_replicate: HSDP), composed with the TP DTensors.

Every setting is a field of one dataclass, `ParallelOptions` (torchtitan's job config): the trainers build it
once from their arguments (`ParallelOptions.from_args`), `ParallelOptions.from_dims` fills every sub-mesh
from one `mesh.ParallelDims` world mesh, and `parallelize_dlm(model, options)` runs the steps above, each
defined once (`apply_float8`, `apply_low_precision_residual`, `apply_activation_checkpointing`,
`apply_compile`, `apply_fsdp`; tensor / expert / context parallel in their own modules). Direct calls may
spell the fields as keywords: `parallelize_dlm(model, compile=True)`.

Used directly where accelerate cannot (accelerate's FSDP does not run on CPU, and this is what the
multi-process CPU tests run), and by the trainer for float8 / compile / checkpointing before
accelerate wraps the model with its own FSDP2 on GPU (call it then with `fsdp=False`).
Module names and state-dict keys are unchanged by every step (`nn.Module.compile` compiles in place,
checkpointing goes through the model's own `GradientCheckpointingLayer`), so the result still saves
and loads with `save_pretrained` / `from_pretrained` key names.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ..utils.transformers_compat import activation_checkpointing_requested
from .float8 import convert_to_float8
from .tensor_parallel import apply_tensor_parallel


@dataclass
class ParallelOptions:
    """What `parallelize_dlm` applies (every field defaults to off / single-device).

    dp_mesh: `DeviceMesh` that FSDP2 shards over (1-D, or 2-D (replicate, shard) for HSDP); default (with
        `fsdp=True`): all ranks of the default process group on the model's device type. With context
        parallel it must include the CP ranks (`dp_shard_cp`): they hold the same weights.
    tp_mesh: 1-D `DeviceMesh` for tensor parallel; None = none. Attention and KV heads must divide by its
        size. With a dp_mesh, both must be slices of one world mesh (`mesh.ParallelDims.build_mesh`).
    cp_mesh: 1-D `DeviceMesh` for context parallel (`context_parallel.apply_context_parallel`, backend
        `cp_backend`: "all_gather" or "ring"); the model then takes whole sequences on every CP rank.
        Its gradients are summed over the CP ranks by FSDP2, which context parallel therefore needs.
    ep_mesh: 1-D `DeviceMesh` for expert parallelism (`expert_parallel.apply_expert_parallel`): MoE experts
        sharded over it, tokens dispatched by all-to-all. With FSDP, the experts stay out of `fully_shard`
        and `ep_mesh` must span the same ranks as `dp_mesh` (EP borrows the data-parallel ranks).
    expert_dp_mesh: torchtitan's `efsdp` (the data-parallel ranks beyond EP, over which experts would be
        FSDP-sharded); only a 1-rank one is supported yet, larger ones are refused.
    fsdp: shard with FSDP2 (implied by a dp_mesh).
    sequence_parallel: with tp_mesh, keep the residual stream split along the sequence between layers.
    gradient_divide_factor: FSDP2's gradient divisor; default: the number of data-parallel ranks (so CP
        ranks' gradients are summed and data-parallel ones averaged). 1 sums over every rank.
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
    """

    dp_mesh: object = None
    tp_mesh: object = None
    cp_mesh: object = None
    ep_mesh: object = None
    expert_dp_mesh: object = None
    fsdp: bool = False
    sequence_parallel: bool = True
    cp_backend: str = "all_gather"
    gradient_divide_factor: float | None = None
    float8_recipe: str | None = None
    float8_min_features: int = 2048
    float8_fast_accum: bool = False
    float8_fsdp_all_gather: bool = False
    activation_checkpointing: bool = False
    low_precision_residual: bool = False
    compile: bool = False
    compile_options: dict | None = field(default=None)
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = torch.float32
    reshard_after_forward: bool = True

    @classmethod
    def from_args(cls, args, dims=None) -> "ParallelOptions":
        """From a trainer's arguments (`DLMTrainingArguments` / `DLMSFTConfig`: fp8_*, low_precision_residual,
        compile_blocks; with a device mesh `dims` also gradient_checkpointing, cp_backend and every sub-mesh)."""
        options = cls(float8_recipe=args.fp8_recipe, float8_fast_accum=args.fp8_fast_accum,
                      float8_min_features=args.fp8_min_features, low_precision_residual=args.low_precision_residual,
                      compile=args.compile_blocks)
        if dims is None:
            return options
        return options.with_dims(dims, activation_checkpointing=activation_checkpointing_requested(args),
                                 cp_backend=args.cp_backend, gradient_divide_factor=dims.loss_parallel_size)

    def with_dims(self, dims, **fields) -> "ParallelOptions":
        """A copy with every sub-mesh taken from `dims` (a `mesh.ParallelDims` whose `build_mesh` ran)."""
        data_parallel = dims.dp_replicate * dims.dp_shard * dims.cp > 1
        return dataclasses.replace(
            self, dp_mesh=dims.fsdp_mesh() if data_parallel else None,
            tp_mesh=dims.meshes["tp"] if dims.tp > 1 else None, cp_mesh=dims.meshes["cp"] if dims.cp > 1 else None,
            ep_mesh=dims.expert_meshes.get("ep"), expert_dp_mesh=dims.expert_meshes.get("efsdp"), **fields)


def parallelize_dlm(model: nn.Module, options: ParallelOptions | None = None, **fields) -> nn.Module:
    """Apply float8, tensor / expert / context parallel, activation checkpointing, per-block compile and FSDP2 in
    place, as `options` say (`fields`: ParallelOptions fields, replacing those of `options`).

    model: a `DLMForDiffusionLM` (or anything with `model.model.layers`), unsharded, any device.
    Returns `model` (the same object)."""
    options = dataclasses.replace(options, **fields) if options is not None else ParallelOptions(**fields)
    cp = options.cp_mesh is not None and options.cp_mesh.size() > 1
    fsdp = options.fsdp or options.dp_mesh is not None
    if cp and not fsdp:
        raise ValueError("parallelize_dlm: context parallel needs FSDP2 (dp_mesh over dp_shard x cp) to sum the "
                         "context-parallel ranks' gradients")
    if options.float8_recipe == "delayed" and options.tp_mesh is not None:
        raise NotImplementedError("parallelize_dlm: float8_recipe='delayed' does not take DTensor weights; "
                                  "with tp_mesh use a torchao recipe ('tensorwise' or 'rowwise')")

    # 1. float8: before sharding, so FSDP2 / DTensor wrap the float8 modules' weights
    if options.float8_recipe is not None:
        apply_float8(model, options)
    if options.low_precision_residual:
        apply_low_precision_residual(model)
    # 2. tensor parallel over the decoder layers, then expert parallel of MoE layers
    if options.tp_mesh is not None:
        apply_tensor_parallel(model, options.tp_mesh, sequence_parallel=options.sequence_parallel)
    ignored_params = set()
    if options.ep_mesh is not None:  # experts sharded over ep_mesh before FSDP sees the model
        from .expert_parallel import apply_expert_parallel, expert_parameters

        if options.expert_dp_mesh is not None and options.expert_dp_mesh.size() > 1:
            raise NotImplementedError(
                "parallelize_dlm: experts FSDP-sharded over further data-parallel ranks (efsdp of size "
                f"{options.expert_dp_mesh.size()}, torchtitan's dp_shard_mod_ep) are not built yet; use ep_size = "
                "dp_shard x cp")
        apply_expert_parallel(model, options.ep_mesh)
        ignored_params = set(expert_parameters(model))
    # 3. context parallel: a pre-hook slices the whole-sequence inputs to this rank's chunk
    if cp:
        from .context_parallel import apply_context_parallel

        apply_context_parallel(model, options.cp_mesh, backend=options.cp_backend)
    # 4. activation checkpointing, 5. regional compile, 6. FSDP2
    if options.activation_checkpointing:
        apply_activation_checkpointing(model)
    if options.compile:
        apply_compile(model, options.compile_options)
    if fsdp:
        apply_fsdp(model, options, ignored_params)
    return model


def apply_float8(model: nn.Module, options: ParallelOptions) -> None:
    convert_to_float8(model, recipe=options.float8_recipe, min_features=options.float8_min_features,
                      fast_accum=options.float8_fast_accum, fsdp_all_gather=options.float8_fsdp_all_gather)


def apply_low_precision_residual(model: nn.Module) -> None:
    """The embeddings' output cast to the autocast dtype (once, however often it is applied)."""
    embeddings = model.get_input_embeddings()
    if getattr(embeddings, "_autocast_output_hook", None) is None:
        embeddings._autocast_output_hook = embeddings.register_forward_hook(_output_to_autocast_dtype)


def apply_activation_checkpointing(model: nn.Module) -> None:
    """One non-reentrant checkpoint per decoder layer through the layers' own GradientCheckpointingLayer hook,
    so parameter names stay as saved (a checkpoint_wrapper would insert `_checkpoint_wrapped_module.`)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.24
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def apply_compile(model: nn.Module, compile_options: dict | None = None) -> None:
    """Regional compile: each decoder layer in place (state-dict keys keep no `_orig_mod.` prefix; identical
    layers reuse one graph), and the masked head's linear + cross-entropy chunks."""
    for layer in model.model.layers:
        layer.compile(**(compile_options or {}))
    if hasattr(model, "compile_loss_head"):
        model.compile_loss_head = True


def apply_fsdp(model: nn.Module, options: ParallelOptions, ignored_params: set | None = None, layers=None) -> None:
    """FSDP2: each decoder layer one all-gather / reduce-scatter unit, the root holds the rest. `layers`: the
    decoder layers (default `model.model.layers`; a pipeline stage passes its own)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    layers = list(model.model.layers if layers is None else layers)
    dp_mesh = options.dp_mesh
    if dp_mesh is None:
        from torch.distributed.device_mesh import init_device_mesh

        dp_mesh = init_device_mesh(next(model.parameters()).device.type, (dist.get_world_size(),))
    if options.ep_mesh is not None and sorted(dist.get_process_group_ranks(options.ep_mesh.get_group())) != sorted(
            dist.get_process_group_ranks(dp_mesh.get_group())):
        raise NotImplementedError(
            "parallelize_dlm: ep_mesh must span the ranks of dp_mesh; experts replicated over further data-"
            "parallel ranks would need their own FSDP mesh (torchtitan's dp_shard_mod_ep), not built yet"
        )
    # experts are sharded by expert parallelism already: FSDP2 leaves them out (ignored_params)
    shard_options = {"ignored_params": ignored_params} if ignored_params else {}
    mp_policy = MixedPrecisionPolicy(param_dtype=options.param_dtype, reduce_dtype=options.reduce_dtype)
    for index, layer in enumerate(layers):
        # the last layer's parameters are needed again at once by backward: keep them gathered
        reshard = options.reshard_after_forward and index < len(layers) - 1
        fully_shard(layer, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=reshard, **shard_options)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=False, **shard_options)
    divide = options.gradient_divide_factor
    if divide is None and options.cp_mesh is not None and options.cp_mesh.size() > 1:
        divide = dp_mesh.size() // options.cp_mesh.size()
    if divide is not None and divide != dp_mesh.size():
        # gloo has no pre-multiplied sum: there, reduce by plain sums and divide afterwards
        sum_only = dist.get_backend(_first_group(dp_mesh)) == "gloo"
        for module in model.modules():
            if hasattr(module, "set_gradient_divide_factor"):
                module.set_gradient_divide_factor(float(divide))
                if sum_only:
                    module.set_force_sum_reduction_for_comms(True)


def _first_group(mesh):
    return mesh.get_group(0) if mesh.ndim > 1 else mesh.get_group()


def parallelize_from_dims(model: nn.Module, dims, options: ParallelOptions | None = None, **fields) -> nn.Module:
    """`parallelize_dlm` with every sub-mesh taken from `dims` (a `mesh.ParallelDims` whose `build_mesh` ran)."""
    return parallelize_dlm(model, (options or ParallelOptions()).with_dims(dims, **fields))


def _output_to_autocast_dtype(module, args, output):
    device_type = output.device.type
    if torch.is_autocast_enabled(device_type) and output.is_floating_point():
        return output.to(torch.get_autocast_dtype(device_type))
    return output
