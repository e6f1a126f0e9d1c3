"""Commit rules: which positions of the current block a diffusion step commits, one registry for
`model.generate` and the serving engine, each rule naming where it is published.

A step's decision has three parts, each from the registry:
- an order (`remasking`): how masked positions are ranked (confidence of the candidate token, random,
  top-1 minus top-2 margin, minus the entropy);
- a count: LLaDA's per-step budget of the best-ranked masks (default), or a rule that decides how many
  itself and ignores `steps`: `threshold`, `factor`, `entropy_bound`;
- an optional edit (`editing_threshold`, beside `threshold`): committed tokens of the current block re-decided;
- an optional credit (`credit_alpha`, beside `threshold`): the block's earlier steps raise the logits of the tokens
  they predicted (`credit_logits`; the caller keeps the state per row across a block's steps);
- which masks of the block are candidates at all (`block_candidates`): every one, or Fast-dLLM v2's sub-block
  (`sub_block_length`) and lone first token (`first_token_alone`).

`decide_step` applies them to a batch of rows that share settings (`CommitSettings`); the candidates are
Gumbel-max draws in float64 (LLaDA), the [MASK] token never a candidate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import add_gumbel_noise, confidence_scores, filter_logits


@dataclass(frozen=True)
class CommitRule:
    name: str
    kind: str  # "order": ranks masks; "count": how many masks a step commits; "edit": re-decides committed tokens;
    # "candidates": which masks of the block a step may commit; "credit": raises the logits a step reads
    source: str


COMMIT_RULES: dict[str, CommitRule] = {}


def _register(name: str, kind: str, source: str):
    COMMIT_RULES[name] = CommitRule(name, kind, source)


_register("low_confidence", "order", "LLaDA generate.py (remasking='low_confidence'): softmax probability of x0")
_register("random", "order", "LLaDA generate.py (remasking='random'): uniform random ranks")
_register("margin", "order", "Dream generation_utils (alg='topk_margin'): top-1 minus top-2 probability")
_register("entropy", "order", "Dream generation_utils (alg='entropy'): minus the entropy")
_register("budget", "count", "LLaDA generate.py get_num_transfer_tokens: masks // steps per step, remainder first")
_register("threshold", "count", "Fast-dLLM llada/generate.py get_transfer_index: confidence >= threshold, "
          "at least the best")
_register("factor", "count", "Fast-dLLM get_transfer_index_dynamic: the longest prefix of the sorted confidences "
          "with c_(i) >= 1 - factor / (i + 1), at least one")
_register("entropy_bound", "count", "EB sampler (arXiv 2505.24857; transformers EntropyBoundSampler.accept_canvas, "
          "SGLang eb_sampling): the k lowest-entropy masks with sum - max <= bound")
_register("hierarchy_threshold", "count", "dInfer parallel_strategy.py HierarchyDecoder (its low_threshold; "
          "`threshold` its threshold): in each run of contiguous candidates the most confident, when > "
          "hierarchy_threshold; beside it every candidate > threshold; and the block's best")
_register("sub_block_length", "candidates", "Fast-dLLM v2 batch_sample (small_block_size): the masks of the "
          "block's first unfinished sub-block")
_register("first_token_alone", "candidates", "Fast-dLLM v2 batch_sample: a block's first token comes alone from the "
          "previous position's logits (the forward that completes the previous block)")
_register("credit_alpha", "credit", "dInfer parallel_strategy.py CreditThresholdParallelDecoder (beside threshold): "
          "logits + credit_alpha * log(1 + C), C per position and token of the block: each step decays it by "
          "credit_decay and adds top-1 p ** credit_boost at the masks' top-1 tokens")
_register("editing_threshold", "edit", "LLaDA2.1 generate (diffusers BlockRefinementScheduler editing_threshold): "
          "committed tokens of the block replaced where p > editing_threshold and the prediction differs")

REMASKING = tuple(name for name, rule in COMMIT_RULES.items() if rule.kind == "order")
# the settings that decide the count themselves; hierarchy_threshold first: `threshold` beside it is its second bound
COUNT_RULES = ("hierarchy_threshold", "threshold", "factor", "entropy_bound")


@dataclass(frozen=True)
class CommitSettings:
    """The settings one `decide_step` call shares across its rows (hashable: the engine groups rows by it)."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    remasking: str = "low_confidence"
    threshold: float | None = None
    factor: float | None = None
    entropy_bound: float | None = None
    hierarchy_threshold: float | None = None
    editing_threshold: float | None = None
    sub_block_length: int | None = None
    first_token_alone: bool = False
    credit_alpha: float | None = None
    credit_boost: float = 0.2
    credit_decay: float = 0.8

    @classmethod
    def from_config(cls, config) -> "CommitSettings":
        """From a `DLMGenerationConfig` (greedy whatever the temperature when do_sample is off)."""
        return cls(temperature=config.sampling_temperature, top_k=config.top_k or None, top_p=config.top_p,
                   remasking=config.remasking, threshold=config.threshold, factor=config.factor,
                   entropy_bound=config.entropy_bound, hierarchy_threshold=config.hierarchy_threshold,
                   editing_threshold=config.editing_threshold,
                   sub_block_length=config.sub_block_length, first_token_alone=bool(config.first_token_alone),
                   credit_alpha=config.credit_alpha, credit_boost=config.credit_boost, credit_decay=config.credit_decay)

    @property
    def count_rule(self) -> str:
        """"budget" (LLaDA's steps) or the rule in COUNT_RULES that is set."""
        return next((name for name in COUNT_RULES if getattr(self, name) is not None), "budget")


