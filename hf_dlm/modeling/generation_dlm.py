"""`model.generate` for DLMs: LLaDA's semi-autoregressive masked-diffusion sampler and Fast-dLLM's
threshold decoding and KV caches.

Canvas = prompt + `max_new_tokens` masks, split into blocks of `block_length` decoded left to right;
`steps` forward passes are shared evenly over the blocks. Each step (LLaDA `generate.py` semantics):
candidates `x0 = argmax(logits + Gumbel noise at temperature T)` (float64 noise; T = 0 is argmax), a
confidence per position (`remasking`), -inf after the current block and on committed tokens, then the
`num_transfer_tokens` most confident masked positions are committed (or, with `threshold`, every one
whose confidence is >= threshold and at least the best). Masks inside the prompt (infilling) compete
with the current block, as in LLaDA.

Caches (`cache`):
- bidirectional models: `prefix` / `dual` are Fast-dLLM's caches and APPROXIMATE by nature: at each
  block start one full forward stores every position's keys / values; later steps of the block
  recompute only the block (`dual`) or the block and everything after it (`prefix`), reusing the
  stored, slightly stale keys / values of the rest.
- attention_mode='block' models: either value selects an EXACT cache. Tokens of finished model blocks
  never see later tokens, so their keys / values are final; each step recomputes only the model
  blocks that overlap the current sampler block (per row, so left padding is handled), and the result
  equals the uncached sampler.
Left padding with an attention mask is supported in every mode: each row is decoded as if alone.
"""

from __future__ import annotations

import torch

from .generation_cache import DLMKVCache
from .generation_config import DLMGenerationConfig


def num_transfer_tokens(masked_count: torch.Tensor, steps: int) -> torch.Tensor:
    """Tokens to commit at each of `steps` steps: `masked_count // steps` each, the remainder one each
    to the first steps (LLaDA's `get_num_transfer_tokens`). (B,) -> (B, steps)."""
    base = torch.div(masked_count, steps, rounding_mode="floor").unsqueeze(1)
    remainder = (masked_count % steps).unsqueeze(1)
    step_index = torch.arange(steps, device=masked_count.device).unsqueeze(0)
    return base + (step_index < remainder).long()


def add_gumbel_noise(logits: torch.Tensor, temperature: float, generator: torch.Generator | None = None):
    """Gumbel-max sampling in float64 (low precision Gumbel noise degrades sample quality):
    argmax(exp(logits) / (-log u)^T) draws from softmax(logits / T)."""
    if temperature == 0:
        return logits
    logits = logits.to(torch.float64)
    noise = torch.rand(logits.shape, dtype=torch.float64, device=logits.device, generator=generator)
    return logits.exp() / (-torch.log(noise)) ** temperature


def filter_logits(logits: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """top-k / nucleus filtering before the Gumbel draw (filtered entries -> -inf)."""
    if top_k:
        kth = logits.topk(min(int(top_k), logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -torch.inf)
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) > top_p  # keep the smallest set reaching top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), -torch.inf)
    return logits


def confidence_scores(logits, x0, remasking: str, generator=None) -> torch.Tensor:
    """(B, L, V), (B, L) -> (B, L): higher = commit first. Probabilities come from the unfiltered,
    unnoised logits (as in LLaDA); the log-sum-exp avoids a full float softmax for low_confidence."""
    if remasking == "random":
        return torch.rand(x0.shape, device=x0.device, generator=generator, dtype=torch.float64)
    logits = logits.float()
    log_z = logits.logsumexp(-1)
    if remasking == "low_confidence":
        return (logits.gather(-1, x0.unsqueeze(-1)).squeeze(-1) - log_z).exp()
    if remasking == "margin":
        top2 = (logits.topk(2, dim=-1).values - log_z.unsqueeze(-1)).exp()
        return top2[..., 0] - top2[..., 1]
    log_p = logits - log_z.unsqueeze(-1)
    return (log_p.exp() * log_p).sum(-1)  # entropy: minus the entropy, so low entropy commits first


def select_commits(confidence: torch.Tensor, budget: torch.Tensor | None, threshold: float | None):
    """Which positions to commit. confidence (B, W) with -inf where not allowed; budget (B,) tokens
    per row (LLaDA top-k) or threshold (Fast-dLLM: >= threshold, plus the best one). -> (B, W) bool."""
    allowed = torch.isfinite(confidence)
    if threshold is not None:
        best = torch.zeros_like(allowed).scatter_(1, confidence.argmax(-1, keepdim=True), True)
        return ((confidence >= threshold) | best) & allowed
    k_max = int(budget.max()) if budget.numel() else 0
    if k_max == 0:
        return torch.zeros_like(allowed)
    index = confidence.topk(k_max, dim=-1).indices
    rank_ok = torch.arange(k_max, device=budget.device).unsqueeze(0) < budget.unsqueeze(1)
    return torch.zeros_like(allowed).scatter_(1, index, rank_ok) & allowed


class DLMGenerationMixin:
    """Adds `generate` to DLM models (named *GenerationMixin so transformers gives them a
    `generation_config`)."""

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        generation_config=None,
        streamer=None,
        callback=None,
        generator: torch.Generator | None = None,
        **kwargs,
    ) -> torch.LongTensor:
        """Prompt (B, P), left-padded with `attention_mask` for mixed lengths -> sequences (B, P + N).

        kwargs override `generation_config` (default: `model.generation_config`) fields, see
        `DLMGenerationConfig`. streamer: a transformers streamer (`put` / `end`, batch 1) that receives
        the prompt, then the completion's committed left-to-right prefix as it grows. callback:
        `callback(canvas=(B, P + N) tensor, step=int, block=int)` after every forward pass (read-only
        canvas, for UIs that show intermediate states)."""
        config = DLMGenerationConfig.from_any(generation_config or getattr(self, "generation_config", None), **kwargs)
        return DiffusionSampler(self, config, generator).run(input_ids, attention_mask, streamer, callback)


