import math

import pytest
import torch

from hf_dlm import MaskedDiffusionObjective
from hf_dlm.diffusion.elbo import elbo_nll
from hf_dlm.diffusion.objective import NORMALIZATIONS
from hf_dlm.diffusion.noise import hashed_uniform

from tests.utils import MASK_ID, VOCAB, tiny_model

IDS = torch.arange(40).view(4, 10) + 1


def _objective(**kwargs):
    return MaskedDiffusionObjective(mask_token_id=MASK_ID, **kwargs)


def test_hashed_uniform_is_stateless_uniform_and_keyed():
    index = torch.arange(2000)
    u = hashed_uniform(7, 1, index)
    assert torch.equal(u, hashed_uniform(7, 1, index))
    assert 0 <= float(u.min()) and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.03
    assert not torch.equal(u, hashed_uniform(8, 1, index)) and not torch.equal(u, hashed_uniform(7, 2, index))
    grid = hashed_uniform(7, 1, index[:3], torch.arange(5))
    assert grid.shape == (3, 5) and len(set(grid.flatten().tolist())) == 15
    big = torch.tensor([2**40 + 3, 3])  # indices past 32 bits stay distinct
    assert hashed_uniform(0, 0, big)[0] != hashed_uniform(0, 0, big)[1]


def test_linear_elbo_hand_computed():
    """t from the hash, mask iff u < t, weight 1/t, labels at masked positions, loss / (B * L)."""
    objective = _objective(eps=1e-3)
    index = torch.tensor([5, 6, 7, 8])
    out = objective.corrupt(IDS, index)
    t = 1e-3 + (1 - 1e-3) * hashed_uniform(0, 0, index)
    u = hashed_uniform(0, 1, index, torch.arange(10))
    masked = u < t.unsqueeze(1)
    torch.testing.assert_close(out["t"], t)
    assert torch.equal(out["masked"], masked)
    assert torch.equal(out["input_ids"], torch.where(masked, MASK_ID, IDS))
    assert torch.equal(out["labels"], torch.where(masked, IDS, -100))
    torch.testing.assert_close(out["label_weights"], torch.where(masked, 1 / t.unsqueeze(1), 0.0))
    assert out["num_items_in_batch"] == 40


def test_cosine_schedule_weight_is_minus_alpha_prime_over_one_minus_alpha():
    objective = _objective(schedule="cosine")
    t = torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)
    h = 1e-6
    alpha_prime = (objective.alpha(t + h) - objective.alpha(t - h)) / (2 * h)
    torch.testing.assert_close(objective.elbo_weight(t), -alpha_prime / (1 - objective.alpha(t)))
    torch.testing.assert_close(objective.mask_probability(t), 1 - torch.cos(math.pi * t / 2))


def test_normalisations_and_measured_weighting():
    index = torch.arange(4)
    token = _objective(normalization="token", weighting="uniform").corrupt(IDS, index)
    assert token["num_items_in_batch"] == 40  # every real token, masked or not
    masked = _objective(normalization="masked", weighting="uniform").corrupt(IDS, index)
    assert masked["num_items_in_batch"] == int(masked["masked"].sum())
    assert _objective(normalization="sample").corrupt(IDS, index)["num_items_in_batch"] == 4
    measured = _objective(weighting="measured").corrupt(IDS, index)
    k = measured["masked"].sum(1).clamp(min=1).float()
    expected = torch.where(measured["masked"], (10 / k).unsqueeze(1), 0.0)
    torch.testing.assert_close(measured["label_weights"], expected)
    prompt = torch.zeros_like(IDS, dtype=torch.bool)
    prompt[:, :4] = True
    sequence = _objective(normalization="sequence").corrupt(IDS, index, prompt_mask=prompt)
    t = sequence["t"].unsqueeze(1)
    torch.testing.assert_close(sequence["label_weights"], torch.where(sequence["masked"], 1 / t / 6, 0.0))
    assert sequence["num_items_in_batch"] == 4


