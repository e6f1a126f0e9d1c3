"""Float8 decoding with static activation scales (`quantize_float8_for_decoding(activation_scheme="static")`):
each projection's scale is the largest activation the calibration showed it over the float8 maximum, a
projection computes the per-tensor float8 GEMM of that scale (transcribed by hand), and a calibration that
misses a projection leaves the model as it was. The float8 GEMM runs on a CPU here (`torch._scaled_mm`); the
float8-GPU check is bypassed, as it guards speed, not the arithmetic."""

import pytest
import torch

from tests.utils import tiny_model

pytest.importorskip("torchao")

FLOAT8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")


@pytest.fixture
def float8(monkeypatch):
    from hf_dlm.generation import float8

    monkeypatch.setattr(float8, "_require_float8_gpu", lambda device: None)
    return float8


def _pair():
    model = tiny_model("sdpa", vocab_size=96, mask_token_id=95, hidden_size=32, intermediate_size=64).to(torch.bfloat16)
    reference = tiny_model("sdpa", vocab_size=96, mask_token_id=95, hidden_size=32, intermediate_size=64)
    reference = reference.to(torch.bfloat16)
    reference.load_state_dict(model.state_dict())
    return model, reference


def _decode(model):
    prompt = torch.randint(0, 90, (2, 6), generator=torch.Generator().manual_seed(3))
    return model.generate(prompt, max_new_tokens=8, block_length=4, steps=8, cache="dual", temperature=0.0,
                          stop_on_eos=False)


def _float8_per_tensor(tensor, scale):
    return (tensor.float() / scale).clamp(-FLOAT8_MAX, FLOAT8_MAX).to(torch.float8_e4m3fn)


def test_static_scales_are_the_calibrations_largest_activation_and_the_gemm_is_the_per_tensor_float8_one(float8):
    model, reference = _pair()
    largest = {}  # the largest |input| each projection of the bf16 twin sees over the same decoding
    hooks = [module.register_forward_pre_hook(
        lambda module, args, name=name: largest.__setitem__(name, max(largest.get(name, 0.0),
                                                                      args[0].abs().max().float().item())))
        for name, module in reference.named_modules() if name.endswith(PROJECTIONS)]
    _decode(reference)
    for hook in hooks:
        hook.remove()

    float8.quantize_float8_for_decoding(model, "tensor", activation_scheme="static", calibrate=_decode)
    assert len(largest) == 2 * len(PROJECTIONS)
    for name, seen in largest.items():
        weight = model.get_submodule(name).weight
        assert type(weight).__name__ == "PrototypeFloat8Tensor", name
        # torchao divides in the activation's dtype: the scale is the bf16 rounding of largest / 448
        expected = torch.tensor(seen / FLOAT8_MAX).to(torch.bfloat16).item()
        assert weight.act_quant_scale.flatten().tolist() == pytest.approx([expected], rel=1e-6), name
    assert model.lm_head.weight.dtype == torch.bfloat16 and type(model.lm_head) is torch.nn.Linear

    # one projection against the transcription, inside the calibrated range and 10x beyond it (saturates)
    name = "model.layers.1.mlp.down_proj"
    linear, twin = model.get_submodule(name), reference.get_submodule(name)
    x_scale = linear.weight.act_quant_scale.item()
    w_scale = twin.weight.abs().max().float() / FLOAT8_MAX
    w8 = _float8_per_tensor(twin.weight, w_scale)
    x = torch.randn(2, 5, linear.in_features, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    for gain in (largest[name] / x.abs().max().item() / 2, 10 * largest[name] / x.abs().max().item()):
        inputs = (x.float() * gain).to(torch.bfloat16)
        expected = (_float8_per_tensor(inputs, x_scale).float() @ w8.float().T) * (x_scale * w_scale)
        with torch.no_grad():
            got = linear(inputs).float()
        torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())
        unclamped = inputs.float() @ twin.weight.float().T
        if gain > 1:  # beyond the calibrated range the float8 inputs saturate: far from the bf16 product
            assert (got - unclamped).abs().max() > 0.5 * unclamped.abs().max()

    tokens = _decode(model)  # the quantized model decodes
    assert tokens.shape == (2, 14) and not (tokens[:, 6:] == 95).any()


