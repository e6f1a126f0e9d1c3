"""Each family's sampler through `model.generate` (the decoding core) with the family's published defaults
equals a transcription of the source's own generate on tiny random models: LLaDA's `generate.py`
(semi-autoregressive blocks, low-confidence remasking), the same with Dream's logit shift, and LLaDA2's
`generate` (block diffusion under the block-causal mask, threshold commits with a top-k floor), which SDAR's
`low_confidence_dynamic` remasking shares (threshold 0.85)."""

import pytest
import torch
import torch.nn.functional as F

import hf_dlm  # noqa: F401
from tests.utils import FAMILY_MASK as MASK
from tests.utils import tiny_family as tiny


def prompt(length, seed=0):
    return torch.randint(0, 120, (1, length), generator=torch.Generator().manual_seed(seed))


def llada_generate(model, ids, steps, gen_length, block_length, shift=False):
    """LLaDA's `generate.py` (temperature 0, no CFG, low-confidence remasking), batch 1; `shift`: Dream's
    alignment, the logits at i-1 predict token i (`cat([logits[:, :1], logits[:, :-1]])`)."""
    P = ids.shape[1]
    x = torch.full((1, P + gen_length), MASK, dtype=torch.long)
    x[:, :P] = ids
    num_blocks = gen_length // block_length
    steps_per_block = steps // num_blocks
    for b in range(num_blocks):
        block = x[:, P + b * block_length: P + (b + 1) * block_length] == MASK
        count = block.sum(dim=1, keepdim=True)
        num_transfer = torch.zeros(1, steps_per_block, dtype=torch.long) + count // steps_per_block
        num_transfer[:, : int(count % steps_per_block)] += 1
        for i in range(steps_per_block):
            mask_index = x == MASK
            logits = model(x).logits
            if shift:
                logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
            x0 = logits.argmax(-1)
            x0_p = F.softmax(logits, dim=-1).gather(-1, x0[..., None])[..., 0]
            x0_p[:, P + (b + 1) * block_length:] = -torch.inf
            x0 = torch.where(mask_index, x0, x)
            confidence = torch.where(mask_index, x0_p, -torch.inf)
            _, select = torch.topk(confidence[0], k=int(num_transfer[0, i]))
            x[0, select] = x0[0, select]
    return x


def block_diffusion_generate(model, ids, block_length, gen_length, threshold):
    """LLaDA2MoeModelLM.generate (temperature 0, steps = block_length, so at least one commit a step), batch 1:
    the whole prefix recomputed under tril(ones(nb, nb)).repeat_interleave(block_length) each step."""
    P = ids.shape[1]
    num_blocks = (P + gen_length + block_length - 1) // block_length
    total = num_blocks * block_length
    allowed = torch.tril(torch.ones(num_blocks, num_blocks)).repeat_interleave(block_length, 0).repeat_interleave(block_length, 1)
    mask4d = allowed.log()[None, None]
    x = torch.full((1, total), MASK, dtype=torch.long)
    x[:, :P] = ids
    for b in range(P // block_length, num_blocks):
        end = (b + 1) * block_length
        window = x[:, :end]
        for _ in range(block_length):
            active = window[:, -block_length:] == MASK
            if active.sum() == 0:
                break
            logits = model(window, attention_mask=mask4d[:, :, :end, :end], position_ids=torch.arange(end)[None]).logits
            probs = F.softmax(logits[:, -block_length:], dim=-1)
            x0 = probs.argmax(-1)
            confidence = torch.where(active, probs.gather(-1, x0[..., None])[..., 0], -torch.inf)
            transfer = torch.zeros_like(x0, dtype=torch.bool)
            high = confidence[0] > threshold
            if high.sum() >= 1:
                transfer[0] = high
            else:
                transfer[0, confidence[0].argmax()] = True
            window[:, -block_length:][transfer] = x0[transfer]
    return x[:, : P + gen_length]


def test_published_sampler_defaults():
    llada, llada2, sdar = tiny("llada"), tiny("llada2_moe"), tiny("sdar")
    assert (llada.generation_config.steps, llada.generation_config.block_length,
            llada.generation_config.remasking) == (128, 32, "low_confidence")
    assert (llada2.generation_config.block_length, llada2.generation_config.threshold,
            llada2.generation_config.cache) == (32, 0.95, "prefix")
    assert (sdar.generation_config.block_length, sdar.generation_config.threshold) == (4, 0.85)
    assert tiny("Dream").generation_config.remasking == "entropy"


def test_llada_semi_autoregressive_blocks_equal_llada_generate():
    model = tiny("llada")
    ids = prompt(6)
    with torch.no_grad():
        expected = llada_generate(model, ids, steps=8, gen_length=16, block_length=8)
        out = model.generate(ids, max_new_tokens=16, steps=8, block_length=8)  # 2 tokens a step: ties matter less
    assert torch.equal(out, expected)


def test_dream_logit_shift_equals_dream_alignment():
    model = tiny("Dream")
    ids = prompt(5, seed=1)
    settings = dict(max_new_tokens=8, steps=8, block_length=8, remasking="low_confidence", do_sample=False)
    with torch.no_grad():
        expected = llada_generate(model, ids, steps=8, gen_length=8, block_length=8, shift=True)
        unshifted = llada_generate(model, ids, steps=8, gen_length=8, block_length=8, shift=False)
        out = model.generate(ids, **settings)
    assert torch.equal(out, expected) and not torch.equal(out, unshifted)  # the shift matters here


@pytest.mark.parametrize("name,threshold", [("llada2_moe", None), ("sdar", None), ("sdar_moe", None),
                                            ("llada2_moe", 0.1), ("sdar", 0.2)])
def test_block_diffusion_equals_llada2_generate(name, threshold):
    """Prompt of whole blocks (the published generate starts its first block at the prompt's last block
    boundary; hf-dlm's core starts at the prompt end, which equals it there). The published threshold, and a
    low one under which several tokens commit per step; the exact block cache and the uncached core agree."""
    model = tiny(name)
    block = model.config.block_size = 4
    threshold = threshold if threshold is not None else model.generation_config.threshold
    ids = prompt(8, seed=2)
    with torch.no_grad():
        expected = block_diffusion_generate(model, ids, block, 12, threshold)
        cached = model.generate(ids, max_new_tokens=12, block_length=block, threshold=threshold)
        uncached = model.generate(ids, max_new_tokens=12, block_length=block, threshold=threshold, cache="none")
    assert torch.equal(cached, expected) and torch.equal(uncached, expected)
