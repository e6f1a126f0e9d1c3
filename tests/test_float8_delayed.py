"""Delayed-scaling float8 linears (`float8_delayed`): outputs and gradients equal the float8 formula computed
by hand (dynamic scales on the first step, the history's on later ones, saturation beyond it), the history
records each step, siblings share the input scale, compiled training equals eager, checkpoints stay plain."""

import pytest
import torch
from torch import nn

from hf_dlm.parallel.float8 import convert_to_float8
from hf_dlm.parallel.float8_delayed import E4M3, E5M2, GRAD, INPUT, WEIGHT, DelayedFloat8Linear
from hf_dlm.parallel.parallelize import parallelize_dlm
from hf_dlm.utils.import_utils import is_torchao_available
from tests.utils import VOCAB, tiny_model

MAX4, MAX5 = 448.0, 57344.0


def quantize(t, amax, dtype, limit):
    """Float8 round trip of `t` with the scale limit / amax, as float32 values (saturating)."""
    scale = limit / amax
    return (t * scale).clamp(-limit, limit).to(dtype).float() / scale


def make_layer(seed=0, bias=False):
    torch.manual_seed(seed)
    plain = nn.Linear(32, 48, bias=bias)
    return plain, DelayedFloat8Linear.from_linear(nn.Linear(32, 48, bias=bias))


def test_first_step_is_dynamic_float8_of_the_formula():
    plain, layer = make_layer(bias=True)
    layer.load_state_dict(plain.state_dict())
    x = torch.randn(2, 7, 32, requires_grad=True)  # 14 rows: padded to 16 for the weight gradient
    out = layer(x)
    w = layer.weight.detach()
    expected = quantize(x.detach(), x.abs().max(), E4M3, MAX4) @ quantize(w, w.abs().max(), E4M3, MAX4).T
    torch.testing.assert_close(out, expected + layer.bias, rtol=1e-5, atol=1e-5)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    g = quantize(grad_out.reshape(-1, 48), grad_out.abs().max(), E5M2, MAX5)
    x_q = quantize(x.detach(), x.abs().max(), E4M3, MAX4).reshape(-1, 32)
    w_q = quantize(w, w.abs().max(), E4M3, MAX4)
    torch.testing.assert_close(x.grad.reshape(-1, 32), g @ w_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.weight.grad, g.T @ x_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.bias.grad, grad_out.reshape(-1, 48).sum(0))
    # and close to the high-precision layer (float8 keeps ~3 significant bits)
    torch.testing.assert_close(out, plain(x), rtol=0.1, atol=0.1)


def test_later_steps_scale_by_the_history_and_saturate():
    _, layer = make_layer(seed=1)
    x = torch.randn(16, 32)
    grad_out = torch.randn(16, 48)
    layer(x).backward(grad_out)
    history = layer.amax_history
    assert history[INPUT, 0] == x.abs().max() and history[GRAD, 0] == grad_out.abs().max()
    assert history[WEIGHT, 0] == layer.weight.abs().max() and (history[:, 1:] == 0).all()
    assert layer.scales_ready and layer.grad_amax_sink.grad is None
    # step 2: the input doubles; its scale still comes from step 1's amax, so the largest values saturate
    x2 = torch.randn(16, 32) * 2
    out = layer(x2)
    w = layer.weight.detach()
    expected = quantize(x2, history[INPUT, 0], E4M3, MAX4) @ quantize(w, history[WEIGHT, 0], E4M3, MAX4).T
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    dynamic = quantize(x2, x2.abs().max(), E4M3, MAX4) @ quantize(w, w.abs().max(), E4M3, MAX4).T
    assert not torch.allclose(out, dynamic, rtol=1e-5, atol=1e-5)
    out.backward(grad_out * 3)
    assert layer.amax_history[GRAD, 1] == (grad_out * 3).abs().max()  # a ring: the next column
    assert layer.amax_history[GRAD, 0] == grad_out.abs().max()
    for _ in range(layer.history_len):  # a full turn later, column 1 is overwritten again
        layer(x).backward(grad_out)
    assert layer.amax_history[GRAD, 1] == grad_out.abs().max() and (layer.amax_history > 0).all()