def test_a_calibration_that_misses_a_projection_names_it_and_leaves_the_model_as_it_was(float8):
    model, reference = _pair()
    weights = {name: module.weight for name, module in model.named_modules() if name.endswith(PROJECTIONS)}

    def first_mlp_only(m):  # the attention projections and the second layer never run
        m.model.layers[0].mlp(torch.randn(1, 4, 32, dtype=torch.bfloat16))

    with pytest.raises(ValueError, match=r"never ran 11 of the 14 .*model\.layers\.0\.self_attn\.q_proj"):
        float8.quantize_float8_for_decoding(model, "tensor", activation_scheme="static", calibrate=first_mlp_only)
    for name, weight in weights.items():
        module = model.get_submodule(name)
        assert type(module) is torch.nn.Linear and module.weight is weight, name
    with torch.no_grad():
        torch.testing.assert_close(model(torch.arange(8)[None]).logits, reference(torch.arange(8)[None]).logits,
                                   rtol=0, atol=0)

    def failing(m):
        raise RuntimeError("calibration data missing")

    with pytest.raises(RuntimeError, match="calibration data missing"):
        float8.quantize_float8_for_decoding(model, "tensor", activation_scheme="static", calibrate=failing)
    assert all(type(model.get_submodule(name)) is torch.nn.Linear for name in weights)


def test_static_scheme_refuses_row_scales_a_missing_calibration_and_an_unknown_scheme(float8):
    model, _ = _pair()
    with pytest.raises(ValueError, match=r"needs granularity='tensor'.*got 'row'"):
        float8.quantize_float8_for_decoding(model, "row", activation_scheme="static", calibrate=_decode)
    with pytest.raises(ValueError, match=r"a `calibrate` callable \(got None\)"):
        float8.quantize_float8_for_decoding(model, "tensor", activation_scheme="static")
    with pytest.raises(ValueError, match=r"activation_scheme must be one of \('dynamic', 'static'\), got 'delayed'"):
        float8.quantize_float8_for_decoding(model, "tensor", activation_scheme="delayed")
    assert all(type(module.weight) is torch.nn.Parameter for module in model.modules()
               if isinstance(module, torch.nn.Linear))


def test_fused_projections_keep_their_split_through_calibration_conversion_and_a_failed_calibration(float8):
    # torchao's prepare / convert put new linear modules in place; the fused layers' split must survive both
    model, reference = _pair()
    model.fuse_projections()
    reference.fuse_projections()
    with pytest.raises(ValueError, match="never ran"):
        float8.quantize_float8_for_decoding(model, "tensor", activation_scheme="static", calibrate=lambda m: None)
    assert model.model.layers[0].self_attn.qkv_proj.split_sizes == (32, 16, 16)
    float8.quantize_float8_for_decoding(model, "tensor", activation_scheme="static", calibrate=_decode)
    fused = model.model.layers[1].mlp.gate_up_proj
    assert type(fused.weight).__name__ == "PrototypeFloat8Tensor" and fused.split_sizes == (64, 64)
    assert model.model.layers[0].self_attn.qkv_proj.split_sizes == (32, 16, 16)
    tokens, expected = _decode(model), _decode(reference)
    assert (tokens[:, :6] == expected[:, :6]).all() and not (tokens[:, 6:] == 95).any()


def test_the_engine_serves_a_static_float8_model_with_generates_tokens(float8):
    # the engine packs every row's tokens into one (1, tokens, hidden) forward: the calibrated per-tensor scale
    # must take that shape as it takes generate's (float32 activations: exact on a CPU)
    from hf_dlm.serving.engine import ContinuousBatchingEngine, GenerationRequest

    model = tiny_model("sdpa", vocab_size=96, mask_token_id=95, hidden_size=32, intermediate_size=64, eos_token_id=5)
    model.fuse_projections()
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 90, (4 + i,), generator=generator).tolist() for i in range(4)]
    options = dict(max_new_tokens=16, block_length=8, cache="dual", stop_on_eos=False, temperature=0.0)
    float8.quantize_float8_for_decoding(
        model, "tensor", activation_scheme="static",
        calibrate=lambda m: [m.generate(torch.tensor([prompt]), **options) for prompt in prompts])
    assert type(model.model.layers[0].self_attn.qkv_proj.weight).__name__ == "PrototypeFloat8Tensor"
    engine = ContinuousBatchingEngine(model, max_batch_size=4)
    requests = [GenerationRequest(prompt, engine.sampling_params(**options)) for prompt in prompts]
    for request in requests:  # one joins before each step, while the others run
        engine.submit([request])
        engine.step()
    while engine.has_work():
        engine.step()
    for prompt, request in zip(prompts, requests):
        assert request.generated == model.generate(torch.tensor([prompt]), **options)[0, len(prompt):].tolist()


def test_a_tied_lm_head_takes_a_static_float8_copy_and_the_embeddings_keep_theirs(float8):
    model = tiny_model("sdpa", vocab_size=96, mask_token_id=95, tie_word_embeddings=True).to(torch.bfloat16)
    float8.quantize_float8_for_decoding(model, "tensor", lm_head=True, activation_scheme="static", calibrate=_decode)
    assert type(model.lm_head.weight).__name__ == "PrototypeFloat8Tensor"
    assert model.lm_head.weight.act_quant_scale.item() > 0
    assert type(model.model.embed_tokens.weight) is torch.nn.Parameter
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert _decode(model).shape == (2, 14)