def test_prompt_and_padding_are_never_masked():
    attention = torch.ones_like(IDS)
    attention[:, 8:] = 0
    prompt = torch.zeros_like(IDS, dtype=torch.bool)
    prompt[:, :3] = True
    out = _objective(eps=0.99).corrupt(IDS, torch.arange(4), attention_mask=attention, prompt_mask=prompt)
    assert not out["masked"][:, :3].any() and not out["masked"][:, 8:].any()
    assert out["masked"][:, 3:8].all()  # t >= 0.99 masks nearly everything maskable


def test_antithetic_t_is_mdlm_stratified_over_the_batch():
    """MDLM `_sample_t`: t_j = eps + (1 - eps)((u_j / n + j / n) mod 1), one stratum of width 1/n per sample."""
    objective = _objective(t_sampling="antithetic", eps=1e-3)
    index = torch.tensor([7, 3, 5, 11, 2, 9])  # slots follow the order of the keys: 3, 1, 2, 5, 0, 4
    t = objective.sample_t(index)
    slot = torch.tensor([3, 1, 2, 5, 0, 4])
    expected = 1e-3 + (1 - 1e-3) * ((hashed_uniform(0, 0, index) / 6 + slot / 6) % 1)
    torch.testing.assert_close(t, expected)
    # the whole range is covered by any batch: every stratum [j/6, (j+1)/6) holds exactly one sample
    strata = ((t - 1e-3) / (1 - 1e-3) * 6).floor().long()
    assert sorted(strata.tolist()) == list(range(6))
    # a group given explicitly (the trainer's global batch of 12): the same sample, another stratum
    wide = objective.sample_t(index, slot=slot + 6, group_size=12)
    torch.testing.assert_close(wide, 1e-3 + (1 - 1e-3) * (hashed_uniform(0, 0, index) + slot + 6) / 12)


def test_at_least_one_masked():
    class TinyT(MaskedDiffusionObjective):
        def sample_t(self, sample_index, slot=None, group_size=None):
            return torch.full(sample_index.shape, 1e-9)

    out = TinyT(mask_token_id=MASK_ID, at_least_one_masked=True).corrupt(IDS, torch.arange(4))
    assert torch.equal(out["masked"].sum(1), torch.ones(4, dtype=torch.long))
    plain = TinyT(mask_token_id=MASK_ID).corrupt(IDS, torch.arange(4))
    assert not plain["masked"].any()


def test_shift_alignment_moves_labels_left_and_never_masks_position_zero():
    out = _objective(label_alignment="shift", eps=0.99).corrupt(IDS, torch.arange(4))
    assert not out["masked"][:, 0].any()
    assert torch.equal(out["labels"][:, :-1], torch.where(out["masked"][:, 1:], IDS[:, 1:], -100))
    assert (out["labels"][:, -1] == -100).all()


def test_random_length_cuts_each_sample_by_its_attention_mask():
    out = _objective(random_length_prob=1.0, eps=0.99).corrupt(IDS, torch.arange(4))
    lengths = out["attention_mask"].sum(1)
    assert ((lengths >= 2) & (lengths <= 10)).all()
    beyond = torch.arange(10).unsqueeze(0) >= lengths.unsqueeze(1)
    assert not out["masked"][beyond].any()
    assert (out["attention_mask"].cumsum(1).amax(1) == lengths).all()  # a prefix is kept


def test_ar_mode_is_next_token_cross_entropy():
    model = tiny_model(attention_mode="causal", label_alignment="shift")
    objective = MaskedDiffusionObjective.from_model_config(model.config)
    assert objective.mode == "ar"
    ids = torch.randint(0, VOCAB - 1, (2, 9))
    loss, inputs = objective(model, ids, torch.arange(2))
    logits = model(ids).logits
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(loss, expected)
    with pytest.raises(ValueError, match="causal"):
        objective(tiny_model(), ids, torch.arange(2))


