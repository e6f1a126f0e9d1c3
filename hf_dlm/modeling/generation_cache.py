"""The samplers' KV cache: per layer, the keys / values of every canvas slot (B, nkv, L, hd).

Hand-written rather than a transformers `Cache`: a diffusion sampler recomputes a window in the middle
of the sequence (dual cache) and the Cache classes only append; their names also moved between
transformers 5.17 and 5.24. A forward with a cache sees the window [start, start + Q) as queries and the
slots [0, key_end) as keys, the window's slots replaced by the freshly computed keys / values.
"""

from __future__ import annotations

import torch


class DLMKVCache:
    def __init__(self, attention_mask: torch.Tensor, position_ids: torch.Tensor):
        """attention_mask / position_ids: (B, L) of the whole canvas (1 = real token)."""
        self.attention_mask = attention_mask
        self.position_ids = position_ids
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.start, self.key_end, self.store = 0, attention_mask.shape[1], True

    def window(self, start: int, key_end: int | None = None, store: bool = False) -> "DLMKVCache":
        """Next forward: queries from slot `start`, keys up to `key_end`; `store` writes the window back."""
        self.start, self.key_end, self.store = start, key_end or self.attention_mask.shape[1], store
        return self

    def update(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor):
        """key / value (B, nkv, Q, hd) of the window -> keys / values of slots [0, key_end)."""
        end = self.start + key.shape[2]
        if layer_idx not in self.layers:
            shape = (*key.shape[:2], self.attention_mask.shape[1], key.shape[3])
            self.layers[layer_idx] = (key.new_zeros(shape), value.new_zeros(shape))
        cached_key, cached_value = self.layers[layer_idx]
        if self.store:
            cached_key[:, :, self.start : end], cached_value[:, :, self.start : end] = key, value
        if self.start == 0 and end == self.key_end:
            return key, value
        keys = torch.cat([cached_key[:, :, : self.start], key, cached_key[:, :, end : self.key_end]], dim=2)
        values = torch.cat([cached_value[:, :, : self.start], value, cached_value[:, :, end : self.key_end]], dim=2)
        return keys, values