# ---- candidates -----------------------------------------------------------------------------------------------
def block_candidates(masks: torch.Tensor, offset, settings: CommitSettings) -> torch.Tensor:
    """masks (B, W): the masked slots of each row's current block; offset: int or (B,) the place of column 0 in its
    aligned block (0 at an aligned block start). -> (B, W) bool, the step's candidates: every mask, or the masks of
    the first sub-block of `sub_block_length` (aligned to the block start) that has any, or, with
    `first_token_alone`, the block's first position alone while it is masked."""
    if not settings.sub_block_length and not settings.first_token_alone:
        return masks
    offset = torch.as_tensor(offset, device=masks.device).reshape(-1, 1)
    place = torch.arange(masks.shape[1], device=masks.device).unsqueeze(0) + offset  # (B, W) in the aligned block
    if settings.sub_block_length:
        sub = torch.div(place, settings.sub_block_length, rounding_mode="floor")
        first = torch.where(masks, sub, torch.iinfo(sub.dtype).max).min(-1, keepdim=True).values
        masks = masks & sub.eq(first)
    if settings.first_token_alone:
        lone = masks & place.eq(0)
        masks = torch.where(lone.any(-1, keepdim=True), lone, masks)
    return masks


# ---- count rules: confidence (B, W) with -inf where not a candidate -> (B, W) bool --------------------------
def budget_commits(confidence: torch.Tensor, budget: torch.Tensor) -> torch.Tensor:
    """The `budget` (B,) best candidates per row; ties go to the lower index (no host sync)."""
    index = confidence.sort(dim=-1, descending=True, stable=True).indices
    rank_ok = torch.arange(index.shape[1], device=budget.device).unsqueeze(0) < budget.unsqueeze(1)
    return torch.zeros_like(rank_ok).scatter_(1, index, rank_ok) & torch.isfinite(confidence)


def threshold_commits(confidence: torch.Tensor, threshold: float, strict: bool = False) -> torch.Tensor:
    """Every candidate with confidence >= threshold (> with `strict`, LLaDA2.1) plus the best one."""
    allowed = torch.isfinite(confidence)
    best = torch.zeros_like(allowed).scatter_(1, confidence.argmax(-1, keepdim=True), True)
    above = confidence > threshold if strict else confidence >= threshold
    return (above | best) & allowed


def hierarchy_commits(confidence: torch.Tensor, low: float, threshold: float | None = None) -> torch.Tensor:
    """dInfer's hierarchical decoding: in each run of contiguous candidates, the positions at the run's largest
    confidence (ties: all of them, as the source's equality) when > `low`; every candidate > `threshold`; the
    row's best candidate always (the first maximum). Vectorised as the source is: runs numbered by a cumulative
    sum of their starts, each run's maximum by a scatter."""
    allowed = torch.isfinite(confidence)
    starts = allowed & ~torch.nn.functional.pad(allowed[:, :-1], (1, 0))
    run = (starts.long().cumsum(-1) - 1).clamp(min=0)
    run_max = torch.full_like(confidence, -torch.inf).scatter_reduce(1, run, confidence, "amax", include_self=True)
    commit = confidence.eq(run_max.gather(1, run)) & (confidence > low)
    if threshold is not None:
        commit |= confidence > threshold
    best = torch.zeros_like(allowed).scatter_(1, confidence.argmax(-1, keepdim=True), True)
    return (commit | best) & allowed


