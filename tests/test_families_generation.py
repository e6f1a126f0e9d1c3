"""Each family's sampler through `model.generate` (the decoding core) with the family's published defaults
equals a transcription of the source's own generate on tiny random models: LLaDA's `generate.py`
(semi-autoregressive blocks, low-confidence remasking), the same with Dream's logit shift, Dream's `_sample`
(its timestep schedule of tokens per step, entropy / maskgit_plus / topk_margin orders), LLaDA2's `generate`
(block diffusion under the block-causal mask, threshold commits with a top-k floor, blocks aligned to the
positions so the prompt's partial block comes first), which SDAR's `low_confidence_dynamic` remasking shares
(threshold 0.85), and Fast-dLLM v2's `batch_sample` (aligned blocks of 32 in sub-blocks of 8, each block's first
token from the previous position's logits, the token shift). Transcriptions run greedy (the sources draw with
torch's samplers, which no other code reproduces draw for draw) and leave out the stop-token handling."""

import pytest
import torch
import torch.nn.functional as F

import hf_dlm  # noqa: F401
from tests.utils import FAMILY_MASK as MASK
from tests.utils import tiny_family


def tiny(name, seed=0):
    model = tiny_family(name, seed)
    if not model.config.tie_word_embeddings:  # the sources let [MASK] win the argmax (and stay masked); the core
        with torch.no_grad():  # never proposes it: keep it out of reach
            model.get_output_embeddings().weight[MASK] = 0
    return model


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



def dream_generate(model, ids, new_tokens, steps, alg, eps=1e-3):
    """Dream's `DreamGenerationMixin._sample` (temperature 0, no top-p / top-k, alg_temp 0), batch 1: logits shifted
    by one; each step commits, by top-k of the alg's confidence over every mask, int(m * (1 - s / t)) of the m masks
    left with t, s consecutive timesteps of linspace(1, eps, steps + 1), every mask left at the last step. A step
    whose count is 0 commits nothing (its forward is skipped here: greedy, nothing else depends on it)."""
    x = torch.cat([ids, torch.full((1, new_tokens), MASK, dtype=torch.long)], dim=1)
    timesteps = torch.linspace(1, eps, steps + 1)
    for i in range(steps):
        mask_index = x == MASK
        t, s = timesteps[i], timesteps[i + 1]
        num_mask_token = mask_index.sum() / mask_index.shape[0]
        count = int(num_mask_token * (1 - s / t)) if i < steps - 1 else int(num_mask_token)
        if count == 0:
            continue
        logits = model(x).logits
        logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
        probs = torch.softmax(logits[mask_index], dim=-1)
        confidence, x0 = probs.max(dim=-1)
        if alg == "topk_margin":
            top = probs.sort(dim=-1, descending=True).values
            confidence = top[:, 0] - top[:, 1]
        elif alg == "entropy":
            confidence = (probs * torch.log(probs + 1e-10)).sum(-1)
        full_confidence = torch.full(x.shape, -torch.inf)
        full_confidence[mask_index] = confidence
        transfer = full_confidence.topk(count).indices
        candidate = torch.full_like(x, MASK)
        candidate[mask_index] = x0
        x[0, transfer[0]] = candidate[0, transfer[0]]
    return x


