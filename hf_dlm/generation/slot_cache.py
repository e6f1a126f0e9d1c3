"""Per-slot key / value storage and the ragged forward of the serving engine.

Every running row owns a lane: a preallocated canvas row and, per layer, key / value storage
(lanes, capacity + 1, nkv, hd); the last slot is a trash slot that padding writes to. A step sends every
row's query span through ONE forward, whatever its phase: an uncached row or a cached row at its block
start queries its whole canvas (keys / values stored), a cached row mid-block its window (dual: the
block; prefix: the block and the rest). The spans are packed into one (1, T) sequence, so the GEMMs see
only real tokens; attention runs per row, the packed queries laid out as (rows, Q_max) against the rows'
storage (`RaggedKV.attention`, called by the model's attention through its `kv_cache`). A step mixing whole
canvases with windows attends in two calls (`long_rows`), so that the windows are not padded to the canvas.

Why hand-written: transformers' caches append per sequence and its continuous batching targets causal
models; a diffusion sampler recomputes windows in the middle of each row's canvas (Fast-dLLM's caches).

Writing a window's fresh keys into the storage is exact for Fast-dLLM's semantics: a cached row's next
steps recompute the same window before reading it, and its next block start rewrites every slot.
"""

from __future__ import annotations

import torch

from ..utils.masking import additive_mask


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
    and grown (rounded up) only when a longer canvas or more lanes are needed (the engine reserves its whole
    size up front when its steps are captured as CUDA graphs, which hold the storage's addresses)."""

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


def bucket(n: int) -> int:
    """Static sizes for captured / compiled steps: n itself up to 16, else rounded up to a multiple of an eighth
    of its power of two (at most ~12% padding, a few sizes per octave)."""
    if n <= 16:
        return max(n, 1)
    step = 1 << (n.bit_length() - 4)
    return -(-n // step) * step


def _row_count(n: int, buckets: bool) -> int:
    """Rows of a call: n, or bucketed and at least two (a size of 1 is a case of its own for the compiler: a
    recompile of the whole model)."""
    return max(bucket(n), 2) if buckets else n


def _query_index(offsets: torch.Tensor, lengths: torch.Tensor, width: int) -> torch.Tensor:
    """(rows, width): packed index of each row's queries (rows start at `offsets`); padding columns read token 0
    (their outputs are never used)."""
    columns = torch.arange(width).unsqueeze(0)
    return torch.where(columns < lengths.unsqueeze(1), offsets.unsqueeze(1) + columns, 0)


def _attention_mask(key_lengths: torch.Tensor, starts: torch.Tensor, queries: int, longest: int, storage: SlotStorage,
                    mode: str, block_size: int | None, buckets: bool, mask_dtype: torch.dtype | None) -> torch.Tensor:
    """(rows, 1, queries, K) on the device: row r's query q (canvas slot starts[r] + q) sees slots < key_lengths[r]
    (as `mode` allows). K: the slots up to the longest key length (bucketed), not the whole storage: a storage
    preallocated for the model's positions costs no attention beyond what the rows hold; the trash slot never."""
    key_count = min(bucket(longest) if buckets else longest, storage.capacity + 1)
    key_slot = torch.arange(key_count, device=storage.device).view(1, 1, -1)
    allowed = key_slot < key_lengths.view(-1, 1, 1)  # (rows, 1, K)
    query_position = (starts.unsqueeze(1) + torch.arange(queries, device=storage.device)).unsqueeze(-1)
    if mode == "causal":
        allowed = allowed & (key_slot <= query_position)
    elif mode == "block":
        allowed = allowed & (key_slot // block_size <= query_position // block_size)
    allowed = allowed.expand(key_lengths.shape[0], queries, -1).unsqueeze(1)
    return allowed if mask_dtype is None else additive_mask(allowed, mask_dtype)


SPLIT_GAIN = 0.5  # split when the two calls' query-key pairs are at most half of one padded call's


def long_rows(lengths: list[int], key_lengths: list[int], buckets: bool) -> list[int]:
    """The rows that attend in a call of their own: those querying more than a cut, where the two calls (every row
    at the short width, the long rows at the full width) compute at most `SPLIT_GAIN` of the query-key pairs of one
    call padding every row to the longest. A step mixing 4 block starts (320 queries) with 28 windows (32) computes
    0.22 of the pairs (why hand-written: SDPA pads a batch to its longest row; a varlen kernel would read packed
    keys, where the engine's keys sit in per-lane storage)."""
    size = bucket if buckets else (lambda n: max(n, 1))
    rows, widest = len(lengths), max(lengths)
    best, chosen = SPLIT_GAIN * rows * size(widest) * size(max(key_lengths)), []
    for cut in sorted(set(lengths) - {widest, 0}):  # 0: the filler rows
        long = [i for i, n in enumerate(lengths) if n > cut]
        short_keys = max([k for n, k in zip(lengths, key_lengths) if n <= cut])
        count = _row_count(len(long), buckets)
        pairs = rows * size(cut) * size(short_keys) + count * size(widest) * size(max(key_lengths[i] for i in long))
        if pairs <= best:
            best, chosen = pairs, long
    return chosen


class RaggedStep:
    """The plan of one engine forward. Rows r = 0..b-1 each query their canvas slots [start_r, start_r + length_r)
    on lane `lanes[r]`, against keys [0, key_length_r). `tensors` holds the device indices `ragged_forward`
    takes; with `buckets` every size (rows, packed tokens, queries per row) is rounded up (`bucket`), the
    filler rows / tokens reading slot 0 and writing the trash slot, so that a few static shapes repeat.

    mode: the model's attention_mode ('bidirectional', 'causal' or 'block' with `block_size`): which keys
    a query at position p sees (all of its row's; <= p; blocks <= p's block)."""

    def __init__(self, storage: SlotStorage, lanes: list[int], starts: list[int], lengths: list[int],
                 key_lengths: list[int], mode: str = "bidirectional", block_size: int | None = None,
                 buckets: bool = False, heads: list[tuple[int, int]] | None = None, extra: dict | None = None,
                 mask_dtype: torch.dtype | None = None, by_lane: bool = False, split: bool = True):
        """heads: per row (first canvas slot, count) whose hidden states go through the LM head ->
        tensors["head_index"] (rows, max count), later columns repeating the last; extra: per-row integer lists
        sent to the device with the rest (one host-to-device copy per step). mask_dtype: the mask as an additive
        bias of this dtype (0 / the dtype's lowest), built once per step; else boolean, which SDPA converts in
        every layer (on the H100 ~9% of a batch-16 LLaDA-8B step, benchmarks/RESULTS.md).

        by_lane: row r is lane r (lanes unique; the lanes between without work are filler rows), so that attention
        reads the storage's first rows as a view (`tensors["lanes"]` None) where gathering the rows' lanes copied
        every layer's keys / values (11% of a batch-64 LLaDA-8B step on the H100, benchmarks/RESULTS.md);
        the LM head's rows stay the given rows, in their order (bucketed): idle lanes cost no LM-head columns.

        split: rows with many queries (a block start's whole canvas) beside rows querying a window attend in a
        second call (`long_rows`), so the window rows' queries are not padded to the canvas width."""
        # the LM head's rows: the given rows, in their order, each read through its place among the step's rows
        head_places, head_starts = list(range(len(lanes))), list(starts)
        if by_lane:
            count = max(lanes) + 1
            rows = min(_row_count(count, buckets), max(storage.lanes, count))
            place = dict(zip(lanes, range(len(lanes))))
            if len(place) != len(lanes):
                raise ValueError(f"by_lane: every row needs a lane of its own, got lanes {lanes}")

            def placed(values, fill):
                return [values[place[lane]] if lane in place else fill for lane in range(rows)]

            head_places = list(lanes)
            starts, lengths, key_lengths = placed(starts, 0), placed(lengths, 0), placed(key_lengths, 1)
            extra = None if extra is None else {name: placed(list(v), v[0]) for name, v in extra.items()}
            lanes = list(range(rows))
        b, total, width = len(lanes), sum(lengths), max(lengths)
        # a filler row has no tokens, only its attention row and LM-head columns
        rows = b if by_lane else _row_count(b, buckets)
        self.num_tokens = bucket(total) if buckets else total
        width = bucket(width) if buckets else width
        filler = rows - b
        lanes, starts = lanes + [lanes[0]] * filler, starts + [0] * filler
        lengths_t = torch.tensor(lengths + [0] * filler)
        offsets = torch.cumsum(lengths_t, 0) - lengths_t
        row = torch.repeat_interleave(torch.arange(rows), lengths_t)  # (T,) row of each packed token
        qpos = torch.arange(total) - offsets[row]
        slot = torch.tensor(starts)[row] + qpos
        padding = self.num_tokens - total  # filler tokens: row 0's lane, the trash slot
        row = torch.cat([row, torch.zeros(padding, dtype=torch.long)])
        qpos = torch.cat([qpos, torch.zeros(padding, dtype=torch.long)])
        slot = torch.cat([slot, torch.full((padding,), storage.trash)])
        lane = torch.tensor(lanes)[row]
        # (rows, Q) -> packed token index; padding queries read token 0 (their outputs are never used)
        q_index = _query_index(offsets, lengths_t, width)
        key_lengths = key_lengths + [1] * filler
        lanes_t, key_lengths_t, starts_t = torch.tensor(lanes), torch.tensor(key_lengths), torch.tensor(starts)
        parts = {"token_lane": lane, "token_slot": slot, "token_row": row, "token_qpos": qpos, "q_index": q_index,
                 "lanes": lanes_t, "key_lengths": key_lengths_t, "starts": starts_t}
        long = long_rows(lengths_t.tolist(), key_lengths, buckets) if split else []
        if long:  # group 0: every row, the long ones as filler (no queries, slot 0); group 1: the long rows
            is_long = torch.zeros(rows, dtype=torch.bool)
            is_long[long] = True
            short_lengths = lengths_t.masked_fill(is_long, 0)
            short_width = int(short_lengths.max())  # a short row is a real one: long_rows cuts at a real length
            short_width = bucket(short_width) if buckets else short_width
            count = _row_count(len(long), buckets)  # filler long rows repeat the first, with no queries
            long_all = torch.tensor(long + [long[0]] * (count - len(long)))
            filler_long = torch.arange(count) >= len(long)
            parts["key_lengths"] = key_lengths_t.masked_fill(is_long, 1)
            parts["short_index"] = _query_index(offsets, short_lengths, short_width)
            parts["long_index"] = _query_index(offsets[long_all], lengths_t[long_all].masked_fill(filler_long, 0),
                                               width)
            parts["long_lanes"] = lanes_t[long_all]
            parts["long_key_lengths"] = key_lengths_t[long_all].masked_fill(filler_long, 1)
            parts["long_starts"] = starts_t[long_all]
            # the packed tokens' places in the two calls' outputs laid end to end: (rows, Qs) then (count, Q)
            place = torch.zeros(rows, dtype=torch.long)
            place[long] = torch.arange(len(long))
            parts["token_out"] = torch.where(is_long[row], rows * short_width + place[row] * width + qpos,
                                             row * short_width + qpos)
        if heads is not None:
            first = torch.tensor([h[0] for h in heads]) - torch.tensor(head_starts) + offsets[head_places]
            count = torch.tensor([h[1] for h in heads])
            columns = torch.arange(int(count.max()))
            index = first.unsqueeze(1) + torch.minimum(columns.unsqueeze(0), count.unsqueeze(1) - 1)
            fill = _row_count(len(heads), buckets) - len(heads)  # filler rows: token 0
            parts["head_index"] = torch.cat([index, index.new_zeros(fill, index.shape[1])])
        for name, values in (extra or {}).items():
            parts[name] = torch.tensor(list(values) + [values[0]] * filler)
        # the step's one upload; non-blocking: a blocking copy to a GPU waits for the work queued before it
        flat = torch.cat([t.flatten() for t in parts.values()]).to(storage.device, non_blocking=True)
        tensors, at = {}, 0
        for name, t in parts.items():
            tensors[name] = flat[at : at + t.numel()].view(t.shape)
            at += t.numel()
        longest_short = int(parts["key_lengths"].max())
        tensors["mask"] = _attention_mask(tensors.pop("key_lengths"), tensors.pop("starts"),
                                          short_width if long else width, longest_short, storage, mode, block_size,
                                          buckets, mask_dtype)
        if long:
            tensors["long_mask"] = _attention_mask(tensors.pop("long_key_lengths"), tensors.pop("long_starts"), width,
                                                   int(parts["long_key_lengths"].max()), storage, mode, block_size,
                                                   buckets, mask_dtype)
        else:
            tensors.update(short_index=None, long_index=None, long_lanes=None, long_mask=None, token_out=None)
        slots = tensors["token_slot"]
        tensors["positions"] = torch.where(slots == storage.trash, 0, slots).unsqueeze(0)  # (1, T) RoPE positions
        if by_lane:
            tensors["lanes"] = None  # attention slices the storage
        self.tensors = {name: tensors.pop(name) for name in list(tensors) if name not in (extra or {})}
        self.extra = tensors
        self.offsets, self.starts, self.rows = offsets.tolist(), starts, rows


class RaggedKV:
    """The `kv_cache` of `ragged_forward`: writes the packed queries' fresh keys / values into their lanes' slots
    and runs each row's attention against its lane (`attends`: DLMAttention hands the attention over)."""

    attends = True

    def __init__(self, keys: list, values: list, token_lane, token_slot, token_row, token_qpos, q_index, mask, lanes,
                 groups=None, short_index=None, long_index=None, long_lanes=None, long_mask=None, token_out=None):
        """short_index ... token_out: a split step's second call (`RaggedStep(split=True)`), else None."""
        self.keys, self.values = keys, values
        self.token_lane, self.token_slot, self.token_row, self.token_qpos = token_lane, token_slot, token_row, token_qpos
        self.q_index, self.mask, self.lanes = q_index, mask, lanes
        self.short_index, self.long_index, self.long_lanes, self.long_mask = short_index, long_index, long_lanes, long_mask
        self.token_out = token_out
        self._groups = groups

    @property
    def token_groups(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(q_index (rows, Q), valid (rows, Q)): which packed tokens form each row, for the layers that mix tokens
        besides attention (expert-choice MoE routes within each row, as if it were decoded alone). A padding
        column points at token 0, a real token only when it is row 0's first (rows are never empty)."""
        if self._groups is None:  # once per forward, shared by the layers
            rows, width = self.q_index.shape
            device = self.q_index.device
            valid = (self.token_row[self.q_index] == torch.arange(rows, device=device).view(-1, 1)) & (
                self.token_qpos[self.q_index] == torch.arange(width, device=device).view(1, -1))
            self._groups = (self.q_index, valid)
        return self._groups

    def storage_of(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[layer_idx], self.values[layer_idx]

    def update(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor):
        """key / value (1, nkv, T, hd) fresh for the packed queries."""
        keys, values = self.storage_of(layer_idx)
        keys[self.token_lane, self.token_slot] = key[0].transpose(0, 1).to(keys.dtype)
        values[self.token_lane, self.token_slot] = value[0].transpose(0, 1).to(values.dtype)
        return key, value

    def attention(self, module, query: torch.Tensor, key=None, value=None) -> torch.Tensor:
        """query (1, nh, T, hd) -> attention output (1, T, nh, hd): per row against its lane's keys / values."""
        keys, values = self.storage_of(module.layer_idx)
        queries = query[0].transpose(0, 1)  # (T, nh, hd)
        if self.long_index is None:
            output = _attend(module, queries, keys, values, self.q_index, self.mask, self.lanes)
            return output[self.token_row, self.token_qpos].unsqueeze(0)  # (1, T, nh, hd)
        short = _attend(module, queries, keys, values, self.short_index, self.mask, self.lanes)
        long = _attend(module, queries, keys, values, self.long_index, self.long_mask, self.long_lanes)
        return torch.cat([short.flatten(0, 1), long.flatten(0, 1)])[self.token_out].unsqueeze(0)


def _attend(module, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, index: torch.Tensor,
            mask: torch.Tensor, lanes: torch.Tensor | None) -> torch.Tensor:
    """One SDPA call: packed queries (T, nh, hd) laid out by `index` (b, Q) against lanes `lanes` of the storage
    (None: the first b lanes, a view) -> (b, Q, nh, hd)."""
    width = mask.shape[-1]  # the call's K slots (`RaggedStep`)
    if lanes is None:  # row r is lane r (`RaggedStep(by_lane=True)`): a view, no copy
        rows = index.shape[0]
        keys, values = keys[:rows, :width].transpose(1, 2), values[:rows, :width].transpose(1, 2)
    else:
        keys = keys[:, :width].index_select(0, lanes).transpose(1, 2)  # (b, nkv, K, hd)
        values = values[:, :width].index_select(0, lanes).transpose(1, 2)
    queries = queries[index].transpose(1, 2)  # (b, nh, Q, hd)
    rows, heads, width_q, head_dim = queries.shape
    groups = heads // keys.shape[1]
    if groups > 1:
        # grouped-query attention: the query heads of a kv head stacked along the query axis (head h reads kv head
        # h // groups), the mask repeated for each; SDPA then reads the storage's keys / values as they are.
        # Repeating the keys / values per query head copied every row's canvas per layer and step (SDPA's own
        # enable_gqa falls back to its math kernel under a mask on CUDA)
        queries = queries.reshape(rows, keys.shape[1], groups * width_q, head_dim)
        mask = mask.unsqueeze(2).expand(-1, -1, groups, -1, -1).reshape(rows, mask.shape[1], groups * width_q, -1)
    output = torch.nn.functional.scaled_dot_product_attention(
        queries, keys.to(queries.dtype), values.to(queries.dtype), attn_mask=mask, scale=module.scaling)
    return output.reshape(rows, heads, width_q, head_dim).transpose(1, 2)


class _Allocating(RaggedKV):
    """The first forward of a storage: allocates each layer's keys / values from the first fresh ones (the model's
    kv heads, head size and dtype, read from its output) and records which layers attended through it."""

    def __init__(self, storage: SlotStorage, **tensors):
        super().__init__(storage.keys, storage.values, **tensors)
        self.storage, self.layers_seen = storage, set()

    def update(self, layer_idx, key, value):
        if layer_idx not in self.storage.keys:
            shape = (self.storage.lanes, self.storage.capacity + 1, key.shape[1], key.shape[3])
            self.storage.keys[layer_idx], self.storage.values[layer_idx] = key.new_zeros(shape), value.new_zeros(shape)
        return super().update(layer_idx, key, value)

    def attention(self, module, query, key=None, value=None):
        self.layers_seen.add(module.layer_idx)
        return super().attention(module, query, key, value)


def ragged_forward(model, input_ids, head_index, positions, mask, keys, values, **index):
    """One engine forward: packed queries (1, T) -> logits (b, W, V) at `head_index` (b, W) (packed indices).
    keys / values: per layer, the storage (lanes, capacity + 1, nkv, hd), updated in place; `index`: the rest of
    `RaggedStep.tensors`."""
    cache = RaggedKV(keys, values, mask=mask, **index)
    hidden_states = model.model.forward_window(input_ids, None, positions, mask, positions, cache)[0]
    return model.lm_head(hidden_states[head_index])


class _LayerKV(RaggedKV):
    """One layer's storage, whatever the layer's index: the compiled layer step reads none (one graph serves
    every layer)."""

    def storage_of(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys, self.values


def _ragged_layer(layer, hidden_states, position_embeddings, mask, keys, values, token_lane, token_slot, token_row,
                  token_qpos, q_index, lanes, groups, short_index, long_index, long_lanes, long_mask, token_out):
    cache = _LayerKV(keys, values, token_lane, token_slot, token_row, token_qpos, q_index, mask, lanes, groups,
                     short_index, long_index, long_lanes, long_mask, token_out)
    return layer(hidden_states, attention_mask=mask, position_embeddings=position_embeddings, kv_cache=cache)


class CompiledRaggedForward:
    """`ragged_forward` with each decoder layer through one compiled function (regional compilation, as
    PyTorch's recipe for repeated blocks): the identical layers share one graph, so the compile time does not
    grow with the depth, where compiling the whole forward traces and compiles every layer (the symbolic
    shape work of a dynamic-size step is ~3.5 s a layer on a CPU, benchmarks/RESULTS.md). Embeddings, norm and
    LM head run eagerly around it; on CUDA the whole step is still captured as one graph (`StepGraphs`).
    Layers of another kind (MoE beside dense) compile a graph of their own."""

    def __init__(self, **compile_options):
        self.layer_step = torch.compile(_ragged_layer, dynamic=True, **compile_options)

    def __call__(self, model, input_ids, head_index, positions, mask, keys, values, **index):
        # MoE layers route within each row (`token_groups`): computed once here and passed in, not built inside the
        # compiled layer (where a graph break made Dynamo guard on the tensors' values: a recompile a step on CPU)
        groups = RaggedKV(keys, values, mask=mask, **index).token_groups if getattr(
            model.config, "num_experts", 0) else None

        def run_layer(i, layer, hidden_states, attention_mask, position_embeddings):
            return self.layer_step(layer, hidden_states, position_embeddings, mask, keys[i], values[i], **index,
                                   groups=groups)

        hidden_states = model.model.forward_window(input_ids, None, positions, mask, positions, None,
                                                   run_layer=run_layer)[0]
        return model.lm_head(hidden_states[head_index])


def first_ragged_forward(model, storage: SlotStorage, input_ids, head_index, positions, mask, **tensors):
    """`ragged_forward` that allocates the storage; raises when the model's attention ignored the ragged cache."""
    cache = _Allocating(storage, mask=mask, **tensors)
    hidden_states = model.model.forward_window(input_ids, None, positions, mask, positions, cache)[0]
    if not cache.layers_seen or cache.layers_seen != set(storage.keys):
        raise NotImplementedError(f"{type(model).__name__}: its attention does not take the engine's ragged kv_cache "
                                  "(`attends`); decode it with model.generate")
    return model.lm_head(hidden_states[head_index])


__all__ = ["CompiledRaggedForward", "RaggedKV", "RaggedStep", "SlotStorage", "bucket", "first_ragged_forward",
           "ragged_forward"]
