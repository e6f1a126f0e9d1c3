"""Log-likelihood of continuations given contexts: the scoring path of the `hf-dlm` lm-eval model, as a
plain function (no lm-eval import) that benchmarks call too.

- Diffusion models (bidirectional or block attention): minus LLaDA's Monte Carlo ELBO of the continuation
  given the context (`elbo_nll`, `mc_num` stratified draws): a lower bound on the log-likelihood. Each pair
  draws its masks from a generator seeded by a hash of (seed, its tokens), so a score does not change with
  the batch size or the order of the pairs. `is_greedy`: every continuation token is the argmax when the
  whole continuation is masked ("one_forward"), or LLaDA's iterative check ("iterative").
- Causal models (`attention_mode="causal"`, an AR model trained with the "ar" objective): the exact
  log-likelihood, sum over continuation tokens of log p(token | everything before it); `is_greedy`: every
  continuation token is the next-token argmax.
"""

from __future__ import annotations

import hashlib

import torch
from tqdm.auto import tqdm

from ..diffusion.elbo import elbo_nll

GREEDY_CHECKS = ("one_forward", "iterative")  # how `is_greedy` is decided for a diffusion model


def _denoise(model, ids, attention_mask, mask_id, subs):
    logits = model.denoising_logits(ids, attention_mask=attention_mask).float()
    if subs:
        logits[..., mask_id] = float("-inf")
    return logits


@torch.no_grad()
def greedy_one_forward(model, input_ids, attention_mask, answer, mask_id, subs=False) -> torch.Tensor:
    """(B,) is every answer token the argmax when the whole answer is masked (one forward)?"""
    logits = _denoise(model, input_ids.masked_fill(answer, mask_id), attention_mask, mask_id, subs)
    return (logits.argmax(-1).eq(input_ids) | ~answer).all(1)


@torch.no_grad()
def greedy_iterative(model, input_ids, attention_mask, answer, mask_id, subs=False) -> torch.Tensor:
    """(B,) LLaDA's `suffix_greedy_prediction`, batched: from a fully masked answer, each of the answer's K forwards
    commits the argmax at the masked answer position whose argmax has the highest probability (a row stops after
    its own K forwards); is the decoded answer the answer?"""
    canvas = input_ids.masked_fill(answer, mask_id)
    lengths = answer.sum(1)
    for step in range(int(lengths.max()) if answer.any() else 0):
        masked = (canvas == mask_id) & answer & (step < lengths).unsqueeze(1)  # (B, L)
        probs = _denoise(model, canvas, attention_mask, mask_id, subs).softmax(-1)
        confidence, x0 = probs.max(-1)  # (B, L)
        best = confidence.masked_fill(~masked, -1.0).argmax(1)  # (B,)
        rows = masked.any(1).nonzero().squeeze(1)
        canvas[rows, best[rows]] = x0[rows, best[rows]]
    return (canvas.eq(input_ids) | ~answer).all(1)


