"""`generate(compile=...)`: the sampler's forward pass with static shapes, run through `torch.compile`.

A small DLM decodes host-bound: each step launches hundreds of small eager kernels. Captured as one
graph (CUDA graphs: `mode="reduce-overhead"`, or `backend="cudagraphs"` without Inductor), a step
costs one launch. Capture needs the same shapes every step and no host syncs or data-dependent Python
inside the graph, so the compiled sampler differs from the eager one in how it calls the model only:

- the batch stays whole (finished rows still go through the forward; their commits are masked),
- without a cache the query is the whole canvas; with the dual cache it is the block (keys: the whole
  canvas), with the prefix cache the block and everything after it (one graph per block: its width
  changes), and the cache's refresh at a block start is a whole-canvas forward,
- cached keys / values are spliced in with `index_copy` at tensor-valued slots (no Python int that
  would specialise the graph per block), and the refreshed keys / values are returned and copied into
  the cache outside the graph (a graph must not mutate its inputs),
- the LM head runs on the window's positions through `index_select` (static width).

Tokens equal the eager sampler's (tests, CPU); only bidirectional models' caches and the uncached
sampler of every attention mode are supported (the exact block-model cache recomputes a per-row
span of changing width).
"""

from __future__ import annotations

import weakref

import torch

# generate(compile=...) value -> torch.compile keyword arguments (True picks per device)
COMPILE_CHOICES = {
    "default": dict(mode="default"),
    "reduce-overhead": dict(mode="reduce-overhead"),
    "max-autotune": dict(mode="max-autotune"),
    "max-autotune-no-cudagraphs": dict(mode="max-autotune-no-cudagraphs"),
    "cudagraphs": dict(backend="cudagraphs"),  # CUDA graphs without Inductor: compiles in seconds
    "eager": dict(backend="eager"),  # Dynamo tracing only: checks capturability, no speed-up
}


# graphs `static_forward` may hold (Dynamo's recompile limit while the sampler calls it): one per static
# shape, i.e. per batch size, canvas length and, with the prefix cache, per block of a generation
MAX_COMPILED_GRAPHS = 256


def resolve_compile(value, device: torch.device) -> str | None:
    """The `compile` field -> a key of COMPILE_CHOICES or None (eager)."""
    if value is None or value is False:
        return None
    if value is True:
        return "reduce-overhead" if device.type == "cuda" else "default"
    if value not in COMPILE_CHOICES:
        raise ValueError(f"DLMGenerationConfig.compile must be a bool or one of {tuple(COMPILE_CHOICES)}, "
                         f"got {value!r}")
    return value


class _SplicedKV:
    """Duck-types the `kv_cache` argument of `DLMAttention`: returns the cached keys / values with the
    query slots replaced (out of place) and remembers the fresh ones."""

    def __init__(self, past, slots):
        self.past, self.slots, self.fresh = past, slots, []

    def update(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor):
        self.fresh.append((key, value))
        if self.past is None:
            return key, value
        cached_key, cached_value = self.past[0][layer_idx], self.past[1][layer_idx]
        return (cached_key.index_copy(2, self.slots, key.to(cached_key.dtype)),
                cached_value.index_copy(2, self.slots, value.to(cached_value.dtype)))


def static_forward(model, input_ids, position_ids, key_padding, key_position_ids, head_index, past=None, slots=None,
                   return_kv: bool = False):
    """One sampler forward with static shapes.

    input_ids / position_ids (b, Q): the query slots; key_padding / key_position_ids (b, K): the whole
    canvas (1 = real token); head_index (W,): the query offsets whose logits are wanted; past: per layer
    (key, value) (b, nkv, K, hd) of the whole canvas, or None when the query is the whole canvas;
    slots (Q,): the canvas slots of the query. -> logits (b, W, V) [, keys (n_layers, b, nkv, Q, hd),
    values (same)]."""
    cache = _SplicedKV(past, slots)
    # queries are the last Q keys: exact for the whole canvas and the prefix cache; for the dual cache's
    # window the offset only reaches the self-clause of padded queries, and its queries are never padding
    hidden_states = model.model.forward_window(input_ids, None, position_ids, key_padding, key_position_ids, cache)
    logits = model.lm_head(hidden_states.index_select(1, head_index))
    if not return_kv:
        return logits
    return logits, torch.stack([k for k, _ in cache.fresh]), torch.stack([v for _, v in cache.fresh])


_COMPILED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> {choice: compiled function}


def compiled_forward(model, choice: str):
    """`static_forward` compiled with COMPILE_CHOICES[choice], kept per model (weakly: not an attribute,
    so copying or saving the model never meets it). Dynamo keeps the graphs on `static_forward` itself,
    so later calls reuse them whichever wrapper calls."""
    store = _COMPILED.setdefault(model, {})
    if choice not in store:
        store[choice] = torch.compile(static_forward, dynamic=False, **COMPILE_CHOICES[choice])
    return store[choice]


class CapturedStep:
    """`static_forward` of one static shape captured as a CUDA graph, without `torch.compile`.

    The eager sampler's cached window step (dual / prefix cache, every row in the forward) has the same
    shapes at every step of a block and, at batch 1, is launch-bound: an 8B model's 32-token window
    launches ~1,400 small kernels whose host-side cost is several times the GPU work (H200, LLaDA-8B
    shape: 42.6 ms per eager window step, 10.3 ms per step replayed, benchmarks/RESULTS.md). A graph
    replays them in one launch. Unlike `generate(compile=...)` nothing is traced or compiled, so
    the first replay is ready after a few warm-up forwards. Tensor arguments are copied into the graph's
    static input buffers before each replay; `past` (the cache's per-layer keys / values) is read in
    place, so the cache's refresh at each block start is seen by later replays."""

    def __init__(self, model, past, tensors: dict):
        self.model, self.past = model, past
        self.inputs = {name: None if t is None else t.clone() for name, t in tensors.items()}
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up outside the graph: cuBLAS / cuDNN workspaces and plans
            for _ in range(2):
                self._call()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self._call()

    def _call(self):
        i = self.inputs
        return static_forward(self.model, i["input_ids"], i["position_ids"], i["key_padding"], i["key_position_ids"],
                              i["head_index"], past=self.past, slots=i["slots"])

    def __call__(self, tensors: dict) -> torch.Tensor:
        for name, t in tensors.items():
            if t is not None:
                self.inputs[name].copy_(t)
        self.graph.replay()
        return self.logits.clone()  # the next replay overwrites the graph's output


__all__ = ["COMPILE_CHOICES", "MAX_COMPILED_GRAPHS", "CapturedStep", "compiled_forward", "resolve_compile",
           "static_forward"]