def test_gradient_scale_comes_from_the_history():
    _, layer = make_layer(seed=2)
    x = torch.randn(16, 32)
    layer(x).backward(torch.randn(16, 48))
    g_amax = layer.amax_history[GRAD, 0].clone()
    w_amax = layer.amax_history[WEIGHT, 0].clone()
    x = torch.randn(16, 32, requires_grad=True)
    grad_out = torch.randn(16, 48) * 10  # ten times the recorded amax: scaled by the old one
    layer(x).backward(grad_out)
    g = quantize(grad_out, g_amax, E5M2, MAX5)
    w_q = quantize(layer.weight.detach(), w_amax, E4M3, MAX4)
    torch.testing.assert_close(x.grad, g @ w_q, rtol=1e-5, atol=1e-5)


def test_frozen_weight_gets_no_gradient_but_the_input_does():
    _, layer = make_layer(seed=3)
    layer.weight.requires_grad_(False)  # as under LoRA
    x = torch.randn(16, 32, requires_grad=True)
    grad_out = torch.randn(16, 48)
    layer(x).backward(grad_out)
    w = layer.weight
    expected = quantize(grad_out, grad_out.abs().max(), E5M2, MAX5) @ quantize(w, w.abs().max(), E4M3, MAX4)
    torch.testing.assert_close(x.grad, expected, rtol=1e-5, atol=1e-5)
    assert layer.weight.grad is None and layer.scales_ready  # the step is still recorded


def test_evaluation_forward_records_nothing():
    _, layer = make_layer()
    with torch.no_grad():
        layer(torch.randn(16, 32))
    assert not layer.scales_ready and (layer.amax_history == 0).all()


def test_history_survives_dtype_round_trip():
    _, layer = make_layer()
    layer.to(torch.float64).to(torch.float32)  # replaces the sink buffer: its hook must follow
    layer(torch.randn(16, 32)).sum().backward()
    assert layer.scales_ready and layer.amax_history[GRAD, 0] == 1.0


def test_odd_features_are_refused():
    with pytest.raises(ValueError, match="divisible by 16"):
        DelayedFloat8Linear(30, 48)


def _model():
    return tiny_model("sdpa", hidden_size=64, intermediate_size=128, vocab_size=VOCAB)


def test_conversion_shares_input_scales_and_keeps_checkpoints_plain():
    model = _model()
    keys = set(model.state_dict())
    names = convert_to_float8(model, recipe="delayed", min_features=16)
    attention, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert all(isinstance(model.get_submodule(n), DelayedFloat8Linear) for n in names)
    assert attention.k_proj._input_owner is attention.q_proj and attention.v_proj._input_owner is attention.q_proj
    assert mlp.up_proj._input_owner is mlp.gate_proj and mlp.down_proj._input_owner is None
    assert not isinstance(model.lm_head, DelayedFloat8Linear)
    assert set(model.state_dict()) == keys  # the bookkeeping buffers are not persistent
    plain = _model()
    plain.load_state_dict(model.state_dict())
    with pytest.raises(ValueError, match="tensorwise"):
        convert_to_float8(_model(), recipe="delayed", min_features=16, fsdp_all_gather=True)
    assert not mlp.up_proj.fast_accum_backward
    fast = _model()
    convert_to_float8(fast, recipe="delayed", min_features=16, fast_accum=True)
    assert all(m.fast_accum_backward for m in fast.modules() if isinstance(m, DelayedFloat8Linear))


def _train(model, steps, ids, labels):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        loss = model(ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses)