def test_same_noise_whatever_the_micro_batch_or_rank_split():
    objective = _objective(t_sampling="antithetic")
    index = torch.arange(100, 104)
    whole = objective.corrupt(IDS, index)
    slots = torch.arange(4)  # places in the global batch, as DLMTrainer passes them
    halves = [objective.corrupt(IDS[s], index[s], t_slot=slots[s], t_group_size=4) for s in (slice(0, 2), slice(2, 4))]
    ranks = [objective.corrupt(IDS[r::2], index[r::2], t_slot=slots[r::2], t_group_size=4) for r in (0, 1)]
    for key in ("input_ids", "labels", "label_weights"):
        assert torch.equal(whole[key], torch.cat([h[key] for h in halves]))
        interleaved = torch.stack([ranks[0][key], ranks[1][key]], 1).flatten(0, 1)
        assert torch.equal(whole[key], interleaved)


def test_micro_batches_with_the_global_normaliser_sum_to_the_full_batch_loss():
    model = tiny_model()
    objective = _objective(normalization="masked")
    index = torch.arange(4)
    full, inputs = objective(model, IDS, index)
    total = inputs["num_items_in_batch"]
    parts = [objective(model, IDS[s], index[s], num_items_in_batch=total)[0] for s in (slice(0, 1), slice(1, 4))]
    # `num_items_in_batch` passed explicitly overrides the per-micro-batch count
    torch.testing.assert_close(sum(parts), full, rtol=1e-6, atol=1e-6)


def test_a_fixed_batch_overfits():
    """Training on one sequence under fresh masks drives its ELBO far below log V.

    Judged by the seeded ELBO of the trained model (32 stratified mask draws, the same draws before and
    after), not by the last single-batch losses: those swing by ~0.3 nats with the mask ratio drawn at
    each step, so a threshold on them flips with the last ulp of a kernel (it failed on one CI machine).
    One sequence (four copies under different masks) rather than four random rows: memorising it needs
    only positions, which this tiny model learns within 150 steps from every seed tried (ELBO 0.33-0.81
    from 4.6 for seeds 0-3), while telling four random rows apart takes 300-600+ steps depending on
    the seed. Knowing only which tokens occur (unigram) gives log 12 ~ 0.54 x log V, above the bar.
    """
    model = tiny_model("sdpa").train()
    objective = _objective(normalization="token", weighting="uniform")
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
    ids = torch.randint(0, VOCAB - 1, (1, 12), generator=torch.Generator().manual_seed(0)).expand(4, -1)
    before = elbo_nll(model.eval(), ids[:1], mc_num=32)["nll_per_token"]
    model.train()
    for step in range(150):  # fresh masks every step
        loss, _ = objective(model, ids, torch.arange(4) + 4 * step)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    after = elbo_nll(model.eval(), ids[:1], mc_num=32)["nll_per_token"]
    assert before == pytest.approx(math.log(VOCAB), rel=0.05)  # an untrained model is near uniform
    assert after < 0.35 * before


def test_elbo_of_a_uniform_model_is_log_vocab_and_seeded():
    model = tiny_model()
    torch.nn.init.zeros_(model.lm_head.weight)  # every logit 0: CE = log V on every masked token
    ids = torch.randint(0, VOCAB - 1, (3, 16))
    result = elbo_nll(model, ids, mc_num=4)
    assert result["nll_per_token"] == pytest.approx(math.log(VOCAB), rel=1e-5)
    assert result["num_tokens"] == 48
    trained = tiny_model(seed=3)
    a, b = elbo_nll(trained, ids, mc_num=4, seed=1), elbo_nll(trained, ids, mc_num=4, seed=1)
    assert a["nll_per_token"] == b["nll_per_token"]


