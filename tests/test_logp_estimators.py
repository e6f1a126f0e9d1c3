"""Completion log-probability estimators (d1 one-step, coupled, Monte Carlo ELBO) against hand-computed values."""

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from hf_dlm.diffusion.logp_estimators import (CoupledEstimator, MonteCarloELBOEstimator, OneStepEstimator,
                                             build_estimator, row_keys)
from hf_dlm.diffusion.noise import hashed_uniform
from tests.utils import MASK_ID, VOCAB, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


class CountingModel(nn.Module):
    """Logits at every position: c for token 0 and 0 elsewhere, c = the row's number of unmasked real tokens.
    So log p(0) = f(c) = c - log(e^c + V - 1): every estimate is a closed form in the mask counts."""

    def __init__(self, vocab=7, mask_id=6):
        super().__init__()
        self.config = SimpleNamespace(mask_token_id=mask_id, label_alignment="same")
        self.vocab = vocab
        self.calls = 0

    def forward(self, input_ids, attention_mask, logits_to_keep=0):
        self.calls += 1
        visible = ((input_ids != self.config.mask_token_id) & attention_mask.bool()).sum(1).float()  # (B,)
        logits = torch.zeros(*input_ids.shape, self.vocab)
        logits[..., 0] = visible.unsqueeze(1)
        return SimpleNamespace(logits=logits[:, -logits_to_keep:])


def f(c, vocab=7):
    return c - math.log(math.exp(c) + vocab - 1)


def canvas(prompt_len, completion_len, batch=1, completion_token=0):
    prompt = torch.arange(1, prompt_len + 1).remainder(5).add(1).repeat(batch, 1)  # tokens 1..5, never 0 or the mask
    ids = torch.cat([prompt, torch.full((batch, completion_len), completion_token)], 1)
    return ids, torch.ones_like(ids)


def test_one_step_hand_computed():
    model = CountingModel()
    ids, mask = canvas(5, 3)
    # no prompt masking: the completion fully masked, 5 visible prompt tokens -> f(5) for every completion token
    logps, _ = OneStepEstimator(mask_token_id=6, prompt_mask_prob=0.0)(model, ids, mask, 3, seed=0)
    torch.testing.assert_close(logps, torch.full((1, 3), f(5)))
    # prompt masked with p: the masked count is the number of prompt uniforms below p (the documented keying)
    u = hashed_uniform(7, 0, row_keys(ids), torch.arange(8))[0, :5]
    logps, _ = OneStepEstimator(mask_token_id=6, prompt_mask_prob=0.5)(model, ids, mask, 3, seed=7)
    torch.testing.assert_close(logps, torch.full((1, 3), f(5 - int((u < 0.5).sum()))))


def test_coupled_hand_computed():
    model = CountingModel()
    ids, mask = canvas(4, 6)
    keys = row_keys(ids)
    # t_min = t_max = 0.25: t is exactly 0.25; a token is in the first pass iff its uniform is below t
    first = hashed_uniform(3, 2, keys, torch.arange(6))[0] < 0.25
    m = int(first.sum())
    assert 0 < m < 6  # both passes score something in this case
    # scored once, in the pass where it is masked, weighted by the inverse probability of that mask
    expected_pair = torch.where(first, f(4 + 6 - m) / 0.25, f(4 + m) / 0.75)
    pair, _ = CoupledEstimator(mask_token_id=6, t_min=0.25, t_max=0.25, with_full_mask=False)(model, ids, mask, 6, 3)
    torch.testing.assert_close(pair[0], expected_pair)
    triple, _ = CoupledEstimator(mask_token_id=6, t_min=0.25, t_max=0.25)(model, ids, mask, 6, 3)
    torch.testing.assert_close(triple[0], (f(4) + expected_pair) / 2)  # DiffuCoder: averaged with the full mask


def test_mc_elbo_hand_computed():
    model = CountingModel()
    ids, mask = canvas(4, 2)
    # K = 2, mc_num = 2 stratified: draw 0 masks l = 1 token (weight 2), draw 1 masks both (weight 1);
    # the sum over the completion is (2 f(5) + 2 f(4)) / 2 whatever the seed
    for seed in (0, 1, 2):
        logps, _ = MonteCarloELBOEstimator(mask_token_id=6, mc_num=2)(model, ids, mask, 2, seed)
        assert logps.sum().item() == pytest.approx(f(5) + f(4), abs=1e-5)
    assert model.calls == 3  # the mc_num draws go through one forward
    # only the scored tokens count: with the second completion token unscored, K = 1 and l = 1 in both draws
    logps, _ = MonteCarloELBOEstimator(mask_token_id=6, mc_num=2)(model, ids, mask, 2, 0,
                                                                  scored=torch.tensor([[1, 0]]))
    torch.testing.assert_close(logps, torch.tensor([[f(5), 0.0]]))


@pytest.mark.parametrize("name", ["d1", "coupled", "mc_elbo"])
def test_estimators_seeded_and_independent_of_row_order(name):
    model = tiny_model().float()
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB - 1, (4, 12))
    mask = torch.ones_like(ids)
    estimator = build_estimator(name, MASK_ID)
    with torch.no_grad():
        first, entropy = estimator(model, ids, mask, 6, seed=11, compute_entropy=True)
        again, _ = estimator(model, ids, mask, 6, seed=11)
        other, _ = estimator(model, ids, mask, 6, seed=12)  # the next inner iteration's seed
        flipped, _ = estimator(model, ids.flip(0), mask, 6, seed=11)
    assert torch.equal(first, again)
    assert not torch.allclose(first, other)
    torch.testing.assert_close(flipped.flip(0), first)  # trl shuffles rows between rollout and loss
    assert first.shape == entropy.shape == (4, 6) and (entropy > 0).all()


def test_unknown_estimator_is_named():
    with pytest.raises(ValueError, match="mc_elbo"):
        build_estimator("ar", MASK_ID)
