"""Float8 converters: the right linears are swapped (large ones, never lm_head, never dims off 16), the
recipe reaches torchao, and the converted model still trains to about the same loss."""

import sys

import pytest
import torch

from hf_dlm.parallel.float8 import TORCHAO_RECIPES, TRANSFORMER_ENGINE_AVAILABLE, convert_to_float8, float8_module_filter
from hf_dlm.parallel.parallelize import parallelize_dlm
from hf_dlm.utils.import_utils import is_torchao_available
from tests.utils import VOCAB, tiny_model

needs_torchao = pytest.mark.skipif(not is_torchao_available(), reason="torchao is not installed (pip install 'hf-dlm[fp8]')")
LARGE = ("q_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # in and out features >= 64 below


def _model():
    # hidden 64, 4 heads of 16, 2 KV heads: k_proj / v_proj are 64 -> 32, too small at min_features=64
    return tiny_model("sdpa", hidden_size=64, intermediate_size=128, vocab_size=VOCAB)


def test_module_filter_skips_small_head_and_odd_dims():
    keep = float8_module_filter(min_features=64)
    assert keep(torch.nn.Linear(64, 128), "model.layers.0.mlp.up_proj")
    assert not keep(torch.nn.Linear(64, 32), "model.layers.0.self_attn.k_proj")  # too small
    assert not keep(torch.nn.Linear(72, 72), "x")  # 72 is not a multiple of 16
    assert not keep(torch.nn.Linear(64, 128), "lm_head")  # never the head
    assert not keep(torch.nn.LayerNorm(64), "norm")


@needs_torchao
@pytest.mark.parametrize("recipe", TORCHAO_RECIPES)
def test_torchao_swaps_the_large_linears(recipe):
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    model = _model()
    names = convert_to_float8(model, recipe=recipe, min_features=64)
    assert sorted(names) == sorted(f"model.layers.{i}.{kind}.{n}" for i in range(2) for kind, n in
                                   [("self_attn", "q_proj"), ("self_attn", "o_proj"), ("mlp", "gate_proj"),
                                    ("mlp", "up_proj"), ("mlp", "down_proj")])
    converted = {name for name, module in model.named_modules() if isinstance(module, Float8Linear)}
    assert converted == set(names)
    assert not isinstance(model.lm_head, Float8Linear)
    assert not isinstance(model.model.layers[0].self_attn.k_proj, Float8Linear)
    expected = Float8LinearConfig.from_recipe_name(recipe)
    assert model.model.layers[0].mlp.up_proj.config == expected


@needs_torchao
def test_float8_model_trains_close_to_bf16():
    ids = torch.randint(0, VOCAB - 1, (2, 16))
    labels = torch.where(torch.rand(2, 16) < 0.5, ids, -100)
    losses = []
    for recipe in (None, "tensorwise"):
        model = parallelize_dlm(_model().train(), float8_recipe=recipe, float8_min_features=64)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(ids, labels=labels).loss
        loss.backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)
        losses.append(loss.detach())
    from torchao.float8.float8_linear import Float8Linear

    assert isinstance(model.model.layers[0].mlp.up_proj, Float8Linear)
    torch.testing.assert_close(losses[1], losses[0], rtol=0.05, atol=0)


def test_unknown_recipe_and_backend_are_rejected():
    with pytest.raises(ValueError, match="recipe"):
        convert_to_float8(_model(), recipe="blockwise")
    with pytest.raises(ValueError, match="backend"):
        convert_to_float8(_model(), backend="nvfp4")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Transformer Engine needs a CUDA GPU")
@pytest.mark.skipif(not TRANSFORMER_ENGINE_AVAILABLE, reason="transformer_engine is not installed (and could not be "
                    "installed where this was written): the Transformer Engine path is unverified")
def test_transformer_engine_swap_keeps_outputs():
    import transformer_engine.pytorch as te

    from hf_dlm.parallel.float8 import fp8_autocast

    model = _model().cuda()
    ids = torch.randint(0, VOCAB - 1, (2, 16), device="cuda")
    with torch.no_grad():
        reference = model.model(ids).last_hidden_state
    names = convert_to_float8(model, min_features=64, backend="transformer_engine")
    assert all(isinstance(model.get_submodule(name), te.Linear) for name in names)
    with torch.no_grad(), fp8_autocast(enabled=False):
        torch.testing.assert_close(model.model(ids).last_hidden_state, reference, rtol=1e-4, atol=1e-4)


@needs_torchao
def test_fast_accumulation_reaches_the_backward_gemms():
    model = _model()
    convert_to_float8(model, recipe="tensorwise", min_features=64, fast_accum=True)
    config = model.model.layers[0].mlp.up_proj.config
    assert config.gemm_config_grad_input.use_fast_accum and config.gemm_config_grad_weight.use_fast_accum
    default = _model()
    convert_to_float8(default, recipe="tensorwise", min_features=64)
    assert not default.model.layers[0].mlp.up_proj.config.gemm_config_grad_weight.use_fast_accum


@needs_torchao
def test_fsdp_float8_all_gather_is_tensorwise_only(monkeypatch):
    from hf_dlm.parallel.float8 import precompute_float8_scales

    with pytest.raises(ValueError, match="tensorwise"):
        convert_to_float8(_model(), recipe="rowwise", min_features=64, fsdp_all_gather=True)
    model = _model()
    convert_to_float8(model, min_features=64, fsdp_all_gather=True)
    assert model.model.layers[0].mlp.up_proj.config.enable_fsdp_float8_all_gather
    # without float8 all-gather weights it returns before touching torchao (which may not be installed)
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    plain = _model()
    precompute_float8_scales(plain)
    with pytest.raises(ImportError):
        precompute_float8_scales(model)
