"""The per-step arithmetic of the diffusion samplers: token budgets, Gumbel-max candidates, confidence
scores and which masked positions to commit (LLaDA `generate.py` and Fast-dLLM semantics)."""

from __future__ import annotations

import torch

SCHEDULES = ("even", "dream")


def num_transfer_tokens(masked_count: torch.Tensor, steps: int) -> torch.Tensor:
    """Tokens to commit at each of `steps` steps: `masked_count // steps` each, the remainder one each
    to the first steps (LLaDA's `get_num_transfer_tokens`). (B,) -> (B, steps)."""
    base = torch.div(masked_count, steps, rounding_mode="floor").unsqueeze(1)
    remainder = (masked_count % steps).unsqueeze(1)
    step_index = torch.arange(steps, device=masked_count.device).unsqueeze(0)
    return base + (step_index < remainder).long()


def dream_transfer_tokens(masked_count: torch.Tensor, steps: int, eps: float = 1e-3) -> torch.Tensor:
    """Dream's per-step count (`DreamGenerationMixin._sample`): timesteps t = linspace(1, eps, steps + 1); step i
    commits int(m * (1 - t[i+1] / t[i])) of the m masks left, every one left at the last step. Each step commits
    exactly its count, so the counts follow from the block's masks; computed on the host in float32, as Dream
    computes them (the truncation makes early steps of long schedules commit nothing). (B,) -> (B, steps)."""
    timesteps = torch.linspace(1, eps, steps + 1)
    left = masked_count.detach().to("cpu", torch.long)
    counts = []
    for i in range(steps):
        t, s = timesteps[i], timesteps[i + 1]
        count = (left.float() * (1 - s / t)).long() if i < steps - 1 else left
        counts.append(count)
        left = left - count
    return torch.stack(counts, 1).to(masked_count.device)


def transfer_schedule(masked_count: torch.Tensor, steps: int, schedule: str = "even", eps: float = 1e-3):
    """Tokens each of a block's `steps` steps commits under LLaDA's budget: `schedule` "even" (LLaDA) or "dream"."""
    if schedule == "dream":
        return dream_transfer_tokens(masked_count, steps, eps)
    return num_transfer_tokens(masked_count, steps)


def block_bounds(prompt_len: int, new_tokens: int, block_length: int, phase: int | None = None):
    """The sampler's blocks over a canvas whose prompt ends at `prompt_len` -> ([(start, end, offset)], canvas length).

    phase None: blocks of block_length from the prompt end (LLaDA); the canvas holds prompt + new_tokens (a multiple
    of block_length). phase (the canvas index of position 0, mod block_length: the row's left padding): blocks
    aligned to multiples of block_length in the row's positions (LLaDA2.x, SDAR, Fast-dLLM v2 generate): the first
    block is the rest of the prompt's partial block, the canvas is extended to the end of the last block (the caller
    cuts the output at new_tokens). offset: the block's first canvas slot, counted from its aligned start."""
    if phase is None:
        blocks = [(prompt_len + k * block_length, prompt_len + (k + 1) * block_length, 0)
                  for k in range(new_tokens // block_length)]
        return blocks, prompt_len + new_tokens
    total = prompt_len + new_tokens + (phase - prompt_len - new_tokens) % block_length
    blocks, start = [], prompt_len
    while start < total:
        offset = (start - phase) % block_length
        blocks.append((start, start + block_length - offset, offset))
        start += block_length - offset
    return blocks, total


def add_gumbel_noise(logits: torch.Tensor, temperature: float, generator: torch.Generator | None = None,
                     noise: torch.Tensor | None = None):
    """Gumbel-max sampling in float64 (low-precision Gumbel noise degrades sample quality, LLaDA):
    argmax(exp(logits) / (-log u)^T) draws from softmax(logits / T). T = 0 returns the logits (argmax).
    noise: the uniforms u (float64, logits' shape) when the caller drew them (rows with generators of their own);
    else drawn from `generator`."""
    if temperature == 0:
        return logits
    logits = logits.to(torch.float64)
    if noise is None:
        noise = torch.rand(logits.shape, dtype=torch.float64, device=logits.device, generator=generator)
    return logits.exp() / (-torch.log(noise)) ** temperature


def filter_logits(logits: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """top-k / nucleus filtering of the candidates' distribution (filtered entries -> -inf)."""
    if top_k:
        kth = logits.topk(min(int(top_k), logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -torch.inf)
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.float().softmax(-1)
        drop = probs.cumsum(-1) - probs > top_p  # keep the smallest prefix whose mass reaches top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), -torch.inf)
    return logits


def confidence_scores(logits: torch.Tensor, x0: torch.Tensor, remasking: str, generator=None) -> torch.Tensor:
    """(B, W, V), (B, W) -> (B, W) float64: higher = committed first. Probabilities come from the
    unfiltered, un-noised logits in float64, as in LLaDA."""
    if remasking == "random":
        return torch.rand(x0.shape, device=x0.device, generator=generator, dtype=torch.float64)
    # log p = logit - logsumexp: one vocabulary-sized float64 tensor, not two (the upcast and log_softmax)
    logits = logits.to(torch.float64)
    lse = logits.logsumexp(-1)
    if remasking == "low_confidence":
        return (logits.gather(-1, x0.unsqueeze(-1)).squeeze(-1) - lse).exp()
    if remasking == "margin":  # top-1 minus top-2 probability
        top2 = (logits.topk(2, dim=-1).values - lse.unsqueeze(-1)).exp()
        return top2[..., 0] - top2[..., 1]
    log_p = logits - lse.unsqueeze(-1)
    return (log_p.exp() * log_p).sum(-1)  # "entropy": minus the entropy, so low entropy commits first


def finished_rows(block_tokens: torch.Tensor, eos_ids: torch.Tensor) -> torch.Tensor:
    """(B, W) decoded block -> (B,) bool: the block ends in EOS and everything after its first EOS is EOS
    (LLaDA-style models pad the answer with EOS, so the rest of the row is EOS too)."""
    is_eos = torch.isin(block_tokens, eos_ids)
    after_first = is_eos.long().cummax(-1).values.bool()
    return is_eos[:, -1] & (after_first == is_eos).all(-1)
