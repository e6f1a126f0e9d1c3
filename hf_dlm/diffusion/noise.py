"""Counter-based random numbers keyed by (seed, stream, sample index, position).

Why hand-written: the diffusion noise of a sample must not depend on which rank, micro-batch or resume
point it lands in (otherwise runs are not reproducible and TP/CP ranks disagree), and torch's
generators are stateful streams. A stateless integer hash gives every (sample, position) its own
uniform number, vectorised, identical on CPU and CUDA, and traceable by torch.compile.
The mixer is Chris Wellons' `lowbias32`; products are split into 16-bit halves so int64 never overflows.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """(x * constant) mod 2**32 for 0 <= x < 2**32, without int64 overflow."""
    low, high = constant & 0xFFFF, constant >> 16
    return (x * low + (((x * high) & 0xFFFF) << 16)) & _MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def hashed_uniform(
    seed: int, stream: int, sample_index: torch.Tensor, positions: torch.Tensor | None = None
) -> torch.Tensor:
    """Uniform floats in [0, 1) with 24 random bits.

    sample_index: (B,) int64 global sample indices; positions: (L,) positions within a sample, or None
    for one number per sample. Returns (B, L) or (B,) float32 on sample_index's device.
    """
    index = sample_index.long()
    key = mix32(torch.full_like(index, (seed * 0x9E3779B9 + stream * 0x85EBCA6B) & _MASK32))
    key = mix32(key ^ (index & _MASK32))
    key = mix32(key ^ ((index >> 32) & _MASK32))
    if positions is not None:
        key = mix32(key.unsqueeze(1) ^ positions.long().unsqueeze(0))
    return (key >> 8).float() * (1.0 / (1 << 24))
