"""Estimators of a completion's per-token log-probabilities under a masked-diffusion LM (for RL).

A DLM has no exact left-to-right factorisation, so policy-gradient methods score a completion with a
masked forward pass. Each estimator maps (prompt + completion canvas, a seed) to per-token values whose
sum over the completion estimates log p(completion | prompt):

- `OneStepEstimator` (d1, diffu-GRPO): one forward with the completion fully masked and each prompt token
  masked with probability `prompt_mask_prob` (0.15); per-token log p(x_i | masked canvas).
- `CoupledEstimator` (DiffuCoder coupled-GRPO): t ~ U[t_min, t_max]; two complementary completion masks
  (u < t and u >= t, prompt clean) so every completion token is scored exactly once, weighted by the
  inverse probability of its mask (1/t or 1/(1-t)); averaged with the fully masked pass (DiffuCoder's
  released code does the three passes), or alone with `with_full_mask=False`.
- `MonteCarloELBOEstimator` (LLaDA's likelihood bound, used by wd1 / SPG-style objectives): `mc_num` draws of
  l ~ U{1..K} masked completion tokens (stratified), each masked token's log p weighted by K / l; the mean
  over draws sums to the ELBO, a lower bound on log p(completion | prompt).

Randomness: every uniform comes from `noise.hashed_uniform(seed, stream, row key, position)`, where the row
key hashes the row's tokens. So an estimate depends on the seed and on the row's content only, not on its
place in the batch: GRPO's old / reference / current log-probabilities of a rollout use the same masks even
though trl shuffles and re-chunks the rows in between; a new `seed` (the trainer derives one per inner
iteration, as d1 does) gives new masks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .noise import hashed_uniform, mix32

_PROMPT, _T, _COMPLETION, _DRAW, _ORDER = 0, 1, 2, 3, 4  # random streams


def row_keys(input_ids: torch.Tensor) -> torch.Tensor:
    """(B, L) token ids -> (B,) int64 hashes of each row's content (and token positions), in [0, 2**32)."""
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    mixed = mix32(mix32(input_ids.long() & 0xFFFFFFFF) ^ mix32(positions + 0x9E3779B9).unsqueeze(0))
    return mix32(mixed.sum(1) & 0xFFFFFFFF)


def completion_logits(model, noisy: torch.Tensor, attention_mask: torch.Tensor, completion_length: int,
                      temperature: float = 1.0) -> torch.Tensor:
    """Float32 logits (B, K, V) predicting the last K = `completion_length` tokens of `noisy` (B, L), whatever the
    model's label alignment; only those positions go through the LM head (`logits_to_keep`). `model` may be
    wrapped (DDP, peft): only its forward is called."""
    config = getattr(model, "config", None) or model.module.config
    shift = int(getattr(config, "label_alignment", "same") == "shift")
    logits = model(input_ids=noisy, attention_mask=attention_mask, logits_to_keep=completion_length + shift).logits
    if shift:
        logits = logits[:, :-1]  # logits at i - 1 predict token i
    return logits.float() / temperature


def token_logps_and_entropy(logits: torch.Tensor, targets: torch.Tensor, compute_entropy: bool):
    """(B, K, V), (B, K) -> log p(target) (B, K) and, if asked, the entropy of each predictive distribution."""
    log_probs = logits.log_softmax(-1)
    logps = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1) if compute_entropy else None
    return logps, entropy


@dataclass
class CompletionLogProbEstimator:
    """Base class. `__call__(model, input_ids, attention_mask, completion_length, seed)` with input_ids (B, L) whose
    last K = completion_length columns are the completion, attention_mask (B, L) (0 on left padding) and
    `scored` (B, K) the completion tokens that count -> (per-token values (B, K), entropies (B, K) or None)."""

    mask_token_id: int
    temperature: float = 1.0

    def __call__(self, model, input_ids, attention_mask, completion_length: int, seed: int,
                 scored: torch.Tensor | None = None, compute_entropy: bool = False):
        raise NotImplementedError

    def _logps(self, model, noisy, attention_mask, targets, compute_entropy):
        logits = completion_logits(model, noisy, attention_mask, targets.shape[1], self.temperature)
        return token_logps_and_entropy(logits, targets, compute_entropy)


@dataclass
class OneStepEstimator(CompletionLogProbEstimator):
    """d1's estimator (diffu-GRPO): completion fully masked, prompt tokens masked with `prompt_mask_prob`."""

    prompt_mask_prob: float = 0.15

    def __call__(self, model, input_ids, attention_mask, completion_length, seed, scored=None, compute_entropy=False):
        keys, positions = row_keys(input_ids), torch.arange(input_ids.shape[1], device=input_ids.device)
        prompt = positions.unsqueeze(0) < input_ids.shape[1] - completion_length  # (1, L)
        drop = hashed_uniform(seed, _PROMPT, keys, positions) < self.prompt_mask_prob  # (B, L)
        noisy = torch.where(~prompt | drop, self.mask_token_id, input_ids)
        return self._logps(model, noisy, attention_mask, input_ids[:, -completion_length:], compute_entropy)


