"""Attention masks of the DLM family, built by the model itself for every attention backend.

Why not `transformers.masking_utils`: its builders decide from the tracing state whether to skip or
materialise a mask (under `torch.compile` on 5.17 a model with `is_causal = False` still got a causal
mask), their signatures changed between 5.17 and 5.24 (`past_key_values` -> `cache`), and they have no
two-stream block-diffusion layout. One mask function here serves all backends, in the mask-mod
convention of FlexAttention: `mask_mod(batch, head, q_idx, kv_idx) -> bool` (True = may attend). Dense
masks for eager / sdpa evaluate the same function on broadcast index grids, so every backend sees the
same mask by construction.
"""

from __future__ import annotations

from typing import Callable

import torch

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
FLASH_IMPLEMENTATIONS = ("flash_attention_2", "flash_attention_3")


def _is_compiling() -> bool:
    return torch.compiler.is_compiling()


def document_ids_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Packed sequences: a document starts wherever `position_ids` restarts at 0. (B, L) -> (B, L)."""
    return (position_ids == 0).cumsum(-1)


def block_ids(position_ids: torch.Tensor, block_size: int) -> torch.Tensor:
    """Block index of every position, from position ids so that left padding and packed documents keep
    their blocks aligned to each document's first token. (B, L) -> (B, L)."""
    return torch.div(position_ids, block_size, rounding_mode="floor")


def make_mask_mod(
    mode: str,
    key_padding: torch.Tensor | None = None,
    document_ids: torch.Tensor | None = None,
    blocks: torch.Tensor | None = None,
    query_offset: int = 0,
    stream_length: int | None = None,
) -> MaskMod:
    """The mask of one forward pass.

    mode: "bidirectional", "causal" or "block".
    key_padding: (B, K) bool, True for real tokens. A padded query still sees itself, so no row is empty.
    document_ids: (B, S) document of every position (S = K, or `stream_length` in two-stream mode).
    blocks: (B, S) block index of every position ("block" mode).
    query_offset: queries are keys `query_offset ...` (decoding against a KV cache).
    stream_length: two-stream block-diffusion training input `x_t ⊕ x_0` of 2 * stream_length tokens:
        x_t block k sees x_t block k and x_0 blocks < k; x_0 block k sees x_0 blocks <= k.
    """

    def mask_mod(b, h, q_idx, kv_idx):
        q = q_idx + query_offset
        q_pos, kv_pos = (q, kv_idx) if stream_length is None else (q % stream_length, kv_idx % stream_length)
        allowed = torch.ones_like(q == kv_idx)
        if mode == "causal":
            allowed = kv_pos <= q_pos
        elif mode == "block":
            q_block, kv_block = blocks[b, q_pos], blocks[b, kv_pos]
            if stream_length is None:
                allowed = kv_block <= q_block
            else:
                q_clean, kv_clean = q >= stream_length, kv_idx >= stream_length
                allowed = torch.where(
                    q_clean,
                    kv_clean & (kv_block <= q_block),
                    torch.where(kv_clean, kv_block < q_block, kv_block == q_block),
                )
        if document_ids is not None:
            allowed = allowed & (document_ids[b, q_pos] == document_ids[b, kv_pos])
        if key_padding is not None:
            allowed = (allowed & key_padding[b, kv_idx]) | (q == kv_idx)
        return allowed

    return mask_mod


def dense_mask(mask_mod: MaskMod, batch_size: int, query_length: int, key_length: int, device) -> torch.Tensor:
    """Evaluate a mask mod on a broadcast grid: (B, 1, Q, K) bool."""
    b = torch.arange(batch_size, device=device).view(-1, 1, 1, 1)
    h = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device)
    q = torch.arange(query_length, device=device).view(1, 1, -1, 1)
    kv = torch.arange(key_length, device=device).view(1, 1, 1, -1)
    return mask_mod(b, h, q, kv).expand(batch_size, 1, query_length, key_length)


def build_attention_mask(
    implementation: str,
    mode: str,
    block_size: int | None,
    batch_size: int,
    query_length: int,
    key_length: int,
    device: torch.device,
    dtype: torch.dtype,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    packed: bool = False,
    two_stream: bool = False,
):
    """The mask in the form `implementation` expects, or None where the kernel needs none.

    attention_mask: (B, K) 1 for real tokens, 0 for padding (or a prepared 4D mask / BlockMask, passed
        through). position_ids: (B, K) positions of the keys (of one stream in two-stream mode).
    packed: position_ids come from packed documents; attention never crosses a document boundary.
    Returns None (sdpa / flash then run mask-free, reading `is_causal`), a (B, 1, Q, K) bool mask
    (sdpa), an additive float mask (eager), a `BlockMask` (flex_attention) or the 2D padding mask
    (flash-attn, which unpads it itself).
    """
    if attention_mask is not None and (attention_mask.dim() == 4 or type(attention_mask).__name__ == "BlockMask"):
        return attention_mask
    stream_length = key_length // 2 if two_stream else None
    if attention_mask is not None and not _is_compiling() and bool(attention_mask.all()):
        attention_mask = None  # no padding: keep the mask-free fast path
    if packed and position_ids is not None and not _is_compiling() and not bool((position_ids[:, 1:] == 0).any()):
        packed = False
    query_offset = key_length - query_length

    if implementation in FLASH_IMPLEMENTATIONS:
        if mode == "block" or two_stream:
            raise ValueError(
                f"attn_implementation={implementation!r} cannot express block-diffusion masks; "
                "use 'flex_attention' or 'sdpa' for attention_mode='block'"
            )
        return attention_mask

    needs_mask = attention_mask is not None or packed or mode == "block" or two_stream
    needs_mask |= mode == "causal" and (implementation == "eager" or query_offset > 0)
    if implementation != "flex_attention" and not needs_mask:
        return None

    if position_ids is None:
        position_ids = torch.arange(stream_length or key_length, device=device).expand(batch_size, -1)
    mask_mod = make_mask_mod(
        mode,
        key_padding=None if attention_mask is None else attention_mask.bool(),
        document_ids=document_ids_from_position_ids(position_ids) if packed else None,
        blocks=block_ids(position_ids, block_size) if mode == "block" else None,
        query_offset=query_offset,
        stream_length=stream_length,
    )

    if implementation == "flex_attention":
        from torch.nn.attention.flex_attention import create_block_mask

        return create_block_mask(mask_mod, batch_size, None, query_length, key_length, device=device)
    mask = dense_mask(mask_mod, batch_size, query_length, key_length, device)
    if implementation != "eager":
        return mask  # sdpa and registered custom kernels take the boolean mask
    return torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill(~mask, torch.finfo(dtype).min)
