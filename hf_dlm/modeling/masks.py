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

from collections import OrderedDict
from typing import Callable

import torch

from ..utils.masking import additive_mask

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
FLASH_IMPLEMENTATIONS = ("flash_attention_2", "flash_attention_3")
# FlexAttention's tile: a BlockMask lists, per (query tile, key tile), whether it is empty, full or partial
FLEX_BLOCK_SIZE = 128
# queries evaluated at once when a BlockMask is derived from its mask mod: bounds the transient
# (B, 1, chunk, K) bool grid (a 32k-token row of 4 samples: 128 MiB, not 4 GiB)
BLOCK_MASK_QUERY_CHUNK = 1024
_BLOCK_MASK_CACHE: "OrderedDict[tuple, object]" = OrderedDict()  # layouts that do not depend on the data
_BLOCK_MASK_CACHE_SIZE = 8


def _is_compiling() -> bool:
    """Tracing or capturing: no host syncs (a CUDA graph capture fails on one)."""
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


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


def dense_mask(mask_mod: MaskMod, batch_size: int, query_length: int, key_length: int, device,
               query_start: int = 0) -> torch.Tensor:
    """Evaluate a mask mod on a broadcast grid: (B, 1, Q, K) bool for queries query_start ... + Q."""
    b = torch.arange(batch_size, device=device).view(-1, 1, 1, 1)
    h = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device)
    q = torch.arange(query_start, query_start + query_length, device=device).view(1, 1, -1, 1)
    kv = torch.arange(key_length, device=device).view(1, 1, 1, -1)
    return mask_mod(b, h, q, kv).expand(batch_size, 1, query_length, key_length)


