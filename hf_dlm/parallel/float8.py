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
from collections.abc import Callable, Iterable

import torch
from torch import nn

from ..utils.import_utils import is_transformer_engine_available, require

# torchao's recipe names, and "delayed": hf-dlm's own delayed scaling (float8_delayed.py), no torchao needed
TORCHAO_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
FLOAT8_RECIPES = (*TORCHAO_RECIPES, "delayed")
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
) -> list[str]:
    """Swap `model`'s large linear layers for float8 training layers in place; returns their names.

    recipe: torchao scaling recipe, "tensorwise" (one scale per tensor), "rowwise" (one per row, more
        accurate) or "rowwise_with_gw_hp" (rowwise, weight gradient in high precision); or "delayed":
        tensorwise with scales from the last 16 steps' amaxes (`float8_delayed`, no torchao needed; the
        fastest, benchmarks/RESULTS.md). Ignored by the Transformer Engine backend (its recipe goes to
        `fp8_autocast`).
    min_features: a linear is converted only if both its in and out features are at least this.
    skip: module names (any dotted part) never converted; `lm_head` by default.
    backend: "torchao" or "transformer_engine".
    fast_accum: Hopper's fast float8 accumulation in the backward GEMMs too (the forward GEMM always
        uses it): faster, with less precise gradient sums.
    fsdp_all_gather: torchao, "tensorwise" only: FSDP2 all-gathers the converted weights already cast
        to float8 (a quarter of fp32's bytes on the wire), with scales for all weights computed at once
        by `precompute_float8_scales(model)`, to call after each optimizer step. For multi-GPU FSDP2; on
        one GPU its copies cost about what it saves (benchmarks/RESULTS.md).
    Call it before tensor parallel and FSDP (`parallelize_dlm` does). Float8 GEMMs need a GPU of
    compute capability 8.9 or newer (H100, H200, L40S, B200); on others the swapped layers fail at forward.
    """
    module_filter = float8_module_filter(min_features, skip)
    selected = [name for name, module in model.named_modules() if module_filter(module, name)]
    if recipe == "delayed" and backend == "torchao":
        if fsdp_all_gather:
            raise ValueError("float8 FSDP all-gather needs the 'tensorwise' recipe, not 'delayed'")
        from .float8_delayed import convert_to_delayed_float8

        convert_to_delayed_float8(model, selected, fast_accum_backward=fast_accum)
    elif backend == "torchao":
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
    elif backend == "transformer_engine":
        _swap_to_te_linear(model, selected)
    else:
        raise ValueError(f"float8 backend {backend!r} is not one of ('torchao', 'transformer_engine')")
    return selected


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
