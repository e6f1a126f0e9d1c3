"""The training head computes its gradients in forward (`weighted_linear_cross_entropy`): the values and
gradients of the plain computation (full logits, autograd), of a hand computation, and of the
checkpointed head."""

import pytest
import torch
import torch.nn.functional as F

from hf_dlm.modeling.loss import weighted_linear_cross_entropy
from tests.utils import VOCAB, tiny_model


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


def test_frozen_head_weight_gets_no_gradient_and_hidden_gradient_is_unchanged():
    h, w, b, labels, scale = _head_inputs()
    expected = torch.autograd.grad(_reference(h, w, b, labels, scale), h)[0]
    frozen_w, frozen_b = w.detach(), b.detach()  # a frozen head (LoRA): no weight or bias gradient wanted
    loss = weighted_linear_cross_entropy(h, frozen_w, labels, scale.detach(), frozen_b, chunk_size=4)
    assert loss.grad_fn is not None and "LinearCrossEntropy" in type(loss.grad_fn).__name__
    saved = [t for t in loss.grad_fn.saved_tensors if t is not None]
    assert all(t.shape != frozen_w.shape for t in saved)  # no vocabulary x hidden gradient was computed
    torch.testing.assert_close(torch.autograd.grad(loss, h)[0], expected, rtol=1e-5, atol=1e-6)
