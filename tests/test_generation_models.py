"""The samplers on tiny real DLMs: mixed-length batches equal row-by-row generation in every attention
mode and cache setting, exact caches equal the uncached sampler, and sampling is reproducible."""

import itertools

import pytest
import torch

from tests.utils import left_padded, tiny_model

GEN = dict(max_new_tokens=16, block_length=8, steps=8, temperature=0.0)


def model_for(mode, alignment="same"):
    return tiny_model(attention_mode=mode, label_alignment=alignment, **({"block_size": 4} if mode == "block" else {}))


@pytest.mark.parametrize("mode,cache,threshold,alignment", list(itertools.product(
    ["bidirectional", "causal", "block"], ["none", "prefix", "dual"], [None, 0.012], ["same", "shift"])))
def test_each_row_of_a_mixed_length_batch_equals_generating_it_alone(mode, cache, threshold, alignment):
    model = model_for(mode, alignment)
    prompts, input_ids, attention_mask = left_padded([5, 9, 3])
    options = dict(GEN, cache=cache, threshold=threshold)
    out = model.generate(input_ids, attention_mask=attention_mask, **options)
    width = input_ids.shape[1]
    for row, prompt in enumerate(prompts):
        alone = model.generate(prompt[None], **options)
        assert torch.equal(out[row, width - len(prompt) :], alone[0]), f"row {row} differs"


@pytest.mark.parametrize("mode,cache", [("bidirectional", "none"), ("bidirectional", "dual"), ("block", "dual")])
def test_rows_done_with_their_block_leave_the_forward_batch(mode, cache):
    model = model_for(mode)
    with torch.no_grad():  # confident, unequal rows: a random head's probabilities all sit near 1 / vocab
        model.lm_head.weight.mul_(40)
    _, input_ids, attention_mask = left_padded([5, 9, 3])
    shrank = False
    for threshold in (0.3, 0.5, 0.7, 0.9):  # where rows finish a block at different steps depends on the weights
        options = dict(GEN, cache=cache, threshold=threshold, return_dict_in_generate=True)
        out = model.generate(input_ids, attention_mask=attention_mask, **options)
        shrank |= min(out.forward_batch_sizes) < 3
        for row in range(3):  # the kept rows' results are unchanged: each equals that row in a batch of 1
            alone = model.generate(input_ids[row : row + 1], attention_mask=attention_mask[row : row + 1], **options)
            assert torch.equal(out.sequences[row], alone.sequences[0])
    assert shrank


@pytest.mark.parametrize("mode", ["block", "causal"])
@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_exact_caches_equal_the_uncached_sampler(mode, cache):
    model = model_for(mode)
    _, input_ids, attention_mask = left_padded([6, 2, 4], seed=3)
    for options in (dict(GEN), dict(GEN, threshold=0.012), dict(GEN, block_length=4, steps=16)):
        reference = model.generate(input_ids, attention_mask=attention_mask, **options)
        cached = model.generate(input_ids, attention_mask=attention_mask, cache=cache, **options)
        assert torch.equal(cached, reference)


def test_approximate_caches_run_fewer_positions_and_differ_from_uncached_only_in_tokens():
    model = model_for("bidirectional")
    _, input_ids, attention_mask = left_padded([6, 2, 4], seed=3)
    reference = model.generate(input_ids, attention_mask=attention_mask, **GEN)
    for cache in ("prefix", "dual"):
        out = model.generate(input_ids, attention_mask=attention_mask, cache=cache, **GEN)
        assert torch.equal(out[:, : input_ids.shape[1]], reference[:, : input_ids.shape[1]])
        assert not out[:, input_ids.shape[1] :].eq(model.config.mask_token_id).any()


def test_cfg_rows_are_independent_and_cached_cfg_matches_uncached_for_block_models():
    model = model_for("block")
    prompts, input_ids, attention_mask = left_padded([5, 2])
    options = dict(GEN, cfg_scale=1.5)
    out = model.generate(input_ids, attention_mask=attention_mask, **options)
    for row, prompt in enumerate(prompts):
        assert torch.equal(out[row, input_ids.shape[1] - len(prompt) :], model.generate(prompt[None], **options)[0])
    assert torch.equal(out, model.generate(input_ids, attention_mask=attention_mask, cache="dual", **options))


def test_temperature_zero_is_deterministic_and_seeded_sampling_reproducible():
    model = model_for("bidirectional")
    _, input_ids, attention_mask = left_padded([5, 9])
    greedy = [model.generate(input_ids, attention_mask=attention_mask, **GEN) for _ in range(2)]
    assert torch.equal(*greedy)
    sampled = dict(GEN, temperature=1.0, top_k=20, top_p=0.9, remasking="random")
    runs = [model.generate(input_ids, attention_mask=attention_mask, generator=torch.Generator().manual_seed(seed),
                           **sampled) for seed in (7, 7, 8)]
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])
    assert not torch.equal(runs[0], greedy[0])


