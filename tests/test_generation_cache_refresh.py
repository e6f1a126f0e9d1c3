"""Fast-dLLM's approximate caches against a transcription of the published algorithm (Wu et al. 2025,
"Fast-dLLM", `generate_with_prefix_cache` / `generate_with_dual_cache`): at each block start one forward
over the whole canvas refreshes every position's keys / values; the block's later steps run the block
(dual) or the block and everything after it (prefix) against the stored keys of the other positions.
Greedy, LLaDA's low-confidence commits (a fixed number per step)."""

import pytest
import torch

from hf_dlm.generation.cache import DLMKVCache
from hf_dlm.generation.sampling import num_transfer_tokens
from tests.utils import tiny_model

PROMPT, NEW, BLOCK, STEPS = 5, 12, 4, 6  # 3 blocks of 4 tokens, 2 steps per block: 2 commits per step


def _fast_dllm(model, prompt, cache_kind):
    """One row, greedy -> (canvas, the block's logits at every step). Also checks each commit was decided by a clear margin (top-1 vs top-2 logit, and
    the k-th vs (k+1)-th confidence), so kernel rounding (~1e-6) cannot flip it on another CPU."""
    mask_id = model.config.mask_token_id
    canvas = torch.cat([prompt, torch.full((1, NEW), mask_id)], 1)
    total = canvas.shape[1]
    attention = torch.ones_like(canvas)
    steps_per_block = STEPS // (NEW // BLOCK)
    seen = []
    for start in range(PROMPT, total, BLOCK):
        end = start + BLOCK
        budget = num_transfer_tokens(canvas[:, start:end].eq(mask_id).sum(1), steps_per_block)[0]
        cache = DLMKVCache(attention, torch.arange(total).unsqueeze(0))
        for step in range(steps_per_block):
            if step == 0:  # refresh: the whole canvas, keys / values stored
                logits = model(input_ids=canvas, kv_cache=cache.window(0, None, store=True)).logits[:, start:end]
            elif cache_kind == "dual":
                logits = model(input_ids=canvas[:, start:end], kv_cache=cache.window(start)).logits
            else:
                logits = model(input_ids=canvas[:, start:], kv_cache=cache.window(start)).logits[:, :BLOCK]
            seen.append(logits[0].float())
            top2 = logits[0].float().topk(2, dim=-1).values
            assert float((top2[:, 0] - top2[:, 1]).min()) > 1e-4
            tokens = logits[0].argmax(-1)
            confidence = logits[0].float().softmax(-1).max(-1).values
            confidence = torch.where(canvas[0, start:end].eq(mask_id), confidence, -1.0)
            k = int(budget[step])
            ranked = confidence.sort(descending=True).values
            if k < BLOCK and ranked[k] > -1:
                assert float(ranked[k - 1] - ranked[k]) > 1e-5
            chosen = confidence.topk(k).indices
            canvas[0, start + chosen] = tokens[chosen]
    return canvas, seen


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_fast_dllm_caches_equal_the_transcription(monkeypatch, cache):
    """The tokens and the logits of every step equal the transcription's (1e-5: the same float32 math through
    a different attention path, softmax sums in another order); the logits of dual and prefix differ by far
    more (the suffix's keys are stale in dual), so the comparison tells them apart."""
    import hf_dlm.generation.sampler as sampler

    torch.manual_seed(0)
    model = tiny_model(attention_mode="bidirectional").eval()
    prompt = torch.randint(0, model.config.mask_token_id, (1, PROMPT), generator=torch.Generator().manual_seed(4))
    seen = []
    decide = sampler.decide_step

    def recording(logits, *args, **kwargs):
        seen.append(logits[0, -BLOCK:].float().clone())  # the block's columns (the window may start earlier)
        return decide(logits, *args, **kwargs)

    monkeypatch.setattr(sampler, "decide_step", recording)
    with torch.no_grad():
        expected, expected_logits = _fast_dllm(model, prompt.clone(), cache)
        _, other_logits = _fast_dllm(model, prompt.clone(), "dual" if cache == "prefix" else "prefix")
        out = model.generate(prompt, max_new_tokens=NEW, block_length=BLOCK, steps=STEPS, temperature=0.0,
                             cache=cache)
    assert torch.equal(out, expected)
    assert len(seen) == len(expected_logits) == STEPS
    for step, (got, want, other) in enumerate(zip(seen, expected_logits, other_logits)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=f"{cache} step {step}")
    stale = max(float((a - b).abs().max()) for a, b in zip(expected_logits, other_logits))
    assert stale > 1e-3  # the case discriminates dual from prefix
