"""Commit rules against transcriptions of their published algorithms (written out here from the sources' text,
per row, with Python loops), on equal logits and through whole generations on a tiny model."""

import math

import pytest
import torch

from hf_dlm.generation.commit_rules import (COMMIT_RULES, CommitSettings, decide_step, entropy_bound_commits,
                                            factor_commits)

from tests.utils import MASK_ID, SCRIPTED_MASK, SCRIPTED_VOCAB, ScriptedModel, tiny_model


# ---- transcriptions -----------------------------------------------------------------------------------------
def fast_dllm_factor(confidence_row: list[float], factor: float) -> set[int]:
    """Fast-dLLM get_transfer_index_dynamic for one row: candidates sorted descending, thresholds 1 - factor/(n+1)
    for n = 1.., the first one -1; stop at the first failure; bump the count when it is 0 or the last index."""
    candidates = [i for i, c in enumerate(confidence_row) if c != -float("inf")]
    thresholds = [1 - factor / (n + 1) for n in range(1, len(candidates) + 1)]
    thresholds[0] = -1
    ordered = sorted((confidence_row[i] for i in candidates), reverse=True)
    top_i = 0
    for top_i in range(len(thresholds)):
        if ordered[top_i] < thresholds[top_i]:
            break
    if top_i == 0 or top_i == len(thresholds) - 1:
        top_i += 1
    by_confidence = sorted(candidates, key=lambda i: -confidence_row[i])
    return set(by_confidence[:top_i])


def eb_accept(entropies: list[float], masked: list[bool], bound: float) -> set[int]:
    """EB sampler (SGLang eb_sampling, block-wise masked form): masked positions by entropy ascending, accept
    while the entropies before the current one sum to <= bound (the first always)."""
    order = sorted((i for i in range(len(entropies)) if masked[i]), key=lambda i: entropies[i])
    accepted, total = set(), 0.0
    for i in order:
        if accepted and total > bound:
            break
        accepted.add(i)
        total += entropies[i]
    return accepted


def llada21_step(logits, block, prompt_in_block, threshold, editing_threshold, mask_id):
    """One step of LLaDA2.1's generate (greedy) for one row's block: masks with p > threshold (else the best),
    plus edits of committed, non-prompt positions with p > editing_threshold whose prediction changed."""
    probs = torch.softmax(logits.double(), -1)
    tokens = probs.index_fill(-1, torch.tensor([mask_id]), -1).argmax(-1)  # [MASK] never proposed (hf-dlm)
    p = probs.gather(-1, tokens[:, None])[:, 0]
    active = [t == mask_id for t in block]
    transfer = [active[i] and p[i] > threshold for i in range(len(block))]
    if any(active) and not any(transfer):
        best = max((i for i in range(len(block)) if active[i]), key=lambda i: p[i])
        transfer[best] = True
    edits = [not active[i] and not prompt_in_block[i] and p[i] > editing_threshold and int(tokens[i]) != block[i]
             for i in range(len(block))]
    new = [int(tokens[i]) if transfer[i] or edits[i] else block[i] for i in range(len(block))]
    return new, any(edits)


class DInferCredit:
    """dInfer CreditThresholdParallelDecoder.decode (python/dinfer/decoding/parallel_strategy.py), greedy, for a batch:
    a credit matrix per (block_start, block_end), decayed by beta from the block's second call on, each masked
    position's float32 top-1 token gaining p ** gamma; logits + alpha * log(credit + 1) decide through
    get_transfer_index_threshold (float32 probabilities, [MASK] predictions dropped, commit confidence >=
    min(max confidence - 1e-5, threshold)); every matrix dropped once x has no masks."""

    def __init__(self, threshold, mask_id, alpha=0.7, gamma=0.2, beta=0.8):
        self.threshold, self.mask_id, self.alpha, self.gamma, self.beta = threshold, mask_id, alpha, gamma, beta
        self.mats, self.iters = {}, {}

    def decode(self, logits, block_start, block_end, x):
        batch, length, vocab = logits.shape
        mask_index = x[:, block_start:block_end] == self.mask_id
        key = (block_start, block_end)
        if key not in self.mats or self.mats[key].shape != (batch, length, vocab):
            self.mats[key], self.iters[key] = torch.zeros(batch, length, vocab), 0
        mat = self.mats[key]
        if self.iters[key] > 0:
            mat *= self.beta
        probs = torch.softmax(logits.float(), -1)
        for b in range(batch):
            for i in range(length):
                if mask_index[b, i]:
                    top = int(probs[b, i].argmax())
                    mat[b, i, top] += float(probs[b, i, top]) ** self.gamma
        fused = logits + self.alpha * torch.log(mat + 1)
        self.iters[key] += 1
        x0 = fused.argmax(-1)
        p = torch.softmax(fused.float(), -1)
        for b in range(batch):
            confidence = [float(p[b, i, x0[b, i]]) if mask_index[b, i] and x0[b, i] != self.mask_id else -float("inf")
                          for i in range(length)]
            floor = min(max(max(confidence) - 1e-5, -1000), self.threshold)
            for i in range(length):
                if confidence[i] >= floor and mask_index[b, i]:
                    x[b, block_start + i] = x0[b, i]
        if not (x == self.mask_id).any():
            self.mats.clear()
            self.iters.clear()


