"""generate(compile=...): the static-shape sampler (whole batch, block-sized windows, spliced caches) gives
exactly the eager sampler's tokens, traced by Dynamo ('eager' backend: fast) and compiled by Inductor."""

import pytest
import torch

from hf_dlm.modeling import generation_compile
from hf_dlm.modeling.generation_config import DLMGenerationConfig

from .conftest import tiny_model
from .test_generation_models import left_padded

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
    assert generation_compile._COMPILED[model].keys() == {"default"}
    # two graphs (the block-start refresh and the block window) serve every block and later calls
    counters = torch._dynamo.utils.counters
    frames = counters["stats"]["unique_graphs"]
    again = model.generate(input_ids, attention_mask=attention_mask, compile=True, **options)
    assert torch.equal(again, eager) and counters["stats"]["unique_graphs"] == frames


def test_compile_option_is_validated_and_saved(tmp_path):
    with pytest.raises(ValueError, match="compile"):
        DLMGenerationConfig.from_any(None, compile="fast")
    config = DLMGenerationConfig(compile="cudagraphs")
    config.save_pretrained(tmp_path)
    assert DLMGenerationConfig.from_pretrained(tmp_path).compile == "cudagraphs"
    assert generation_compile.resolve_compile(True, torch.device("cpu")) == "default"
    assert generation_compile.resolve_compile(True, torch.device("cuda")) == "reduce-overhead"
    assert generation_compile.resolve_compile(False, torch.device("cpu")) is None