def fast_dllm_v2_generate(model, ids, block, sub_block, new_tokens, threshold):
    """Fast-dLLM v2's `batch_sample` (batch 1, temperature 0, use_block_cache=False, no stop token). The prompt's
    whole blocks are prefilled, and when the prompt ends on a block boundary their last position's logits give the
    next token; blocks then run from the prompt's partial one to new_tokens // block + P // block: the block's masks
    are decided sub-block by sub-block, each step re-running the block over the cached prefix with the logits
    shifted by one (i-1 predicts i) and committing the sub-block's masks with p > threshold, at least the most
    likely one; the forward of the finished block gives the next block's first token (argmax of its last position).
    The block-causal model makes the cached prefix equal to recomputing it, which this transcription does."""
    P = ids.shape[1]
    assert P != block  # batch_sample prefills only prompts longer than a block (at exactly one it drops the prompt)
    x = ids.clone()
    if P > block and P % block == 0:
        x = torch.cat([x, model(x).logits[:, -1:].argmax(-1)], dim=1)
    for b in range(P // block, new_tokens // block + P // block):
        x = torch.cat([x, torch.full((1, (b + 1) * block - x.shape[1]), MASK, dtype=torch.long)], dim=1)
        for sub in range(block // sub_block):
            lo, hi = b * block + sub * sub_block, b * block + (sub + 1) * sub_block
            while (x[:, lo:hi] == MASK).any():
                logits = model(x).logits
                logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)[:, lo:hi]
                probs = torch.softmax(logits, dim=-1)
                x1 = probs.argmax(-1)
                masked = x[:, lo:hi] == MASK
                x1_p = torch.where(masked, probs.gather(-1, x1[..., None])[..., 0], -torch.inf)
                unmask = x1_p > threshold
                unmask[0, x1_p[0].argmax()] = True
                unmask &= masked
                x[:, lo:hi][unmask] = x1[unmask]
        x = torch.cat([x, model(x).logits[:, -1:].argmax(-1)], dim=1)
    return x

def test_published_sampler_defaults():
    llada, llada2, sdar = tiny("llada"), tiny("llada2_moe"), tiny("sdar")
    assert (llada.generation_config.steps, llada.generation_config.block_length,
            llada.generation_config.remasking) == (128, 32, "low_confidence")
    assert (llada2.generation_config.block_length, llada2.generation_config.threshold,
            llada2.generation_config.cache) == (32, 0.95, "prefix")
    assert (sdar.generation_config.block_length, sdar.generation_config.threshold) == (4, 0.85)
    assert llada2.generation_config.align_blocks and sdar.generation_config.align_blocks
    dream = tiny("Dream").generation_config
    assert (dream.remasking, dream.schedule, dream.schedule_eps, dream.steps) == ("entropy", "dream", 1e-3, 512)
    fast = tiny("Fast_dLLM_Qwen").generation_config
    assert (fast.block_length, fast.sub_block_length, fast.threshold, fast.first_token_alone, fast.align_blocks,
            fast.cache) == (32, 8, 0.95, True, True, "prefix")


@pytest.mark.parametrize("name", ["llada", "lladamoe"])
def test_llada_semi_autoregressive_blocks_equal_llada_generate(name):
    """LLaDA's published defaults (blocks of 32, one token a step, low confidence, greedy), which LLaDA-MoE ships
    too, and 2 tokens a step in blocks of 8."""
    model = tiny(name)
    ids = prompt(6)
    with torch.no_grad():
        defaults = model.generate(ids, max_new_tokens=64, steps=64)  # the 128 / 128 defaults at half the length
        assert torch.equal(defaults, llada_generate(model, ids, steps=64, gen_length=64, block_length=32))
        expected = llada_generate(model, ids, steps=8, gen_length=16, block_length=8)
        out = model.generate(ids, max_new_tokens=16, steps=8, block_length=8)  # 2 tokens a step: ties matter less
    assert torch.equal(out, expected)


def test_dream_logit_shift_equals_dream_alignment():
    model = tiny("Dream")
    ids = prompt(5, seed=1)
    settings = dict(max_new_tokens=8, steps=8, block_length=8, remasking="low_confidence", do_sample=False,
                    schedule="even")  # LLaDA's loop with Dream's alignment
    with torch.no_grad():
        expected = llada_generate(model, ids, steps=8, gen_length=8, block_length=8, shift=True)
        unshifted = llada_generate(model, ids, steps=8, gen_length=8, block_length=8, shift=False)
        out = model.generate(ids, **settings)
    assert torch.equal(out, expected) and not torch.equal(out, unshifted)  # the shift matters here


@pytest.mark.parametrize("name,threshold,prompt_length", [
    ("llada2_moe", None, 8), ("sdar", None, 8), ("sdar_moe", None, 8), ("llada2_moe", 0.1, 8), ("sdar", 0.2, 8),
    ("llada2_moe", None, 6), ("llada2_moe", 0.1, 9), ("sdar", 0.2, 7), ("sdar_moe", None, 5)])
def test_block_diffusion_equals_llada2_generate(name, threshold, prompt_length):
    """The published threshold, and a low one under which several tokens commit per step; prompts of whole blocks
    and prompts that end inside a block (the published generate decodes the rest of that block first, and decodes
    its last block whole before cutting at gen_length: `align_blocks`, a family default); the exact block cache and
    the uncached core agree."""
    model = tiny(name)
    block = model.config.block_size = 4
    threshold = threshold if threshold is not None else model.generation_config.threshold
    ids = prompt(prompt_length, seed=2)
    with torch.no_grad():
        expected = block_diffusion_generate(model, ids, block, 12, threshold)
        cached = model.generate(ids, max_new_tokens=12, block_length=block, threshold=threshold)
        uncached = model.generate(ids, max_new_tokens=12, block_length=block, threshold=threshold, cache="none")
    assert torch.equal(cached, expected) and torch.equal(uncached, expected)
    if prompt_length % block:  # blocks from the prompt end instead: another sampler, other tokens
        unaligned = model.generate(ids, max_new_tokens=12, block_length=block, threshold=threshold, align_blocks=False)
        assert not torch.equal(unaligned, expected)


def test_aligned_blocks_in_a_left_padded_batch_equal_each_row_alone():
    """Rows whose padding puts their aligned blocks on different slots are decoded in groups: each equals itself."""
    from tests.utils import left_padded

    model = tiny("llada2_moe")
    model.config.block_size = 4
    prompts, input_ids, attention_mask = left_padded([6, 9, 5, 8], seed=3)
    options = dict(max_new_tokens=8, block_length=4, threshold=0.3)
    with torch.no_grad():
        batch = model.generate(input_ids, attention_mask=attention_mask, **options)
        for row, ids in enumerate(prompts):
            alone = model.generate(ids[None], **options)
            assert torch.equal(batch[row, input_ids.shape[1]:], alone[0, len(ids):]), row


@pytest.mark.parametrize("alg,remasking", [("entropy", "entropy"), ("maskgit_plus", "low_confidence"),
                                           ("topk_margin", "margin")])
@pytest.mark.parametrize("steps", [8, 24])
def test_dream_schedule_equals_dream_sample(alg, remasking, steps):
    """Dream's defaults (schedule='dream', one block, 'entropy'), greedy; steps = max_new_tokens as Dream's README
    runs it (most counts then 0 or 1, the rest at the last step) and fewer steps (several tokens a step)."""
    model = tiny("Dream")
    ids = prompt(5, seed=4)
    with torch.no_grad():
        expected = dream_generate(model, ids, 24, steps, alg)
        options = dict(max_new_tokens=24, steps=steps, remasking=remasking, do_sample=False, top_p=None)
        out = model.generate(ids, return_dict_in_generate=True, **options)
        even = model.generate(ids, schedule="even", **options)
    assert torch.equal(out.sequences, expected)
    if steps == 8:  # counts 2, 3, ..., 3, 4: the schedule matters here
        assert not torch.equal(even, expected)
    else:  # counts 0, 1, ..., 1, 2: the first step commits nothing (no forward), the last two masks go together
        assert len(out.forward_batch_sizes) == 23


@pytest.mark.parametrize("prompt_length,threshold", [(5, None), (37, None), (64, None), (5, 0.3), (64, 0.3)])
def test_fast_dllm_v2_equals_batch_sample(prompt_length, threshold):
    """Fast-dLLM v2's defaults (block 32, sub-blocks of 8, threshold 0.95, the token shift, each block's first token
    alone); a prompt inside the first block, one ending inside a later block and one on a block boundary (its next
    token from the prefill's last position); a low threshold under which several tokens commit per step. The exact
    block cache and the uncached core agree."""
    model = tiny("Fast_dLLM_Qwen")
    threshold = threshold if threshold is not None else model.generation_config.threshold
    ids = prompt(prompt_length, seed=5)
    new_tokens = 32  # batch_sample's blocks: 32 // 32 + P // 32, so it decodes up to the end of the block after P
    end = (prompt_length // 32 + 1) * 32
    with torch.no_grad():
        expected = fast_dllm_v2_generate(model, ids, 32, 8, new_tokens, threshold)[:, :end]
        cached = model.generate(ids, max_new_tokens=end - prompt_length, threshold=threshold)
        uncached = model.generate(ids, max_new_tokens=end - prompt_length, threshold=threshold, cache="none")
        whole_blocks = model.generate(ids, max_new_tokens=end - prompt_length, threshold=threshold,
                                      sub_block_length=None)
    assert torch.equal(cached, expected) and torch.equal(uncached, expected)
    assert not torch.equal(whole_blocks, expected)  # the sub-blocks matter here


def test_published_generation_config_keeps_ids_and_takes_the_family_sampler(tmp_path, caplog):
    """A checkpoint's own generation_config.json (Fast-dLLM v2 ships its Qwen parent's: repetition_penalty,
    temperature, top_k) keeps its token ids; the family's sampler defaults replace what they name and the options
    the diffusion sampler cannot honour are reset, named in a warning. A file hf-dlm wrote is used as saved."""
    import json
    import logging

    from transformers import AutoModelForMaskedLM

    model = tiny("Fast_dLLM_Qwen")
    model.save_pretrained(tmp_path / "published")
    (tmp_path / "published" / "generation_config.json").write_text(json.dumps({
        "bos_token_id": 1, "eos_token_id": [2, 3], "pad_token_id": 1, "do_sample": True, "repetition_penalty": 1.05,
        "temperature": 0.7, "top_k": 20, "top_p": 0.8}))
    with caplog.at_level(logging.WARNING):
        loaded = AutoModelForMaskedLM.from_pretrained(tmp_path / "published")
    config = loaded.generation_config
    assert (config.eos_token_id, config.pad_token_id, config.repetition_penalty) == ([2, 3], 1, 1.0)
    assert (config.do_sample, config.threshold, config.sub_block_length, config.align_blocks) == (False, 0.95, 8, True)
    assert "repetition_penalty" in caplog.text
    ids = prompt(5)
    with torch.no_grad():
        assert torch.equal(loaded.generate(ids, max_new_tokens=27), model.generate(ids, max_new_tokens=27))

    loaded.generation_config.threshold, loaded.generation_config.align_blocks = 0.5, False
    loaded.save_pretrained(tmp_path / "saved")
    again = AutoModelForMaskedLM.from_pretrained(tmp_path / "saved").generation_config
    assert (again.threshold, again.align_blocks, again.sub_block_length, again.eos_token_id) == (0.5, False, 8, [2, 3])


def test_aligned_block_bounds_and_refused_combinations():
    from hf_dlm.generation.sampling import block_bounds
    from hf_dlm.utils.errors import FieldError

    # prompt of 6 (slots 0..5), 10 new tokens, blocks of 4: the rest of block [4, 8), then [8, 12), [12, 16)
    assert block_bounds(6, 10, 4, 0) == ([(6, 8, 2), (8, 12, 0), (12, 16, 0)], 16)
    # one slot of left padding: position 0 at slot 1, boundaries at slots 1, 5, 9, ...; canvas to slot 17
    assert block_bounds(6, 10, 4, 1) == ([(6, 9, 1), (9, 13, 0), (13, 17, 0)], 17)
    assert block_bounds(6, 8, 4) == ([(6, 10, 0), (10, 14, 0)], 14)  # unaligned: from the prompt end
    model = tiny("llada")
    for name, value in (("sub_block_length", 8), ("first_token_alone", True)):
        with pytest.raises(FieldError, match=name) as error:  # LLaDA's budget counts the whole block
            model.generate(prompt(4), max_new_tokens=8, block_length=8, **{name: value})
        assert error.value.field == name
    with pytest.raises(FieldError, match="schedule"):
        model.generate(prompt(4), max_new_tokens=8, schedule="cosine")
