"""Every objective preset and normalisation against its source's own formula, written out by hand.

Each case draws its noise independently from `hashed_uniform` (the objective's documented streams:
0 = t, 1 = per-position mask uniforms, 2 / 3 = random-length cut and its length), runs the model on
the noisy ids, and computes the loss the way the peer's code does, from the full logits.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from hf_dlm import MaskedDiffusionObjective
from hf_dlm.diffusion.noise import hashed_uniform

from tests.utils import MASK_ID, VOCAB, tiny_model

B, L = 4, 12
IDS = torch.randint(0, VOCAB - 2, (B, L), generator=torch.Generator().manual_seed(1))
INDEX = torch.tensor([40, 41, 42, 43])


def _noise(index, eps, valid, seed=0):
    """t (B,) and the masked positions (B, L) as the objective's streams define them."""
    t = eps + (1 - eps) * hashed_uniform(seed, 0, index)
    u = hashed_uniform(seed, 1, index, torch.arange(L))
    return t, (u < t[:, None]) & valid, u


def _token_ce(model, noisy, attention_mask=None):
    with torch.no_grad():
        logits = model(input_ids=noisy, attention_mask=attention_mask).logits.float()  # (B, L, V)
    return F.cross_entropy(logits.transpose(1, 2), IDS, reduction="none")  # (B, L)


def _run(objective, model, **kwargs):
    with torch.no_grad():
        loss, inputs = objective(model, IDS, INDEX, **kwargs)
    return loss, inputs


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=5)


def test_llada_pretraining(model):
    """LLaDA GUIDELINES: p_mask = (1 - eps) t + eps; loss = sum(CE[masked] / p_mask[masked]) / (B * L)."""
    objective = MaskedDiffusionObjective.from_preset("llada", mask_token_id=MASK_ID, random_length_prob=0.0)
    t, masked, _ = _noise(INDEX, 1e-3, torch.ones(B, L, dtype=torch.bool))
    ce = _token_ce(model, torch.where(masked, MASK_ID, IDS))
    expected = (ce / t[:, None])[masked].sum() / (B * L)
    loss, inputs = _run(objective, model)
    assert torch.equal(inputs["masked"], masked)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)


def test_llada_sft_divides_each_row_by_its_answer_length(model):
    """LLaDA SFT: prompt never masked; loss = sum(CE / p_mask / answer_length[row]) / B."""
    prompt = torch.zeros(B, L, dtype=torch.bool)
    prompt[0, :3], prompt[1, :5], prompt[2, :1], prompt[3, :7] = True, True, True, True
    objective = MaskedDiffusionObjective.from_preset("llada", mask_token_id=MASK_ID, random_length_prob=0.0,
                                                     normalization="sequence")
    t, masked, _ = _noise(INDEX, 1e-3, ~prompt)
    answer_length = (~prompt).sum(1, keepdim=True).float()
    ce = _token_ce(model, torch.where(masked, MASK_ID, IDS))
    expected = (ce / t[:, None] / answer_length)[masked].sum() / B
    loss, inputs = _run(objective, model, prompt_mask=prompt)
    assert not inputs["masked"][prompt].any() and (inputs["labels"][prompt] == -100).all()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)


def _mdlm_subs_nelbo(logits, x0, xt, t, attention_mask, mask_index, noise_eps=0.0):
    """MDLM (kuleshov-group/mdlm diffusion.py), transcribed from its equations in float64:
    `_subs_parameterization`: logits[..., mask] += -1e6; log-softmax; at unmasked positions the log-prob of
    x_t's own token is 0 (all others -inf). `_forward_pass_diffusion` (subs): loss = -log p_theta(x0) *
    dsigma / expm1(sigma) with LogLinearNoise sigma(t) = -log1p(-(1 - eps) t), dsigma = (1 - eps) / (1 - (1 - eps) t).
    `_loss`: nlls = loss * attention_mask; token_nll = nlls.sum() / attention_mask.sum()."""
    logits = logits.double().clone()
    logits[:, :, mask_index] += -1000000.0
    log_p = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    unmasked = xt != mask_index
    log_p[unmasked] = -1000000.0
    log_p[unmasked, xt[unmasked]] = 0.0
    log_p_theta = torch.gather(log_p, -1, x0[:, :, None]).squeeze(-1)
    t = t.double()
    sigma = -torch.log1p(-(1 - noise_eps) * t)
    dsigma = (1 - noise_eps) / (1 - (1 - noise_eps) * t)
    loss = -log_p_theta * (dsigma / torch.expm1(sigma))[:, None]
    nlls = loss * attention_mask
    return nlls.sum() / attention_mask.sum()


