"""Float8 weights for decoding (as LLaDA2.1 is served): every projection of the decoder layers in float8 with
one scale per output row, activations quantised per row on the fly, the GEMMs in float8 (torchao's
`Float8DynamicActivationFloat8WeightConfig`, `torch._scaled_mm`). At batch 1 a decoding step of an 8B model
is bounded by reading its weights (16 GB in bf16); float8 halves what is read.

The embeddings, norms and the LM head stay in their dtype (the head's logits decide which token is
committed; it is also the layer whose quantisation error is largest). Needs torchao and a GPU with float8
tensor cores (compute capability >= 8.9: Ada, Hopper, Blackwell)."""

from __future__ import annotations

import torch

from ..utils.import_utils import require

KEEP = ("lm_head", "embed_tokens")  # modules left in their dtype, by name suffix


def float8_decoding_filter(module: torch.nn.Module, name: str) -> bool:
    """The linear layers float8 takes: decoder projections whose sizes the float8 GEMM accepts (multiples of 16)."""
    return (isinstance(module, torch.nn.Linear) and not any(name == k or name.endswith("." + k) for k in KEEP)
            and module.in_features % 16 == 0 and module.out_features % 16 == 0)


def quantize_float8_for_decoding(model: torch.nn.Module) -> torch.nn.Module:
    """In place: the decoder projections of `model` in float8 (see the module docstring); returns the model.
    Raises an ImportError naming the extra without torchao, a RuntimeError without a float8-capable GPU."""
    require("torchao", "float8 decoding (quantize_float8_for_decoding)", "0.10")
    device = next(model.parameters()).device
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        raise RuntimeError(f"float8 decoding needs a CUDA GPU with compute capability >= 8.9 (the model is on "
                           f"{device}); keep bf16 weights there")
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    quantize_(model, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()), filter_fn=float8_decoding_filter)
    return model


__all__ = ["float8_decoding_filter", "quantize_float8_for_decoding"]
