"""Fused input projections for decoding: each attention's q / k / v as one linear layer (`qkv_proj`) and each
MLP's gate / up as one (`gate_up_proj`), as vLLM serves Llama-style models (its QKVParallelLinear and
MergedColumnParallelLinear).

Why: a decoding step at batch 1 multiplies ~32 tokens by every weight, so it is bound by reading them, and a
small GEMM reads its weight slower than a large one. Measured on an H200 at 32 tokens (benchmarks/RESULTS.md,
`gemm_small_batch.py`): a 4096 x 4096 projection reads at 1.4-1.7 TB/s, a 4096 x 12288 one at 3.2-3.4 TB/s;
one LLaDA-8B layer's GEMMs take 5.91 ms separate and 4.52 ms with q / k / v and gate / up fused. At
hundreds of tokens per step fusing changes nothing.

Fusing changes the module tree (and the state-dict keys), so it is a decoding-time transform, done in place and
undone by `unfuse_projections` (bit-exact); a fused model refuses `save_pretrained`. Call it before
`quantize_float8_for_decoding` so that the fused layers are the ones quantised. Hand-written because neither
transformers nor peft fuse a model's projections after loading (transformers' conversion ops merge at load
time, for the families whose checkpoints are fused)."""

from __future__ import annotations

import torch
from torch import nn

# (owner attribute of the fused layer, the layers it replaces, in output order)
GROUPS = (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj")))


def _is_plain_linear(module) -> bool:
    """An nn.Linear with ordinary tensors (not a LoRA wrapper, a float8 or DTensor weight)."""
    return (type(module) is nn.Linear and type(module.weight.data) is torch.Tensor
            and (module.bias is None or type(module.bias.data) is torch.Tensor))


def _linear(weight: torch.Tensor, bias: torch.Tensor | None, requires_grad: bool) -> nn.Linear:
    """An nn.Linear holding these tensors (no other allocation: made on the meta device, its parameters replaced)."""
    with torch.device("meta"):
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    linear.weight = nn.Parameter(weight, requires_grad=requires_grad)
    if bias is not None:
        linear.bias = nn.Parameter(bias, requires_grad=requires_grad)
    return linear


def _concatenated(linears: list[nn.Linear]) -> nn.Linear:
    weight = torch.cat([linear.weight.detach() for linear in linears])
    has_bias = [linear.bias is not None for linear in linears]
    bias = torch.cat([linear.bias.detach() if linear.bias is not None else weight.new_zeros(linear.out_features)
                      for linear in linears]) if any(has_bias) else None
    fused = _linear(weight, bias, linears[0].weight.requires_grad)
    fused.split_sizes = tuple(linear.out_features for linear in linears)
    fused.split_has_bias = tuple(has_bias)
    return fused


def _replace(module: nn.Module, old: tuple[str, ...], new: dict[str, nn.Module]) -> None:
    """`module`'s children `old` replaced by `new`, at the place of the first of them (the module order, hence the
    state-dict order, stays that of the unfused model)."""
    children = list(module._modules.items())
    at = next(i for i, (name, _) in enumerate(children) if name in old)  # no `old` child comes before it
    kept = [(name, child) for name, child in children if name not in old]
    module._modules.clear()
    module._modules.update(kept[:at] + list(new.items()) + kept[at:])


def _owners(model: nn.Module):
    """(name, module, fused attribute, parts) for every module that has (or had) a fusable group."""
    for name, module in model.named_modules():
        for fused_name, parts in GROUPS:
            if all(isinstance(getattr(module, part, None), nn.Module) for part in parts) or isinstance(
                    getattr(module, fused_name, None), nn.Module):
                yield name, module, fused_name, parts


def fuse_projections(model: nn.Module) -> nn.Module:
    """In place: q / k / v -> `qkv_proj` and gate / up -> `gate_up_proj` in every attention and MLP of `model`
    (shared experts included); returns the model. Idempotent. Raises a ValueError naming the module when a part
    is not a plain nn.Linear (a LoRA wrapper: merge it first; float8 weights: fuse before quantising)."""
    for name, module, fused_name, parts in list(_owners(model)):
        if isinstance(getattr(module, fused_name, None), nn.Module):
            continue
        linears = [getattr(module, part) for part in parts]
        odd = [f"{name}.{part} is {type(linear).__name__}" for part, linear in zip(parts, linears)
               if not _is_plain_linear(linear)]
        if odd:
            raise ValueError(f"fuse_projections: {', '.join(odd)}, not a plain nn.Linear with plain weights (merge "
                             "LoRA adapters with merge_and_unload(), and fuse before quantize_float8_for_decoding)")
        _replace(module, parts, {fused_name: _concatenated(linears)})
    return model


def unfuse_projections(model: nn.Module) -> nn.Module:
    """In place: undoes `fuse_projections` (the original layers, bit-exact); returns the model."""
    for name, module, fused_name, parts in list(_owners(model)):
        fused = getattr(module, fused_name, None)
        if not isinstance(fused, nn.Module):
            continue
        if not _is_plain_linear(fused):
            raise ValueError(f"unfuse_projections: {name}.{fused_name} is no longer a plain nn.Linear "
                             f"({type(fused.weight.data).__name__} weight): a quantised model cannot be unfused")
        weights = fused.weight.detach().split(fused.split_sizes)
        biases = fused.bias.detach().split(fused.split_sizes) if fused.bias is not None else [None] * len(parts)
        linears = {part: _linear(weight.clone(), bias.clone() if has_bias else None, fused.weight.requires_grad)
                   for part, weight, bias, has_bias in zip(parts, weights, biases, fused.split_has_bias)}
        _replace(module, (fused_name,), linears)
    return model


def has_fused_projections(model: nn.Module) -> bool:
    return any(isinstance(getattr(module, fused_name, None), nn.Module)
               for _, module, fused_name, _ in _owners(model))


__all__ = ["fuse_projections", "has_fused_projections", "unfuse_projections"]