def _large_mask_logit_model():
    """A tiny model whose [MASK] logit is the largest at most positions (the case SUBS changes most)."""
    model = tiny_model(seed=5)
    with torch.no_grad():
        hidden = model.model(input_ids=IDS).last_hidden_state.reshape(-1, model.config.hidden_size)
        model.lm_head.weight[MASK_ID] = 10.0 * hidden.mean(0) / hidden.mean(0).norm()
    return model


def test_mdlm_is_the_subs_nelbo_per_real_token():
    """The `mdlm` preset equals MDLM's SUBS NELBO per real token (padding present) on a model whose [MASK]
    logit is the largest; without SUBS the two differ by far more."""
    model = _large_mask_logit_model()
    attention = torch.ones(B, L, dtype=torch.long)
    attention[1, 9:], attention[3, 4:] = 0, 0
    objective = MaskedDiffusionObjective.from_preset("mdlm", mask_token_id=MASK_ID)
    assert objective.subs
    slot = torch.arange(B)  # INDEX is increasing
    t = 1e-3 + (1 - 1e-3) * ((hashed_uniform(0, 0, INDEX) / B + slot / B) % 1)
    masked = (hashed_uniform(0, 1, INDEX, torch.arange(L)) < t[:, None]) & attention.bool()
    xt = torch.where(masked, MASK_ID, IDS)
    with torch.no_grad():
        logits = model(input_ids=xt, attention_mask=attention).logits
    assert (logits.argmax(-1) == MASK_ID).float().mean() > 0.5
    expected = _mdlm_subs_nelbo(logits, IDS, xt, t, attention, MASK_ID)
    loss, inputs = _run(objective, model, attention_mask=attention)
    torch.testing.assert_close(inputs["t"], t)
    assert torch.equal(inputs["masked"], masked) and inputs["num_items_in_batch"] == attention.sum()
    assert abs(loss.double().item() - expected.item()) <= 1e-6 * expected.item()
    # the same under training (the head's fused gradient path) and its gradient matches the transcription's
    model.train()
    trained, _ = objective(model, IDS, INDEX, attention_mask=attention)
    assert abs(trained.double().item() - expected.item()) <= 1e-6 * expected.item()
    # without SUBS (the softmax keeps [MASK]) the loss is far from MDLM's
    plain, _ = _run(MaskedDiffusionObjective.from_preset("mdlm", mask_token_id=MASK_ID, subs=False), model,
                    attention_mask=attention)
    assert plain.item() > 1.2 * expected.item()


def test_mdlm_subs_gradient_equals_the_transcription():
    """d loss / d lm_head of the fused training head with SUBS equals autograd through the transcription."""
    model = _large_mask_logit_model().train()
    attention = torch.ones(B, L, dtype=torch.long)
    attention[2, 7:] = 0
    objective = MaskedDiffusionObjective.from_preset("mdlm", mask_token_id=MASK_ID)
    loss, inputs = objective(model, IDS, INDEX, attention_mask=attention)
    loss.backward()
    ours = model.lm_head.weight.grad.clone()
    model.zero_grad()
    logits = model(input_ids=inputs["input_ids"], attention_mask=attention).logits
    _mdlm_subs_nelbo(logits, IDS, inputs["input_ids"], inputs["t"], attention, MASK_ID).backward()
    assert ours[MASK_ID].abs().max() == 0  # [MASK] is never predicted: its row gets no gradient
    torch.testing.assert_close(ours, model.lm_head.weight.grad, rtol=1e-4, atol=1e-6)