def test_elbo_of_packed_rows_keeps_documents_apart():
    model = tiny_model("sdpa", seed=3)
    ids = torch.randint(0, VOCAB - 1, (2, 16), generator=torch.Generator().manual_seed(0))
    whole = torch.arange(16).expand(2, -1)  # one document per row: the same as no packing
    plain = elbo_nll(model, ids, mc_num=3, seed=2)["per_sequence"]
    torch.testing.assert_close(elbo_nll(model, ids, mc_num=3, seed=2, position_ids=whole)["per_sequence"], plain)
    two_docs = torch.cat([torch.arange(6), torch.arange(10)]).expand(2, -1)
    packed = elbo_nll(model, ids, mc_num=3, seed=2, position_ids=two_docs)["per_sequence"]
    assert not torch.allclose(packed, plain)  # the documents no longer see each other
    # what the bound sees: the second document's tokens do not reach the first one's logits
    changed = ids.clone()
    changed[:, 6:] = (changed[:, 6:] + 1) % (VOCAB - 1)
    with torch.no_grad():
        a = model.denoising_logits(ids, position_ids=two_docs)[:, :6]
        b = model.denoising_logits(changed, position_ids=two_docs)[:, :6]
    torch.testing.assert_close(a, b)


def test_bad_options_name_the_field():
    with pytest.raises(ValueError, match="weighting"):
        _objective(weighting="sqrt")
    with pytest.raises(ValueError, match="mask_token_id"):
        MaskedDiffusionObjective()
    with pytest.raises(ValueError, match="preset"):
        MaskedDiffusionObjective.from_preset("nope", mask_token_id=1)
    assert MaskedDiffusionObjective.from_preset("megadlms", mask_token_id=1).weighting == "measured"


def test_weighted_loss_of_a_uniform_model_by_hand():
    """Every logit 0, so each masked token costs log V. Two rows of 10, t forced to 0.25 and 0.5, and
    uniforms chosen so row 0 masks 2 tokens and row 1 masks 3. Then LLaDA's loss (batch) is
    (2 * 4 + 3 * 2) log V / (2 * 10); token normalisation (the NELBO per token) divides the same sum by
    the 20 real tokens, masked normalisation by the 5 masked ones, sample normalisation by the 2 rows;
    uniform weighting with masked normalisation gives log V, sequence normalisation
    (4 * 2 / 10 + 2 * 3 / 10) log V / 2, measured weighting (10/2 * 2 + 10/3 * 3) log V / 20."""

    class Forced(MaskedDiffusionObjective):
        def sample_t(self, sample_index, slot=None, group_size=None):
            return torch.tensor([0.25, 0.5])

        def sample_mask_uniforms(self, sample_index, positions):
            u = torch.ones(2, 10)
            u[0, [1, 7]] = 0.1  # < 0.25: masked
            u[1, [0, 4, 9]] = 0.4  # < 0.5: masked
            return u

    model = tiny_model()
    torch.nn.init.zeros_(model.lm_head.weight)
    log_v = math.log(VOCAB)
    cases = (({}, 14 * log_v / 20), ({"normalization": "token"}, 14 * log_v / 20),
             ({"normalization": "masked"}, 14 * log_v / 5), ({"normalization": "sample"}, 14 * log_v / 2),
             ({"normalization": "masked", "weighting": "uniform"}, log_v),
             ({"normalization": "sequence"}, (0.8 + 0.6) * log_v / 2),
             ({"weighting": "measured"}, 20 * log_v / 20))
    for options, expected in cases:
        loss, inputs = Forced(mask_token_id=MASK_ID, **options)(model, IDS[:2], torch.arange(2))
        assert inputs["masked"].sum(1).tolist() == [2, 3]
        assert loss.item() == pytest.approx(expected, rel=1e-5), options


def test_nothing_masked_gives_zero_loss_not_nan():
    class TinyT(MaskedDiffusionObjective):
        def sample_t(self, sample_index, slot=None, group_size=None):
            return torch.full(sample_index.shape, 1e-9)

    for normalization in NORMALIZATIONS:
        loss, inputs = TinyT(mask_token_id=MASK_ID, normalization=normalization)(tiny_model(), IDS, torch.arange(4))
        assert not inputs["masked"].any() and loss.item() == 0.0, normalization
