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


def test_mdlm_is_the_nelbo_per_real_token(model):
    """MDLM `_loss`: nlls = (-log p * 1/t on masked tokens, 0 elsewhere) * attention_mask;
    loss = nlls.sum() / attention_mask.sum(); t stratified over the batch (`_sample_t`)."""
    attention = torch.ones(B, L, dtype=torch.long)
    attention[1, 9:], attention[3, 4:] = 0, 0
    objective = MaskedDiffusionObjective.from_preset("mdlm", mask_token_id=MASK_ID)
    slot = torch.arange(B)  # INDEX is increasing
    t = 1e-3 + (1 - 1e-3) * ((hashed_uniform(0, 0, INDEX) / B + slot / B) % 1)
    masked = (hashed_uniform(0, 1, INDEX, torch.arange(L)) < t[:, None]) & attention.bool()
    ce = _token_ce(model, torch.where(masked, MASK_ID, IDS), attention)
    nlls = ce * masked / t[:, None] * attention
    expected = nlls.sum() / attention.sum()
    loss, inputs = _run(objective, model, attention_mask=attention)
    torch.testing.assert_close(inputs["t"], t)
    assert torch.equal(inputs["masked"], masked) and inputs["num_items_in_batch"] == attention.sum()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    # the scale a user compares with an evaluation NLL: an untrained model is near log V per token
    fresh = MaskedDiffusionObjective.from_preset("mdlm", mask_token_id=MASK_ID)
    zero = tiny_model()
    torch.nn.init.zeros_(zero.lm_head.weight)
    ids = torch.randint(0, VOCAB - 1, (64, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        nelbo, _ = fresh(zero, ids, torch.arange(64))
    # E_t[(1/t) * P(masked | t)] = 1: the NELBO per token of a uniform model is log V (here within 5%)
    assert nelbo.item() == pytest.approx(math.log(VOCAB), rel=0.05)


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
