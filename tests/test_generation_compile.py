"""generate(compile=...): the static-shape sampler (whole batch, block-sized windows, spliced caches) gives
exactly the eager sampler's tokens, traced by Dynamo ('eager' backend: fast) and compiled by Inductor."""

import warnings

import pytest
import torch

from hf_dlm.generation import compiled_step as generation_compile
from hf_dlm.generation.configuration import DLMGenerationConfig

from tests.utils import eager_commit, emulate_step_graphs, tiny_model
from tests.utils import count_host_reads, left_padded

GEN = dict(max_new_tokens=16, block_length=8, steps=16, temperature=0.0)


def confident_model(mode="bidirectional", alignment="same", **overrides):
    model = tiny_model(attention_mode=mode, label_alignment=alignment, attn_implementation="sdpa",
                       **({"block_size": 4} if mode == "block" else {}), **overrides)
    with torch.no_grad():  # sharpen the head so threshold decoding commits several tokens at some steps
        model.lm_head.weight.mul_(40)
    return model


@pytest.mark.parametrize("cache,threshold,alignment,cfg_scale,lengths", [
    ("none", None, "same", 0.0, [5, 9, 3]), ("none", 0.5, "shift", 0.0, [5, 9, 3]), ("dual", 0.5, "same", 0.0, [5, 9, 3]),
    ("dual", 0.5, "shift", 0.0, [5, 9, 3]), ("prefix", 0.5, "same", 0.0, [5, 9, 3]), ("dual", None, "same", 1.5, [5, 9, 3]),
    ("dual", 0.5, "same", 0.0, [7, 7, 7]),  # no padding
])
def test_traced_static_sampler_equals_eager_on_a_mixed_length_batch(cache, threshold, alignment, cfg_scale, lengths):
    model = confident_model(alignment=alignment, eos_token_id=3)
    _, input_ids, attention_mask = left_padded(lengths)
    options = dict(GEN, cache=cache, threshold=threshold, cfg_scale=cfg_scale, return_dict_in_generate=True)
    eager = model.generate(input_ids, attention_mask=attention_mask, **options)
    traced = model.generate(input_ids, attention_mask=attention_mask, compile="eager", **options)
    assert torch.equal(traced.sequences, eager.sequences)
    # static shapes: every forward runs the whole batch (CFG doubles it), never fewer rows
    assert set(traced.forward_batch_sizes) == {3 * (2 if cfg_scale else 1)}
    assert len(traced.forward_batch_sizes) == len(eager.forward_batch_sizes)


def test_prefix_cache_with_many_blocks_stays_compiled():
    # one graph per block (the prefix cache's query width changes): 12 blocks pass Dynamo's default
    # limit of 8 graphs, after which it would silently fall back to eager
    from torch._dynamo.utils import counters

    model = confident_model()
    _, input_ids, attention_mask = left_padded([5, 9])
    options = dict(max_new_tokens=48, block_length=4, steps=48, temperature=0.0, cache="prefix", threshold=0.5)
    counters.clear()
    traced = model.generate(input_ids, attention_mask=attention_mask, compile="eager", **options)
    assert counters["stats"]["unique_graphs"] > 8 and counters["frames"]["total"] == counters["frames"]["ok"]
    assert torch.equal(traced, model.generate(input_ids, attention_mask=attention_mask, **options))


def test_block_attention_model_compiles_uncached_and_rejects_its_exact_cache():
    model = confident_model(mode="block")
    _, input_ids, attention_mask = left_padded([6, 2, 4], seed=3)
    eager = model.generate(input_ids, attention_mask=attention_mask, **GEN, threshold=0.5)
    traced = model.generate(input_ids, attention_mask=attention_mask, **GEN, threshold=0.5, compile="eager")
    assert torch.equal(traced, eager)
    with pytest.raises(ValueError, match="exact cache"):
        model.generate(input_ids, attention_mask=attention_mask, **GEN, cache="dual", compile="eager")


def test_inductor_compiled_sampler_equals_eager_and_reuses_its_graphs():
    torch._dynamo.reset()
    model = confident_model()
    _, input_ids, attention_mask = left_padded([5, 9, 3])
    options = dict(GEN, threshold=0.5, cache="dual")
    eager = model.generate(input_ids, attention_mask=attention_mask, **options)
    compiled = model.generate(input_ids, attention_mask=attention_mask, compile=True, **options)  # CPU: mode default
    assert torch.equal(compiled, eager)
    assert generation_compile._COMPILED[model].keys() == {("default", 1)}  # (choice, layers a graph)
    # two graphs (the block-start refresh and the block window) serve every block and later calls
    counters = torch._dynamo.utils.counters
    frames = counters["stats"]["unique_graphs"]
    again = model.generate(input_ids, attention_mask=attention_mask, compile=True, **options)
    assert torch.equal(again, eager) and counters["stats"]["unique_graphs"] == frames