@dataclass
class CoupledEstimator(CompletionLogProbEstimator):
    """DiffuCoder's coupled sampling: complementary masks at ratio t ~ U[t_min, t_max], inverse-probability
    weighted, averaged with the fully masked pass unless `with_full_mask=False`."""

    t_min: float = 0.2
    t_max: float = 0.8
    with_full_mask: bool = True

    def __call__(self, model, input_ids, attention_mask, completion_length, seed, scored=None, compute_entropy=False):
        keys = row_keys(input_ids)
        prompt_len, targets = input_ids.shape[1] - completion_length, input_ids[:, -completion_length:]
        t = self.t_min + (self.t_max - self.t_min) * hashed_uniform(seed, _T, keys)  # (B,)
        u = hashed_uniform(seed, _COMPLETION, keys, torch.arange(completion_length, device=input_ids.device))
        first = u < t.unsqueeze(1)  # (B, K): masked in the first pass, the rest in the complementary one

        def masked(completion_mask):
            noisy = input_ids.clone()
            noisy[:, prompt_len:] = torch.where(completion_mask, self.mask_token_id, targets)
            return noisy

        # one forward over the stacked variants (rows: first mask, complement[, full mask])
        variants = [masked(first), masked(~first)] + ([masked(torch.ones_like(first))] if self.with_full_mask else [])
        logits = completion_logits(model, torch.cat(variants), attention_mask.repeat(len(variants), 1),
                                   completion_length, self.temperature)
        logps, entropy = token_logps_and_entropy(logits, targets.repeat(len(variants), 1), compute_entropy)
        logps = logps.chunk(len(variants))
        t = t.unsqueeze(1)
        estimate = torch.where(first, logps[0] / t, logps[1] / (1 - t))
        if self.with_full_mask:
            estimate = (logps[2] + estimate) / 2
        if entropy is not None:  # the entropy where the token was scored in the coupled pair
            parts = entropy.chunk(len(variants))
            entropy = torch.where(first, parts[0], parts[1])
        return estimate, entropy


@dataclass
class MonteCarloELBOEstimator(CompletionLogProbEstimator):
    """LLaDA's Monte Carlo ELBO over the completion: `mc_num` stratified draws of l ~ U{1..K_row}
    (K_row = scored tokens of the row), l of them masked at random, each masked token's log p times K_row / l."""

    mc_num: int = 4

    def __call__(self, model, input_ids, attention_mask, completion_length, seed, scored=None, compute_entropy=False):
        batch, device = input_ids.shape[0], input_ids.device
        keys, prompt_len = row_keys(input_ids), input_ids.shape[1] - completion_length
        targets = input_ids[:, prompt_len:]
        scored = torch.ones_like(targets, dtype=torch.bool) if scored is None else scored.bool()
        n_scored = scored.sum(1)  # (B,)
        columns = torch.arange(completion_length, device=device)
        noisy, weights = [], []
        for k in range(self.mc_num):
            draw_keys = mix32(keys ^ (k * 0x632BE5AB))
            u = (k + hashed_uniform(seed, _DRAW, draw_keys)) / self.mc_num  # stratified in [k/M, (k+1)/M)
            n_masked = torch.minimum((u * n_scored).floor().long() + 1, n_scored.clamp(min=1))  # (B,)
            order = hashed_uniform(seed, _ORDER, draw_keys, columns).masked_fill(~scored, 2.0)
            rank = order.argsort(1).argsort(1)
            mask = scored & (rank < n_masked.unsqueeze(1))  # (B, K)
            variant = input_ids.clone()
            variant[:, prompt_len:] = torch.where(mask, self.mask_token_id, targets)
            noisy.append(variant)
            weights.append(mask * (n_scored.float() / n_masked.float()).unsqueeze(1))
        logits = completion_logits(model, torch.cat(noisy), attention_mask.repeat(self.mc_num, 1), completion_length,
                                   self.temperature)
        logps, entropy = token_logps_and_entropy(logits, targets.repeat(self.mc_num, 1), compute_entropy)
        weight = torch.cat(weights)  # (M * B, K)
        estimate = (logps * weight).view(self.mc_num, batch, -1).sum(0) / self.mc_num
        if entropy is not None:  # mean entropy over the draws where the token was masked
            masked = (weight > 0).float().view(self.mc_num, batch, -1)
            entropy = (entropy.view(self.mc_num, batch, -1) * masked).sum(0) / masked.sum(0).clamp(min=1)
        return estimate, entropy


ESTIMATORS = {"d1": OneStepEstimator, "coupled": CoupledEstimator, "mc_elbo": MonteCarloELBOEstimator}


def build_estimator(name: str, mask_token_id: int, **options) -> CompletionLogProbEstimator:
    if name not in ESTIMATORS:
        raise ValueError(f"unknown log-probability estimator {name!r}; choose from {sorted(ESTIMATORS)}")
    return ESTIMATORS[name](mask_token_id=mask_token_id, **options)


__all__ = ["CompletionLogProbEstimator", "OneStepEstimator", "CoupledEstimator", "MonteCarloELBOEstimator",
           "ESTIMATORS", "build_estimator", "row_keys"]
