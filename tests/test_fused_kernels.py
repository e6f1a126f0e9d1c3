"""The training speed-ups that change how, not what, is computed: the head's gradients computed in
forward (`weighted_linear_cross_entropy`) and the fused q/k/v and gate/up GEMMs (`fused_linear`) give
the plain computation's values and gradients."""

import pytest
import torch
import torch.nn.functional as F

from hf_dlm.modeling.fused_linear import fused_linear, fusion_kind
from hf_dlm.modeling.loss import weighted_linear_cross_entropy
from hf_dlm.training.fp8 import convert_to_float8
from hf_dlm.training.parallelize import parallelize_dlm
from hf_dlm.utils.import_utils import is_torchao_available
from tests.conftest import VOCAB, tiny_model


def _head_inputs(n=11, hidden=8, vocab=13, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g, dtype=torch.float64).requires_grad_(True)
    w = torch.randn(vocab, hidden, generator=g, dtype=torch.float64).requires_grad_(True)
    b = torch.randn(vocab, generator=g, dtype=torch.float64).requires_grad_(True) if bias else None
    labels = torch.randint(0, vocab, (n,), generator=g)
    scale = torch.rand(n, generator=g, dtype=torch.float64).requires_grad_(True)
    return h, w, b, labels, scale


def _reference(h, w, b, labels, scale):
    """The definition: full logits, per-row cross-entropy, weighted sum."""
    ce = F.cross_entropy(F.linear(h, w, b), labels, reduction="none")
    return (ce * scale).sum()


@pytest.mark.parametrize("chunk", [1, 4, 11, 64])
@pytest.mark.parametrize("bias", [True, False])
def test_grad_in_forward_head_matches_autograd(chunk, bias):
    inputs = _head_inputs(bias=bias)
    leaves = [t for t in (inputs[0], inputs[1], inputs[2], inputs[4]) if t is not None]
    expected = _reference(*inputs)
    expected_grads = torch.autograd.grad(3.0 * expected, leaves)  # an upstream gradient other than 1
    loss = weighted_linear_cross_entropy(inputs[0], inputs[1], inputs[3], inputs[4], inputs[2], chunk_size=chunk)
    assert loss.grad_fn is not None and "LinearCrossEntropy" in type(loss.grad_fn).__name__
    torch.testing.assert_close(loss.double(), expected, rtol=1e-6, atol=1e-6)  # accumulates in fp32
    grads = torch.autograd.grad(3.0 * loss, leaves)
    for name, got, want in zip(("hidden", "weight", "bias", "scale")[: len(leaves)], grads, expected_grads):
        assert got.dtype == want.dtype, name
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)


def test_grad_in_forward_head_hand_computed():
    # two rows, vocabulary 2, identity weight: logits are the hidden states themselves
    h = torch.tensor([[0.0, 0.0], [2.0, 0.0]], requires_grad=True)
    w = torch.eye(2, requires_grad=True)
    labels, scale = torch.tensor([0, 1]), torch.tensor([1.0, 0.5])
    loss = weighted_linear_cross_entropy(h, w, labels, scale, chunk_size=1)
    log2, lse = torch.log(torch.tensor(2.0)), torch.log(1 + torch.exp(torch.tensor(2.0)))
    torch.testing.assert_close(loss, log2 + 0.5 * (lse - 0.0))
    loss.backward()
    p = torch.softmax(torch.tensor([2.0, 0.0]), 0)
    # d loss / d logits = scale * (softmax - one-hot), and logits = h here
    torch.testing.assert_close(h.grad, torch.stack([torch.tensor([0.5, 0.5]) - torch.tensor([1.0, 0.0]),
                                                    0.5 * (p - torch.tensor([0.0, 1.0]))]))


def test_grad_in_forward_head_under_bf16_autocast_matches_checkpointed_head():
    h, w, _, labels, scale = _head_inputs(n=40, hidden=16, vocab=50, bias=False)
    h, w, scale = (t.detach().float().requires_grad_(True) for t in (h, w, scale))
    results = []
    for grad_in_forward in (True, False):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = weighted_linear_cross_entropy(h, w, labels, scale, chunk_size=16, grad_in_forward=grad_in_forward)
        results.append((loss, *torch.autograd.grad(loss, (h, w, scale))))
    for fused, checkpointed in zip(*results):
        assert fused.dtype == checkpointed.dtype
        torch.testing.assert_close(fused, checkpointed, rtol=2e-2, atol=2e-3)