# ---- equal logits -------------------------------------------------------------------------------------------
def test_every_rule_names_its_source():
    assert {"low_confidence", "random", "margin", "entropy", "threshold", "factor", "entropy_bound",
            "editing_threshold", "hierarchy_threshold"} <= set(COMMIT_RULES)
    assert all(rule.source for rule in COMMIT_RULES.values())


@pytest.mark.parametrize("factor", [0.5, 1.0, 2.0, 4.0])
def test_factor_rule_equals_fast_dllm_on_random_confidences(factor):
    generator = torch.Generator().manual_seed(int(factor * 10))
    confidence = torch.rand(64, 12, generator=generator, dtype=torch.float64) ** 0.3  # many near 1
    confidence[torch.rand(64, 12, generator=generator) < 0.3] = -torch.inf  # committed positions
    confidence[0, :] = -torch.inf
    confidence[0, 3] = 0.2  # a single candidate
    confidence[1, :] = -torch.inf
    confidence[1, :2] = torch.tensor([0.99, 0.1], dtype=torch.float64)  # the last two go together
    got = factor_commits(confidence, factor)
    for row in range(64):
        if not torch.isfinite(confidence[row]).any():
            continue
        expected = fast_dllm_factor(confidence[row].tolist(), factor)
        assert set(got[row].nonzero().flatten().tolist()) == expected, row
    assert got[1, :2].all()


def test_entropy_bound_equals_the_transcription_and_transformers_accept_canvas():
    generator = torch.Generator().manual_seed(0)
    entropy = torch.rand(32, 10, generator=generator, dtype=torch.float64) * 2
    masked = torch.rand(32, 10, generator=generator) < 0.7
    masked[:, 0] = True
    for bound in (0.0, 0.5, 1.3, 5.0):
        got = entropy_bound_commits(entropy.masked_fill(~masked, torch.inf), bound)
        for row in range(32):
            expected = eb_accept(entropy[row].tolist(), masked[row].tolist(), bound)
            assert set(got[row].nonzero().flatten().tolist()) == expected
    gemma = pytest.importorskip("transformers.models.diffusion_gemma.generation_diffusion_gemma")
    logits = torch.randn(4, 16, 40, generator=generator, dtype=torch.float64) * 3
    logits[..., MASK_ID % 40] = -torch.inf
    sampler = gemma.EntropyBoundSampler(gemma.EntropyBoundSamplerConfig(entropy_bound=1.5), 16, 40, 16)
    current = torch.full((4, 16), MASK_ID % 40)
    accepted = sampler.accept_canvas(current, logits.argmax(-1), logits, 0)
    ours, _ = decide_step(logits, current, torch.ones(4, 16, dtype=torch.bool), CommitSettings(entropy_bound=1.5),
                          mask_id=MASK_ID % 40)
    assert torch.equal(ours, accepted)
    assert sampler.accepted_token_mask.sum() > 4  # several tokens per step somewhere


def test_editing_step_equals_llada21_on_equal_logits():
    generator = torch.Generator().manual_seed(3)
    vocab, width, mask_id = 40, 8, 39
    for trial in range(40):
        logits = torch.randn(width, vocab, generator=generator, dtype=torch.float64) * 4
        logits[:, mask_id] = -1e9  # LLaDA2.1 keeps [MASK] a candidate; here it never wins, so both agree
        block = torch.randint(0, vocab - 1, (width,), generator=generator)
        block[torch.rand(width, generator=generator) < 0.5] = mask_id
        if trial % 4 == 0:
            block[block == mask_id] = 1  # mask-free steps edit only
        if trial % 3 == 0:  # committed tokens the model agrees with: no edit there (a settled block)
            block = torch.where(block == mask_id, block, logits.argmax(-1))
        prompt_in_block = [False] * width
        expected, expected_edit = llada21_step(logits, block.tolist(), prompt_in_block, 0.6, 0.5, mask_id)
        candidates = block.eq(mask_id)[None]
        tokens, edited = decide_step(logits[None], block[None], candidates, CommitSettings(threshold=0.6,
                                     editing_threshold=0.5), editable=~candidates, mask_id=mask_id)
        assert tokens[0].tolist() == expected and bool(edited[0]) == expected_edit


