"""Monte Carlo ELBO (negative log-likelihood bound) of a masked-diffusion LM.

LLaDA's estimator: draw the number of masked tokens l ~ U{1..L} over the L scored tokens of a
sequence, mask l of them uniformly at random and score `(L / l) * sum_masked CE`; the mean over
`mc_num` draws bounds -log p(x). Draws are stratified over l and seeded, so two evaluations of the
same model and data give the same number.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


@torch.no_grad()
def elbo_nll(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    prompt_mask: torch.Tensor | None = None,
    mc_num: int = 16,
    seed: int = 0,
    batch_size: int = 32,
    position_ids: torch.Tensor | None = None,
    row_seeds: list[int] | None = None,
    subs: bool = False,
) -> dict:
    """Bound on the NLL of the scored tokens (real, non-prompt tokens) of every row.

    input_ids (N, L); position_ids (N, L): packed rows (positions restart at 0 for each document), passed
    to the model so that attention stays inside each document, as in training; a packed row's bound is
    then one on the joint NLL of its documents (the masked count is drawn over the whole row).
    row_seeds (N,): each row draws its masks from its own generator seeded so, over its scored tokens
    only, so a row's bound does not depend on the batch it is in, its order or its padding (lm-eval
    scores must not change with the batch size); without them one generator seeded by `seed` serves all.
    subs: MDLM's SUBS parameterisation, [MASK] removed from the softmax (for models trained with the
    objective's `subs=True`, the `mdlm` preset).
    Returns {"nll_per_token": nats/token over all scored tokens, "perplexity_bound", "num_tokens",
    "per_sequence": (N,) bound in nats}.
    """
    mask_id = model.config.mask_token_id
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    totals, counts = [], []
    for start in range(0, input_ids.shape[0], batch_size):
        ids = input_ids[start : start + batch_size].to(device)
        valid = torch.ones_like(ids, dtype=torch.bool) if attention_mask is None else attention_mask[start : start + batch_size].to(device).bool()
        scored = valid if prompt_mask is None else valid & ~prompt_mask[start : start + batch_size].to(device).bool()
        if model.config.label_alignment == "shift":
            scored = scored.clone()
            scored[:, 0] = False  # nothing predicts the first token
        n_scored = scored.sum(1)  # (B,)
        if row_seeds is not None:
            row_masks = _row_seeded_masks(scored.cpu(), row_seeds[start : start + batch_size], mc_num).to(device)
        bound = torch.zeros(ids.shape[0], dtype=torch.float64, device=device)
        for k in range(mc_num):
            if row_seeds is not None:
                masked, n_masked = row_masks[k], row_masks[k].sum(1)
            else:
                masked, n_masked = _shared_draw(scored, n_scored, k, mc_num, generator)
            noisy = torch.where(masked, mask_id, ids)
            logits = model.denoising_logits(
                noisy, attention_mask=None if attention_mask is None else valid.long(),
                position_ids=None if position_ids is None else position_ids[start : start + batch_size].to(device),
            )
            logits = logits.float()
            if subs:
                logits[..., mask_id] = float("-inf")
            ce = F.cross_entropy(logits.transpose(1, 2), ids, reduction="none")  # (B, L)
            estimate = (ce * masked).sum(1).double() * n_scored.double() / n_masked.clamp(min=1).double()
            bound += torch.where(n_scored > 0, estimate, 0.0) / mc_num
        totals.append(bound.cpu())
        counts.append(n_scored.cpu())
    per_sequence, num_tokens = torch.cat(totals), torch.cat(counts)
    nll = float(per_sequence.sum() / num_tokens.sum().clamp(min=1))
    return {"nll_per_token": nll, "perplexity_bound": math.exp(nll), "num_tokens": int(num_tokens.sum()),
            "per_sequence": per_sequence}


def _shared_draw(scored, n_scored, k, mc_num, generator):
    """The k-th stratified draw of every row from one shared generator -> (masked (B, L), n_masked (B,))."""
    device = scored.device
    # stratified l in {1..L_b}: the k-th of mc_num equal slices of [0, 1)
    u = (k + torch.rand(scored.shape[0], generator=generator)) / mc_num
    n_masked = (u.to(device) * n_scored).floor().long().clamp(min=0) + 1
    n_masked = torch.minimum(n_masked, n_scored.clamp(min=1))
    # random order of the scored positions; the first n_masked of them are masked
    keys = torch.rand(scored.shape, generator=generator).to(device).masked_fill(~scored, 2.0)
    rank = keys.argsort(1).argsort(1)
    return scored & (rank < n_masked.unsqueeze(1)), n_masked


def _row_seeded_masks(scored: torch.Tensor, seeds: list[int], mc_num: int) -> torch.Tensor:
    """(B, L) scored positions -> (mc_num, B, L) masks; row b's draws come from Generator(seeds[b]) over
    its scored positions only (stratified l, then a uniformly random subset of size l)."""
    masks = torch.zeros((mc_num, *scored.shape), dtype=torch.bool)
    for b, seed in enumerate(seeds):
        generator = torch.Generator().manual_seed(int(seed))
        positions = scored[b].nonzero().squeeze(1)
        n = positions.numel()
        if n == 0:
            continue
        for k in range(mc_num):
            u = (k + float(torch.rand(1, generator=generator))) / mc_num
            n_masked = min(int(u * n) + 1, n)
            order = torch.rand(n, generator=generator).argsort()
            masks[k, b, positions[order[:n_masked]]] = True
    return masks
