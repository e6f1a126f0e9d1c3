"""Float8 weights for decoding (as LLaDA2.1 is served): every projection of the decoder layers in float8 with
one scale per output row, activations quantised per row on the fly, the GEMMs in float8 (torchao's
`Float8DynamicActivationFloat8WeightConfig`, `torch._scaled_mm`). At batch 1 a decoding step of an 8B model
is bounded by reading its weights (16 GB in bf16); float8 halves what is read.

The embeddings and norms stay in their dtype, and by default the LM head too (its logits decide which token is
committed; it is also the layer whose quantisation error is largest). `lm_head=True` takes it as well: its bf16
read is 7 % of a batch-1 float8 step at the LLaDA-8B shape, but on an H200 the step did not get faster (its
activation quantisation adds kernels; benchmarks/RESULTS.md). Needs torchao and a GPU with float8 tensor cores
(compute capability >= 8.9: Ada, Hopper, Blackwell)."""

from __future__ import annotations

import torch

from ..utils.import_utils import require

KEEP = ("lm_head", "embed_tokens")  # modules left in their dtype, by name suffix


def float8_decoding_filter(module: torch.nn.Module, name: str, lm_head: bool = False) -> bool:
    """The linear layers float8 takes: decoder projections (and the LM head with `lm_head`) whose sizes the float8
    GEMM accepts (multiples of 16)."""
    keep = tuple(k for k in KEEP if not (lm_head and k == "lm_head"))
    return (isinstance(module, torch.nn.Linear) and not any(name == k or name.endswith("." + k) for k in keep)
            and module.in_features % 16 == 0 and module.out_features % 16 == 0)


GRANULARITIES = ("row", "tensor")  # scales: one per output row (weights) / token (activations), or one per tensor


def _require_float8_gpu(device: torch.device) -> None:
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        raise RuntimeError(f"float8 decoding needs a CUDA GPU with compute capability >= 8.9 (the model is on "
                           f"{device}); keep bf16 weights there")


def quantize_float8_for_decoding(model: torch.nn.Module, granularity: str = "row",
                                 lm_head: bool = False) -> torch.nn.Module:
    """In place: the decoder projections of `model` in float8 (see the module docstring); returns the model.
    `granularity` "row" (the default) or "tensor" (one scale per weight and per activation: cuBLAS's float8
    GEMM instead of the row-scaled one); `lm_head`: the LM head in float8 too (a tied head gets a float8 copy, the
    embeddings keep theirs). Raises an ImportError naming the extra without torchao, a RuntimeError
    without a float8-capable GPU, a ValueError for another granularity."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"quantize_float8_for_decoding: granularity must be one of {GRANULARITIES}, got {granularity!r}")
    require("torchao", "float8 decoding (quantize_float8_for_decoding)", "0.10")
    _require_float8_gpu(next(model.parameters()).device)
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, PerTensor, quantize_

    # set_inductor_config=False: torchao's default turns on Inductor's coordinate-descent tuning (and lowers the
    # float32 matmul precision) for the whole process; on the GPU that made the 8B decoder's first compile take
    # 467 s instead of 107 (benchmarks/RESULTS.md), and it would change every later compile the process makes
    config = Float8DynamicActivationFloat8WeightConfig(granularity=PerRow() if granularity == "row" else PerTensor(),
                                                       set_inductor_config=False)
    head = getattr(model, "lm_head", None)
    if lm_head and (not isinstance(head, torch.nn.Linear) or head.in_features % 16 or head.out_features % 16):
        shape = tuple(head.weight.shape) if isinstance(head, torch.nn.Linear) else type(head).__name__
        raise ValueError(f"quantize_float8_for_decoding(lm_head=True): the LM head ({shape}) is not a linear layer "
                         "whose sizes are multiples of 16, which the float8 GEMM needs; pass lm_head=False")
    quantize_(model, config, filter_fn=lambda module, name: float8_decoding_filter(module, name, lm_head))
    return model


__all__ = ["GRANULARITIES", "float8_decoding_filter", "quantize_float8_for_decoding"]
