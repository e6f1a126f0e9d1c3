"""Float8 weights for decoding (as LLaDA2.1 is served): every projection of the decoder layers in float8 with
one scale per output row, activations quantised per row on the fly, the GEMMs in float8 (torchao's
`Float8DynamicActivationFloat8WeightConfig`, `torch._scaled_mm`). At batch 1 a decoding step of an 8B model
is bounded by reading its weights (16 GB in bf16); float8 halves what is read.

The embeddings and norms stay in their dtype, and by default the LM head too (its logits decide which token is
committed; it is also the layer whose quantisation error is largest). `lm_head=True` takes it as well: its bf16
read is 7 % of a batch-1 float8 step at the LLaDA-8B shape, but on an H200 the step did not get faster (its
activation quantisation adds kernels; benchmarks/RESULTS.md). Needs torchao and a GPU with float8 tensor cores
(compute capability >= 8.9: Ada, Hopper, Blackwell).

`activation_scheme="static"` (vLLM's name) fixes each projection's activation scale once, from what a calibration
run shows it (torchao's observer flow: prepare, calibrate, convert), as float8 checkpoints with `input_scale`
are served. The dynamic scheme spends, per projection and step, a reduction over the activation (two kernels)
before its cast; a static scale is a constant, so the cast fuses into the norm or the activation that produces
the input. Values beyond the calibrated range saturate at the float8 maximum."""

from __future__ import annotations

from typing import Any, Callable

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


ACTIVATION_SCHEMES = ("dynamic", "static")  # activation scales: per step from the activation, or calibrated once


def quantize_float8_for_decoding(model: torch.nn.Module, granularity: str = "row", lm_head: bool = False,
                                 activation_scheme: str = "dynamic",
                                 calibrate: Callable[[torch.nn.Module], Any] | None = None) -> torch.nn.Module:
    """In place: the decoder projections of `model` in float8 (see the module docstring); returns the model.
    `granularity` "row" (the default) or "tensor" (one scale per weight and per activation: cuBLAS's float8
    GEMM instead of the row-scaled one); `lm_head`: the LM head in float8 too (a tied head gets a float8 copy, the
    embeddings keep theirs). `activation_scheme` "dynamic" (scales from each step's activations) or "static"
    (tensor granularity only): `calibrate(model)` runs representative decoding (e.g. an eager `model.generate`,
    `compile=None`, on a few prompts) while each projection records the largest activation it sees; its scale is
    then fixed. Raises an ImportError naming the extra without torchao, a RuntimeError without a float8-capable
    GPU, a ValueError for another granularity or scheme, a static scheme without `calibrate`, or a projection the
    calibration never reached (the model is then left as it was)."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"quantize_float8_for_decoding: granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if activation_scheme not in ACTIVATION_SCHEMES:
        raise ValueError(f"quantize_float8_for_decoding: activation_scheme must be one of {ACTIVATION_SCHEMES}, got "
                         f"{activation_scheme!r}")
    static = activation_scheme == "static"
    if static and (granularity != "tensor" or calibrate is None):
        raise ValueError("quantize_float8_for_decoding(activation_scheme='static') needs granularity='tensor' (one "
                         f"calibrated scale per activation; got {granularity!r}) and a `calibrate` callable (got "
                         f"{calibrate!r})")
    require("torchao", "float8 decoding (quantize_float8_for_decoding)", "0.10")
    _require_float8_gpu(next(model.parameters()).device)
    from torchao.quantization import (Float8DynamicActivationFloat8WeightConfig,
                                      Float8StaticActivationFloat8WeightConfig, PerRow, PerTensor, quantize_)

    head = getattr(model, "lm_head", None)
    if lm_head and (not isinstance(head, torch.nn.Linear) or head.in_features % 16 or head.out_features % 16):
        shape = tuple(head.weight.shape) if isinstance(head, torch.nn.Linear) else type(head).__name__
        raise ValueError(f"quantize_float8_for_decoding(lm_head=True): the LM head ({shape}) is not a linear layer "
                         "whose sizes are multiples of 16, which the float8 GEMM needs; pass lm_head=False")
    taken = lambda module, name: float8_decoding_filter(module, name, lm_head)  # noqa: E731
    # set_inductor_config=False: torchao's default turns on Inductor's coordinate-descent tuning (and lowers the
    # float32 matmul precision) for the whole process; on the GPU that made the 8B decoder's first compile take
    # 467 s instead of 107 (benchmarks/RESULTS.md), and it would change every later compile the process makes
    if not static:
        scales = PerRow() if granularity == "row" else PerTensor()
        quantize_(model, Float8DynamicActivationFloat8WeightConfig(granularity=scales, set_inductor_config=False),
                  filter_fn=taken)
        return model
    # torchao's prepare and convert put new modules in place: the attributes of ours (a fused projection's
    # `split_sizes`) are carried over by name
    extras = {name: _own_attributes(module) for name, module in model.named_modules() if taken(module, name)}
    quantize_(model, Float8StaticActivationFloat8WeightConfig(step="prepare", set_inductor_config=False),
              filter_fn=taken)
    _set_attributes(model, extras)
    observed = {name: module for name, module in model.named_modules() if hasattr(module, "input_act_obs")}
    try:
        with torch.no_grad():
            calibrate(model)
        unseen = [name for name, module in observed.items() if not hasattr(module.input_act_obs, "max_val")]
        if unseen:
            raise ValueError(f"quantize_float8_for_decoding: the calibration never ran {len(unseen)} of the "
                             f"{len(observed)} float8 projections (first: {unseen[0]}), so they have no activation "
                             "scale; calibrate with decoding that runs the whole model")
    except BaseException:
        _restore_linears(model, observed)
        _set_attributes(model, extras)
        raise
    quantize_(model, Float8StaticActivationFloat8WeightConfig(step="convert", set_inductor_config=False),
              filter_fn=lambda module, name: name in observed)
    _set_attributes(model, extras)
    return model


def _own_attributes(module: torch.nn.Module) -> dict:
    """The plain attributes set on a linear layer beyond those nn.Linear sets itself."""
    return {key: value for key, value in vars(module).items()
            if not key.startswith("_") and key not in ("training", "in_features", "out_features")}


def _set_attributes(model: torch.nn.Module, extras: dict[str, dict]) -> None:
    for name, attributes in extras.items():
        for key, value in attributes.items():
            setattr(model.get_submodule(name), key, value)


def _restore_linears(model: torch.nn.Module, observed: dict[str, torch.nn.Module]) -> None:
    """Puts plain linear layers (the same weights) back where the calibration's observers were."""
    for name, module in observed.items():
        parent, _, child = name.rpartition(".")
        plain = torch.nn.Linear(module.in_features, module.out_features, bias=module.bias is not None, device="meta")
        plain.weight, plain.bias = module.weight, module.bias
        setattr(model.get_submodule(parent) if parent else model, child, plain)


__all__ = ["ACTIVATION_SCHEMES", "GRANULARITIES", "float8_decoding_filter", "quantize_float8_for_decoding"]
