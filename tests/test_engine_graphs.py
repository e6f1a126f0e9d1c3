"""The engine's captured steps over a long run: with the slot storage preallocated (max_batch_size lanes x the
model's positions, the default when the step is captured as CUDA graphs) it never grows, so each bucketed shape
is captured once, and the replays read the live storage (tokens equal generate alone). Graphs are emulated on CPU
(`EmulatedGraph`: inputs copied into capture-time buffers, the storage seen at capture read in place)."""

import pytest
import torch

from hf_dlm.serving.engine import ContinuousBatchingEngine, GenerationRequest

from tests.utils import EmulatedGraph, eager_commit, emulate_step_graphs, tiny_model


def long_run(model, preallocate: bool):
    """One row alone to its end, rows of growing canvases (up to the model's 96 positions) arriving one per two
    steps, with and without the dual cache, then the first row's twin alone (the first shapes again)
    -> (engine, the cases (prompt, options, request), graphs captured before the twin)."""
    engine = ContinuousBatchingEngine(model, max_batch_size=3, compile="eager", preallocate=preallocate)
    generator = torch.Generator().manual_seed(3)
    shapes = [(4, 8, "none"), (6, 16, "dual"), (5, 24, "none"), (9, 32, "dual"), (3, 48, "none"), (7, 80, "dual"),
              (4, 16, "dual"), (6, 8, "none")]
    cases = []
    for length, new, cache in shapes:
        ids = torch.randint(0, 90, (length,), generator=generator).tolist()
        options = dict(max_new_tokens=new, block_length=8, steps=new, cache=cache, stop_on_eos=False)
        cases.append((ids, options, GenerationRequest(ids, engine.sampling_params(**options))))
    first_ids, first_options, first = cases[0]
    engine.submit([first])
    engine.run_until_idle()
    for _, _, request in cases[1:]:
        engine.submit([request])
        engine.step()
        engine.step()
    engine.run_until_idle()
    twin, captured = GenerationRequest(first_ids, engine.sampling_params(**first_options)), len(EmulatedGraph.captures)
    engine.submit([twin])
    engine.run_until_idle()
    return engine, cases + [(first_ids, first_options, twin)], captured


@pytest.mark.parametrize("preallocate", [True, False])
def test_preallocated_storage_captures_each_shape_once_in_a_long_run(monkeypatch, preallocate):
    model = tiny_model("sdpa", eos_token_id=5, max_position_embeddings=96)
    captures = emulate_step_graphs(monkeypatch)
    engine, cases, before_twin = long_run(model, preallocate)
    shapes, replays = [graph.shapes for graph in captures], sum(graph.replays for graph in captures)
    pools = [graph.pool for graph in captures]  # before generate below captures graphs of its own
    for ids, options, request in cases:  # replays read the storage the rows live in
        out = model.generate(torch.tensor([ids]), **options)
        assert request.generated == out[0, len(ids):].tolist(), options
    assert replays > 2 * len(shapes)
    assert engine.stats["graph_captures"] == len(shapes)  # /metrics' hf_dlm_graph_captures_total
    if preallocate:  # each capture's input shapes, in capture order (the benchmark reports the ones a warm-up missed)
        expected = [{name: list(size) for name, size in shape if size is not None} for shape in shapes]
        assert engine.graphs.captured_shapes == expected
        assert len(set(shapes)) == len(shapes)  # every shape captured once
        # one memory pool for all of them (a pool each held 21 GiB for 60 shapes of the 8B engine on an H100)
        assert pools[0] is not None and all(pool is pools[0] for pool in pools)
        assert len(shapes) == before_twin  # the twin replays the first row's graphs
        assert (engine.storage.lanes, engine.storage.capacity) == (3, 128)  # 96 rounded up to 64s, never grown
    else:  # the storage grew (more lanes, longer canvases): shapes seen before were captured again
        assert len(set(shapes)) < len(shapes)


def test_preallocation_needs_a_length_and_refuses_longer_requests():
    model = tiny_model("sdpa", max_position_embeddings=96)
    engine = ContinuousBatchingEngine(model, max_batch_size=2, max_length=40, preallocate=True)
    assert (engine.storage.lanes, engine.storage.capacity) == (2, 64)
    with pytest.raises(ValueError, match="max_length"):
        engine.submit([GenerationRequest([1] * 10, engine.sampling_params(max_new_tokens=32, block_length=8))])
    with pytest.raises(ValueError, match="max_length"):
        ContinuousBatchingEngine(model, max_length=200)
    assert ContinuousBatchingEngine(model).storage.lanes == 0  # on CPU, eager: the storage grows as rows need


