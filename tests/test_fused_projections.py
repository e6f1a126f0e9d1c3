"""Fused q / k / v and gate / up projections for decoding (`hf_dlm/modeling/fused_projections.py`): the fused
layers are the concatenated weights, a fused model decodes the same tokens in generate and in the engine, unfusing
gives the original weights back bit for bit, and what cannot be fused or saved is refused by name."""

import pytest
import torch
from torch import nn

from hf_dlm.serving.engine import ContinuousBatchingEngine, GenerationRequest

from tests.utils import tiny_family, tiny_model

DECODE = dict(max_new_tokens=8, block_length=4, steps=8, temperature=0.0, stop_on_eos=False)


def test_fused_layers_are_the_concatenated_weights_and_unfusing_is_bit_exact():
    model = tiny_model(qkv_bias=True)
    with torch.no_grad():  # biases start at zero: give them values a mix-up would show
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    attention, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    q, k, v = attention.q_proj, attention.k_proj, attention.v_proj
    gate, up = mlp.gate_proj.weight.clone(), mlp.up_proj.weight.clone()
    model.fuse_projections()
    assert not hasattr(attention, "q_proj") and not hasattr(mlp, "gate_proj")
    # hand-built: q (4 heads x 8), k and v (2 kv heads x 8) stacked in that order, biases likewise
    assert attention.qkv_proj.weight.shape == (32 + 16 + 16, 32)
    assert torch.equal(attention.qkv_proj.weight[:32], q.weight) and torch.equal(attention.qkv_proj.weight[48:], v.weight)
    assert torch.equal(attention.qkv_proj.bias[32:48], k.bias)
    assert torch.equal(mlp.gate_up_proj.weight, torch.cat([gate, up]))
    model.fuse_projections()  # idempotent
    x = torch.randn(2, 5, 32)
    expected = nn.functional.silu(x @ gate.T) * (x @ up.T) @ mlp.down_proj.weight.T
    torch.testing.assert_close(mlp(x), expected)
    model.unfuse_projections()
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[name], before[name]) for name in before)
    assert not hasattr(attention, "qkv_proj") and isinstance(attention.q_proj, nn.Linear)


@pytest.mark.parametrize("family", ["llada", "Dream", "lladamoe", "sdar"])
def test_a_fused_model_decodes_the_same_tokens_in_generate_and_the_engine(family):
    """Dream has q / k / v biases, LLaDA-MoE a shared expert (an MLP of its own), SDAR block-causal
    attention and q / k norms."""
    model = tiny_family(family)
    vocab = model.config.vocab_size - 3
    prompts = [torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (4, 8)]  # whole blocks (SDAR aligns them)
    ids = torch.tensor([prompts[0]])
    with torch.no_grad():
        logits = model(torch.tensor([prompts[1]])).logits
        expected = {cache: model.generate(ids, cache=cache, **DECODE)[0].tolist() for cache in ("dual", "none")}
        expected_rows = [model.generate(torch.tensor([p]), cache="prefix", **DECODE)[0, len(p):].tolist()
                         for p in prompts]
        model.fuse_projections()
        shared = getattr(model.model.layers[-1].mlp, "shared_expert", None)
        assert shared is None or hasattr(shared, "gate_up_proj")
        torch.testing.assert_close(model(torch.tensor([prompts[1]])).logits, logits, rtol=1e-5, atol=1e-5)
        for cache, tokens in expected.items():
            assert model.generate(ids, cache=cache, **DECODE)[0].tolist() == tokens, cache
    engine = ContinuousBatchingEngine(model, max_batch_size=2)
    requests = [GenerationRequest(p, engine.sampling_params(cache="prefix", **DECODE)) for p in prompts]
    engine.submit(requests)
    while engine.has_work():
        engine.step()
    assert [r.generated for r in requests] == expected_rows


def test_a_fused_model_refuses_save_pretrained_and_saves_once_unfused(tmp_path):
    model = tiny_model().fuse_projections()
    with pytest.raises(ValueError, match="unfuse_projections"):
        model.save_pretrained(tmp_path / "fused")
    assert not (tmp_path / "fused" / "model.safetensors").exists()
    model.unfuse_projections().save_pretrained(tmp_path / "plain")
    loaded = type(model).from_pretrained(tmp_path / "plain")
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))


def test_fusing_refuses_a_wrapped_projection_by_name():
    class Adapter(nn.Linear):  # stands in for a LoRA layer or a quantised one
        pass

    model = tiny_model()
    old = model.model.layers[0].self_attn.k_proj
    model.model.layers[0].self_attn.k_proj = Adapter(old.in_features, old.out_features, bias=False)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_proj is Adapter"):
        model.fuse_projections()
