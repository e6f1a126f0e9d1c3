"""`generate(compile=...)`: the sampler's forward pass with static shapes, run through `torch.compile`.

A DLM decodes host-bound at small batches: each step launches hundreds of small eager kernels. Inductor
fuses the elementwise work between the GEMMs (norms, RoPE, SwiGLU, the cache splice) and, on CUDA, hf-dlm
captures each static shape of the compiled forward as one CUDA graph (`StepGraphs`: the refresh at a
block start and the window step), so a step costs one launch. `compile=True` on CUDA is that pairing
(Inductor's "default" mode plus hf-dlm's graphs); Inductor's own graphs (`"reduce-overhead"`) and
Dynamo's `"cudagraphs"` backend (no Inductor) are slower here (LLaDA-8B shape, one H200, batch 1: 148
against 130 and 51 tokens/s, benchmarks/RESULTS.md). The decoder layers go through one compiled graph per
shape (`CompiledStaticForward`, regional compilation: compiling does not grow with the depth). Capture needs
the same shapes every step and no host syncs or data-dependent Python inside the graph, so the compiled
sampler differs from the eager one in how it calls the model only:

- the batch stays whole (finished rows still go through the forward; their commits are masked),
- without a cache the query is the whole canvas; with the dual cache it is the block (keys: the whole
  canvas), with the prefix cache the block and everything after it (one graph per block: its width
  changes), and the cache's refresh at a block start is a whole-canvas forward,
- cached keys / values are spliced in with `index_copy_` at tensor-valued slots (no Python int that
  would specialise the graph per block), in place: a window step writes its fresh keys / values into the
  cache (every later step recomputes those slots before it reads them, so the tokens are the same) instead of
  copying the whole canvas' keys / values per layer; out of place under Inductor's own CUDA graphs
  ("reduce-overhead"), which skip graphs that mutate an input. The refreshed keys / values are returned and
  copied into the cache outside the graph,
- the LM head runs on the window's positions through `index_select` (static width).

Tokens equal the eager sampler's (tests, CPU); only bidirectional models' caches and the uncached
sampler of every attention mode are supported (the exact block-model cache recomputes a per-row
span of changing width).
"""

from __future__ import annotations

import warnings
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


def is_compile_choice(value) -> bool:
    """A valid `compile` field: a bool, None or a key of COMPILE_CHOICES (a dict or list is not, without a TypeError)."""
    return value is None or isinstance(value, bool) or (isinstance(value, str) and value in COMPILE_CHOICES)


def resolve_compile(value, device: torch.device) -> str | None:
    """The `compile` field -> a key of COMPILE_CHOICES or None (eager)."""
    if value is None or value is False:
        return None
    if value is True:
        return "default"  # on CUDA with hf-dlm's CUDA graphs around Inductor's kernels (StepGraphs)
    if not is_compile_choice(value):
        raise ValueError(f"DLMGenerationConfig.compile must be a bool or one of {tuple(COMPILE_CHOICES)}, "
                         f"got {value!r}")
    return value


class _SplicedKV:
    """Duck-types the `kv_cache` argument of `DLMAttention`: returns the cached keys / values with the
    query slots replaced (in the cache itself with `in_place`, else in a copy) and remembers the fresh ones."""

    def __init__(self, past, slots, in_place: bool = False):
        self.past, self.slots, self.in_place, self.fresh = past, slots, in_place, []

    def update(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor):
        self.fresh.append((key, value))
        if self.past is None:
            return key, value
        cached_key, cached_value = self.past[0][layer_idx], self.past[1][layer_idx]
        if self.in_place:  # a scatter of the window's slots; out of place copies every slot of the canvas
            return (cached_key.index_copy_(2, self.slots, key.to(cached_key.dtype)),
                    cached_value.index_copy_(2, self.slots, value.to(cached_value.dtype)))
        return (cached_key.index_copy(2, self.slots, key.to(cached_key.dtype)),
                cached_value.index_copy(2, self.slots, value.to(cached_value.dtype)))


def static_forward(model, input_ids, position_ids, key_padding, key_position_ids, head_index, past=None, slots=None,
                   return_kv: bool = False, in_place: bool = False):
    """One sampler forward with static shapes.

    input_ids / position_ids (b, Q): the query slots; key_padding / key_position_ids (b, K): the whole
    canvas (1 = real token); head_index (W,): the query offsets whose logits are wanted; past: per layer
    (key, value) (b, nkv, K, hd) of the whole canvas, or None when the query is the whole canvas;
    slots (Q,): the canvas slots of the query; in_place: the query's fresh keys / values written into `past`
    (see the module docstring). -> logits (b, W, V) [, keys (n_layers, b, nkv, Q, hd), values (same)]."""
    cache = _SplicedKV(past, slots, in_place)
    # queries are the last Q keys: exact for the whole canvas and the prefix cache; for the dual cache's
    # window the offset only reaches the self-clause of padded queries, and its queries are never padding
    hidden_states = model.model.forward_window(input_ids, None, position_ids, key_padding, key_position_ids, cache)
    logits = model.lm_head(hidden_states.index_select(1, head_index))
    if not return_kv:
        return logits
    return logits, torch.stack([k for k, _ in cache.fresh]), torch.stack([v for _, v in cache.fresh])


