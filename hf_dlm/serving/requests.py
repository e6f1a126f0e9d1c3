"""What a caller hands the serving engine and gets back: a request (`GenerationRequest`) with its sampler settings
(`SamplingParams`, resolved from the model's `DLMGenerationConfig`), the engine's refusals, and `decode_answer`
(a row's tokens -> text and finish reason, for the server and lm-eval)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..generation.commit_rules import CommitSettings
from ..generation.configuration import DLMGenerationConfig
from ..utils.errors import FieldError


class QueueFullError(RuntimeError):
    """The engine's waiting queue is full (the server answers 429)."""


class EngineStoppedError(RuntimeError):
    """The engine is shutting down and takes no new requests (the server answers 503)."""


@dataclass
class SamplingParams:
    """Per-request sampler settings (the `DLMGenerationConfig` fields the engine honours)."""

    max_new_tokens: int
    block_length: int
    steps: int | None
    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None
    threshold: float | None = None
    remasking: str = "low_confidence"
    stop_on_eos: bool = True
    seed: int | None = None
    cache: str = "none"  # "prefix" / "dual": Fast-dLLM's caches (bidirectional models)
    cfg_scale: float = 0.0  # classifier-free guidance: an unconditional copy (prompt masked) joins the forward
    factor: float | None = None
    entropy_bound: float | None = None
    hierarchy_threshold: float | None = None  # dInfer's hierarchical decoding (threshold, if set, beside it)
    editing_threshold: float | None = None
    max_post_steps: int = 16
    align_blocks: bool = False  # steps is then None (one token a step) or split over the row's own blocks
    schedule: str = "even"
    schedule_eps: float = 1e-3
    sub_block_length: int | None = None
    first_token_alone: bool = False
    credit_alpha: float | None = None  # dInfer's credit decoding, beside threshold
    credit_boost: float = 0.2
    credit_decay: float = 0.8

    @property
    def settings(self) -> CommitSettings:
        return CommitSettings(
            temperature=self.temperature, top_k=self.top_k or None, top_p=self.top_p, remasking=self.remasking,
            threshold=self.threshold, factor=self.factor, entropy_bound=self.entropy_bound,
            hierarchy_threshold=self.hierarchy_threshold, editing_threshold=self.editing_threshold,
            sub_block_length=self.sub_block_length,
            first_token_alone=self.first_token_alone, credit_alpha=self.credit_alpha, credit_boost=self.credit_boost,
            credit_decay=self.credit_decay)

    @classmethod
    def from_generation_config(cls, generation_config, attention_mode: str = "bidirectional",
                               attention_implementation: str = "sdpa", **overrides):
        """Defaults from the model's generation config, `overrides` on top (None = default). Raises
        ValueError naming the field for values the sampler cannot run."""
        seed = overrides.pop("seed", None)
        given = {k: v for k, v in overrides.items() if v is not None}
        config = DLMGenerationConfig.from_any(generation_config, **given)
        new_tokens = config.max_new_tokens or 64
        block_length = config.block_length or new_tokens
        if block_length <= 0:
            raise FieldError("block_length", f"block_length must be positive, got {block_length}", block_length)
        if new_tokens % block_length and not config.align_blocks:
            raise FieldError("max_new_tokens", f"max_tokens ({new_tokens}) must be a multiple of block_length "
                             f"({block_length})", new_tokens)
        num_blocks = new_tokens // block_length
        steps = config.steps or new_tokens
        if config.align_blocks:  # the row's blocks follow from its prompt length (RowSchedule checks steps)
            steps = config.steps
        elif steps <= 0 or steps % num_blocks:
            raise FieldError("steps", f"steps ({steps}) must be a positive multiple of the number of blocks "
                             f"({num_blocks})", steps)
        # the exact cache of 'block' / 'causal' models gives the uncached tokens: those rows run uncached
        cache = config.cache if attention_mode == "bidirectional" else "none"
        return cls(max_new_tokens=new_tokens, block_length=block_length, steps=steps,
                   temperature=config.sampling_temperature, top_p=config.top_p, top_k=config.top_k,
                   threshold=config.threshold, remasking=config.remasking, stop_on_eos=config.stop_on_eos, seed=seed,
                   cache=cache, cfg_scale=config.cfg_scale or 0.0, factor=config.factor,
                   entropy_bound=config.entropy_bound, hierarchy_threshold=config.hierarchy_threshold,
                   editing_threshold=config.editing_threshold, max_post_steps=config.max_post_steps,
                   align_blocks=config.align_blocks, schedule=config.schedule,
                   schedule_eps=config.schedule_eps, sub_block_length=config.sub_block_length,
                   first_token_alone=config.first_token_alone, credit_alpha=config.credit_alpha,
                   credit_boost=config.credit_boost, credit_decay=config.credit_decay)


@dataclass
class GenerationRequest:
    """One sequence to decode. on_block(request, new_token_ids) runs on the engine thread at each of
    the row's block boundaries; on_done(request, finish_reason, error) once at the end ("stop": EOS
    or `stop_check`, "length": the canvas is full, "error"). stop_check(generated_ids) -> True ends
    the row early (stop sequences)."""

    prompt_ids: list[int]
    params: SamplingParams
    on_block: Callable | None = None
    on_done: Callable | None = None
    stop_check: Callable | None = None
    request_id: int = field(default_factory=itertools.count().__next__)
    generated: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: Exception | None = None
    cancelled: bool = False  # set by the caller (client gone): the row leaves at the next step
    submitted_at: float = field(default_factory=time.monotonic)  # time.monotonic() (vLLM's RequestMetrics' times)
    admitted_at: float | None = None  # took a lane
    first_block_at: float | None = None  # its first block read back
    finished_at: float | None = None  # answered (on_done)


def decode_answer(tokenizer, generated: list[int], eos_ids, stops: list[str], max_tokens: int):
    """(text, finish reason or None) of a row's tokens so far: cut at max_tokens, at the first EOS
    ("stop") and before the first stop sequence ("stop"); "length" once max_tokens are decoded."""
    tokens, reason = generated[:max_tokens], None
    eos = next((i for i, t in enumerate(tokens) if t in eos_ids), None)
    if eos is not None:
        tokens, reason = tokens[:eos], "stop"
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    hits = [text.find(s) for s in stops if s in text]
    if hits:
        text, reason = text[: min(hits)], "stop"
    if reason is None and len(generated) >= max_tokens:
        reason = "length"
    return text, reason