def test_compile_option_is_validated_and_saved(tmp_path):
    for bad in ("fast", {"backend": "eager"}, ["eager"]):  # a dict or list is refused by name, not a TypeError
        with pytest.raises(ValueError, match="compile"):
            DLMGenerationConfig.from_any(None, compile=bad)
        with pytest.raises(ValueError, match="compile"):
            generation_compile.resolve_compile(bad, torch.device("cpu"))
    config = DLMGenerationConfig(compile="cudagraphs")
    config.save_pretrained(tmp_path)
    assert DLMGenerationConfig.from_pretrained(tmp_path).compile == "cudagraphs"
    assert generation_compile.resolve_compile(True, torch.device("cpu")) == "default"
    assert generation_compile.resolve_compile(True, torch.device("cuda")) == "default"  # + hf-dlm's CUDA graphs
    assert generation_compile.resolve_compile(False, torch.device("cpu")) is None


@pytest.fixture
def emulated_graphs(monkeypatch):
    """enable(): from then on every sampler's StepGraphs is enabled on CPU, capturing `EmulatedGraph`s."""
    return lambda: emulate_step_graphs(monkeypatch)


@pytest.mark.parametrize("warmups,fail_first,expected", [
    # no warm-ups first (the shape's first sight ran it plainly), then warm-ups, then without cuDNN
    (0, 3, [(["cudnn", "flash"], 0), (["cudnn", "flash"], 2), (["flash"], 2)]),
    (0, 1, [(["cudnn", "flash"], 0), (["cudnn", "flash"], 2)]),
    (0, 0, [(["cudnn", "flash"], 0)]),
    (2, 2, [(["cudnn", "flash"], 2), (["flash"], 2)]),  # warm-ups already: no second try with them
])
def test_a_failed_capture_is_retried_with_warmups_then_without_cudnn(monkeypatch, warmups, fail_first, expected):
    model = tiny_model("sdpa")
    model.config.sdpa_backends = ["cudnn", "flash"]
    tried = []

    class Capture:
        def __init__(self, forward, tensors, fixed, pool=None, warmups=None):
            tried.append((list(model.config.sdpa_backends), warmups))
            if len(tried) <= fail_first:
                raise RuntimeError("operation not permitted when stream is capturing")

        def __call__(self, tensors):
            return "replayed"

    monkeypatch.setattr(generation_compile, "CapturedStep", Capture)
    monkeypatch.setattr(generation_compile, "CAPTURE_WARMUPS", warmups)
    monkeypatch.setattr(generation_compile.torch.cuda, "graph_pool_handle", object)
    graphs = generation_compile.StepGraphs(model, enabled=True)
    tensors = {"input_ids": torch.zeros(1, 4, dtype=torch.long)}
    forward = lambda model, input_ids: input_ids + 1  # noqa: E731
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outputs = [graphs(forward, tensors) for _ in range(3)]  # the second sight captures
    assert tried == expected
    assert model.config.sdpa_backends == ["cudnn", "flash"]  # restored after every try
    failed_all = fail_first >= len(expected)
    assert graphs.enabled is not failed_all and graphs.captured == (not failed_all)
    if failed_all:  # plain forwards from then on
        assert all(torch.equal(out, tensors["input_ids"] + 1) for out in outputs)
    else:
        assert torch.equal(outputs[0], tensors["input_ids"] + 1) and outputs[1:] == ["replayed", "replayed"]
    assert any("could not be captured" in str(w.message) for w in caught) is failed_all


@pytest.mark.parametrize("compile_choice", [None, "eager"])
def test_captured_steps_equal_plain_steps(emulated_graphs, compile_choice):
    # the eager sampler's window steps (None) and the compiled sampler's forwards ('eager': Dynamo-traced,
    # the path Inductor takes without CUDA graphs of its own) replayed from graphs: the refresh at each
    # block start must reach later replays through the cache, read in place
    model = confident_model()
    _, input_ids, _ = left_padded([7, 7])
    options = dict(max_new_tokens=24, block_length=8, steps=24, temperature=0.0, cache="dual")
    plain = model.generate(input_ids, **options)
    captures = emulated_graphs()
    captured = model.generate(input_ids, compile=compile_choice, **options)
    assert torch.equal(captured, plain)
    # one graph per shape, captured at its second sight: the window (and, compiled, the block refresh)
    expected = 1 if compile_choice is None else 2
    assert len(captures) == expected
    window = captures[0]  # the window's second sight comes before the refresh's (the next block's start)
    assert window.replays == 3 * (8 - 1) - 1  # 7 window steps a block; the first plain, then captured
    if compile_choice is not None:
        assert captures[1].replays == 3 - 1  # the refresh at each of the 3 block starts


