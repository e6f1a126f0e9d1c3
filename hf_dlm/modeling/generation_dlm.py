"""`model.generate` for DLMs: a low-confidence remasking sampler with LLaDA's step semantics.

Canvas = prompt + `max_new_tokens` masks, split into blocks of `block_length` decoded left to right;
`steps` forward passes are shared evenly over the blocks, and each step commits the most confident
masked positions of the current block (temperature 0: argmax). The full sampler family (random /
margin / entropy remasking, CFG, threshold decoding, KV caches) extends this module.
"""

from __future__ import annotations

import torch


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


class DLMGenerationMixin:
    """Adds `generate` to DLM models (named *GenerationMixin so transformers gives them a
    `generation_config`)."""

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        max_new_tokens: int = 64,
        steps: int | None = None,
        block_length: int | None = None,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
        **kwargs,
    ) -> torch.LongTensor:
        """Prompt (B, P), left-padded with `attention_mask` for mixed lengths -> sequences (B, P + N)."""
        mask_id = self.config.mask_token_id
        if mask_id is None:
            raise ValueError("generate needs config.mask_token_id")
        steps = steps or max_new_tokens
        block_length = block_length or max_new_tokens
        if max_new_tokens % block_length:
            raise ValueError(f"max_new_tokens ({max_new_tokens}) must be a multiple of block_length ({block_length})")
        num_blocks = max_new_tokens // block_length
        if steps % num_blocks:
            raise ValueError(f"steps ({steps}) must be a multiple of the number of blocks ({num_blocks})")
        steps_per_block = steps // num_blocks

        batch, prompt_len = input_ids.shape
        canvas = torch.full((batch, prompt_len + max_new_tokens), mask_id, dtype=torch.long, device=input_ids.device)
        canvas[:, :prompt_len] = input_ids
        full_mask = None
        if attention_mask is not None:
            full_mask = torch.ones_like(canvas)
            full_mask[:, :prompt_len] = attention_mask
        for block in range(num_blocks):
            start = prompt_len + block * block_length
            end = start + block_length
            schedule = num_transfer_tokens((canvas[:, start:end] == mask_id).sum(1), steps_per_block)
            for step in range(steps_per_block):
                masked = canvas == mask_id
                logits = self.denoising_logits(canvas, attention_mask=full_mask)
                x0 = add_gumbel_noise(logits, temperature, generator).argmax(-1)
                confidence = torch.softmax(logits.float(), dim=-1).gather(-1, x0.unsqueeze(-1)).squeeze(-1)
                confidence[:, end:] = -torch.inf  # confined to the current block
                confidence = torch.where(masked, confidence, -torch.inf)
                x0 = torch.where(masked, x0, canvas)
                for row in range(batch):
                    k = int(schedule[row, step])
                    if k:
                        chosen = torch.topk(confidence[row], k).indices
                        canvas[row, chosen] = x0[row, chosen]
        return canvas
