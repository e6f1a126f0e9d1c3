"""Masked-only, chunked linear + cross-entropy: the training head of a DLM.

A masked-diffusion step supervises a fraction of the positions (half, on average, for the linear
schedule), so the full-vocabulary logits of the others are wasted work and memory (151936 x 4096 x 4
bytes = 2.3 GiB per sequence for Qwen3's vocabulary). Only the hidden states of supervised positions
are gathered, and their logits exist `chunk_size` rows at a time: each chunk's logits are recomputed in
backward (activation checkpointing) instead of being stored.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100


def _chunk_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias, labels: torch.Tensor) -> torch.Tensor:
    logits = F.linear(hidden, weight, bias)  # (n, V)
    return F.cross_entropy(logits.float(), labels, reduction="none")


_compiled_chunk_cross_entropy = None


def _chunk_function(compiled: bool):
    """The chunk's linear + cross-entropy, optionally through `torch.compile` (one graph with a dynamic
    row count: Inductor fuses the fp32 upcast, log-softmax and gather instead of materialising fp32
    logits; measured 3.5% faster training steps on an H200 at the Qwen3-1.7B shape)."""
    global _compiled_chunk_cross_entropy
    if not compiled:
        return _chunk_cross_entropy
    if _compiled_chunk_cross_entropy is None:
        _compiled_chunk_cross_entropy = torch.compile(_chunk_cross_entropy, dynamic=True)
    return _compiled_chunk_cross_entropy


def linear_cross_entropy(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    chunk_size: int = 4096,
    compiled: bool = False,
) -> torch.Tensor:
    """Per-row cross-entropy of `hidden_states @ weight.T (+ bias)` against `labels`. (N, H) -> (N,) fp32.
    compiled: run each chunk through `torch.compile` (see `_chunk_function`)."""
    chunk_cross_entropy = _chunk_function(compiled)
    if hidden_states.shape[0] <= chunk_size:
        return chunk_cross_entropy(hidden_states, weight, bias, labels)
    pieces = []
    for start in range(0, hidden_states.shape[0], chunk_size):
        h, y = hidden_states[start : start + chunk_size], labels[start : start + chunk_size]
        if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
            pieces.append(checkpoint(chunk_cross_entropy, h, weight, bias, y, use_reentrant=False))
        else:
            pieces.append(chunk_cross_entropy(h, weight, bias, y))
    return torch.cat(pieces)


def masked_lm_loss(
    hidden_states: torch.Tensor,
    lm_head: torch.nn.Linear,
    labels: torch.Tensor,
    label_weights: torch.Tensor | None = None,
    num_items_in_batch: torch.Tensor | int | None = None,
    chunk_size: int = 4096,
    compiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sum_i w_i * CE_i / num_items_in_batch` over the positions whose label is not -100.

    hidden_states: (B, L, H) final hidden states; labels: (B, L) targets aligned with the positions whose
    logits predict them (-100: no loss); label_weights: (B, L) per-position weights (default 1);
    num_items_in_batch: the normaliser (default: the number of supervised positions); compiled: chunks
    through `torch.compile`. Returns (loss, number of supervised positions).
    """
    flat_labels = labels.reshape(-1)
    selected = (flat_labels != IGNORE_INDEX).nonzero().squeeze(-1)  # (N,)
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1]).index_select(0, selected)
    targets = flat_labels.index_select(0, selected)
    ce = linear_cross_entropy(hidden, lm_head.weight, targets, lm_head.bias, chunk_size, compiled)
    if label_weights is not None:
        ce = ce * label_weights.reshape(-1).index_select(0, selected).float()
    count = selected.new_tensor(selected.numel())
    normaliser = count.clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    if isinstance(normaliser, torch.Tensor):
        normaliser = normaliser.to(ce.device)
    return ce.sum() / normaliser, count