@pytest.mark.parametrize("compile_choice", [None, "eager"])
@pytest.mark.parametrize("cache,threshold,cfg_scale,lengths", [
    ("prefix", None, 0.0, [7, 7]),  # the prefix cache's window narrows every block: one graph per block
    ("dual", 0.5, 0.0, [5, 9, 3]),  # threshold decoding, left padding (a mask in every forward)
    ("dual", None, 1.5, [7, 7]),  # classifier-free guidance: the unconditional copy in the same graph
])
def test_captured_steps_equal_plain_steps_in_every_cached_mode(emulated_graphs, compile_choice, cache, threshold,
                                                             cfg_scale, lengths):
    model = confident_model()
    _, input_ids, attention_mask = left_padded(lengths)
    options = dict(max_new_tokens=24, block_length=8, steps=24, temperature=0.0, cache=cache, threshold=threshold,
                   cfg_scale=cfg_scale)
    plain = model.generate(input_ids, attention_mask=attention_mask, **options)
    captures = emulated_graphs()
    captured = model.generate(input_ids, attention_mask=attention_mask, compile=compile_choice, **options)
    assert torch.equal(captured, plain)
    assert captures and sum(graph.replays for graph in captures) > 0


def test_step_graphs_key_on_shapes_and_flags(emulated_graphs):
    captures = emulated_graphs()
    graphs = generation_compile.StepGraphs(confident_model(), enabled=True)
    calls = []

    def forward(model, x, return_kv=False):
        calls.append(x.shape)
        return x * 2

    for x in [torch.ones(2), torch.ones(2), torch.ones(3), torch.ones(2) * 5]:
        out = graphs(forward, dict(x=x))
    assert torch.equal(out, torch.full((2,), 10.0)) and len(captures) == 1
    graphs(forward, dict(x=torch.ones(2)), return_kv=True)
    graphs(forward, dict(x=torch.ones(2)), return_kv=True)
    assert len(captures) == 2  # a flag is part of the key


def test_compiled_generate_traces_one_layer_whatever_the_depth(monkeypatch):
    # regional compilation (`CompiledStaticForward`): the decoder layers share one graph per step shape, so the
    # compile time (~50 s at 8B on an H200 for the whole forward) does not grow with the depth
    from torch._dynamo.utils import counters

    eager_commit(monkeypatch)  # the step's graphs alone (the commit's own are tested in test_commit_rules.py)

    _, input_ids, attention_mask = left_padded([5, 9])
    options = dict(max_new_tokens=8, block_length=4, steps=8, temperature=0.0, cache="dual")
    traced = []
    for layers in (2, 4):
        torch._dynamo.reset()
        counters.clear()
        model = tiny_model("sdpa", num_hidden_layers=layers)
        compiled = model.generate(input_ids, attention_mask=attention_mask, compile="eager", **options)
        assert torch.equal(compiled, model.generate(input_ids, attention_mask=attention_mask, **options))
        traced.append((counters["stats"]["unique_graphs"], counters["stats"]["calls_captured"]))
    assert traced[0] == traced[1] and traced[0][0] == 2, traced  # the refresh and the window step


@pytest.mark.parametrize("group", [2, 3])
def test_layers_compiled_in_groups_decode_the_same_tokens_with_a_graph_per_group_shape(monkeypatch, group):
    """`LAYERS_PER_GRAPH`: several decoder layers a compiled graph (Inductor may then fuse across a layer
    boundary). The tokens equal the eager sampler's, each layer's fresh keys / values reach the cache in order
    (a wrong order or a skipped layer changes the tokens), and equal groups share a graph: 4 layers in groups
    of 2 trace the refresh and the window step once each; groups of 3 add the last layer's group of 1."""
    from torch._dynamo.utils import counters

    from hf_dlm.generation import compiled_step

    eager_commit(monkeypatch)
    monkeypatch.setattr(compiled_step, "LAYERS_PER_GRAPH", group)
    _, input_ids, attention_mask = left_padded([5, 9])
    options = dict(max_new_tokens=8, block_length=4, steps=8, temperature=0.0, cache="dual")
    torch._dynamo.reset()
    counters.clear()
    model = tiny_model("sdpa", num_hidden_layers=4)
    compiled = model.generate(input_ids, attention_mask=attention_mask, compile="eager", **options)
    assert torch.equal(compiled, model.generate(input_ids, attention_mask=attention_mask, **options))
    assert compiled_step._COMPILED[model].keys() == {("eager", group)}
    assert counters["stats"]["unique_graphs"] == (2 if 4 % group == 0 else 4)