def request_seed(seed: int, *token_lists) -> int:
    """A 63-bit seed from (seed, token lists): the same request gets the same masks wherever it is batched."""
    digest = hashlib.sha256(repr((seed, *token_lists)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


def _batch_rows(rows, pad_token_id: int):
    """(context, continuation) id lists -> right-padded input_ids, attention_mask (None without padding) and
    prompt_mask (True on the context), each (B, W)."""
    width = max(len(c) + len(x) for c, x in rows)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    prompt_mask = torch.zeros_like(input_ids, dtype=torch.bool)
    for r, (context, continuation) in enumerate(rows):
        input_ids[r, : len(context) + len(continuation)] = torch.tensor(context + continuation)
        attention_mask[r, : len(context) + len(continuation)] = 1
        prompt_mask[r, : len(context)] = True
    return input_ids, (None if bool(attention_mask.all()) else attention_mask), prompt_mask


@torch.no_grad()
def _causal_scores(model, input_ids, attention_mask, prompt_mask) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact AR log-likelihood of the non-prompt real tokens: the logits at j predict token j + 1."""
    device = next(model.parameters()).device
    input_ids = input_ids.to(device)
    logits = model(input_ids=input_ids,
                   attention_mask=None if attention_mask is None else attention_mask.to(device)).logits
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)  # (B, W-1, V): position j scores token j+1
    targets = input_ids[:, 1:]
    scored = ~prompt_mask[:, 1:].to(device)
    if attention_mask is not None:
        scored &= attention_mask[:, 1:].to(device).bool()
    token_logp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (B, W-1)
    total = (token_logp.double() * scored).sum(1)
    greedy = (logp.argmax(-1).eq(targets) | ~scored).all(1)
    return total.cpu(), greedy.cpu()


@torch.no_grad()
def _diffusion_scores(model, input_ids, attention_mask, prompt_mask, mc_num, seeds, subs, greedy_check):
    """Minus the ELBO of the non-prompt real tokens, and whether the continuation is greedy (`greedy_check`)."""
    device = next(model.parameters()).device
    bound = elbo_nll(model, input_ids, attention_mask, prompt_mask, mc_num=mc_num, batch_size=input_ids.shape[0],
                     row_seeds=seeds, subs=subs)["per_sequence"]
    answer = ~prompt_mask if attention_mask is None else attention_mask.bool() & ~prompt_mask
    check = greedy_one_forward if greedy_check == "one_forward" else greedy_iterative
    greedy = check(model, input_ids.to(device), None if attention_mask is None else attention_mask.to(device),
                   answer.to(device), model.config.mask_token_id, subs).cpu()
    return -bound, greedy


def score_continuations(model, pairs: list[tuple[list[int], list[int]]], *, pad_token_id: int = 0,
                        prefix_token_id: int | None = None, max_length: int | None = None, batch_size: int = 8,
                        mc_num: int = 128, seed: int = 1234, subs: bool = False, greedy_check: str = "one_forward",
                        progress: str | None = None) -> list[tuple[float, bool]]:
    """(context ids, continuation ids) pairs -> [(log-likelihood, or its ELBO lower bound for a diffusion
    model; is_greedy)] in the input order.

    An empty context becomes `[prefix_token_id]`; contexts are cut from the left so that a row fits
    `max_length` (default: the model's max_position_embeddings). Pairs of similar lengths are batched
    together (`batch_size` rows); the scores do not depend on the batching. Diffusion models only: `mc_num`
    ELBO draws per pair, `subs` ([MASK] out of the softmax: MDLM SUBS models), `greedy_check` (GREEDY_CHECKS:
    "one_forward", the whole continuation masked in one forward, or "iterative", LLaDA's
    suffix_greedy_prediction)."""
    if greedy_check not in GREEDY_CHECKS:
        raise ValueError(f"score_continuations: greedy_check must be one of {GREEDY_CHECKS}, got {greedy_check!r}")
    max_length = int(max_length or getattr(model.config, "max_position_embeddings", 2048))
    causal = getattr(model.config, "attention_mode", None) == "causal"
    order = sorted(range(len(pairs)), key=lambda i: -sum(map(len, pairs[i])))  # similar lengths batch together
    results: list = [None] * len(pairs)
    for start in tqdm(range(0, len(order), batch_size), desc=progress, disable=progress is None):
        chunk = order[start : start + batch_size]
        rows = []
        for i in chunk:
            context, continuation = pairs[i]
            if not context:
                if prefix_token_id is None:
                    raise ValueError(f"score_continuations: pair {i} has an empty context and no prefix_token_id")
                context = [prefix_token_id]
            context = list(context)[-(max_length - len(continuation)) :]
            rows.append((context, list(continuation)[-max_length:]))
        input_ids, attention_mask, prompt_mask = _batch_rows(rows, pad_token_id)
        if causal:
            scores, greedy = _causal_scores(model, input_ids, attention_mask, prompt_mask)
        else:
            seeds = [request_seed(seed, c, x) for c, x in rows]
            scores, greedy = _diffusion_scores(model, input_ids, attention_mask, prompt_mask, mc_num, seeds, subs,
                                              greedy_check)
        for r, i in enumerate(chunk):
            results[i] = (float(scores[r]), bool(greedy[r]))
    return results