def factor_commits(confidence: torch.Tensor, factor: float) -> torch.Tensor:
    """Fast-dLLM's factor rule, vectorised: sort the n candidates' confidences descending; the first index
    i (0-based) with c_(i) < 1 - factor / (i + 2) fails (never i = 0); commit the i before it. Kept from the
    source: when the failure is the last candidate every candidate is committed (so a block's last two masks
    always go together). A row without candidates commits nothing (the source's loop fails there)."""
    ordered, index = confidence.sort(dim=-1, descending=True, stable=True)
    count = torch.isfinite(confidence).sum(-1, keepdim=True)  # (B, 1)
    rank = torch.arange(confidence.shape[1], device=confidence.device).unsqueeze(0)
    bound = 1 - factor / (rank + 2).to(ordered.dtype)
    fails = (ordered < bound) & (rank > 0) & (rank < count)
    first_fail = torch.where(fails, rank, confidence.shape[1]).min(-1, keepdim=True).values
    take = torch.where(first_fail >= count - 1, count, first_fail)
    return torch.zeros_like(fails).scatter_(1, index, rank < take) & torch.isfinite(confidence)


def entropy_bound_commits(entropy: torch.Tensor, bound: float) -> torch.Tensor:
    """entropy (B, W), +inf where not a candidate: the k lowest with sum - max <= bound (sorted ascending,
    the max is the last one taken, so the sum of the earlier ones; equality accepts, the first always)."""
    ordered, index = entropy.sort(dim=-1, stable=True)
    earlier = ordered.cumsum(-1) - ordered
    accept = (earlier <= bound) | (torch.arange(entropy.shape[1], device=entropy.device) == 0)
    return torch.zeros_like(accept).scatter_(1, index, accept) & torch.isfinite(entropy)


def editing_commits(probability, x0, current, editable, editing_threshold: float) -> torch.Tensor:
    """LLaDA2.1's token-to-token edits: editable (already committed, non-prompt, current block) positions where
    the prediction differs and its probability is > editing_threshold (strict)."""
    return editable & (probability > editing_threshold) & x0.ne(current)


# ---- credit ---------------------------------------------------------------------------------------------------
def credit_logits(logits: torch.Tensor, credit: torch.Tensor, masks: torch.Tensor, settings: CommitSettings):
    """dInfer's credit fusion, one step: credit (B, W, V) float32, zeros at a block start, updated in place (decayed,
    then each mask's top-1 token of this step's float32 softmax gains p ** credit_boost) -> the logits every later
    part of the step reads, logits + credit_alpha * log(credit + 1) (float32, as the source's sum promotes)."""
    credit.mul_(settings.credit_decay)  # the source skips this at a block's first step, where credit is all 0
    top1, index = logits.float().softmax(-1).max(-1)
    gain = top1.pow(settings.credit_boost) * masks.to(top1.dtype)
    credit.scatter_add_(-1, index.unsqueeze(-1), gain.unsqueeze(-1))
    return logits + settings.credit_alpha * torch.log(credit + 1)


# ---- a greedy step's vocabulary-sized work ----------------------------------------------------------------------
def without_mask(logits: torch.Tensor, mask_id: int | None) -> torch.Tensor:
    """The logits with [MASK] at -inf (never a candidate); an int id, not an index tensor: compiled, the fill fuses
    into the reduction that reads it instead of copying the logits."""
    if mask_id is None:
        return logits
    return logits.masked_fill(torch.arange(logits.shape[-1], device=logits.device) == mask_id, -torch.inf)


def greedy_scores(logits: torch.Tensor, mask_id: int | None, remasking: str):
    """(B, W, V) -> (x0 (B, W): the argmax without [MASK], confidence (B, W) float64: `confidence_scores`)."""
    x0 = without_mask(logits, mask_id).argmax(-1)
    return x0, confidence_scores(logits, x0, remasking)