def test_subs_elbo_evaluation_removes_mask_from_the_softmax():
    """`elbo_nll(subs=True)` scores every masked token with [MASK] out of the softmax (LLaDA's estimator on
    the SUBS model): equal to the bound recomputed by hand from the same draws."""
    from hf_dlm.diffusion.elbo import _row_seeded_masks, elbo_nll

    model = _large_mask_logit_model()
    attention = torch.ones(B, L, dtype=torch.long)
    attention[0, 8:] = 0
    seeds, mc = [3, 4, 5, 6], 4
    result = elbo_nll(model, IDS, attention, mc_num=mc, row_seeds=seeds, subs=True)
    plain = elbo_nll(model, IDS, attention, mc_num=mc, row_seeds=seeds)
    masks = _row_seeded_masks(attention.bool(), seeds, mc)
    expected = torch.zeros(B, dtype=torch.float64)
    for k in range(mc):
        with torch.no_grad():
            logits = model(input_ids=torch.where(masks[k], MASK_ID, IDS), attention_mask=attention).logits.double()
        logits[..., MASK_ID] = float("-inf")
        ce = F.cross_entropy(logits.transpose(1, 2), IDS, reduction="none")
        expected += (ce * masks[k]).sum(1) * attention.sum(1) / masks[k].sum(1) / mc
    torch.testing.assert_close(result["per_sequence"], expected, rtol=1e-5, atol=1e-6)
    assert (plain["per_sequence"] > result["per_sequence"] + 0.1).all()


def test_mdlm_is_the_nelbo_per_real_token(model):
    """Scale check: an untrained model's NELBO per token under the `mdlm` preset is near log V."""
    fresh = MaskedDiffusionObjective.from_preset("mdlm", mask_token_id=MASK_ID)
    zero = tiny_model()
    torch.nn.init.zeros_(zero.lm_head.weight)
    ids = torch.randint(0, VOCAB - 1, (64, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        nelbo, _ = fresh(zero, ids, torch.arange(64))
    # E_t[(1/t) * P(masked | t)] = 1: the NELBO per token of a uniform model over V - 1 tokens (SUBS) is log(V - 1)
    assert nelbo.item() == pytest.approx(math.log(VOCAB - 1), rel=0.05)


def test_megadlms_weights_by_the_measured_fraction_and_forces_a_mask(model):
    """MegaDLMs: p_mask = k / l measured per row (no eps), at least one masked token,
    loss = sum(CE[masked] * l / k) / (B * L)."""
    objective = MaskedDiffusionObjective.from_preset("megadlms", mask_token_id=MASK_ID, random_length_prob=0.0)
    t, masked, u = _noise(INDEX, 0.0, torch.ones(B, L, dtype=torch.bool))
    none = ~masked.any(1)
    masked[none, u[none].argmin(1)] = True  # the most likely token to mask is forced
    k = masked.sum(1, keepdim=True).float()
    ce = _token_ce(model, torch.where(masked, MASK_ID, IDS))
    expected = (ce * L / k)[masked].sum() / (B * L)
    loss, inputs = _run(objective, model)
    assert torch.equal(inputs["masked"], masked)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["token", "sequence", "batch"])
def test_dllm_modes(model, mode):
    """dllm MDLMTrainer: maskable = labels != -100 (no prompt, no padding); CE * 1/t on masked tokens;
    "token": / maskable.sum(); "sequence": / (maskable.sum(-1) * b); "batch": / b."""
    prompt = torch.zeros(B, L, dtype=torch.bool)
    prompt[:, :2] = True
    attention = torch.ones(B, L, dtype=torch.long)
    attention[0, 10:] = 0
    maskable = ~prompt & attention.bool()
    ours = {"token": "token", "sequence": "sequence", "batch": "sample"}[mode]
    objective = MaskedDiffusionObjective(mask_token_id=MASK_ID, eps=1e-3, normalization=ours)
    t, masked, _ = _noise(INDEX, 1e-3, maskable)
    ce = _token_ce(model, torch.where(masked, MASK_ID, IDS), attention) * (1 / t[:, None]) * masked
    if mode == "token":
        expected = (ce / maskable.sum()).sum()
    elif mode == "sequence":
        expected = (ce / (maskable.sum(-1, keepdim=True) * B)).sum()
    else:
        expected = (ce / B).sum()
    loss, _ = _run(objective, model, attention_mask=attention, prompt_mask=prompt)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)


