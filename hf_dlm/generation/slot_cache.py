"""Per-slot key / value storage and the ragged forward of the serving engine.

Every running row owns a lane: a preallocated canvas row and, per layer, key / value storage
(lanes, capacity + 1, nkv, hd); the last slot is a trash slot that padding writes to. A step sends every
row's query span through ONE forward, whatever its phase: an uncached row or a cached row at its block
start queries its whole canvas (keys / values stored), a cached row mid-block its window (dual: the
block; prefix: the block and the rest). The spans are packed into one (1, T) sequence, so the GEMMs see
only real tokens; attention runs per row, the packed queries laid out as (rows, Q_max) against the rows'
storage (`RaggedStep.attention`, called by the model's attention through its `kv_cache`).

Why hand-written: transformers' caches append per sequence and its continuous batching targets causal
models; a diffusion sampler recomputes windows in the middle of each row's canvas (Fast-dLLM's caches).

Writing a window's fresh keys into the storage is exact for Fast-dLLM's semantics: a cached row's next
steps recompute the same window before reading it, and its next block start rewrites every slot.
"""

from __future__ import annotations

import torch


def _grow(tensor: torch.Tensor | None, lanes: int, length: int, fill=0) -> torch.Tensor | None:
    """`tensor` (lanes', length' + 1, ...) enlarged to (lanes, length + 1, ...), contents kept, the trash slot last."""
    if tensor is None or (tensor.shape[0] >= lanes and tensor.shape[1] >= length + 1):
        return tensor
    lanes, length = max(lanes, tensor.shape[0]), max(length, tensor.shape[1] - 1)
    out = tensor.new_full((lanes, length + 1, *tensor.shape[2:]), fill)
    out[: tensor.shape[0], : tensor.shape[1] - 1] = tensor[:, :-1]
    return out


