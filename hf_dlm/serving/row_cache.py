"""Fast-dLLM's prefix / dual caches for the serving engine, where every row has its own canvas and its
current block sits at its own position.

`generation_cache.DLMKVCache` serves a batch that shares one canvas layout (one query window for all
rows); here each row stores its own keys / values (nkv, L_row, hd) per layer at its block start, and a
cached step sends each row's own query window [start_row, end_row) through `DLMModel.forward_window`:
the cache scatters the fresh keys into a per-step frame of every row's stored keys. The attention mask
is built here as a 4D mask (passed through by `build_attention_mask`): a real query sees its row's keys,
a padding query only its own slot (a dummy last slot of the frame), so no row sees another's padding.
Semantics equal `model.generate(cache=...)`: approximate for bidirectional models, as Fast-dLLM's.
"""

from __future__ import annotations

import torch


class RowKVCache:
    """kv_cache for one `forward_window` call over rows with separate canvases. store=True: the queries
    are the whole canvases (block start) and each row keeps its keys / values; store=False: queries are
    windows whose frame slots are `slots` (b, Q) and the keys come from the rows' stores."""

    def __init__(self, stores: list[dict], lengths: list[int], slots: torch.Tensor, key_length: int, store: bool):
        self.stores, self.lengths, self.slots, self.key_length, self.store = stores, lengths, slots, key_length, store

    def update(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor):
        """key / value (b, nkv, Q, hd) of the queries -> keys / values (b, nkv, K, hd) of the frame."""
        if self.store:
            for store, length, k, v in zip(self.stores, self.lengths, key, value):
                store[layer_idx] = (k[:, :length].clone(), v[:, :length].clone())
            return key, value
        batch, heads, _, dim = key.shape
        keys = key.new_zeros(batch, heads, self.key_length, dim)
        values = value.new_zeros(batch, heads, self.key_length, dim)
        for r, (store, length) in enumerate(zip(self.stores, self.lengths)):
            keys[r, :, :length], values[r, :, :length] = store[layer_idx]
        index = self.slots[:, None, :, None].expand(-1, heads, -1, dim)
        return keys.scatter(2, index, key), values.scatter(2, index, value)


def cached_hidden_states(backbone, rows: list, spans: list[tuple[int, int]], store: bool, pad_id: int):
    """Hidden states (b, Q, H) of each row's query span [s, e) of its canvas (`row.canvas`, `row.kv`);
    store: spans are whole canvases and every row's keys / values are (re)stored."""
    device = rows[0].canvas.device
    lengths = [row.canvas.numel() for row in rows]
    width = max(e - s for s, e in spans)
    key_length = max(lengths) if store else max(lengths) + 1  # + the dummy slot of padding queries
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long, device=device)
    positions = torch.zeros_like(input_ids)
    if store:
        slots = torch.arange(width, device=device).repeat(len(rows), 1)
    else:
        slots = torch.full_like(input_ids, key_length - 1)
    valid = torch.zeros_like(input_ids, dtype=torch.bool)
    for r, (row, (s, e)) in enumerate(zip(rows, spans)):
        input_ids[r, : e - s] = row.canvas[s:e]
        positions[r, : e - s] = torch.arange(s, e, device=device)
        slots[r, : e - s] = positions[r, : e - s]
        valid[r, : e - s] = True
    key_real = torch.arange(key_length, device=device) < torch.tensor(lengths, device=device).unsqueeze(1)  # (b, K)
    own_slot = torch.nn.functional.one_hot(slots, key_length).bool()  # (b, Q, K)
    allowed = torch.where(valid.unsqueeze(-1), key_real.unsqueeze(1), own_slot).unsqueeze(1)  # (b, 1, Q, K)
    config = backbone.config
    if (config._attn_implementation or "eager") == "eager":
        dtype = backbone.embed_tokens.weight.dtype
        allowed = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)
    key_positions = torch.arange(key_length, device=device).expand(len(rows), -1)
    cache = RowKVCache([row.kv for row in rows], lengths, slots, key_length, store)
    return backbone.forward_window(input_ids, None, positions, allowed, key_positions, cache)