def test_shifted_labels_weights_sit_exactly_where_labels_are(model):
    """Shift alignment (Dream): logits at i - 1 predict token i; position 0 is never masked; the label
    weight is non-zero exactly where a label is; the loss is the shifted CE of the masked tokens."""
    objective = MaskedDiffusionObjective(mask_token_id=MASK_ID, label_alignment="shift", normalization="token")
    valid = torch.ones(B, L, dtype=torch.bool)
    valid[:, 0] = False
    t, masked, _ = _noise(INDEX, 1e-3, valid)
    out = objective.corrupt(IDS, INDEX)
    assert torch.equal(out["masked"], masked)
    expected_labels = torch.full((B, L), -100)
    expected_labels[:, :-1] = torch.where(masked[:, 1:], IDS[:, 1:], -100)
    assert torch.equal(out["labels"], expected_labels)
    assert torch.equal(out["label_weights"] != 0, expected_labels != -100)
    torch.testing.assert_close(out["label_weights"][:, :-1][masked[:, 1:]], (1 / t[:, None]).expand(B, L)[:, 1:][masked[:, 1:]])
    with torch.no_grad():
        logits = model(input_ids=out["input_ids"]).logits.float()
    ce = F.cross_entropy(logits[:, :-1].transpose(1, 2), IDS[:, 1:], reduction="none")  # (B, L - 1)
    expected = (ce / t[:, None])[masked[:, 1:]].sum() / (L - 1) / B
    loss, _ = _run(objective, model)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)


def test_at_least_one_masked_never_forces_a_prompt_or_pad_token():
    """t tiny: nothing is masked by chance, so every row is forced; the forced token is the supervised
    position with the smallest uniform, never a prompt or padding position (which have smaller ones)."""
    objective = MaskedDiffusionObjective(mask_token_id=MASK_ID, eps=0.0, at_least_one_masked=True)
    index = torch.arange(200, 264)
    ids = torch.randint(0, VOCAB - 2, (64, L), generator=torch.Generator().manual_seed(2))
    prompt = torch.zeros(64, L, dtype=torch.bool)
    prompt[:, :4] = True
    attention = torch.ones(64, L, dtype=torch.long)
    attention[:, 9:] = 0
    attention[5] = 0  # a row that is all padding gets nothing
    attention[5, :4] = 1
    tiny = torch.full((64,), 1e-6)
    objective.sample_t = lambda sample_index, slot=None, group_size=None: tiny
    out = objective.corrupt(ids, index, attention_mask=attention, prompt_mask=prompt)
    supervised = attention.bool() & ~prompt
    u = hashed_uniform(0, 1, index, torch.arange(L))
    forced = torch.where(supervised, u, 2.0).argmin(1)
    expected = torch.zeros(64, L, dtype=torch.bool)
    expected[torch.arange(64), forced] = True
    expected[5] = False
    assert torch.equal(out["masked"], expected)
    assert not out["masked"][~supervised].any()
    # the prompt or pad position with the row's smallest uniform would have been chosen without the guard
    assert bool((u.argmin(1) != forced).any())


