"""FP8 training converters: linear layers swapped for float8 ones before any sharding (torchtitan's
"converter" step).

Two backends, both optional:
- torchao (`pip install 'hf-dlm[fp8]'`): `torchao.float8.convert_to_float8_training`, dynamic scaling
  with the "tensorwise" or "rowwise" recipe. Works with `torch.compile` (which fuses the casts) and
  with FSDP2.
- Transformer Engine, when `transformer_engine` is installed: `nn.Linear` -> `te.pytorch.Linear`
  with the weights copied, and the forward run under `te.pytorch.fp8_autocast` (`fp8_autocast`
  below). Thin on purpose; it was never run here (Transformer Engine could not be installed on the
  machines this was built on), so treat it as unverified.

Layers too small to gain are left in bf16: a float8 GEMM pays for its casts and scales, which only
amortise on large matrices (torchao's own heuristics skip, for tensorwise, K <= 4096 with N <= 1024 on
H100). `lm_head` is always skipped: its output feeds the cross-entropy and is precision-sensitive, and
it is tied to the input embedding in most DLMs.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable

import torch
from torch import nn

from ..utils.import_utils import is_transformer_engine_available, require

FLOAT8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")  # torchao recipe names
DEFAULT_SKIP = ("lm_head",)


def float8_module_filter(
    min_features: int = 2048, skip: Iterable[str] = DEFAULT_SKIP
) -> Callable[[nn.Module, str], bool]:
    """`module_filter_fn(module, fqn) -> bool` choosing the linears to convert: not named in `skip`
    (matched against every dotted part of the name), both dimensions multiples of 16 (a float8 GEMM
    requirement) and at least `min_features`."""
    skip = tuple(skip)

    def module_filter(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear):
            return False
        if any(part in skip for part in fqn.split(".")):
            return False
        out_features, in_features = module.weight.shape
        if in_features % 16 or out_features % 16:
            return False
        return min(in_features, out_features) >= min_features

    return module_filter


def convert_to_float8(
    model: nn.Module,
    recipe: str = "tensorwise",
    min_features: int = 2048,
    skip: Iterable[str] = DEFAULT_SKIP,
    backend: str = "torchao",
    fast_accum: bool = False,
    fsdp_all_gather: bool = False,
    cast_weights_once: bool = True,
) -> list[str]:
    """Swap `model`'s large linear layers for float8 training layers in place; returns their names.

    recipe: torchao scaling recipe, "tensorwise" (one scale per tensor, fastest), "rowwise" (one per
        row, more accurate) or "rowwise_with_gw_hp" (rowwise, weight gradient in high precision). Ignored by the Transformer Engine backend (its recipe goes to `fp8_autocast`).
    min_features: a linear is converted only if both its in and out features are at least this.
    skip: module names (any dotted part) never converted; `lm_head` by default.
    backend: "torchao" or "transformer_engine".
    fast_accum: torchao: Hopper's fast float8 accumulation in the backward GEMMs too (torchao uses it for
        the forward GEMM only by default): faster, with less precise gradient sums.
    fsdp_all_gather: torchao, "tensorwise" only: FSDP2 all-gathers the converted weights already cast
        to float8, so each weight is cast once per step instead of in every forward and backward; call
        `precompute_float8_scales(model)` after each optimizer step.
    cast_weights_once: torchao "tensorwise" without `fsdp_all_gather`: each weight is cast to float8 once
        per forward, with a scale computed for all weights together in one multi-tensor kernel when the
        model's forward starts, and that float8 weight is reused by the backward GEMM. The numbers are
        torchao's own (same scales, same casts); torchao instead recomputes each weight's amax and cast
        inside every layer's forward and again in backward (`cast_weights_once_per_forward`).
    Call it before tensor parallel and FSDP (`parallelize_dlm` does). Float8 GEMMs need a GPU of
    compute capability 8.9 or newer (H100, H200, L40S, B200); on others the swapped layers fail at forward.
    """
    module_filter = float8_module_filter(min_features, skip)
    selected = [name for name, module in model.named_modules() if module_filter(module, name)]
    if backend == "torchao":
        if recipe not in FLOAT8_RECIPES:
            raise ValueError(f"float8 recipe {recipe!r} is not one of {FLOAT8_RECIPES}")
        require("torchao", "FP8 training with torchao", "0.10")
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig.from_recipe_name(recipe)
        if fast_accum:
            from torchao.float8.config import Float8GemmConfig

            config = dataclasses.replace(config, gemm_config_grad_input=Float8GemmConfig(use_fast_accum=True),
                                         gemm_config_grad_weight=Float8GemmConfig(use_fast_accum=True))
        if fsdp_all_gather:
            if recipe != "tensorwise":
                raise ValueError(f"float8 FSDP all-gather needs the 'tensorwise' recipe, not {recipe!r}")
            config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
        convert_to_float8_training(model, config=config, module_filter_fn=module_filter)
        if cast_weights_once and recipe == "tensorwise" and not fsdp_all_gather:
            cast_weights_once_per_forward(model)
    elif backend == "transformer_engine":
        _swap_to_te_linear(model, selected)
    else:
        raise ValueError(f"float8 backend {backend!r} is not one of ('torchao', 'transformer_engine')")
    return selected


def cast_weights_once_per_forward(model: nn.Module) -> list[nn.Module]:
    """Make `model`'s torchao tensorwise float8 linears cast their weights with scales precomputed by a
    forward pre-hook on the backbone (`model.model` when it holds the layers): one `_foreach_norm` over
    every float8 weight per forward, all-reduced when the weights are DTensors (FSDP2, tensor parallel).
    Hand-written because torchao offers this only through FSDP2's float8 all-gather, which costs more than
    it saves on one GPU (extra copies of every weight; benchmarks/RESULTS.md). Returns the linears."""
    cast_once_class = _cast_once_linear_class()
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_utils import amax_to_scale

    linears = [m for m in model.modules() if isinstance(m, Float8Linear)]
    if not linears:
        return []
    configs = {(m.config.cast_config_weight.target_dtype, m.config.round_scales_to_power_of_2) for m in linears}
    if len(configs) != 1 or any(m.config.enable_fsdp_float8_all_gather or m.config.cast_config_weight.scaling_granularity
                                is not ScalingGranularity.TENSORWISE for m in linears):
        raise ValueError("cast_weights_once_per_forward needs one tensorwise float8 config without FSDP all-gather")
    (target_dtype, round_to_power_of_2), = configs
    for linear in linears:
        if type(linear) is not cast_once_class:
            linear.__class__ = cast_once_class
            linear.register_buffer("float8_weight_scale", torch.ones((), device=linear.weight.device),
                                   persistent=False)

    @torch.no_grad()
    def refresh_scales():
        amax = torch.stack(torch._foreach_norm([m.weight for m in linears], ord=math.inf))
        if hasattr(amax, "full_tensor"):  # DTensor shards: the max over all ranks
            amax = amax.full_tensor()
        scales = amax_to_scale(amax, target_dtype, round_to_power_of_2)
        torch._foreach_copy_([m.float8_weight_scale for m in linears], list(scales.unbind()))

    backbone = model.model if isinstance(getattr(model, "model", None), nn.Module) and hasattr(model.model, "layers") \
        else model
    if getattr(backbone, "_float8_scale_hook", None) is not None:  # converted again: one hook, the new list
        backbone._float8_scale_hook.remove()
    backbone._float8_scale_hook = backbone.register_forward_pre_hook(lambda module, args: refresh_scales())
    # for paths that run the layers without calling the backbone (the compiled sampler calls it once)
    backbone.refresh_float8_weight_scales = refresh_scales
    return linears


@functools.cache
def _cast_once_linear_class() -> type:
    from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args
    from torchao.float8.float8_training_tensor import GemmInputRole, hp_tensor_and_scale_to_float8

    class CastOnceFloat8Linear(Float8Linear):
        """torchao's Float8Linear, tensorwise, whose weight arrives at the matmul already in float8 (cast
        with `float8_weight_scale`), so torchao's matmul neither reduces nor casts it again, in forward or
        backward. The float8 cast passes gradients straight through to the high-precision weight."""

        def forward(self, input: torch.Tensor) -> torch.Tensor:
            if torch.is_autocast_enabled():  # as torchao's forward: the GPU autocast dtype
                input = input.to(torch.get_autocast_gpu_dtype())
            weight = hp_tensor_and_scale_to_float8(
                self.weight, self.float8_weight_scale, self.config.cast_config_weight.target_dtype,
                self.linear_mm_config, GemmInputRole.WEIGHT,
            )
            output = matmul_with_hp_or_float8_args.apply(input, weight.t(), self.linear_mm_config, self.config)
            if self.bias is not None:
                output = output + self.bias.to(output.dtype)
            return output

    return CastOnceFloat8Linear


def precompute_float8_scales(model: nn.Module) -> None:
    """After an optimizer step: the float8 scales of every FSDP2-sharded float8 weight at once (one
    multi-tensor amax, one all-reduce), used by the next all-gather (`fsdp_all_gather=True`). A no-op
    for models without such weights."""
    if not any(getattr(getattr(m, "config", None), "enable_fsdp_float8_all_gather", False)
               for m in model.modules()):
        return
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)


def _swap_to_te_linear(model: nn.Module, names: list[str]) -> None:
    require("transformer_engine", "FP8 training with Transformer Engine")
    import transformer_engine.pytorch as te

    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        linear: nn.Linear = getattr(parent, child)
        replacement = te.Linear(
            linear.in_features, linear.out_features, bias=linear.bias is not None,
            params_dtype=linear.weight.dtype, device=linear.weight.device,
        )
        with torch.no_grad():
            replacement.weight.copy_(linear.weight)
            if linear.bias is not None:
                replacement.bias.copy_(linear.bias)
        setattr(parent, child, replacement)


def fp8_autocast(enabled: bool = True, recipe: str = "delayed", **recipe_kwargs):
    """Transformer Engine's forward context for the swapped layers: "delayed" (DelayedScaling, the
    Hopper default) or "current" (Float8CurrentScaling). torchao layers need no context."""
    require("transformer_engine", "FP8 training with Transformer Engine")
    import transformer_engine.common.recipe as te_recipe
    import transformer_engine.pytorch as te

    recipes = {"delayed": "DelayedScaling", "current": "Float8CurrentScaling"}
    if recipe not in recipes:
        raise ValueError(f"Transformer Engine recipe {recipe!r} is not one of {tuple(recipes)}")
    return te.fp8_autocast(enabled=enabled, fp8_recipe=getattr(te_recipe, recipes[recipe])(**recipe_kwargs))


TRANSFORMER_ENGINE_AVAILABLE = is_transformer_engine_available()  # checked once, at import