def test_the_compiled_steps_build_their_mask_without_reading_the_data(monkeypatch):
    # the mask is built outside the compiled layers, inside the step a CUDA graph captures: a shortcut that reads
    # the data (an all-real padding mask dropped for the mask-free kernel) is a host sync, which fails a capture
    from hf_dlm.modeling import masks, modeling_dlm

    padding = torch.ones(2, 6, dtype=torch.long)
    args = ("sdpa", "bidirectional", None, 2, 3, 6, torch.device("cpu"), torch.float32)
    assert masks.build_attention_mask(*args, attention_mask=padding) is None  # the eager shortcut
    mask = masks.build_attention_mask(*args, attention_mask=padding, capturable=True)
    assert mask.shape == (2, 1, 3, 6) and bool(mask.all())
    seen = []

    def recording(*args, **kwargs):
        seen.append(kwargs.get("capturable", False))
        return masks.build_attention_mask(*args, **kwargs)

    monkeypatch.setattr(modeling_dlm, "build_attention_mask", recording)
    _, input_ids, attention_mask = left_padded([5, 9])
    tiny_model("sdpa").generate(input_ids, attention_mask=attention_mask, compile="eager", max_new_tokens=8,
                                block_length=4, steps=8, cache="dual")
    assert seen and all(seen), seen


def test_compiled_budget_steps_read_nothing_back_per_step(monkeypatch):
    # under a budget rule the steps with work are known at the block start: a read per step (a host sync on a
    # GPU) would stop the host from queueing the next steps while the device runs one. The host reads of a
    # generate do not grow with its steps per block; the tokens equal the eager sampler's.
    model = tiny_model("sdpa", eos_token_id=5)
    _, input_ids, attention_mask = left_padded([5, 9])
    counts = {}
    for steps in (8, 16):
        options = dict(max_new_tokens=16, block_length=8, steps=steps, cache="dual", temperature=0.0)
        model.generate(input_ids, attention_mask=attention_mask, compile="eager", **options)  # compiles
        reads = []
        with monkeypatch.context() as patch:
            count_host_reads(patch, reads)
            compiled = model.generate(input_ids, attention_mask=attention_mask, compile="eager", **options)
        counts[steps] = len(reads)
        assert torch.equal(compiled, model.generate(input_ids, attention_mask=attention_mask, **options))
    assert counts[8] == counts[16], counts


def test_a_window_step_writes_its_keys_into_the_cache_in_place_with_the_logits_of_a_copy():
    # the dual cache's window step splices its fresh keys / values into the stored ones: in place (the compiled and
    # the captured steps) instead of copying every slot of the canvas per layer; the logits are the same, and the
    # cache then holds the window's fresh keys / values (the next step recomputes those slots before reading them)
    from hf_dlm.generation.compiled_step import CompiledStaticForward, static_forward

    model = tiny_model("sdpa")
    canvas = torch.randint(0, 90, (2, 12), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(12).repeat(2, 1)
    with torch.no_grad():
        _, keys, values = static_forward(model, canvas, positions, None, positions, torch.arange(12), return_kv=True)
        window = dict(input_ids=torch.randint(0, 90, (2, 4), generator=torch.Generator().manual_seed(1)),
                      position_ids=positions[:, 4:8], key_padding=None, key_position_ids=positions,
                      head_index=torch.arange(4), slots=torch.arange(4, 8), return_kv=True)
        copied = (keys.clone(), values.clone())
        expected, fresh_keys, fresh_values = static_forward(model, **window, past=copied)
        assert torch.equal(copied[0], keys) and torch.equal(copied[1], values)  # out of place: the cache unchanged
        for forward in (static_forward, CompiledStaticForward()):  # eager (captured) and compiled (Inductor) forms
            past = (keys.clone(), values.clone())  # stacked per layer, as the compiled sampler keeps it
            logits, _, _ = forward(model, **window, past=past, in_place=True)
            torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
            for stored, fresh, before in ((past[0], fresh_keys, keys), (past[1], fresh_values, values)):
                torch.testing.assert_close(stored[:, :, :, 4:8], fresh, rtol=1e-5, atol=1e-5)
                assert torch.equal(stored[:, :, :, :4], before[:, :, :, :4])
                assert torch.equal(stored[:, :, :, 8:], before[:, :, :, 8:])
                assert not torch.allclose(stored[:, :, :, 4:8], before[:, :, :, 4:8])