@pytest.mark.parametrize("remasking", ["margin", "entropy", "random"])
def test_other_remasking_strategies_complete_the_canvas_row_independently(remasking):
    model = model_for("bidirectional")
    prompts, input_ids, attention_mask = left_padded([4, 7])
    options = dict(GEN, remasking=remasking)
    out = model.generate(input_ids, attention_mask=attention_mask, generator=torch.Generator().manual_seed(0), **options)
    assert not out.eq(model.config.mask_token_id).any()
    if remasking != "random":  # random draws depend on the batch shape
        for row, prompt in enumerate(prompts):
            alone = model.generate(prompt[None], **options)
            assert torch.equal(out[row, input_ids.shape[1] - len(prompt) :], alone[0])


def test_generation_config_round_trips_and_rejects_bad_fields(tmp_path):
    from transformers import GenerationConfig

    from hf_dlm.generation.configuration import DLMGenerationConfig

    config = DLMGenerationConfig(max_new_tokens=32, block_length=8, threshold=0.9, cache="dual", temperature=0.0)
    config.save_pretrained(tmp_path)
    loaded = DLMGenerationConfig.from_any(GenerationConfig.from_pretrained(tmp_path))
    assert (loaded.block_length, loaded.threshold, loaded.cache, loaded.sampling_temperature) == (8, 0.9, "dual", 0.0)
    with pytest.raises(ValueError, match="cache"):
        DLMGenerationConfig.from_any(None, cache="full")
    with pytest.raises(ValueError, match="block_length"):
        model_for("bidirectional").generate(torch.tensor([[1, 2]]), max_new_tokens=10, block_length=4)


@pytest.mark.parametrize("query", [(9, 13), (9, 20), (4, 20)])
def test_a_cached_window_on_an_unchanged_canvas_reproduces_the_full_forward(query):
    """The approximate caches differ from the uncached sampler only through stale keys: with nothing
    changed since the cache was filled, a window's logits equal the full forward's (padding included)."""
    from hf_dlm.generation.cache import DLMKVCache

    model = model_for("bidirectional")
    _, input_ids, attention_mask = left_padded([5, 9, 3])
    canvas = torch.cat([input_ids, torch.full((3, 11), model.config.mask_token_id)], 1)
    mask = torch.cat([attention_mask, torch.ones(3, 11, dtype=torch.long)], 1)
    full = model(input_ids=canvas, attention_mask=mask).logits
    cache = DLMKVCache(mask, (mask.cumsum(-1) - 1).clamp(min=0))
    model(input_ids=canvas, kv_cache=cache.window(0, None, store=True))
    window = model(input_ids=canvas[:, query[0] : query[1]], kv_cache=cache.window(query[0])).logits
    torch.testing.assert_close(window, full[:, query[0] : query[1]], rtol=1e-5, atol=1e-5)
    rows = torch.tensor([2, 0])  # a subset of rows (finished rows left the batch) reads its own cache rows
    window = model(input_ids=canvas[rows, query[0] : query[1]], kv_cache=cache.window(query[0], rows=rows)).logits
    torch.testing.assert_close(window, full[rows, query[0] : query[1]], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cache,padded,cfg_scale,alignment", [
    ("dual", False, 0.0, "same"), ("dual", True, 0.0, "shift"), ("prefix", False, 0.0, "same"), ("dual", False, 1.5, "same"),
])
def test_static_window_steps_equal_the_kv_cache_forward(monkeypatch, cache, padded, cfg_scale, alignment):
    """Approximate caches with every row in the forward run their window steps through `static_forward`
    (what CUDA replays as a graph); the tokens equal the per-layer `DLMKVCache` forward's, and the window
    path really ran."""
    from hf_dlm.generation.sampler import DiffusionSampler

    model = model_for("bidirectional", alignment)
    with torch.no_grad():  # sharpen the head: threshold decoding commits several tokens at some steps
        model.lm_head.weight.mul_(40)
    _, input_ids, attention_mask = left_padded([5, 9, 3] if padded else [6, 6, 6])
    options = dict(GEN, cache=cache, threshold=None if cfg_scale else 0.5, cfg_scale=cfg_scale, steps=16)
    calls = []
    original = DiffusionSampler._window_step
    monkeypatch.setattr(DiffusionSampler, "_window_step", lambda self, *a: calls.append(a) or original(self, *a))
    out = model.generate(input_ids, attention_mask=attention_mask, **options)
    assert calls, "no window step went through static_forward"
    original_init = DiffusionSampler.__init__

    def kv_cache_only(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.static_head = False

    monkeypatch.setattr(DiffusionSampler, "__init__", kv_cache_only)
    assert torch.equal(out, model.generate(input_ids, attention_mask=attention_mask, **options))