def test_compiled_step_compiles_once_across_row_counts_and_phases(monkeypatch):
    # rows alone and joined, refresh and window steps, cached and uncached rows: one Dynamo graph (dynamic sizes).
    # Each recompile is a whole-model Inductor compile (minutes at 8B): duck sizing would have turned equal sizes
    # (rows and lanes, queries and LM-head columns) into guards, and a single row into a case of its own
    from torch._dynamo.utils import counters

    eager_commit(monkeypatch)  # the step's graphs alone (the commit's own are tested in test_commit_rules.py)

    torch._dynamo.reset()
    counters.clear()
    model = tiny_model("sdpa", eos_token_id=5, max_position_embeddings=96)
    engine, cases, _ = long_run(model, preallocate=True)
    for ids, options, request in cases:
        assert request.generated == model.generate(torch.tensor([ids]), **options)[0, len(ids):].tolist(), options
    assert engine.stats["forward_passes"] > 40
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def test_warmup_compiles_the_step_before_traffic_and_leaves_the_counters():
    # `hf-dlm serve --compile` warms the engine up before it listens: the first client must not wait for the
    # compiler (minutes at 8B). After warmup() the requests of a long run (rows alone and joined, refresh and
    # window steps, cached and uncached, each remasking rule in the compiled commit, greedy or sampled) compile
    # nothing, and their tokens still equal generate alone
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = tiny_model("sdpa", eos_token_id=5, max_position_embeddings=96)
    engine = ContinuousBatchingEngine(model, max_batch_size=3, compile="eager", preallocate=True)
    held = engine.stats  # as the server's /metrics holds it
    done = engine.warmup()
    assert engine.stats is held
    warm = counters["stats"]["unique_graphs"]
    assert warm > 1 and done["forwards"] >= 2 and done["seconds"] > 0  # the step's graph and the commit's
    assert engine.stats["forward_passes"] == engine.stats["requests_finished"] == engine.stats["engine_steps"] == 0
    assert not engine.has_work() and engine.storage.lanes == 3
    requests = []
    for length, cache, remasking, temperature in ((4, "none", "margin", 0.0), (7, "dual", "entropy", 0.0),
                                                  (5, "prefix", "low_confidence", 0.0), (6, "dual", "margin", 0.7)):
        ids = list(range(10, 10 + length))
        options = dict(max_new_tokens=16, block_length=8, steps=16, cache=cache, stop_on_eos=False,
                       remasking=remasking, temperature=temperature)
        requests.append((ids, options, GenerationRequest(ids, engine.sampling_params(**options, seed=3))))
        engine.submit([requests[-1][2]])
        engine.step()
    engine.run_until_idle()
    assert counters["stats"]["unique_graphs"] == warm, dict(counters["stats"])
    for ids, options, request in requests:  # the sampled request draws from its seed, as generate's generator
        alone = model.generate(torch.tensor([ids]), **options, generator=torch.Generator().manual_seed(3))
        assert request.generated == alone[0, len(ids):].tolist(), options
    assert engine.stats["requests_finished"] == 4
    engine.start()
    with pytest.raises(RuntimeError, match="before start"):
        engine.warmup()
    engine.shutdown(timeout=10)


def test_compiled_step_sees_the_slot_storage_static_and_the_step_sizes_dynamic():
    # the storage's sizes are fixed while its graphs live: static to the compiler they spare it a few symbols
    # per layer (a 28-layer step compiled in 197 s instead of 442 s, benchmarks/RESULTS.md); the step's own
    # tensors stay dynamic (one graph for every batch and phase)
    from hf_dlm.generation.slot_cache import CompiledRaggedForward

    torch._dynamo.reset()
    shapes = {}

    def recording_backend(graph_module, example_inputs):
        for node in graph_module.graph.nodes:
            if node.op == "placeholder" and isinstance(node.meta.get("example_value"), torch.Tensor):
                # a symbolic size compares equal to its hint: keep plain ints only, symbols as their names
                shapes[node.name] = tuple(d if type(d) is int else str(d) for d in node.meta["example_value"].shape)
        return graph_module.forward

    model = tiny_model("sdpa", eos_token_id=5, max_position_embeddings=96)
    engine = ContinuousBatchingEngine(model, max_batch_size=3, compile="eager", preallocate=True)
    engine.compiled = CompiledRaggedForward(backend=recording_backend)
    engine.warmup()
    # the layer step's storage inputs: one layer's keys and values
    assert shapes["l_keys_"] == shapes["l_values_"] == (3, 129, 2, 8), shapes  # lanes, slots + trash, heads, size
    assert isinstance(shapes["l_token_slot_"][0], str) and isinstance(shapes["l_mask_"][0], str)  # symbols


def test_the_compiled_step_traces_one_layer_whatever_the_depth(monkeypatch):
    # regional compilation: the decoder layers share one graph, so the compiler's work (minutes for a 28-layer
    # dynamic-size step) does not grow with the depth. Tokens equal generate alone.
    from torch._dynamo.utils import counters

    eager_commit(monkeypatch)  # the step's graphs alone (the commit's own are tested in test_commit_rules.py)

    traced = []
    for layers in (2, 4):
        torch._dynamo.reset()
        counters.clear()
        model = tiny_model("sdpa", eos_token_id=5, max_position_embeddings=96, num_hidden_layers=layers)
        engine = ContinuousBatchingEngine(model, max_batch_size=3, compile="eager", preallocate=True)
        engine.warmup()
        ids, options = [3, 4, 5, 6], dict(max_new_tokens=8, block_length=4, steps=8, cache="dual", stop_on_eos=False)
        request = GenerationRequest(ids, engine.sampling_params(**options))
        engine.submit([request])
        engine.run_until_idle()
        assert request.generated == model.generate(torch.tensor([ids]), **options)[0, len(ids):].tolist()
        traced.append((counters["stats"]["unique_graphs"], counters["stats"]["calls_captured"]))
    assert traced[0] == traced[1], traced  # the same graphs at 2 and 4 layers
    assert traced[0][0] == 1, traced


