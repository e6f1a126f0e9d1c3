"""Attention masks as additive biases, shared by the rooms that hand a mask to a kernel."""

from __future__ import annotations

import torch


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True: attend) -> a bias of `dtype`, 0 where allowed and the dtype's lowest elsewhere (not
    -inf: a row with no allowed key stays finite)."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)


__all__ = ["additive_mask"]