# ---- whole generations against the sources' loops (uncached, batch 1) ----------------------------------------
def confident_model(scale=100, **overrides):
    model = tiny_model(**overrides)
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)  # peaked distributions: the parallel rules commit several tokens per step
    return model


def logits_of(model, x):
    with torch.no_grad():
        return model(input_ids=x).logits.double()


def reference_loop(model, prompt, new_tokens, block, decide):
    """The sources' outer loop: per block, forward the whole canvas until `decide` says the block is done."""
    x = torch.cat([prompt, torch.full((new_tokens,), MASK_ID)])[None]
    forwards = 0
    for b in range(new_tokens // block):
        start, end = len(prompt) + b * block, len(prompt) + (b + 1) * block
        state = {"post_steps": 0}
        while True:
            masks = x[0, start:end].eq(MASK_ID)
            if not decide.has_work(masks, state):
                break
            logits = logits_of(model, x)[0, start:end]
            forwards += 1
            x[0, start:end] = torch.tensor(decide(logits, x[0, start:end], masks, state))
            if decide.finished(masks, state):
                break
    return x[0, len(prompt):], forwards


class Factor:
    def __init__(self, factor):
        self.factor = factor

    def has_work(self, masks, state):
        return bool(masks.any())

    def finished(self, masks, state):
        return False

    def __call__(self, logits, block, masks, state):
        probs = torch.softmax(logits, -1)  # over the whole vocabulary, as the source
        x0 = probs.index_fill(-1, torch.tensor([MASK_ID]), -1).argmax(-1)  # hf-dlm never proposes [MASK]
        confidence = torch.where(masks, probs.gather(-1, x0[:, None])[:, 0], -torch.inf).tolist()
        chosen = fast_dllm_factor(confidence, self.factor)
        return [int(x0[i]) if i in chosen else int(block[i]) for i in range(len(block))]


class EntropyBound(Factor):
    def __call__(self, logits, block, masks, state):
        logits = logits.index_fill(-1, torch.tensor([MASK_ID]), -torch.inf)  # SGLang suppresses [MASK] first
        log_p = logits.log_softmax(-1)
        entropy = -(log_p.exp() * log_p.nan_to_num(neginf=0.0)).sum(-1)
        chosen = eb_accept(entropy.tolist(), masks.tolist(), self.factor)
        x0 = logits.argmax(-1)
        return [int(x0[i]) if i in chosen else int(block[i]) for i in range(len(block))]


class Hierarchy(Factor):
    """dInfer's HierarchyDecoder (parallel_strategy.py get_transfer_index, then decode's AND with the masks),
    transcribed as loops over the block: confidence = p(x0) at the masks; in each run of contiguous masks the
    positions equal to the run's maximum, kept where > low_threshold; OR every mask > threshold; OR the one-hot
    argmax of the confidence (its first maximum). Probabilities in float64 (hf-dlm's; the source's logits dtype)."""

    def __init__(self, low, threshold=None, max_forwards=6):
        self.factor, self.low, self.threshold, self.max_forwards = None, low, threshold, max_forwards

    def __call__(self, logits, block, masks, state):
        probs = torch.softmax(logits, -1)
        x0 = probs.index_fill(-1, torch.tensor([MASK_ID]), -1).argmax(-1)  # hf-dlm never proposes [MASK]
        p = probs.gather(-1, x0[:, None])[:, 0].tolist()
        width, masked = len(block), masks.tolist()
        confidence = [p[i] if masked[i] else -math.inf for i in range(width)]
        chosen, i = set(), 0
        while i < width:
            if not masked[i]:
                i += 1
                continue
            j = i
            while j < width and masked[j]:
                j += 1
            top = max(confidence[i:j])
            chosen |= {k for k in range(i, j) if confidence[k] == top and confidence[k] > self.low}
            i = j
        if self.threshold is not None:
            chosen |= {k for k in range(width) if confidence[k] > self.threshold}
        chosen.add(max(range(width), key=lambda k: (confidence[k], -k)))
        chosen &= {k for k in range(width) if masked[k]}
        return [int(x0[k]) if k in chosen else int(block[k]) for k in range(width)]


class Editing:
    def __init__(self, threshold, editing_threshold, max_post_steps=16):
        self.threshold, self.editing_threshold, self.max_post_steps = threshold, editing_threshold, max_post_steps

    def has_work(self, masks, state):
        if not masks.any():
            state["post_steps"] += 1
        return state["post_steps"] <= self.max_post_steps

    def finished(self, masks, state):
        return not masks.any() and not state["edited"]

    def __call__(self, logits, block, masks, state):
        new, state["edited"] = llada21_step(logits, block.tolist(), [False] * len(block), self.threshold,
                                            self.editing_threshold, MASK_ID)
        return new


@pytest.mark.parametrize("rule,options", [
    (Factor(1.0), dict(factor=1.0)), (Factor(3.0), dict(factor=3.0)),
    (EntropyBound(1.5), dict(entropy_bound=1.5)), (EntropyBound(3.0), dict(entropy_bound=3.0)),
    (Editing(0.7, 0.5), dict(threshold=0.7, editing_threshold=0.5)),
    (Editing(0.9, 0.3, max_post_steps=2), dict(threshold=0.9, editing_threshold=0.3, max_post_steps=2)),
    (Hierarchy(0.4, max_forwards=12), dict(hierarchy_threshold=0.4)),
    (Hierarchy(0.99, max_forwards=16), dict(hierarchy_threshold=0.99)),  # the gate: the best alone
    (Hierarchy(0.4, 0.9), dict(hierarchy_threshold=0.4, threshold=0.9)),
])
def test_generate_equals_the_source_loop_and_commits_several_tokens_per_forward(rule, options):
    model = confident_model()
    prompt = torch.randint(0, 90, (5,), generator=torch.Generator().manual_seed(2))
    expected, forwards = reference_loop(model, prompt, 16, 8, rule)
    out = model.generate(prompt[None], max_new_tokens=16, block_length=8, return_dict_in_generate=True, **options)
    assert out.sequences[0, 5:].tolist() == expected.tolist()
    assert len(out.forward_batch_sizes) == forwards
    if not isinstance(rule, Editing):
        assert forwards <= getattr(rule, "max_forwards", 6)  # several tokens per forward on a confident model
    else:  # edits fired: more forwards than threshold decoding alone, other tokens
        plain = model.generate(prompt[None], max_new_tokens=16, block_length=8, return_dict_in_generate=True,
                               threshold=options["threshold"])
        assert forwards > len(plain.forward_batch_sizes) + 2 and plain.sequences[0, 5:].tolist() != expected.tolist()


def test_generate_cli_takes_the_new_rules_as_numbers():
    import argparse

    from hf_dlm.commands.generate import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", "m", "--prompt", "x", "--factor", "1.5", "--entropy-bound", "0.3",
                              "--editing-threshold", "0.5", "--max-post-steps", "4"])
    assert (args.factor, args.entropy_bound, args.editing_threshold, args.max_post_steps) == (1.5, 0.3, 0.5, 4)