def sampled_scores(logits: torch.Tensor, noise: torch.Tensor, mask_id: int | None, temperature: torch.Tensor,
                   remasking: str):
    """(B, W, V) logits, (B, W, V) float64 uniform noise -> (x0: the Gumbel-max draw of `add_gumbel_noise` on the
    logits without [MASK], its confidence `confidence_scores`). The noise is drawn by the caller, from the row's
    generator, as the eager path draws it: the same seed gives the same tokens compiled or not. temperature: a
    0-d float64 tensor (Dynamo compiles a graph per Python float, one for every tensor value).

    The draw is taken in the log domain, `logit - T log(-log u)`: the log of LLaDA's `exp(logit) / (-log u)^T`,
    so the same argmax (up to float64 rounding), with two transcendentals an element instead of four (exp, log,
    pow = log + exp). This kernel is bound by its float64 arithmetic (5.4 of a 23.3-ms step at the Qwen3-1.7B
    shape, batch 64, H100 profile in benchmarks/RESULTS.md). It also keeps logits above 709 finite, where
    exp overflows to inf and the first of several infs would win."""
    gumbel = temperature * torch.log(-torch.log(noise))
    x0 = (without_mask(logits, mask_id).to(torch.float64) - gumbel).argmax(-1)
    return x0, confidence_scores(logits, x0, remasking)


_COMPILED_SCORES: dict = {}


def _compiled_scores(function, choice: str):
    """`function` through torch.compile (every size dynamic: the engine's groups vary). Eager, a step reads
    the (B, W, V) logits some ten times (the float64 upcast, the max, the exponentials, the sum, the [MASK]
    fill; sampling adds the noise's log, power and division, each a float64 tensor of the vocabulary's size): 12 %
    of an 8B engine step at batch 64 (H100 profile, benchmarks/RESULTS.md); Inductor fuses them into reductions
    that read the logits once or twice. `choice` "eager" / "cudagraphs" trace only (no Inductor, as those choices
    promise); any other compiles with Inductor's default mode (the forward's CUDA graphs are the sampler's own,
    `StepGraphs`)."""
    backend = "eager" if choice in ("eager", "cudagraphs") else "inductor"
    key = (function.__name__, backend)
    if key not in _COMPILED_SCORES:
        # every size dynamic from the start (the engine's groups and aligned blocks vary, the vocabulary per model):
        # one graph per remasking rule, dtype and grad mode, not one per shape
        compiled = torch.compile(function, backend=backend, dynamic=True)

        def scores(*args):
            with torch._dynamo.config.patch(recompile_limit=64):
                return compiled(*args)

        _COMPILED_SCORES[key] = scores
    return _COMPILED_SCORES[key]


def compiled_greedy_scores(choice: str):
    """`greedy_scores` through `_compiled_scores`."""
    return _compiled_scores(greedy_scores, choice)


def compiled_sampled_scores(choice: str):
    """`sampled_scores` through `_compiled_scores`."""
    return _compiled_scores(sampled_scores, choice)


def warm_compiled_scores(choice: str, vocab_size: int, dtype: torch.dtype, device, mask_id: int | None) -> None:
    """Compiles `compiled_greedy_scores` and `compiled_sampled_scores` for every scored remasking rule, for one row
    and for several (Dynamo gives a size of 1 a graph of its own): a server's warm-up, so that no request waits
    for the compiler. Call it in the grad mode of the steps (a graph is kept per mode)."""
    for rows in (1, 2):
        logits = torch.zeros((rows, 4, vocab_size), dtype=dtype, device=device)
        noise = torch.full(logits.shape, 0.5, dtype=torch.float64, device=device)
        for remasking in REMASKING:
            if remasking != "random":  # drawn, never compiled
                compiled_greedy_scores(choice)(logits, mask_id, remasking)
                temperature = torch.ones((), dtype=torch.float64, device=device)
                compiled_sampled_scores(choice)(logits, noise, mask_id, temperature, remasking)