def test_compiled_training_equals_eager_and_stays_close_to_high_precision():
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB - 1, (2, 16))
    labels = torch.where(torch.rand(2, 16) < 0.5, ids, -100)
    reference = _train(_model().train(), 4, ids, labels)
    eager = parallelize_dlm(_model().train(), float8_recipe="delayed", float8_min_features=16)
    eager_losses = _train(eager, 4, ids, labels)
    compiled = parallelize_dlm(_model().train(), float8_recipe="delayed", float8_min_features=16, compile=True)
    compiled_losses = _train(compiled, 4, ids, labels)
    layer = compiled.model.layers[1].mlp.down_proj
    assert layer.scales_ready and (layer.amax_history[:, :4] > 0).all() and (layer.amax_history[:, 4:] == 0).all()
    torch.testing.assert_close(compiled_losses, eager_losses, rtol=1e-4, atol=1e-4)
    # activation checkpointing recomputes each layer's forward in backward: the same numbers again
    checkpointed = parallelize_dlm(_model().train(), float8_recipe="delayed", float8_min_features=16, compile=True,
                                   activation_checkpointing=True)
    torch.testing.assert_close(_train(checkpointed, 4, ids, labels), eager_losses, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(eager_losses, reference, rtol=0.05, atol=0)
    assert compiled_losses[-1] < compiled_losses[0]  # it trains
    if is_torchao_available():  # the first step scales dynamically: torchao's tensorwise recipe, exactly
        torchao = parallelize_dlm(_model().train(), float8_recipe="tensorwise", float8_min_features=16)
        torch.testing.assert_close(_train(torchao, 1, ids, labels)[0], eager_losses[0], rtol=1e-6, atol=0)
    with pytest.raises(NotImplementedError, match="delayed"):
        parallelize_dlm(_model(), float8_recipe="delayed", tp_mesh=object())


def test_trainer_trains_with_the_delayed_recipe(tmp_path):
    """DLMTrainer with fp8_recipe='delayed': the linears are converted, every micro-batch's backward joins
    the history (2 steps x 2 micro-batches), and the losses stay within a few percent of float32's."""
    from tests.utils import make_trainer

    common = dict(max_steps=2, gradient_accumulation_steps=2, warmup_steps=0)  # step 2's loss sees step 1's update
    plain = make_trainer(tmp_path / "plain", **common)
    plain.train()
    assert plain.state.log_history[0]["learning_rate"] > 0
    trainer = make_trainer(tmp_path / "fp8", fp8_recipe="delayed", fp8_min_features=16, **common)
    layer = trainer.accelerator.unwrap_model(trainer.model).model.layers[0].mlp.up_proj
    assert isinstance(layer, DelayedFloat8Linear)
    trainer.train()
    assert (layer.amax_history[:, :4] > 0).all() and (layer.amax_history[:, 4:] == 0).all()
    torch.testing.assert_close(torch.tensor(trainer.step_losses), torch.tensor(plain.step_losses), rtol=0.05, atol=0)


def test_trainer_resume_restores_the_amax_histories(tmp_path):
    """6 steps straight equal 3 + resume + 3 with fp8_recipe='delayed': the checkpoint holds the
    histories (without them the resumed first step would scale dynamically and the losses would differ)."""
    from hf_dlm.parallel.float8_delayed import float8_state_dict, load_float8_state_dict
    from hf_dlm.training.trainer import FLOAT8_STATE_NAME
    from tests.utils import StopAfter, flat_params, make_trainer

    common = dict(max_steps=6, save_strategy="steps", save_steps=3, fp8_recipe="delayed", fp8_min_features=16)
    straight = make_trainer(tmp_path / "straight", **common)
    straight.train()
    first = make_trainer(tmp_path / "split", **common)
    first.add_callback(StopAfter(3))
    first.train()
    assert (tmp_path / "split" / "checkpoint-3" / FLOAT8_STATE_NAME.format(rank=0)).is_file()
    resumed = make_trainer(tmp_path / "split", model_seed=1, **common)
    resumed.train(resume_from_checkpoint=True)
    torch.testing.assert_close(torch.tensor(first.step_losses + resumed.step_losses, dtype=torch.float64),
                               torch.tensor(straight.step_losses, dtype=torch.float64), rtol=0, atol=1e-6)
    torch.testing.assert_close(flat_params(resumed.model), flat_params(straight.model), rtol=0, atol=1e-6)
    # a state saved from another conversion is refused, naming the layers
    state = float8_state_dict(resumed.model)
    state.pop(next(iter(state)))
    with pytest.raises(KeyError, match="missing"):
        load_float8_state_dict(resumed.model, state)
