"""Log-likelihood of continuations given contexts: the scoring path of the `hf-dlm` lm-eval model, as a
plain function (no lm-eval import) that benchmarks call too.

- Diffusion models (bidirectional or block attention): minus LLaDA's Monte Carlo ELBO of the continuation
  given the context (`elbo_nll`, `mc_num` stratified draws): a lower bound on the log-likelihood. Each pair
  draws its masks from a generator seeded by a hash of (seed, its tokens), so a score does not change with
  the batch size or the order of the pairs. `is_greedy`: every continuation token is the argmax when the
  whole continuation is masked.
- Causal models (`attention_mode="causal"`, an AR model trained with the "ar" objective): the exact
  log-likelihood, sum over continuation tokens of log p(token | everything before it); `is_greedy`: every
  continuation token is the next-token argmax.
"""

from __future__ import annotations

import hashlib

import torch
from tqdm.auto import tqdm

from ..diffusion.elbo import elbo_nll


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
def _diffusion_scores(model, input_ids, attention_mask, prompt_mask, mc_num, seeds):
    """Minus the ELBO of the non-prompt real tokens, and whether the whole masked continuation is greedy."""
    device = next(model.parameters()).device
    bound = elbo_nll(model, input_ids, attention_mask, prompt_mask, mc_num=mc_num, batch_size=input_ids.shape[0],
                     row_seeds=seeds)["per_sequence"]
    answer = ~prompt_mask if attention_mask is None else attention_mask.bool() & ~prompt_mask
    logits = model.denoising_logits(input_ids.masked_fill(answer, model.config.mask_token_id).to(device),
                                    attention_mask=None if attention_mask is None else attention_mask.to(device))
    greedy = (logits.argmax(-1).cpu().eq(input_ids) | ~answer).all(1)
    return -bound, greedy


def score_continuations(model, pairs: list[tuple[list[int], list[int]]], *, pad_token_id: int = 0,
                        prefix_token_id: int | None = None, max_length: int | None = None, batch_size: int = 8,
                        mc_num: int = 128, seed: int = 1234, progress: str | None = None) -> list[tuple[float, bool]]:
    """(context ids, continuation ids) pairs -> [(log-likelihood, or its ELBO lower bound for a diffusion
    model; is_greedy)] in the input order.

    An empty context becomes `[prefix_token_id]`; contexts are cut from the left so that a row fits
    `max_length` (default: the model's max_position_embeddings). Pairs of similar lengths are batched
    together (`batch_size` rows); the scores do not depend on the batching."""
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
            scores, greedy = _diffusion_scores(model, input_ids, attention_mask, prompt_mask, mc_num, seeds)
        for r, i in enumerate(chunk):
            results[i] = (float(scores[r]), bool(greedy[r]))
    return results