def test_hierarchy_by_hand():
    """dInfer's hierarchy on hand-set confidences (-inf: not a mask): each run's best when > low (ties: all),
    every mask > threshold, the row's best always (its first maximum), nothing outside the masks."""
    from hf_dlm.generation.commit_rules import hierarchy_commits

    inf = math.inf
    confidence = torch.tensor([[0.5, 0.3, -inf, 0.2, 0.35, -inf, 0.95, 0.1],
                               [0.3, 0.1, 0.3, -inf, 0.6, 0.6, -inf, -inf],
                               [0.1, 0.2, 0.3, -inf, -inf, -inf, -inf, -inf],
                               [-inf] * 8])
    assert hierarchy_commits(confidence, 0.4).int().tolist() == [[1, 0, 0, 0, 0, 0, 1, 0], [0, 0, 0, 0, 1, 1, 0, 0],
                                                                [0, 0, 1, 0, 0, 0, 0, 0], [0] * 8]
    assert hierarchy_commits(confidence, 0.25).int().tolist() == [[1, 0, 0, 0, 1, 0, 1, 0], [1, 0, 1, 0, 1, 1, 0, 0],
                                                                 [0, 0, 1, 0, 0, 0, 0, 0], [0] * 8]
    with_threshold = hierarchy_commits(confidence, 0.4, 0.15)  # a run's other positions join above threshold
    assert with_threshold.int().tolist() == [[1, 1, 0, 1, 1, 0, 1, 0], [1, 0, 1, 0, 1, 1, 0, 0],
                                             [0, 1, 1, 0, 0, 0, 0, 0], [0] * 8]
    assert hierarchy_commits(confidence, 0.99).int().sum(-1).tolist() == [1, 1, 1, 0]  # the best alone
    # both bounds strict, as the source's torch.gt: a run at exactly 0.5, masks at exactly 0.3 stay
    assert hierarchy_commits(confidence, 0.5)[0].int().tolist() == [0, 0, 0, 0, 0, 0, 1, 0]
    assert hierarchy_commits(confidence, 0.99, 0.3)[1].int().tolist() == [0, 0, 0, 0, 1, 1, 0, 0]


