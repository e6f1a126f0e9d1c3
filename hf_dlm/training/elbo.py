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
) -> dict:
    """Bound on the NLL of the scored tokens (real, non-prompt tokens) of every row.

    input_ids (N, L); position_ids (N, L): packed rows (positions restart at 0 for each document), passed
    to the model so that attention stays inside each document, as in training; a packed row's bound is
    then one on the joint NLL of its documents (the masked count is drawn over the whole row).
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
        bound = torch.zeros(ids.shape[0], dtype=torch.float64, device=device)
        for k in range(mc_num):
            # stratified l in {1..L_b}: the k-th of mc_num equal slices of [0, 1)
            u = (k + torch.rand(ids.shape[0], generator=generator)) / mc_num
            n_masked = (u.to(device) * n_scored).floor().long().clamp(min=0) + 1
            n_masked = torch.minimum(n_masked, n_scored.clamp(min=1))
            # random order of the scored positions; the first n_masked of them are masked
            keys = torch.rand(ids.shape, generator=generator).to(device).masked_fill(~scored, 2.0)
            rank = keys.argsort(1).argsort(1)
            masked = scored & (rank < n_masked.unsqueeze(1))
            noisy = torch.where(masked, mask_id, ids)
            logits = model.denoising_logits(
                noisy, attention_mask=None if attention_mask is None else valid.long(),
                position_ids=None if position_ids is None else position_ids[start : start + batch_size].to(device),
            )
            ce = F.cross_entropy(logits.float().transpose(1, 2), ids, reduction="none")  # (B, L)
            estimate = (ce * masked).sum(1).double() * n_scored.double() / n_masked.double()
            bound += torch.where(n_scored > 0, estimate, 0.0) / mc_num
        totals.append(bound.cpu())
        counts.append(n_scored.cpu())
    per_sequence, num_tokens = torch.cat(totals), torch.cat(counts)
    nll = float(per_sequence.sum() / num_tokens.sum().clamp(min=1))
    return {"nll_per_token": nll, "perplexity_bound": math.exp(nll), "num_tokens": int(num_tokens.sum()),
            "per_sequence": per_sequence}
