"""One row's block schedule, for decoders whose rows move independently (the serving engine): the same
blocks, LLaDA budgets, Fast-dLLM refresh / window spans and LLaDA2.1 editing end as `model.generate`, kept
per row so that a row whose block is done moves on at once (early block departure) and rows join or leave
between steps."""

from __future__ import annotations

import torch

from .commit_rules import CommitSettings
from .sampling import num_transfer_tokens


class RowSchedule:
    def __init__(self, prompt_len: int, max_new_tokens: int, block_length: int, steps: int, settings: CommitSettings,
                 cache: str = "none", max_post_steps: int = 16, shift: int = 0):
        self.prompt_len, self.block_length, self.settings = prompt_len, block_length, settings
        self.cache, self.max_post_steps, self.shift = cache, max_post_steps, shift
        self.length = prompt_len + max_new_tokens
        self.num_blocks = max_new_tokens // block_length
        self.steps_per_block = steps // self.num_blocks
        self.parallel = settings.count_rule != "budget"  # the rule decides how many per step
        self.editing = settings.editing_threshold is not None
        # at a block start every position of the block is masked: LLaDA's budget needs no device read
        self.budget = num_transfer_tokens(torch.tensor([block_length]), self.steps_per_block)[0].tolist()
        self.block = 0
        self._start_block()

    def _start_block(self):
        self.step, self.has_masks, self.settled, self.post_steps = 0, True, False, 0

    @property
    def window(self) -> tuple[int, int]:
        start = self.prompt_len + self.block * self.block_length
        return start, start + self.block_length

    def block_done(self) -> bool:
        if self.parallel:
            return not self.has_masks and (not self.editing or self.settled)
        return self.step >= self.steps_per_block

    def needs_forward(self) -> bool:
        """False: LLaDA's step commits nothing for this row (its budget is 0); the step passes without a forward."""
        if self.parallel or self.budget[self.step] > 0:
            return True
        self.step += 1
        return False

    @property
    def step_budget(self) -> int | None:
        return None if self.parallel else self.budget[self.step]

    def query_span(self) -> tuple[int, int]:
        """Canvas slots this step's forward computes: the whole canvas without a cache and at a cached block's
        start (the refresh stores every slot), else the window (dual: the block; prefix: the block and the rest),
        one slot earlier for shifted models (i - 1 predicts i)."""
        start, end = self.window
        if self.cache == "none" or self.step == 0:
            return 0, self.length
        return start - self.shift, end if self.cache == "dual" else self.length

    def after_step(self, has_masks: bool, began_with_masks: bool, edited: bool):
        self.step += 1
        self.has_masks = has_masks
        if self.editing and not began_with_masks:  # LLaDA2.1: a mask-free step without edits ends the block
            self.post_steps += 1
            self.settled = not edited or self.post_steps >= self.max_post_steps

    def next_block(self) -> bool:
        """Move to the next block; False when the canvas is full."""
        if self.block + 1 >= self.num_blocks:
            return False
        self.block += 1
        self._start_block()
        return True


__all__ = ["RowSchedule"]