# ---- one step -----------------------------------------------------------------------------------------------
def decide_step(logits: torch.Tensor, current: torch.Tensor, candidates: torch.Tensor, settings: CommitSettings,
                budget: torch.Tensor | None = None, generator: torch.Generator | None = None,
                editable: torch.Tensor | None = None, mask_id: int | None = None,
                credit: torch.Tensor | None = None, compile: str | None = None, noise: torch.Tensor | None = None):
    """One step's decision for rows sharing `settings`.

    logits (B, W, V) of the window; current (B, W) its tokens; candidates (B, W) bool: the masks this step may
    commit; budget (B,): LLaDA's count (count rule "budget"); editable (B, W) bool: committed tokens that
    `editing_threshold` may replace; mask_id: the [MASK] id, never a candidate; credit (B, W, V) float32:
    the rows' credit (`credit_alpha`), updated in place at the candidates (every mask of the block: credit takes no
    sub-blocks); compile: a `COMPILE_CHOICES` key (the caller's forward is compiled): a greedy step's
    vocabulary-sized work runs through `compiled_greedy_scores`, a sampled one's through `compiled_sampled_scores`;
    noise: a sampled step's float64 uniforms (B, W, V), drawn by the caller from each row's own generator (one
    call for rows that do not share one); None draws them from `generator`.
    -> (tokens (B, W): the window after the step, edited (B,) bool: some token was re-decided)."""
    if settings.credit_alpha is not None:
        if credit is None:
            raise ValueError("decide_step: credit_alpha needs the rows' credit state (credit=, zeros at a block start)")
        logits = credit_logits(logits, credit, candidates, settings)
    rule = settings.count_rule
    scored = settings.remasking != "random" and rule != "entropy_bound"  # confidence from the logits alone
    unfiltered = not settings.top_k and (settings.top_p is None or settings.top_p >= 1.0)
    if scored and settings.temperature == 0:
        # top-k / top-p never remove the argmax: the candidates are the argmax of the logits without [MASK]
        x0, scores = (compiled_greedy_scores(compile) if compile else greedy_scores)(logits, mask_id,
                                                                                      settings.remasking)
    elif scored and unfiltered and compile:  # the draw as below, its float64 arithmetic fused
        if noise is None:
            noise = torch.rand(logits.shape, dtype=torch.float64, device=logits.device, generator=generator)
        # a 0-d tensor on the device, filled by a kernel: no host copy, no sync
        temperature = torch.full((), settings.temperature, dtype=torch.float64, device=logits.device)
        x0, scores = compiled_sampled_scores(compile)(logits, noise, mask_id, temperature, settings.remasking)
    else:
        masked_logits = without_mask(logits, mask_id)
        filtered = filter_logits(masked_logits, settings.top_k, settings.top_p)
        x0 = add_gumbel_noise(filtered, settings.temperature, generator, noise).argmax(-1)
        if rule != "entropy_bound":
            scores = confidence_scores(logits, x0, settings.remasking, generator)
    if rule == "entropy_bound":
        # entropy of the distribution the token is drawn from: [MASK] suppressed, tempered and filtered when
        # sampling (diffusers / DiffusionGemma), the plain logits when greedy (SGLang)
        scaled = filtered / settings.temperature if settings.temperature else masked_logits
        log_p = scaled.to(torch.float64).log_softmax(-1)
        entropy = -(log_p.exp() * log_p.nan_to_num(neginf=0.0)).sum(-1)
        commit = entropy_bound_commits(entropy.masked_fill(~candidates, torch.inf), settings.entropy_bound)
    else:
        confidence = scores.masked_fill(~candidates, -torch.inf)
        if rule == "hierarchy_threshold":
            commit = hierarchy_commits(confidence, settings.hierarchy_threshold, settings.threshold)
        elif rule == "threshold":
            commit = threshold_commits(confidence, settings.threshold, strict=settings.editing_threshold is not None)
        elif rule == "factor":
            commit = factor_commits(confidence, settings.factor)
        else:
            commit = budget_commits(confidence, budget)
    edited = torch.zeros(current.shape[0], dtype=torch.bool, device=current.device)
    if settings.editing_threshold is not None and editable is not None:
        probability = scores if settings.remasking == "low_confidence" and rule != "entropy_bound" else \
            confidence_scores(logits, x0, "low_confidence")
        edit = editing_commits(probability, x0, current, editable, settings.editing_threshold)
        commit, edited = commit | edit, edit.any(-1)
    return torch.where(commit, x0, current), edited


__all__ = ["COMMIT_RULES", "COUNT_RULES", "REMASKING", "CommitRule", "CommitSettings", "block_candidates",
           "budget_commits", "compiled_greedy_scores", "compiled_sampled_scores", "credit_logits",
           "decide_step", "editing_commits", "entropy_bound_commits", "factor_commits", "greedy_scores",
           "hierarchy_commits", "sampled_scores", "threshold_commits", "warm_compiled_scores", "without_mask"]
