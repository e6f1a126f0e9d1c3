"""Several linears that read the same input run as one GEMM (q/k/v; gate/up).

The parameters stay separate (`q_proj.weight`, ... as in transformers' Llama / Qwen3 layout, so
checkpoints, converters, peft and tensor-parallel plans see the usual names); only the forward
concatenates the weights. Inside a compiled block the concatenation fuses with the bf16 cast autocast
does anyway, so it costs nothing, and one wide GEMM (and one input-gradient GEMM in backward instead of
several plus their sum) runs closer to peak than several narrow ones. Enabled per module by
`parallelize_dlm(fuse_projections=True)`; modules that are not plain (peft adapters, DTensor shards,
tensor subclasses) fall back to separate calls.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..utils.import_utils import is_torchao_available


def _plain(tensor: torch.Tensor | None) -> bool:
    return tensor is None or type(tensor) in (torch.Tensor, nn.Parameter)


def _torchao_float8():
    """(Float8Linear, its matmul autograd function) from torchao, or None where it is not installed."""
    if is_torchao_available():
        from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args

        return Float8Linear, matmul_with_hp_or_float8_args
    return None


def fusion_kind(linears: list[nn.Module]) -> str | None:
    """"linear" (all exact `nn.Linear`), "float8" (all torchao `Float8Linear` with one config) or None."""
    if not all(_plain(m.weight) and _plain(getattr(m, "bias", None)) for m in linears):
        return None
    if all(type(m) is nn.Linear for m in linears):
        return "linear"
    torchao_float8 = _torchao_float8()
    if torchao_float8 is not None and all(type(m) is torchao_float8[0] for m in linears):
        if all(m.config == linears[0].config for m in linears):
            return "float8"
    return None


def fused_linear(x: torch.Tensor, linears: list[nn.Module], kind: str | None) -> list[torch.Tensor]:
    """The outputs of `linears` on `x`, through one GEMM when `kind` (from `fusion_kind`) allows it."""
    if kind is None:
        return [m(x) for m in linears]
    weight = torch.cat([m.weight for m in linears])
    biases = [m.bias for m in linears]
    bias = None if all(b is None for b in biases) else torch.cat(
        [b if b is not None else m.weight.new_zeros(m.out_features) for b, m in zip(biases, linears)])
    if kind == "linear":
        out = F.linear(x, weight, bias)
    else:  # torchao Float8Linear.forward with the concatenated weight (one scale for the group)
        matmul_with_hp_or_float8_args = _torchao_float8()[1]
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        out = matmul_with_hp_or_float8_args.apply(x, weight.t(), linears[0].linear_mm_config, linears[0].config)
        if bias is not None:
            out = out + bias.to(out.dtype)
    return list(out.split([m.out_features for m in linears], dim=-1))