def test_threshold_and_editing_boundaries_by_hand():
    """At a confidence exactly equal to the threshold (0.5, 0.25: exact in binary): Fast-dLLM commits
    (>=), LLaDA2.1's strict form does not; LLaDA2.1 edits only where p > editing_threshold."""
    from hf_dlm.generation.commit_rules import editing_commits, threshold_commits

    confidence = torch.tensor([[0.5, 0.25, 0.75]])
    assert threshold_commits(confidence, 0.5).tolist() == [[True, False, True]]
    assert threshold_commits(confidence, 0.5, strict=True).tolist() == [[False, False, True]]
    probability = torch.tensor([[0.5, 0.75, 0.75]])
    x0, current = torch.tensor([[1, 2, 3]]), torch.tensor([[0, 0, 3]])
    editable = torch.ones(1, 3, dtype=torch.bool)
    assert editing_commits(probability, x0, current, editable, 0.5).tolist() == [[False, True, False]]


# ---- dInfer's credit decoding ---------------------------------------------------------------------------------
def drifting_logits(input_ids):
    """A scripted model for credit decoding: per row, a fixed preference per prompt and position plus noise that
    changes with every committed token, so top-1 tokens mostly repeat over a block's steps (what the credit
    rewards) while their probabilities move around the threshold."""
    out = []
    for row in input_ids:
        weights = torch.arange(1, row.numel() + 1)
        base = torch.randn(row.numel(), SCRIPTED_VOCAB, generator=torch.Generator().manual_seed(int(row[:3].sum()) * 7))
        noise = torch.randn(row.numel(), SCRIPTED_VOCAB, generator=torch.Generator().manual_seed(int(row @ weights)))
        logits = 2.0 * base + 1.0 * noise
        logits[:, SCRIPTED_MASK] = -1e4  # dInfer keeps [MASK] a candidate; here it never wins, so both agree
        out.append(logits)
    return torch.stack(out)


