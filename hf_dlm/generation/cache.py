"""The samplers' KV cache: per layer, the keys / values of every canvas slot (B, nkv, L, hd).

Hand-written rather than a transformers `Cache`: a diffusion sampler recomputes a window in the middle
of the sequence (dual cache) and the Cache classes only append; their names also moved between
transformers 5.17 and 5.24. A forward with a cache sees the window [start, start + Q) as queries and the
slots [0, key_end) as keys, the window's slots replaced by the freshly computed keys / values. `rows`
selects the batch rows of the forward (finished rows leave the forward batch).
"""

from __future__ import annotations

import torch


class DLMKVCache:
    def __init__(self, attention_mask: torch.Tensor, position_ids: torch.Tensor):
        """attention_mask / position_ids: (B, L) of the whole canvas (1 = real token)."""
        self.full_attention_mask = attention_mask
        self.full_position_ids = position_ids
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.start, self.key_end, self.store, self.rows = 0, attention_mask.shape[1], True, None

    def window(self, start: int, key_end: int | None = None, store: bool = False,
               rows: torch.Tensor | None = None) -> "DLMKVCache":
        """Next forward: queries from slot `start`, keys up to `key_end`; `store` writes the window back;
        rows (b,) long: the batch rows in the forward (None = all)."""
        self.start, self.key_end, self.store = start, key_end or self.full_attention_mask.shape[1], store
        self.rows = rows
        return self

    @property
    def attention_mask(self) -> torch.Tensor:
        return self.full_attention_mask if self.rows is None else self.full_attention_mask[self.rows]

    @property
    def position_ids(self) -> torch.Tensor:
        return self.full_position_ids if self.rows is None else self.full_position_ids[self.rows]

    def update(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor):
        """key / value (b, nkv, Q, hd) of the window -> keys / values of slots [0, key_end)."""
        end = self.start + key.shape[2]
        if layer_idx not in self.layers:
            shape = (self.full_attention_mask.shape[0], key.shape[1], self.full_attention_mask.shape[1], key.shape[3])
            self.layers[layer_idx] = (key.new_zeros(shape), value.new_zeros(shape))
        cached_key, cached_value = self.layers[layer_idx]
        rows = slice(None) if self.rows is None else self.rows
        if self.store:
            cached_key[rows, :, self.start : end] = key
            cached_value[rows, :, self.start : end] = value
        if self.start == 0 and end == self.key_end:
            return key, value
        if self.rows is None:
            keys = torch.cat([cached_key[:, :, : self.start], key, cached_key[:, :, end : self.key_end]], dim=2)
            values = torch.cat([cached_value[:, :, : self.start], value, cached_value[:, :, end : self.key_end]], dim=2)
            return keys, values
        keys, values = cached_key[rows, :, : self.key_end], cached_value[rows, :, : self.key_end]  # copies
        keys[:, :, self.start : end], values[:, :, self.start : end] = key, value
        return keys, values