_COMPILED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> {choice: compiled function}


class _LayerSplicedKV(_SplicedKV):
    """`_SplicedKV` over one layer's cache, whatever the layer's index (the compiled layer reads none)."""

    def update(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor):
        return super().update(0, key, value)


def _static_layers(layers, hidden_states, mask, position_embeddings, past_keys, past_values, slots, in_place):
    """Consecutive decoder layers of `static_forward` -> (hidden states, their fresh keys, their fresh values)."""
    keys, values = [], []
    for i, layer in enumerate(layers):
        past = None if past_keys is None else ([past_keys[i]], [past_values[i]])
        cache = _LayerSplicedKV(past, slots, in_place)
        hidden_states = layer(hidden_states, attention_mask=mask, position_embeddings=position_embeddings,
                              kv_cache=cache)
        keys.append(cache.fresh[0][0])
        values.append(cache.fresh[0][1])
    return hidden_states, keys, values


# decoder layers per compiled graph (`CompiledStaticForward`). More than one lets Inductor fuse across a layer
# boundary (a layer's closing residual add into the next layer's norm: one kernel less a boundary) for a compile
# that many times a layer's; 1 keeps compiling independent of the depth
LAYERS_PER_GRAPH = 1


class CompiledStaticForward:
    """`static_forward` with the decoder layers through one compiled function (regional compilation), a group of
    `layers_per_graph` at a time: the identical groups share a graph per shape, so compiling does not grow with
    the depth (the whole forward as one graph compiled every layer: ~50 s for the LLaDA-8B shape's two shapes on
    an H200). Embeddings, mask, norm and LM head run eagerly around it; on CUDA the whole step is still one CUDA
    graph (`StepGraphs`)."""

    def __init__(self, layers_per_graph: int = 1, **compile_options):
        if layers_per_graph < 1:
            raise ValueError(f"layers_per_graph must be >= 1, got {layers_per_graph}")
        self.layers_per_graph = layers_per_graph
        self.layer_step = torch.compile(_static_layers, dynamic=False, **compile_options)

    def __call__(self, model, input_ids, position_ids, key_padding, key_position_ids, head_index, past=None,
                 slots=None, return_kv: bool = False, in_place: bool = False):
        fresh, layers, group = [], model.model.layers, self.layers_per_graph

        def run_layer(i, layer, hidden_states, mask, position_embeddings):
            # `forward_window` hands each layer the previous one's output: the first layer of a group runs the
            # group, the others pass its output on
            if i % group:
                return hidden_states
            members = tuple(layers[i : i + group])
            past_keys, past_values = (None, None) if past is None else (tuple(past[0][i : i + group]),
                                                                        tuple(past[1][i : i + group]))
            hidden_states, keys, values = self.layer_step(members, hidden_states, mask, position_embeddings,
                                                          past_keys, past_values, slots, in_place)
            fresh.extend(zip(keys, values))
            return hidden_states

        hidden_states = model.model.forward_window(input_ids, None, position_ids, key_padding, key_position_ids, None,
                                                   run_layer=run_layer)
        logits = model.lm_head(hidden_states.index_select(1, head_index))
        if not return_kv:
            return logits
        return logits, torch.stack([k for k, _ in fresh]), torch.stack([v for _, v in fresh])


def compiled_forward(model, choice: str):
    """`static_forward` compiled with COMPILE_CHOICES[choice] (`CompiledStaticForward`, `LAYERS_PER_GRAPH`
    layers a graph), kept per model (weakly: not an attribute, so copying or saving the model never meets it)."""
    store = _COMPILED.setdefault(model, {})
    key = (choice, LAYERS_PER_GRAPH)
    if key not in store:
        store[key] = CompiledStaticForward(LAYERS_PER_GRAPH, **COMPILE_CHOICES[choice])
    return store[key]


# plain forwards before a capture. A shape is captured at its second sight (`StepGraphs`), so its first forward
# already compiled it and built its cuDNN plans. Two warm-ups cost two forwards of that shape, which a shape that
# recurs a few times never earned back: an engine step where a group of rows starts a block (7 times in a
# 256-token answer, 2-10x a window step's tokens). H100, LLaDA-8B engine, 64 HTTP clients: 0.92 of the engine
# alone with 2 warm-ups, 0.966 with none (benchmarks/RESULTS.md). A capture that fails retries with
# FALLBACK_WARMUPS
CAPTURE_WARMUPS = 0
FALLBACK_WARMUPS = 2


def _fresh(tensors: dict) -> dict:
    return {name: None if t is None else t.clone(memory_format=torch.contiguous_format) for name, t in tensors.items()}


