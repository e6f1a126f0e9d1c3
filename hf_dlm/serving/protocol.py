"""Request bodies of the OpenAI completions / chat completions API plus the diffusion fields, and
their mapping onto `DLMGenerationConfig` (the one spelling of every sampler setting).

Unknown fields are rejected (422 naming the field) rather than ignored: an OpenAI option the DLM
server does not implement (logprobs, penalties, tools, ...) must not look as if it had an effect.
Types are strict (`"8"` is not a number, `true` is not an integer, NaN and infinities are refused):
a value the server would have to guess at is an error, not a coercion.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ..generation.configuration import CACHE_MODES, DLM_GENERATION_FIELDS, REMASKING

# torch.Generator.manual_seed takes [-2**63, 2**64); choice i of a request uses seed + i (n <= 16), and
# OpenAI seeds are non-negative: [0, 2**63 - 1] keeps every choice's seed in range with room to spare
MAX_SEED = 2**63 - 1
MAX_CHOICES = 16

# request field -> DLMGenerationConfig field, for the fields whose OpenAI name differs; the other sampler
# fields below carry DLMGenerationConfig's own names (`seed` and `n` are per request, not sampler settings)
OPENAI_TO_DLM = {"max_tokens": "max_new_tokens"}
DLM_TO_OPENAI = {dlm: openai for openai, dlm in OPENAI_TO_DLM.items()}
SAMPLER_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "steps", "block_length", "threshold", "cache",
                  "remasking", "cfg_scale", "factor", "entropy_bound", "hierarchy_threshold", "editing_threshold",
                  "max_post_steps",
                  "credit_alpha", "credit_boost", "credit_decay")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class SamplingFields(_Strict):
    model: str | None = Field(None, description="one of the names in /v1/models (optional: one model is served)")
    max_tokens: int | None = Field(None, ge=1, description="most tokens returned; the canvas is rounded up to "
                                   "whole blocks and the answer cut at max_tokens")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="0 = argmax; > 0 float64 Gumbel-max")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: str | list[str] | None = Field(None, description="up to 4 stop sequences (not part of the answer)")
    n: int = Field(1, ge=1, le=MAX_CHOICES, description="choices per prompt (choice i uses seed + i)")
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="sampling seed (choice i uses seed + i)")
    stream: bool = False
    user: str | None = None
    # diffusion fields (hf-dlm extensions; the openai client sends them through extra_body)
    steps: int | None = Field(None, ge=1, description=DLM_GENERATION_FIELDS["steps"][1])
    block_length: int | None = Field(None, ge=1, description=DLM_GENERATION_FIELDS["block_length"][1])
    threshold: float | None = Field(None, ge=0.0, le=1.0, description=DLM_GENERATION_FIELDS["threshold"][1])
    cache: Literal[CACHE_MODES] | None = Field(None, description=DLM_GENERATION_FIELDS["cache"][1])
    remasking: Literal[REMASKING] | None = Field(None, description=DLM_GENERATION_FIELDS["remasking"][1])
    top_k: int | None = Field(None, ge=1)
    cfg_scale: float | None = Field(None, ge=0.0, le=100.0, description=DLM_GENERATION_FIELDS["cfg_scale"][1])
    factor: float | None = Field(None, gt=0.0, le=1e6, description=DLM_GENERATION_FIELDS["factor"][1])
    entropy_bound: float | None = Field(None, ge=0.0, le=1e6, description=DLM_GENERATION_FIELDS["entropy_bound"][1])
    hierarchy_threshold: float | None = Field(None, ge=0.0, le=1.0,
                                              description=DLM_GENERATION_FIELDS["hierarchy_threshold"][1])
    editing_threshold: float | None = Field(None, ge=0.0, le=1.0,
                                            description=DLM_GENERATION_FIELDS["editing_threshold"][1])
    # bounded: each mask-free step of a block is a forward
    max_post_steps: int | None = Field(None, ge=1, le=256, description=DLM_GENERATION_FIELDS["max_post_steps"][1])
    credit_alpha: float | None = Field(None, ge=0.0, le=1e6, description=DLM_GENERATION_FIELDS["credit_alpha"][1])
    credit_boost: float | None = Field(None, ge=0.0, le=1e6, description=DLM_GENERATION_FIELDS["credit_boost"][1])
    credit_decay: float | None = Field(None, ge=0.0, le=1.0, description=DLM_GENERATION_FIELDS["credit_decay"][1])

    def stop_list(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]

    def generation_overrides(self) -> dict:
        """The sampler settings this request gives, under DLMGenerationConfig's names."""
        return {OPENAI_TO_DLM.get(name, name): getattr(self, name) for name in SAMPLER_FIELDS
                if getattr(self, name) is not None}


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] = Field(..., description="text, texts (one choice set each) or token ids")


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)


# every field name of the bodies above: a validation error's location keeps these (and list indices) and
# drops pydantic's union-member tags (`prompt.list[int].3` -> `prompt`)
FIELD_NAMES = frozenset(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields) | set(
    ChatMessage.model_fields)


def error_param(problem: dict) -> str | None:
    """The OpenAI `param` of one pydantic error: the field path, or None when the error is about the body
    as a whole (invalid JSON, not an object). An unknown field is named as sent."""
    location = [part for part in problem.get("loc", ()) if part != "body"]
    if problem.get("type") == "extra_forbidden" and location:
        known = error_param({"loc": location[:-1]})
        return f"{known}.{location[-1]}" if known else str(location[-1])
    parts = []
    for part in location:
        if isinstance(part, int) and parts:
            parts.append(str(part))
        elif part in FIELD_NAMES:
            parts.append(part)
        else:
            break
    return ".".join(parts) or None