class SlotStorage:
    """Canvases (lanes, capacity + 1) and per-layer keys / values (lanes, capacity + 1, nkv, hd), allocated once
    and grown (rounded up) only when a longer canvas or more lanes are needed."""

    def __init__(self, device: torch.device, fill_token: int, round_to: int = 64):
        self.device, self.fill_token, self.round_to = device, fill_token, round_to
        self.lanes, self.capacity = 0, 0
        self.canvas: torch.Tensor | None = None
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    def reserve(self, lanes: int, length: int):
        if lanes <= self.lanes and length <= self.capacity:
            return
        self.lanes = max(lanes, self.lanes)
        self.capacity = max(self.capacity, -(-length // self.round_to) * self.round_to)
        if self.canvas is None:
            self.canvas = torch.full((self.lanes, self.capacity + 1), self.fill_token, dtype=torch.long,
                                     device=self.device)
        self.canvas = _grow(self.canvas, self.lanes, self.capacity, self.fill_token)
        for store in (self.keys, self.values):
            for layer, tensor in store.items():
                store[layer] = _grow(tensor, self.lanes, self.capacity)

    @property
    def trash(self) -> int:
        return self.capacity


class RaggedStep:
    """The `kv_cache` of one engine forward. Rows r = 0..b-1 each query their canvas slots
    [start_r, start_r + length_r) on lane `lanes[r]`, against keys [0, key_length_r).

    mode: the model's attention_mode ('bidirectional', 'causal' or 'block' with `block_size`): which keys
    a query at position p sees (all of its row's; <= p; blocks <= p's block)."""

    def __init__(self, storage: SlotStorage, lanes: list[int], starts: list[int], lengths: list[int],
                 key_lengths: list[int], mode: str = "bidirectional", block_size: int | None = None,
                 pad_to: int | None = None):
        device = storage.device
        self.storage, self.layers_seen = storage, set()
        b = len(lanes)
        lengths_t = torch.tensor(lengths)
        total = int(lengths_t.sum())
        self.num_tokens = max(total, pad_to or 0)
        offsets = torch.cumsum(lengths_t, 0) - lengths_t
        row = torch.repeat_interleave(torch.arange(b), lengths_t)  # (T,) row of each packed token
        qpos = torch.arange(total) - offsets[row]
        slot = torch.tensor(starts)[row] + qpos
        lane = torch.tensor(lanes)[row]
        padding = self.num_tokens - total  # bucket filler: row 0's lane, the trash slot
        if padding:
            row = torch.cat([row, torch.zeros(padding, dtype=torch.long)])
            qpos = torch.cat([qpos, torch.zeros(padding, dtype=torch.long)])
            slot = torch.cat([slot, torch.full((padding,), storage.trash)])
            lane = torch.cat([lane, torch.full((padding,), lanes[0])])
        width = max(lengths)
        # (b, Q_max) -> packed token index; padding queries read token 0 (their outputs are never used)
        q_index = offsets.unsqueeze(1) + torch.arange(width).unsqueeze(0)
        q_valid = torch.arange(width).unsqueeze(0) < lengths_t.unsqueeze(1)
        q_index = torch.where(q_valid, q_index, 0)
        key_slot = torch.arange(storage.capacity + 1)
        allowed = key_slot.view(1, 1, -1) < torch.tensor(key_lengths).view(-1, 1, 1)  # (b, 1, K): the trash never
        query_position = torch.tensor(starts).unsqueeze(1) + torch.arange(width).unsqueeze(0)  # (b, Q_max)
        if mode == "causal":
            allowed = allowed & (key_slot.view(1, 1, -1) <= query_position.unsqueeze(-1))
        elif mode == "block":
            allowed = allowed & (key_slot.view(1, 1, -1) // block_size <= query_position.unsqueeze(-1) // block_size)
        self.mask = allowed.expand(b, width, -1).unsqueeze(1).to(device)  # (b, 1, Q_max, K)
        self.token_row, self.token_qpos = row.to(device), qpos.to(device)
        self.token_lane, self.token_slot = lane.to(device), slot.to(device)
        self.positions = torch.where(slot == storage.trash, 0, slot).unsqueeze(0).to(device)  # (1, T) RoPE positions
        self.q_index = q_index.to(device)
        self.lanes = torch.tensor(lanes, device=device)
        self.offsets, self.starts = offsets.tolist(), starts

    def update(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor):
        """key / value (1, nkv, T, hd) fresh for the packed queries: written into their lanes' slots."""
        storage = self.storage
        if layer_idx not in storage.keys:
            shape = (storage.lanes, storage.capacity + 1, key.shape[1], key.shape[3])
            storage.keys[layer_idx] = key.new_zeros(shape)
            storage.values[layer_idx] = value.new_zeros(shape)
        keys, values = storage.keys[layer_idx], storage.values[layer_idx]
        keys[self.token_lane, self.token_slot] = key[0].transpose(0, 1).to(keys.dtype)
        values[self.token_lane, self.token_slot] = value[0].transpose(0, 1).to(values.dtype)
        return key, value

    attends = True  # DLMAttention hands the attention itself to `attention` below

    def attention(self, module, query: torch.Tensor, key=None, value=None) -> torch.Tensor:
        """query (1, nh, T, hd) -> attention output (1, T, nh, hd): per row against its lane's keys / values."""
        layer = module.layer_idx
        self.layers_seen.add(layer)
        keys = self.storage.keys[layer].index_select(0, self.lanes).transpose(1, 2)  # (b, nkv, K, hd)
        values = self.storage.values[layer].index_select(0, self.lanes).transpose(1, 2)
        queries = query[0].transpose(0, 1)[self.q_index].transpose(1, 2)  # (b, nh, Q_max, hd)
        if keys.shape[1] != queries.shape[1]:  # grouped-query attention
            repeat = queries.shape[1] // keys.shape[1]
            keys, values = keys.repeat_interleave(repeat, 1), values.repeat_interleave(repeat, 1)
        output = torch.nn.functional.scaled_dot_product_attention(
            queries, keys.to(queries.dtype), values.to(queries.dtype), attn_mask=self.mask, scale=module.scaling)
        return output.transpose(1, 2)[self.token_row, self.token_qpos].unsqueeze(0)  # (1, T, nh, hd)


__all__ = ["RaggedStep", "SlotStorage"]