class CapturedStep:
    """A sampler forward of one static shape captured as a CUDA graph.

    forward: `static_forward` (eager kernels: the eager sampler's cached window step) or its Inductor-compiled
    form (`generate(compile=...)` without Inductor's own CUDA graphs). At 8B and batch 1 an eager window
    step launches ~1,400 small kernels whose host-side cost is several times the GPU work (H200, LLaDA-8B
    shape: 42.6 ms per eager window step, 10.3 ms replayed, benchmarks/RESULTS.md); a graph replays them in
    one launch. `tensors` are copied into the graph's static input buffers before each replay; `fixed`
    arguments (the model, the cache's keys / values, flags) are read in place, so a cache refreshed in
    place is seen by later replays. The outputs are cloned (the next replay overwrites them).

    pool: a memory pool shared with the other graphs of a `StepGraphs` (`torch.cuda.graph_pool_handle()`).
    warmups: plain forwards on a side stream before the capture (compilation, cuBLAS / cuDNN workspaces;
    `StepGraphs` passes `CAPTURE_WARMUPS`)."""

    def __init__(self, forward, tensors: dict, fixed: dict, pool=None, warmups: int = 0):
        self.forward, self.fixed = forward, fixed
        self.inputs = _fresh(tensors)
        if warmups:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up outside the graph: compilation, cuBLAS / cuDNN workspaces
                for _ in range(warmups):
                    self.forward(**self.inputs, **self.fixed)
            torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.outputs = self.forward(**self.inputs, **self.fixed)

    def __call__(self, tensors: dict):
        for name, t in tensors.items():
            if t is not None:
                self.inputs[name].copy_(t)
        self.graph.replay()
        if isinstance(self.outputs, tuple):
            return tuple(t.clone() for t in self.outputs)
        return self.outputs.clone()


class StepGraphs:
    """The sampler's CUDA graphs, one per static shape, captured the second time a shape is seen (one-off
    shapes never pay for a capture). Used by the eager sampler's cached window step and by the compiled
    sampler when Inductor runs without CUDA graphs of its own. `enabled` False (or a failed capture) runs
    `forward` plainly."""

    def __init__(self, model, enabled: bool):
        self.model, self.enabled, self.graphs = model, enabled, {}
        self.captured = 0  # graphs captured so far (a capture records the forward once, after CAPTURE_WARMUPS)
        self.captured_shapes: list[dict] = []  # each capture's input shapes, in order (what a warm-up missed)
        # one memory pool for every graph, as vLLM shares one across its captured sizes: a graph's intermediates
        # are dead once its replay's outputs are cloned, and the graphs replay one at a time on one stream. With a
        # pool each, 60 captured shapes of the 8B engine held 21 GiB (an H100 ran out of memory)
        self.pool = None
        # plain calls get the graph's kind of inputs (separate contiguous buffers) only where a capture can
        # follow: else Dynamo's guards (aliasing, e.g. positions passed twice; strides) compile another graph
        self.fresh_inputs = enabled

    def __call__(self, forward, tensors: dict, **fixed):
        fixed["model"] = self.model
        key = (id(forward), *((name, None if t is None else tuple(t.shape)) for name, t in tensors.items()),
               *sorted((name, value) for name, value in fixed.items() if isinstance(value, (bool, int))))
        step = self.graphs.get(key)
        if step is None and self.enabled:
            if key in self.graphs:
                step = self.graphs[key] = self._capture(forward, tensors, fixed)
                self.captured += step is not None
                if step is not None:
                    self.captured_shapes.append({name: list(t.shape) for name, t in tensors.items() if t is not None})
            else:
                self.graphs[key] = None
        if step is not None:
            return step(tensors)
        return forward(**(_fresh(tensors) if self.fresh_inputs else tensors), **fixed)

    def _capture(self, forward, tensors, fixed):
        """A `CapturedStep`, or None (plain forwards from now on, said once) if no attempt captures. A failed
        capture is retried with warm-up forwards first (`CAPTURE_WARMUPS` may be 0), then without cuDNN's SDPA,
        which has failed under capture where flash did not (the backends only matter while capturing: replays run
        the recorded kernels)."""
        config = self.model.config
        backends = list(getattr(config, "sdpa_backends", None) or [])
        attempts = [(backends, CAPTURE_WARMUPS)]
        if CAPTURE_WARMUPS < FALLBACK_WARMUPS:
            attempts.append((backends, FALLBACK_WARMUPS))
        if "cudnn" in backends:
            attempts.append(([b for b in backends if b != "cudnn"], FALLBACK_WARMUPS))
        for attempt, warmups in attempts:
            try:
                config.sdpa_backends = attempt
                if self.pool is None:
                    self.pool = torch.cuda.graph_pool_handle()
                return CapturedStep(forward, tensors, fixed, self.pool, warmups=warmups)
            except RuntimeError as error:
                failure = error
            finally:
                config.sdpa_backends = backends
        warnings.warn(f"generate: the sampler's forward could not be captured as a CUDA graph ({failure}); running "
                      "it without", stacklevel=4)
        self.enabled = False
        return None


__all__ = ["CAPTURE_WARMUPS", "COMPILE_CHOICES", "FALLBACK_WARMUPS", "LAYERS_PER_GRAPH", "MAX_COMPILED_GRAPHS",
           "CapturedStep", "CompiledStaticForward", "StepGraphs", "compiled_forward", "resolve_compile",
           "static_forward"]