def test_model_head_paths_agree_and_feed_label_weight_gradients():
    ids = torch.randint(0, VOCAB - 1, (3, 16), generator=torch.Generator().manual_seed(0))
    labels = torch.where(torch.rand(3, 16, generator=torch.Generator().manual_seed(1)) < 0.5, ids, -100)
    results = []
    for grad_in_forward in (True, False):
        model = tiny_model(loss_chunk_size=5).train()
        model.loss_grad_in_forward = grad_in_forward
        weights = torch.rand(3, 16, generator=torch.Generator().manual_seed(2)).requires_grad_(True)
        loss = model(ids, labels=labels, label_weights=weights, num_items_in_batch=48).loss
        loss.backward()
        results.append((loss.detach(), weights.grad, [p.grad for p in model.parameters()]))
    (loss_a, wgrad_a, grads_a), (loss_b, wgrad_b, grads_b) = results
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(wgrad_a, wgrad_b, rtol=1e-5, atol=1e-8)  # per-position CE / 48: the trainer's t buckets
    assert (wgrad_a[labels == -100] == 0).all() and (wgrad_a[labels != -100] > 0).all()
    for a, b in zip(grads_a, grads_b):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_fused_projections_equal_separate_linears():
    separate = tiny_model().train()
    fused = tiny_model().train()
    kinds = {m.fuse_projections() for m in fused.modules() if hasattr(m, "_fusable_linears")}
    assert kinds == {"linear"}
    ids = torch.randint(0, VOCAB - 1, (2, 12))
    labels = torch.where(torch.rand(2, 12) < 0.5, ids, -100)
    for model in (separate, fused):
        model(ids, labels=labels).loss.backward()
    for (name, a), (_, b) in zip(separate.named_parameters(), fused.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-7, msg=name)
    assert list(separate.state_dict()) == list(fused.state_dict())  # names and layout unchanged


def test_fusion_falls_back_for_wrapped_or_mismatched_linears():
    linear = torch.nn.Linear(8, 8)
    assert fusion_kind([linear, torch.nn.Linear(8, 4)]) == "linear"

    class Wrapped(torch.nn.Linear):  # e.g. an adapter layer: its own forward must run
        def forward(self, x):
            return super().forward(x) + 1

    wrapped = Wrapped(8, 4)
    assert fusion_kind([linear, wrapped]) is None
    x = torch.randn(3, 8)
    a, b = fused_linear(x, [linear, wrapped], fusion_kind([linear, wrapped]))
    torch.testing.assert_close(b, wrapped(x))


def test_parallelize_fuses_with_compile_only():
    model = parallelize_dlm(tiny_model("sdpa"), compile=True, compile_options={"backend": "eager"})
    assert model.model.layers[0].self_attn._fusion == "linear"
    assert parallelize_dlm(tiny_model("sdpa")).model.layers[0].self_attn._fusion is None
    off = parallelize_dlm(tiny_model("sdpa"), compile=True, fuse_projections=False, compile_options={"backend": "eager"})
    assert off.model.layers[0].mlp._fusion is None


needs_torchao = pytest.mark.skipif(not is_torchao_available(), reason="torchao is not installed (pip install 'hf-dlm[fp8]')")


@needs_torchao
def test_float8_groups_convert_together_and_fuse_like_one_float8_linear():
    from torchao.float8.float8_linear import Float8Linear

    # hidden 64, KV heads 2 of 16: k/v are 64 -> 32, too narrow alone at min_features 64, but q/k/v as one
    # GEMM is 64 -> 128; gate/up 64 -> 256
    model = tiny_model("sdpa", hidden_size=64, intermediate_size=128)
    names = convert_to_float8(model, recipe="tensorwise", min_features=64, fused_groups=True)
    assert "model.layers.0.self_attn.k_proj" in names and "model.layers.0.self_attn.v_proj" in names
    attention = model.model.layers[0].self_attn
    assert attention.fuse_projections() == "float8"
    x = torch.randn(2, 5, 64)
    q, k, v = fused_linear(x, attention._fusable_linears(), "float8")
    # the same as one Float8Linear holding the concatenated weight (one tensorwise scale for the group)
    whole = torch.nn.Linear(64, 128, bias=False)
    with torch.no_grad():
        whole.weight.copy_(torch.cat([attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight]))
    whole = Float8Linear.from_float(whole, config=attention.q_proj.config)
    torch.testing.assert_close(torch.cat([q, k, v], -1), whole(x), rtol=0, atol=0)
    separate = torch.cat([attention.q_proj(x), attention.k_proj(x), attention.v_proj(x)], -1)
    torch.testing.assert_close(torch.cat([q, k, v], -1), separate, rtol=0.1, atol=0.05)  # float8 rounding only
    plain = tiny_model("sdpa", hidden_size=64, intermediate_size=128)
    assert "model.layers.0.self_attn.k_proj" not in convert_to_float8(plain, min_features=64)