def _kv_block_lists(selected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, 1, nQ, nK) bool tiles -> BlockMask's (count, indices): per query tile, how many key tiles are
    selected and their indices first, in ascending order."""
    counts = selected.sum(-1, dtype=torch.int32)
    order = selected.to(torch.int8).argsort(dim=-1, descending=True, stable=True).to(torch.int32)
    return counts, order


def block_mask_from_mod(mask_mod: MaskMod, batch_size: int, query_length: int, key_length: int, device):
    """A FlexAttention `BlockMask` for `mask_mod`, classified tile by tile from the mask evaluated on
    broadcast index grids, `BLOCK_MASK_QUERY_CHUNK` queries at a time.

    Hand-written rather than `create_block_mask` (whose tiles it reproduces: tested): that evaluates the
    mask mod under `vmap` on the whole (B, H, Q, K) grid at once (4 GiB of booleans alone for 4 rows of
    32k tokens, more in the index gathers' intermediates), where this needs one (B, 1, chunk, K) grid.
    Tiles that are entirely allowed are "full" (the kernel skips the mask mod there), tiles with no
    allowed pair are skipped, the rest evaluate `mask_mod` in the kernel."""
    from torch.nn.attention.flex_attention import BlockMask

    tile = FLEX_BLOCK_SIZE
    key_tiles = -(-key_length // tile)
    any_parts, all_parts = [], []
    chunk = max(tile, BLOCK_MASK_QUERY_CHUNK // tile * tile)
    for q_start in range(0, query_length, chunk):
        q_end = min(query_length, q_start + chunk)
        allowed = dense_mask(mask_mod, batch_size, q_end - q_start, key_length, device, query_start=q_start)
        # pad to whole tiles with False: ragged edge tiles count as partial, where the mask mod decides
        q_tiles = -(-(q_end - q_start) // tile)
        allowed = torch.nn.functional.pad(allowed, (0, key_tiles * tile - key_length, 0, q_tiles * tile - (q_end - q_start)))
        tiles = allowed.view(batch_size, 1, q_tiles, tile, key_tiles, tile)
        any_parts.append(tiles.any(5).any(3))
        all_parts.append(tiles.all(5).all(3))
    any_tile, full_tile = torch.cat(any_parts, 2), torch.cat(all_parts, 2)  # (B, 1, nQ, nK)
    kv_num_blocks, kv_indices = _kv_block_lists(any_tile & ~full_tile)
    full_kv_num_blocks, full_kv_indices = _kv_block_lists(full_tile)
    return BlockMask.from_kv_blocks(
        kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, BLOCK_SIZE=tile, mask_mod=mask_mod,
        seq_lengths=(query_length, key_length),
    )


def document_attention_implementation(implementation: str, device: torch.device) -> str:
    """Which kernel a forward whose mask has structure (packed documents, block diffusion, padding) runs.

    On CUDA, SDPA (the default) with such a mask would take a dense (B, 1, Q, K) mask, which rules out
    cuDNN / flash and makes the kernel visit every query-key pair, also across documents. Measured on an
    H200 (4 x 4096 tokens, documents of ~650, fwd+bwd): dense-mask SDPA 6.7 ms, FlexAttention 1.95 ms,
    `torch.nn.attention.varlen` 2.5 ms, FlashAttention-4 varlen 2.0 ms; a 1.7B model trains at 35.9k
    tokens/s with the dense mask and 50.0k with FlexAttention (benchmarks/RESULTS.md). So SDPA runs
    FlexAttention there, without the user asking. CPU keeps SDPA with the dense mask (FlexAttention has
    no fast CPU path outside `torch.compile`)."""
    if implementation == "sdpa" and device.type == "cuda":
        return "flex_attention"
    return implementation


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
    structured_kernel: bool = False,
    capturable: bool = False,
):
    """The mask in the form `implementation` expects, or None where the kernel needs none.

    attention_mask: (B, K) 1 for real tokens, 0 for padding (or a prepared 4D mask / BlockMask, passed
        through). position_ids: (B, K) positions of the keys (of one stream in two-stream mode).
    packed: position_ids come from packed documents; attention never crosses a document boundary.
    Returns None (sdpa / flash then run mask-free, reading `is_causal`), a (B, 1, Q, K) bool mask
    (sdpa), an additive float mask (eager), a `BlockMask` (flex_attention) or the 2D padding mask
    (flash-attn, which unpads it itself).
    structured_kernel: a mask with structure (padding, documents, blocks) takes the kernel
        `document_attention_implementation` picks (FlexAttention for SDPA on CUDA): training and scoring
        forwards; the samplers' small query windows keep the dense mask.
    capturable: no shortcut that reads the data (a host sync), as under torch.compile: the caller's step may be
        captured as a CUDA graph (the samplers' compiled steps build their mask outside the compiled layers).
    """
    if attention_mask is not None and (attention_mask.dim() == 4 or type(attention_mask).__name__ == "BlockMask"):
        return attention_mask
    stream_length = key_length // 2 if two_stream else None
    static = capturable or _is_compiling()
    if attention_mask is not None and not static and bool(attention_mask.all()):
        attention_mask = None  # no padding: keep the mask-free fast path
    if packed and position_ids is not None and not static and not bool((position_ids[:, 1:] == 0).any()):
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

    if structured_kernel:
        implementation = document_attention_implementation(implementation, torch.device(device))
    # a layout that does not depend on the data (no padding, no documents): its BlockMask is reused
    cache_key = None
    if implementation == "flex_attention" and attention_mask is None and not packed and not static:
        cache_key = (mode, block_size, batch_size, query_length, key_length, two_stream, str(device))
        if position_ids is not None:  # positions given but not packed: the plain 0..L-1 layout only
            cache_key = cache_key if bool((position_ids == torch.arange(position_ids.shape[1], device=device)).all()) else None
        if cache_key is not None and cache_key in _BLOCK_MASK_CACHE:
            _BLOCK_MASK_CACHE.move_to_end(cache_key)
            return _BLOCK_MASK_CACHE[cache_key]
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
        block_mask = block_mask_from_mod(mask_mod, batch_size, query_length, key_length, device)
        if cache_key is not None:
            _BLOCK_MASK_CACHE[cache_key] = block_mask
            while len(_BLOCK_MASK_CACHE) > _BLOCK_MASK_CACHE_SIZE:
                _BLOCK_MASK_CACHE.popitem(last=False)
        return block_mask
    mask = dense_mask(mask_mod, batch_size, query_length, key_length, device)
    if implementation != "eager":
        return mask  # sdpa and registered custom kernels take the boolean mask
    return additive_mask(mask, dtype)
