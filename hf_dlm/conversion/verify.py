"""Asserted verification: run two checkpoints on the same random inputs and compare their logits.

Either side may be an hf-dlm folder, a transformers causal-LM folder (the AR source of an adaptation)
or a Megatron checkpoint. When exactly one side is an AR model, the hf-dlm side runs causally: an
adapted checkpoint must reproduce its source's logits before its attention is opened up.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

# (atol, rtol) per compute dtype: fail when max |a - b| > atol + rtol * max |a|
TOLERANCES = {"float32": (1e-4, 1e-5), "float16": (1e-2, 5e-3), "bfloat16": (5e-2, 2e-2)}


@dataclass
class LogitDiff:
    max_abs: float
    mean_abs: float
    max_rel: float  # max |a - b| / max |a|
    mean_rel: float  # mean |a - b| / mean |a|
    tolerance: float
    passed: bool

    def __str__(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        return (f"{verdict}: max abs {self.max_abs:.3e}, mean abs {self.mean_abs:.3e}, max rel {self.max_rel:.3e}, "
                f"mean rel {self.mean_rel:.3e} (tolerance on max abs {self.tolerance:.3e})")


def compare_logits(reference: torch.Tensor, candidate: torch.Tensor, atol: float, rtol: float) -> LogitDiff:
    reference, candidate = reference.double(), candidate.double()
    diff = (reference - candidate).abs()
    scale_max, scale_mean = reference.abs().max().item(), reference.abs().mean().item()
    tolerance = atol + rtol * scale_max
    return LogitDiff(
        max_abs=diff.max().item(),
        mean_abs=diff.mean().item(),
        max_rel=diff.max().item() / max(scale_max, 1e-30),
        mean_rel=diff.mean().item() / max(scale_mean, 1e-30),
        tolerance=tolerance,
        passed=bool(torch.isfinite(diff).all()) and diff.max().item() <= tolerance,
    )


DIFFUSION_MODEL_TYPES = ("llada", "dream")  # published DLMs with their own (bidirectional) remote code


def _kind(path) -> str:
    """"dlm" (hf-dlm folder or Megatron checkpoint), "diffusion" (LLaDA / Dream remote code) or "ar"."""
    path = Path(path)
    if not (path / "config.json").is_file():
        return "dlm"  # a Megatron checkpoint becomes an hf-dlm model
    model_type = str(json.loads((path / "config.json").read_text(encoding="utf-8")).get("model_type", "")).lower()
    return "dlm" if model_type == "dlm" else "diffusion" if model_type in DIFFUSION_MODEL_TYPES else "ar"


def load_for_verify(path, dtype: torch.dtype, attention_mode: str | None = None, trust_remote_code: bool = False,
                    trust_pickle: bool = False):
    """(model, is_dlm). `attention_mode` overrides an hf-dlm model's mode."""
    from .megatron import is_megatron_checkpoint

    path = Path(path)
    if not (path / "config.json").is_file() and is_megatron_checkpoint(path):
        from .convert import ConversionOptions, load_as_dlm

        dtype_name = str(dtype).removeprefix("torch.")  # cast the weights only: RoPE buffers stay float32
        options = ConversionOptions(dtype=dtype_name, trust_pickle=trust_pickle, attention_mode=attention_mode)
        model = load_as_dlm("megatron", path, options)[0]
        is_dlm = True
    else:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
        is_dlm = config.get("model_type") == "dlm"
        if is_dlm:
            from ..modeling import DLMForDiffusionLM

            overrides = {"attention_mode": attention_mode} if attention_mode is not None else {}
            model = DLMForDiffusionLM.from_pretrained(path, dtype=dtype, attn_implementation="eager", **overrides)
        else:
            from transformers import AutoModel, AutoModelForCausalLM

            options = dict(dtype=dtype, trust_remote_code=trust_remote_code)
            try:
                model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", **options)
            except ValueError:  # Dream registers its LM head class under AutoModel only
                model = AutoModel.from_pretrained(path, **options)
    if is_dlm:
        model.config._attn_implementation = "eager"
    return model.eval(), is_dlm


@torch.no_grad()
def verify_checkpoints(
    source,
    candidate,
    dtype: str = "float32",
    batch_size: int = 2,
    seq_len: int = 32,
    seed: int = 0,
    atol: float | None = None,
    rtol: float | None = None,
    attention: str = "auto",
    trust_remote_code: bool = False,
    trust_pickle: bool = False,
) -> LogitDiff:
    """Compare `candidate`'s logits with `source`'s on seeded random token ids.

    attention: "auto" (an hf-dlm side facing an AR model runs causal; facing LLaDA / Dream or another
    hf-dlm model it runs as saved), "as-saved", or a mode forced on every hf-dlm side.
    """
    from .convert import DTYPES

    torch_dtype = DTYPES[dtype]
    default_atol, default_rtol = TOLERANCES[dtype]
    atol, rtol = default_atol if atol is None else atol, default_rtol if rtol is None else rtol
    kinds = [_kind(p) for p in (source, candidate)]
    modes = [None if attention in ("auto", "as-saved") else attention] * 2
    if attention == "auto" and "ar" in kinds:  # an adapted AR checkpoint must first reproduce its source
        modes = ["causal" if kind == "dlm" else None for kind in kinds]
    models = [load_for_verify(path, torch_dtype, mode, trust_remote_code, trust_pickle)
              for path, mode in zip((source, candidate), modes)]
    # ids both models know; a DLM's [MASK] row is left out, being the one row an adaptation rewrites
    vocab = min(m.config.vocab_size for m, _ in models)
    mask_ids = {m.config.mask_token_id for m, is_dlm in models if is_dlm and m.config.mask_token_id is not None}
    keep = torch.tensor([i for i in range(vocab) if i not in mask_ids])
    generator = torch.Generator().manual_seed(seed)
    input_ids = keep[torch.randint(0, len(keep), (batch_size, seq_len), generator=generator)]
    logits = [m(input_ids=input_ids).logits[..., keep] for m, _ in models]
    return compare_logits(logits[0], logits[1], atol, rtol)


__all__ = ["TOLERANCES", "LogitDiff", "compare_logits", "load_for_verify", "verify_checkpoints"]
