"""Request bodies of the OpenAI completions / chat completions API plus the diffusion fields.

Unknown fields are rejected (422 naming the field) rather than ignored: an OpenAI option the DLM
server does not implement (logprobs, penalties, tools, ...) must not look as if it had an effect.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ..generation.configuration import CACHE_MODES, DLM_GENERATION_FIELDS, REMASKING


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description="the served model's name (optional: one model is served)")
    max_tokens: int | None = Field(None, ge=1, description="most tokens returned; the canvas is rounded up to "
                                   "whole blocks and the answer cut at max_tokens")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="0 = argmax; > 0 float64 Gumbel-max")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: str | list[str] | None = Field(None, description="up to 4 stop sequences (not part of the answer)")
    n: int = Field(1, ge=1, le=16, description="choices per prompt (choice i uses seed + i)")
    seed: int | None = None
    stream: bool = False
    user: str | None = None
    # diffusion fields (hf-dlm extensions; the openai client sends them through extra_body)
    steps: int | None = Field(None, ge=1, description=DLM_GENERATION_FIELDS["steps"][1])
    block_length: int | None = Field(None, ge=1, description=DLM_GENERATION_FIELDS["block_length"][1])
    threshold: float | None = Field(None, ge=0.0, le=1.0, description=DLM_GENERATION_FIELDS["threshold"][1])
    cache: Literal[CACHE_MODES] | None = Field(None, description=DLM_GENERATION_FIELDS["cache"][1])
    remasking: Literal[REMASKING] | None = Field(None, description=DLM_GENERATION_FIELDS["remasking"][1])
    top_k: int | None = Field(None, ge=1)
    cfg_scale: float | None = Field(None, ge=0.0, description=DLM_GENERATION_FIELDS["cfg_scale"][1])

    def stop_list(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] = Field(..., description="text, texts (one choice set each) or token ids")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