def test_random_length_cut_by_hand(model):
    """With probability p a sample keeps a prefix of 2 + floor(u_len * (L - 1)) tokens: the rest is not
    attended, never masked and not counted by the per-token normaliser."""
    objective = MaskedDiffusionObjective(mask_token_id=MASK_ID, normalization="token", random_length_prob=0.5)
    index = torch.arange(1000, 1000 + B)
    cut = hashed_uniform(0, 2, index) < 0.5
    length = torch.where(cut, 2 + (hashed_uniform(0, 3, index) * (L - 1)).long(), L)
    assert cut.any() and not cut.all()  # these indices exercise both branches
    keep = torch.arange(L)[None] < length[:, None]
    t, masked, _ = _noise(index, 1e-3, keep)
    out = objective.corrupt(IDS, index)
    assert torch.equal(out["attention_mask"], keep.long()) and torch.equal(out["masked"], masked)
    assert out["num_items_in_batch"] == length.sum()
    with torch.no_grad():
        loss, _ = objective(model, IDS, index)
    ce = _token_ce(model, torch.where(masked, MASK_ID, IDS), keep.long())
    torch.testing.assert_close(loss, (ce / t[:, None])[masked].sum() / length.sum(), rtol=1e-5, atol=1e-6)


def test_ar_mode_averages_next_token_ce_over_real_tokens():
    causal = tiny_model(attention_mode="causal", label_alignment="shift")
    objective = MaskedDiffusionObjective.from_preset("ar", mask_token_id=MASK_ID)
    attention = torch.ones(B, L, dtype=torch.long)
    attention[2, 7:] = 0
    with torch.no_grad():
        loss, _ = objective(causal, IDS, INDEX, attention_mask=attention)
        logits = causal(input_ids=IDS, attention_mask=attention).logits.float()
    ce = F.cross_entropy(logits[:, :-1].transpose(1, 2), IDS[:, 1:], reduction="none")
    real = attention[:, 1:].bool()
    torch.testing.assert_close(loss, ce[real].sum() / real.sum(), rtol=1e-5, atol=1e-6)


def test_every_preset_names_its_source():
    from hf_dlm.diffusion import objective as module

    source = open(module.__file__).read()
    for name, words in (("llada", "LLaDA"), ("mdlm", "kuleshov-group/mdlm"), ("megadlms", "MegaDLMs"), ("ar", "AR")):
        comment = source[source.index(f'    "{name}": dict') - 400: source.index(f'    "{name}": dict')]
        assert words in comment, name


def test_trainers_pass_subs_to_the_model():
    """The trainers' model inputs (`corrupted_model_inputs`) carry SUBS: their loss equals the objective's."""
    from hf_dlm.training.diffusion_batch import corrupted_model_inputs

    model = _large_mask_logit_model()
    objective = MaskedDiffusionObjective.from_preset("mdlm", mask_token_id=MASK_ID)
    batch = {"input_ids": IDS, "sample_index": INDEX}
    inputs, corrupted = corrupted_model_inputs(objective, batch, "cpu", (INDEX, B), "bidirectional")
    expected, _ = _run(objective, model)
    with torch.no_grad():
        loss = model(**inputs, num_items_in_batch=corrupted["num_items_in_batch"]).loss
    torch.testing.assert_close(loss, expected)


def test_preset_parity_table(tmp_path):
    """benchmarks/preset_parity.py (the README's preset table), one seed: every preset and option equals its
    source's transcription on the same draws, and the rows that name a different convention do not."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "preset_parity.py")
    spec = importlib.util.spec_from_file_location("preset_parity", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rows = {r["preset"]: r for r in module.main(["--tiny", "--json", str(tmp_path / "rows.json")])}
    different = {"mdlm with subs=False (before)", "mdlm with subs=False, large [MASK] logit",
                 "d1 estimator at rollout temperature 0.9 (default; mean nats/token)"}
    for name, r in rows.items():
        if r["max_rel_diff"] is None:
            continue
        if name in different:
            assert r["max_rel_diff"] > 1e-4, name
        else:
            assert r["max_rel_diff"] < 1e-6, (name, r["max_rel_diff"])
    assert rows["mdlm with subs=False, large [MASK] logit"]["max_rel_diff"] > 0.1