class DiffusionSampler:
    def __init__(self, model, config: DLMGenerationConfig, generator=None):
        self.model, self.config, self.generator = model, config, generator
        self.mask_id = config.mask_token_id if config.mask_token_id is not None else model.config.mask_token_id
        if self.mask_id is None:
            raise ValueError("generate needs config.mask_token_id (model config or generation config)")
        eos = config.eos_token_id if config.eos_token_id is not None else model.config.eos_token_id
        self.eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        self.shift = int(model.config.label_alignment == "shift")
        self.exact_block_cache = config.cache != "none" and model.config.attention_mode == "block"

    def _inputs(self, canvas, prompt_tokens):
        """CFG: the unconditional copy has the prompt masked; both go through one forward."""
        if not self.config.cfg_scale:
            return canvas
        return torch.cat([canvas, canvas.masked_fill(prompt_tokens, self.mask_id)])

    def _guided(self, logits):
        if not self.config.cfg_scale:
            return logits
        cond, uncond = logits.chunk(2)
        return uncond + (self.config.cfg_scale + 1) * (cond - uncond)

    def _logits(self, canvas, prompt_tokens, full_mask, cache, window, query, key_end, store):
        """Logits aligned to canvas positions [window[0], window[1])."""
        x = self._inputs(canvas, prompt_tokens)
        if cache is None:
            mask = full_mask if not self.config.cfg_scale else torch.cat([full_mask, full_mask])
            logits = self.model.denoising_logits(x, attention_mask=mask)[:, window[0] : window[1]]
        else:
            query_start = min(query[0], window[0] - self.shift)  # shifted logits: i - 1 predicts i
            out = self.model(input_ids=x[:, query_start : query[1]], kv_cache=cache.window(query_start, key_end, store))
            first = window[0] - self.shift - query_start
            logits = out.logits[:, first : first + window[1] - window[0]]
        return self._guided(logits)

    def run(self, input_ids, attention_mask, streamer, callback):
        cfg, mask_id = self.config, self.mask_id
        batch, prompt_len = input_ids.shape
        new_tokens = cfg.max_new_tokens or 64
        block_length = cfg.block_length or new_tokens
        steps = cfg.steps or new_tokens
        if new_tokens % block_length:
            raise ValueError(f"max_new_tokens ({new_tokens}) must be a multiple of block_length ({block_length})")
        num_blocks = new_tokens // block_length
        if steps % num_blocks:
            raise ValueError(f"steps ({steps}) must be a multiple of the number of blocks ({num_blocks})")
        steps_per_block = steps // num_blocks
        if streamer is not None and batch != 1:
            raise ValueError("generate(streamer=...) streams one sequence; pass a batch of 1 or use callback")

        device, total = input_ids.device, prompt_len + new_tokens
        canvas = torch.full((batch, total), mask_id, dtype=torch.long, device=device)
        canvas[:, :prompt_len] = input_ids
        full_mask = torch.ones_like(canvas)
        if attention_mask is not None:
            full_mask[:, :prompt_len] = attention_mask
        prompt_tokens = torch.zeros_like(canvas, dtype=torch.bool)
        prompt_tokens[:, :prompt_len] = full_mask[:, :prompt_len].bool()
        if cfg.cache != "none" and (canvas[:, :prompt_len].eq(mask_id) & prompt_tokens[:, :prompt_len]).any():
            raise ValueError("masks inside the prompt (infilling) need cache='none': cached steps never revisit the prompt")
        cache = None
        if cfg.cache != "none":
            positions = (full_mask.cumsum(-1) - 1).clamp(min=0)
            repeat = 2 if cfg.cfg_scale else 1
            cache = DLMKVCache(full_mask.repeat(repeat, 1), positions.repeat(repeat, 1))
            pads = (prompt_len - full_mask[:, :prompt_len].sum(-1)).view(-1, 1)  # (B, 1) left pads per row
        if streamer is not None:
            streamer.put(input_ids.cpu())
        streamed, done, step_count = 0, torch.zeros(batch, dtype=torch.bool, device=device), 0
        query_floor = 0  # exact block cache: first slot recomputed at the next block start

        for block in range(num_blocks):
            start, end = prompt_len + block * block_length, prompt_len + (block + 1) * block_length
            budget = num_transfer_tokens(canvas[:, start:end].eq(mask_id).sum(1), steps_per_block)
            if self.exact_block_cache:
                size = self.model.config.block_size
                block_start = pads + torch.div(start - pads, size, rounding_mode="floor") * size
                block_end = pads + (torch.div(end - 1 - pads, size, rounding_mode="floor") + 1) * size
                query_lo, key_end = int(block_start.min()), min(total, int(block_end.max()))
            step = 0
            while True:
                if cfg.threshold is None and step == steps_per_block:
                    break
                if cfg.threshold is not None and not canvas[:, start:end].eq(mask_id).any():
                    break
                # window: positions this step may commit; queries [query_start, query_end); keys [0, key_end)
                if cache is None:
                    window, query, k_end, store = (0, total), (0, total), total, False
                elif self.exact_block_cache:
                    window, k_end, store = (start, end), key_end, True
                    query = (query_floor if step == 0 else query_lo, key_end)
                elif step == 0:  # Fast-dLLM: refresh every position's keys / values at block start
                    window, query, k_end, store = (start, end), (0, total), total, True
                elif cfg.cache == "dual":
                    window, query, k_end, store = (start, end), (start, end), total, False
                else:  # prefix: the block and everything after it are recomputed
                    window, query, k_end, store = (start, end), (start, total), total, False
                logits = self._logits(canvas, prompt_tokens, full_mask, cache, window, query, k_end, store)
                current = canvas[:, window[0] : window[1]]
                masked = current.eq(mask_id)
                noisy = add_gumbel_noise(filter_logits(logits, cfg.top_k, cfg.top_p), cfg.sampling_temperature, self.generator)
                x0 = noisy.argmax(-1)
                confidence = confidence_scores(logits, x0, cfg.remasking, self.generator)
                confidence[:, max(0, end - window[0]) :] = -torch.inf  # confined to the current block
                confidence = torch.where(masked & ~done.unsqueeze(1), confidence, -torch.inf)
                commit = select_commits(confidence, None if cfg.threshold is not None else budget[:, step], cfg.threshold)
                canvas[:, window[0] : window[1]] = torch.where(commit, x0, current)
                step, step_count = step + 1, step_count + 1
                if callback is not None:
                    callback(canvas=canvas, step=step_count, block=block)
                if streamer is not None:
                    pending = canvas[0, prompt_len:].eq(mask_id).nonzero()
                    ready = int(pending[0]) if len(pending) else new_tokens
                    if ready > streamed:
                        streamer.put(canvas[0, prompt_len + streamed : prompt_len + ready].cpu())
                        streamed = ready
            if self.exact_block_cache:
                query_floor = query_lo
            if cfg.stop_on_eos and self.eos_ids and end < total:
                finished = torch.isin(canvas[:, start:end], torch.tensor(self.eos_ids, device=device)).all(1)
                newly = finished & ~done
                if newly.any():  # the tail of a finished row is EOS: LLaDA-style models pad with EOS
                    tail = canvas[newly, end:]
                    canvas[newly, end:] = tail.masked_fill(tail.eq(mask_id), self.eos_ids[0])
                    done |= newly
                if bool(done.all()):
                    break
        if streamer is not None:
            if streamed < new_tokens:
                streamer.put(canvas[0, prompt_len + streamed :].cpu())
            streamer.end()
        return canvas
