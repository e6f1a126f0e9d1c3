"""One row's block schedule, for decoders whose rows move independently (the serving engine): the same
blocks (aligned or not), LLaDA / Dream budgets, Fast-dLLM refresh / window spans and LLaDA2.1 editing end as
`model.generate`, kept per row so that a row whose block is done moves on at once (early block departure) and
rows join or leave between steps."""

from __future__ import annotations

import torch

from ..utils.errors import FieldError
from .commit_rules import CommitSettings
from .sampling import block_bounds, transfer_schedule


class RowSchedule:
    def __init__(self, prompt_len: int, max_new_tokens: int, block_length: int, steps: int | None,
                 settings: CommitSettings, cache: str = "none", max_post_steps: int = 16, shift: int = 0,
                 align_blocks: bool = False, schedule: str = "even", schedule_eps: float = 1e-3):
        self.prompt_len, self.block_length, self.settings = prompt_len, block_length, settings
        self.cache, self.max_post_steps, self.shift = cache, max_post_steps, shift
        self.schedule, self.schedule_eps = schedule, schedule_eps
        # a row has no left padding: aligned blocks fall on multiples of block_length from slot 0
        self.blocks, self.length = block_bounds(prompt_len, max_new_tokens, block_length, 0 if align_blocks else None)
        self.output_length = prompt_len + max_new_tokens  # aligned blocks: the canvas runs on to the last block's end
        self.num_blocks = len(self.blocks)
        if steps is not None and steps % self.num_blocks:
            raise FieldError("steps", f"steps ({steps}) must be a multiple of the row's number of blocks "
                             f"({self.num_blocks})", steps)
        self.steps_per_block = block_length if steps is None else steps // self.num_blocks
        self.parallel = settings.count_rule != "budget"  # the rule decides how many per step
        self.editing = settings.editing_threshold is not None
        self.block = 0
        self._start_block()

    def _start_block(self):
        self.step, self.forwards, self.has_masks, self.settled, self.post_steps = 0, 0, True, False, 0
        # at a block start every position of the block is masked: LLaDA's budget needs no device read
        start, end, _ = self.blocks[self.block]
        self.budget = transfer_schedule(torch.tensor([end - start]), self.steps_per_block, self.schedule,
                                        self.schedule_eps)[0].tolist()

    @property
    def window(self) -> tuple[int, int]:
        return self.blocks[self.block][:2]

    @property
    def width(self) -> int:
        """The current block's length (an aligned partial block is shorter than block_length)."""
        start, end = self.window
        return end - start

    @property
    def offset(self) -> int:
        """The block's first slot counted from its aligned start (`block_candidates`)."""
        return self.blocks[self.block][2]

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
        if self.cache == "none" or self.forwards == 0:  # a step of count 0 (Dream's schedule) runs no forward
            return 0, self.length
        return start - self.shift, end if self.cache == "dual" else self.length

    def after_step(self, has_masks: bool | None = None, began_with_masks: bool = True, edited: bool = False):
        """The step's outcome, read from the device; a budget rule's block ends on its step count and needs
        none (`has_masks` None)."""
        self.step += 1
        self.forwards += 1
        if has_masks is not None:
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