def test_a_compiled_moe_step_does_not_recompile_as_the_routing_changes():
    # the experts' loop (CPU, fp32) reads each expert's row count on the host: traced, every count of 0, 1 or
    # more would be a guard of its own and each new routing a recompile (a 2-layer model grew from 9 to 14
    # graphs over four rounds of requests). It runs eagerly between the compiled pieces instead.
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = tiny_model("sdpa", eos_token_id=5, max_position_embeddings=96, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=16)
    engine = ContinuousBatchingEngine(model, max_batch_size=3, compile="eager", preallocate=True)
    engine.warmup()
    graphs = []
    for round_ in range(3):
        cases = []
        for row in range(3):
            ids = list(range(10 + round_, 13 + round_ + row))
            options = dict(max_new_tokens=8, block_length=4, steps=8, cache="dual", stop_on_eos=False)
            cases.append((ids, options, GenerationRequest(ids, engine.sampling_params(**options))))
        engine.submit([request for _, _, request in cases])
        engine.run_until_idle()
        for ids, options, request in cases:
            assert request.generated == model.generate(torch.tensor([ids]), **options)[0, len(ids):].tolist()
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] == graphs[1] == graphs[2], graphs


@pytest.mark.parametrize("threshold", [None, 0.5])
def test_budget_steps_read_nothing_back_per_step(monkeypatch, threshold):
    # a budget rule's block ends on its step count: the engine reads nothing back per step, only at a block end
    # (the block's tokens), so the host queues the next step while the device runs one. A threshold row's block
    # ends on its masks: one read per step. Tokens equal generate alone either way.
    from tests.utils import count_host_reads

    model = tiny_model("sdpa", eos_token_id=5)
    counts = {}
    for steps in (8, 16):
        options = dict(max_new_tokens=16, block_length=8, steps=steps, cache="dual", stop_on_eos=False,
                       threshold=threshold)
        engine = ContinuousBatchingEngine(model, max_batch_size=2)
        cases = [(ids, GenerationRequest(ids, engine.sampling_params(**options))) for ids in ([3, 4, 5], [6, 7, 8, 9])]
        engine.submit([request for _, request in cases])
        engine.step()  # the first step: storage, plan
        reads = []
        with monkeypatch.context() as patch:
            count_host_reads(patch, reads)
            engine.run_until_idle()
        counts[steps] = (len(reads), engine.stats["engine_steps"])
        for ids, request in cases:
            assert request.generated == model.generate(torch.tensor([ids]), **options)[0, len(ids):].tolist()
    if threshold is None:
        assert counts[8][0] == counts[16][0] and counts[8][1] < counts[16][1], counts
    else:  # threshold 0.5 on a random model: about one token a step, a read each
        assert counts[16][0] >= counts[16][1] - 1, counts


@pytest.mark.parametrize("defer", [True, False])
def test_block_ends_are_read_after_the_next_step_is_queued(defer):
    # requests that arrive apart end their blocks on staggered steps: reading a block's tokens at once would make the
    # host wait for the device almost every step. On a GPU the engine reads them at the next step, after queuing its
    # forward; a row that stops there ran one step of its next block, whose tokens are dropped. On a CPU (nothing
    # runs ahead) it reads them at once.
    model = tiny_model("sdpa", eos_token_id=5)
    engine = ContinuousBatchingEngine(model, max_batch_size=2)
    assert not engine.defer_block_reads  # the CPU's default
    engine.defer_block_reads = defer
    options = dict(max_new_tokens=16, block_length=4, steps=16, stop_on_eos=False)
    read_at = []
    streamed = GenerationRequest([3, 4, 5], engine.sampling_params(**options),
                                 on_block=lambda request, tokens: read_at.append(engine.stats["forward_passes"]))
    stopped = GenerationRequest([6, 7, 8, 9], engine.sampling_params(**options),
                                stop_check=lambda generated: len(generated) >= 4)
    engine.submit([streamed, stopped])
    engine.run_until_idle()
    # block k ends at forward 4k; deferred, it is read during the next forward, the last one as the engine empties
    assert read_at == ([5, 9, 13, 16] if defer else [4, 8, 12, 16])
    assert streamed.generated == model.generate(torch.tensor([[3, 4, 5]]), **options)[0, 3:].tolist()
    assert stopped.finish_reason == "stop"
    assert stopped.generated == model.generate(torch.tensor([[6, 7, 8, 9]]), **options)[0, 4:8].tolist()
    assert (engine.stats["forward_passes"], engine.stats["forward_rows"]) == (16, 16 + 4 + defer)
    for request in (streamed, stopped):  # a request's times, in order
        assert request.submitted_at <= request.admitted_at <= request.first_block_at <= request.finished_at