def dinfer_credit_loop(script, prompt, new_tokens, block, decoder):
    """dInfer's block loop, uncached: every row forwards until no row of the batch has masks in the block."""
    x = torch.cat([prompt, torch.full((prompt.shape[0], new_tokens), decoder.mask_id)], 1)
    forwards = 0
    for b in range(new_tokens // block):
        start, end = prompt.shape[1] + b * block, prompt.shape[1] + (b + 1) * block
        while (x[:, start:end] == decoder.mask_id).any():
            decoder.decode(script(x)[:, start:end], start, end, x)
            forwards += 1
    return x, forwards


@pytest.mark.parametrize("threshold,alpha,boost,decay", [(0.9, 0.7, 0.2, 0.8), (0.6, 0.7, 0.2, 0.8),
                                                         (0.8, 1.5, 0.5, 0.5)])
def test_credit_equals_dinfer_on_scripted_logits_over_steps_and_blocks(threshold, alpha, boost, decay):
    prompt = torch.randint(0, 14, (3, 4), generator=torch.Generator().manual_seed(5))
    expected, forwards = dinfer_credit_loop(drifting_logits, prompt, 16, 8,
                                            DInferCredit(threshold, SCRIPTED_MASK, alpha, boost, decay))
    model = ScriptedModel(drifting_logits)
    options = dict(max_new_tokens=16, block_length=8, threshold=threshold, return_dict_in_generate=True)
    out = model.generate(prompt, credit_alpha=alpha, credit_boost=boost, credit_decay=decay, **options)
    assert out.sequences.tolist() == expected.tolist()
    assert len(out.forward_batch_sizes) == forwards >= 6  # several steps in each of the two blocks
    plain = model.generate(prompt, **options)
    assert plain.sequences.tolist() != expected.tolist()  # the credit decided some of it


def as_logits(rows: list[dict], vocab: int = 6) -> torch.Tensor:
    """[{token: probability}] per position -> (1, W, vocab) log-probabilities, the rest of the mass spread evenly."""
    logits = []
    for given in rows:
        rest = (1 - sum(given.values())) / (vocab - len(given))
        logits.append([given.get(token, rest) for token in range(vocab)])
    return torch.tensor([logits], dtype=torch.float64).log()


def test_credit_changes_the_token_where_plain_threshold_decides_otherwise():
    """Three masks, threshold 0.9: steps 1 and 2 commit positions 0 and 1 (p = 0.99) while position 2 predicts
    token 1 (p = 0.5); at step 3 token 2 leads by a little (0.42 against 0.40). Plain threshold decoding takes
    token 2; the credit that token 1 gathered over steps 1 and 2 keeps it."""
    mask_id, flat = 5, {3: 0.2}
    steps = [[{0: 0.99}, flat, {1: 0.5, 2: 0.3}], [{0: 0.5}, {0: 0.99}, {1: 0.5, 2: 0.3}],
             [{0: 0.5}, {0: 0.5}, {2: 0.42, 1: 0.40}]]
    results = {}
    for name, settings in (("plain", CommitSettings(threshold=0.9)),
                           ("credit", CommitSettings(threshold=0.9, credit_alpha=0.7))):
        current, credit, committed = torch.full((1, 3), mask_id), torch.zeros(1, 3, 6), []
        for probabilities in steps:
            masks = current.eq(mask_id)
            current, _ = decide_step(as_logits(probabilities), current, masks, settings,
                                     mask_id=mask_id, credit=credit)
            committed.append((masks & current.ne(mask_id)).nonzero()[:, 1].tolist())
        results[name] = current[0].tolist(), committed
    assert results["plain"] == ([0, 0, 2], [[0], [1], [2]])
    assert results["credit"] == ([0, 0, 1], [[0], [1], [2]])


def test_credit_on_a_confident_model_equals_dinfer_and_commits_several_tokens_per_forward():
    model = confident_model()
    prompt = torch.randint(0, 90, (2, 5), generator=torch.Generator().manual_seed(2))

    def script(x):
        with torch.no_grad():
            return model(input_ids=x).logits

    expected, forwards = dinfer_credit_loop(script, prompt, 16, 8, DInferCredit(0.5, MASK_ID))
    options = dict(max_new_tokens=16, block_length=8, threshold=0.5, return_dict_in_generate=True)
    out = model.generate(prompt, credit_alpha=0.7, **options)
    assert out.sequences.tolist() == expected.tolist()
    assert len(out.forward_batch_sizes) == forwards <= 6  # 32 tokens in at most 6 forwards
    assert forwards < len(model.generate(prompt, **options).forward_batch_sizes)  # the credit commits sooner


@pytest.mark.parametrize("options,field", [
    (dict(credit_alpha=0.7), "credit_alpha"),  # no threshold
    (dict(credit_alpha=-0.1, threshold=0.9), "credit_alpha"),
    (dict(credit_alpha=float("inf"), threshold=0.9), "credit_alpha"),
    (dict(credit_alpha=float("nan"), threshold=0.9), "credit_alpha"),
    (dict(credit_alpha=0.7, threshold=0.9, credit_decay=1.5), "credit_decay"),
    (dict(credit_alpha=0.7, threshold=0.9, credit_decay=-0.1), "credit_decay"),
    (dict(credit_alpha=0.7, threshold=0.9, credit_boost=-1.0), "credit_boost"),
    (dict(credit_alpha=0.7, factor=1.0), "credit_alpha"),
    (dict(credit_alpha=0.7, entropy_bound=1.0), "credit_alpha"),
    (dict(credit_alpha=0.7, threshold=0.9, editing_threshold=0.5), "credit_alpha"),
    (dict(credit_alpha=0.7, threshold=0.9, sub_block_length=4), "credit_alpha"),
    (dict(credit_alpha=0.7, threshold=0.9, first_token_alone=True), "credit_alpha"),
    (dict(credit_alpha=0.7, threshold=0.9, remasking="margin"), "credit_alpha"),
    (dict(hierarchy_threshold=1.5), "hierarchy_threshold"),
    (dict(hierarchy_threshold=0.4, factor=1.0), "factor"),
    (dict(hierarchy_threshold=0.4, threshold=0.9, editing_threshold=0.5), "editing_threshold"),
    (dict(credit_alpha=0.7, threshold=0.9, hierarchy_threshold=0.4), "credit_alpha"),
])
def test_credit_settings_are_validated_naming_the_field(options, field):
    from hf_dlm.generation.configuration import DLMGenerationConfig
    from hf_dlm.utils.errors import FieldError

    with pytest.raises(FieldError) as error:
        DLMGenerationConfig.from_any(None, **options)
    assert error.value.field == field and field in str(error.value)
    DLMGenerationConfig.from_any(None, credit_alpha=0.0, threshold=0.9, credit_boost=0.0, credit_decay=1.0)  # limits


# ---- the compiled greedy scores -----------------------------------------------------------------------------------
def test_compiled_greedy_scores_equal_the_eager_ones_by_hand_and_never_pick_the_mask():
    """The compiled sampler's vocabulary-sized work (argmax without [MASK], its confidence in float64) against the
    eager function and a hand-computed row; three batch sizes and two widths through the one dynamic graph."""
    from hf_dlm.generation.commit_rules import compiled_greedy_scores, greedy_scores

    compiled = compiled_greedy_scores("default")
    generator = torch.Generator().manual_seed(0)
    for batch, width in ((3, 8), (5, 8), (2, 6)):
        logits = torch.randn(batch, width, 40, generator=generator)
        logits[..., 7] = 50.0  # [MASK] (id 7) has the largest logit everywhere: it must never be x0
        logits[0, 0, 3] = logits[0, 0, 5] = 20.0  # a tie: the lower id wins, as argmax's first maximum
        for remasking in ("low_confidence", "margin", "entropy"):
            x0, confidence = compiled(logits, 7, remasking)
            eager_x0, eager_confidence = greedy_scores(logits, 7, remasking)
            assert torch.equal(x0, eager_x0) and confidence.dtype == torch.float64
            torch.testing.assert_close(confidence, eager_confidence, rtol=1e-12, atol=1e-15)
            assert not x0.eq(7).any() and x0[0, 0] == 3
        row = logits[0, 0].double()
        _, low = compiled(logits, 7, "low_confidence")
        assert low[0, 0].item() == pytest.approx(float(row[3].exp() / row.exp().sum()), rel=1e-12)


def record_choices(monkeypatch, name: str) -> list:
    """Wraps `commit_rules.<name>` (a compiled-scores factory): -> the compile choices it is asked for, a call per
    step that takes it."""
    from hf_dlm.generation import commit_rules

    calls, original = [], getattr(commit_rules, name)

    def recording(choice):
        calls.append(choice)
        return original(choice)

    monkeypatch.setattr(commit_rules, name, recording)
    return calls


def test_a_compiled_generate_and_engine_commit_through_the_compiled_scores(monkeypatch):
    """generate(compile=...) and the compiled engine take the compiled greedy scores (a call each step), and their
    tokens equal eager generate's (whose steps take the plain function)."""
    from hf_dlm.serving.engine import ContinuousBatchingEngine, GenerationRequest

    calls = record_choices(monkeypatch, "compiled_greedy_scores")
    model = tiny_model(seed=3)
    prompt = torch.randint(0, 60, (2, 5), generator=torch.Generator().manual_seed(1))
    options = dict(max_new_tokens=8, block_length=4, steps=8, cache="dual", temperature=0.0, stop_on_eos=False)
    eager = model.generate(prompt, **options)
    assert calls == []
    compiled = model.generate(prompt, **options, compile="eager")
    assert len(calls) == 8 and set(calls) == {"eager"}
    assert torch.equal(compiled, eager)
    engine = ContinuousBatchingEngine(model, max_batch_size=4, compile="eager")
    requests = [GenerationRequest(row.tolist(), engine.sampling_params(**options)) for row in prompt]
    engine.submit(requests)
    while engine.has_work():
        engine.step()
    assert len(calls) > 8
    assert [r.generated for r in requests] == eager[:, 5:].tolist()


def test_compiled_sampled_scores_equal_a_hand_gumbel_draw_and_never_pick_the_mask():
    """The compiled sampled step (Gumbel-max in float64 over the logits without [MASK], noise from the caller):
    x0 is argmax(exp(logit) / (-log u)^T) written out by hand, its confidence p(x0) in float64."""
    from torch._dynamo.utils import counters

    from hf_dlm.generation.commit_rules import compiled_sampled_scores, sampled_scores

    compiled = compiled_sampled_scores("default")
    generator = torch.Generator().manual_seed(4)
    for batch, width, temperature in ((3, 8, 0.7), (5, 8, 1.0), (2, 6, 0.7)):
        logits = torch.randn(batch, width, 40, generator=generator)
        logits[..., 7] = 50.0  # [MASK] (id 7) would win every draw: it must never be x0
        noise = torch.rand(logits.shape, dtype=torch.float64, generator=generator)
        for remasking in ("low_confidence", "margin", "entropy"):
            tensor = torch.tensor(temperature, dtype=torch.float64)
            x0, confidence = compiled(logits, noise, 7, tensor, remasking)
            eager_x0, eager_confidence = sampled_scores(logits, noise, 7, tensor, remasking)
            assert torch.equal(x0, eager_x0) and confidence.dtype == torch.float64
            torch.testing.assert_close(confidence, eager_confidence, rtol=1e-12, atol=1e-15)
            assert not x0.eq(7).any()
        row, u = logits[1, 2].double(), noise[1, 2]
        keys = [row[v].exp().item() / (-u[v].log().item()) ** temperature if v != 7 else 0.0 for v in range(40)]
        x0, low = compiled(logits, noise, 7, torch.tensor(temperature, dtype=torch.float64), "low_confidence")
        assert x0[1, 2].item() == max(range(40), key=keys.__getitem__)
        assert low[1, 2].item() == pytest.approx(float(row[x0[1, 2]].exp() / row.exp().sum()), rel=1e-12)
    graphs = counters["stats"]["unique_graphs"]
    for temperature in (0.3, 0.9, 1.7):  # one graph for every temperature (a float would compile one each)
        compiled(logits, noise, 7, torch.tensor(temperature, dtype=torch.float64), "margin")
    assert counters["stats"]["unique_graphs"] == graphs


def test_the_log_domain_gumbel_draw_equals_llada_arithmetic_over_many_draws():
    """`sampled_scores` draws argmax(logit - T log(-log u)), the log of LLaDA's argmax(exp(logit) / (-log u)^T)
    (`add_gumbel_noise`): over 1.3 M draws at four temperatures the tokens are the same (the two differ only
    at float64 rounding, a tie no draw here meets). Above exp's range (logit > 709) LLaDA's form overflows to
    inf and takes the first inf; the log form takes the largest."""
    from hf_dlm.generation.commit_rules import sampled_scores
    from hf_dlm.generation.sampling import add_gumbel_noise

    generator = torch.Generator().manual_seed(11)
    for temperature in (0.3, 0.9, 1.0, 1.6):
        logits = torch.randn(16, 32, 640, generator=generator) * 4
        noise = torch.rand(logits.shape, dtype=torch.float64, generator=generator)
        x0, _ = sampled_scores(logits, noise, None, torch.tensor(temperature, dtype=torch.float64), "low_confidence")
        assert torch.equal(x0, add_gumbel_noise(logits, temperature, noise=noise).argmax(-1))
    logits = torch.zeros(1, 1, 4)
    logits[0, 0, 1], logits[0, 0, 3] = 800.0, 900.0
    noise = torch.full((1, 1, 4), 0.5, dtype=torch.float64)
    assert add_gumbel_noise(logits, 1.0, noise=noise).argmax(-1).item() == 1  # LLaDA's form: inf == inf
    assert sampled_scores(logits, noise, None, torch.tensor(1.0, dtype=torch.float64), "low_confidence")[0].item() == 3


def test_a_compiled_sampled_generate_and_engine_draw_the_eager_tokens(monkeypatch):
    """Sampling (temperature > 0) under compile takes the compiled sampled scores each step and draws the same
    tokens as eager generate from the same seed: the noise comes from the row's generator either way. Top-k
    and random remasking stay on the eager path (their draws differ)."""
    from hf_dlm.serving.engine import ContinuousBatchingEngine, GenerationRequest

    calls = record_choices(monkeypatch, "compiled_sampled_scores")
    model = tiny_model(seed=3)
    prompt = torch.randint(0, 60, (2, 5), generator=torch.Generator().manual_seed(1))
    options = dict(max_new_tokens=8, block_length=4, steps=8, cache="dual", temperature=0.9, stop_on_eos=False)
    eager = model.generate(prompt, **options, generator=torch.Generator().manual_seed(5))
    assert calls == []
    compiled = model.generate(prompt, **options, compile="eager", generator=torch.Generator().manual_seed(5))
    assert len(calls) == 8 and set(calls) == {"eager"}
    assert torch.equal(compiled, eager)
    assert not torch.equal(eager, model.generate(prompt, **options, generator=torch.Generator().manual_seed(6)))
    for other in (dict(top_k=5), dict(remasking="random")):
        calls.clear()
        model.generate(prompt, **options | other, compile="eager", generator=torch.Generator().manual_seed(5))
        assert calls == []
    calls.clear()
    engine = ContinuousBatchingEngine(model, max_batch_size=4, compile="eager")
    request = GenerationRequest(prompt[0].tolist(), engine.sampling_params(**options, seed=5))
    engine.submit([request])
    while engine.has_work():
        engine.step()
    assert len(calls) == 8
    alone = model.generate(prompt[:1], **options, generator=torch.Generator().manual_seed(5))
    assert request.generated == alone[0, 5:].tolist()


@pytest.mark.parametrize("top_k,top_p", [(1, None), (3, None), (None, 0.3), (4, 0.9)])
def test_a_greedy_step_commits_the_argmax_of_the_filtered_logits(top_k, top_p):
    # greedy steps take the argmax of the logits without [MASK] and skip top-k / top-p (they never remove the
    # argmax): the tokens equal LLaDA's argmax of the filtered, [MASK]-suppressed logits, written out here
    from hf_dlm.generation.sampling import filter_logits

    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 6, 40, generator=generator)
    logits[0, :, 7] = 9.0  # [MASK] (id 7) the largest at every position of row 0
    logits[1, 2, [4, 9]] = 12.0  # a tie: the lower id
    current = torch.full((3, 6), 7)
    settings = CommitSettings(top_k=top_k, top_p=top_p)
    tokens, _ = decide_step(logits, current, torch.ones(3, 6, dtype=torch.bool), settings,
                            budget=torch.full((3,), 6), mask_id=7)
    suppressed = logits.clone()
    suppressed[..., 7] = -torch.inf
    assert torch.equal(tokens, filter_logits(suppressed, top_k, top_p).argmax(-1))
    assert not tokens.eq(7).any() and tokens[1, 2] == 4
