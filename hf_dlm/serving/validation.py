"""Every field of an API request checked against what the server, the engine and the model can take, before
the request is queued: a request the engine accepts can run to its end (issue 27: a seed past 2**64 used to
crash the engine loop and hang the request; max_tokens past the model's positions ran for minutes).

Schema checks (types, ranges) live in protocol.py; here are the ones that need the tokenizer, the model or
the server's limits. Errors are `APIError`s naming the request field (`param`), OpenAI's spelling.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..utils.errors import FieldError
from .protocol import DLM_TO_OPENAI, MAX_SEED, ChatCompletionRequest

NO_CHAT_TEMPLATE = ("this model's tokenizer has no chat template: start the server with `--chat-template FILE`, "
                    "or save a template with the tokenizer (`tokenizer.chat_template = ...; "
                    "tokenizer.save_pretrained(path)`), or send a plain prompt to /v1/completions")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def refused(error: ValueError) -> APIError:
    """400 for a value the sampler or the engine refused; a FieldError names the field (under its request
    name), no message text is parsed."""
    field = DLM_TO_OPENAI.get(error.field, error.field) if isinstance(error, FieldError) else None
    return APIError(400, str(error), field)


@dataclass
class CheckedRequest:
    prompts: list[list[int]]  # token ids of each prompt
    max_tokens: int  # the answer is cut there
    params: list  # the engine's SamplingParams, one per sequence (prompt-major, then choice i with seed + i)


class RequestChecker:
    def __init__(self, engine, tokenizer, settings):
        self.engine, self.tokenizer, self.settings = engine, tokenizer, settings
        config = getattr(engine.model, "config", None)
        self.max_positions = getattr(config, "max_position_embeddings", None)
        self.vocab_size = getattr(config, "vocab_size", None) or len(tokenizer)

    # texts up to this many characters are tokenized on the event loop (well under a millisecond); longer ones in a
    # worker thread, so that a long prompt does not stall the other requests
    inline_chars = 4096

    def is_light(self, body) -> bool:
        """Cheap enough to check on the event loop: token ids, or texts of at most `inline_chars` in all. The hop to
        a worker thread and back is two hand-offs of the GIL, each up to a switch interval (5 ms) while the engine
        thread runs Python: time a burst of requests waits for."""
        if isinstance(body, ChatCompletionRequest):
            texts = [message.content for message in body.messages]
        else:
            texts = [body.prompt] if isinstance(body.prompt, str) else [p for p in body.prompt if isinstance(p, str)]
        return sum(len(text) for text in texts) <= self.inline_chars

    def __call__(self, body) -> CheckedRequest:
        settings = self.settings
        if body.model is not None and body.model not in settings.model_names:
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves "
                           f"{list(settings.model_names)} (GET /v1/models)", "model", code="model_not_found")
        max_tokens = body.max_tokens or settings.default_max_tokens
        if max_tokens > settings.max_output_tokens:
            raise APIError(400, f"max_tokens={max_tokens} exceeds this server's limit of "
                           f"{settings.max_output_tokens}", "max_tokens")
        if len(body.stop_list()) > 4:
            raise APIError(400, "at most 4 stop sequences", "stop")
        if body.seed is not None and body.seed + body.n - 1 > MAX_SEED:
            raise APIError(400, f"seed: choice i uses seed + i, so seed + n - 1 must be <= {MAX_SEED}", "seed")
        if body.top_k is not None and body.top_k > self.vocab_size:
            raise APIError(400, f"top_k={body.top_k} exceeds the vocabulary ({self.vocab_size} tokens)", "top_k")
        prompts = self.prompts(body)
        if len(prompts) * body.n > settings.max_sequences:
            raise APIError(400, f"{len(prompts)} prompts x n={body.n} sequences exceed this server's limit of "
                           f"{settings.max_sequences} per request; split the request", "n" if body.n > 1 else "prompt")
        defaults = getattr(self.engine.model, "generation_config", None)
        block_length = body.block_length or min(getattr(defaults, "block_length", None) or max_tokens, max_tokens)
        canvas = -(-max_tokens // block_length) * block_length  # whole blocks; the answer is cut at max_tokens
        if canvas > settings.max_output_tokens:
            raise APIError(400, f"block_length={block_length} rounds max_tokens={max_tokens} up to {canvas} tokens, "
                           f"over this server's limit of {settings.max_output_tokens}", "block_length")
        if body.steps is not None and body.steps > canvas:
            # more steps than tokens only adds steps that commit nothing (LLaDA's budgets), at the price of forwards
            raise APIError(400, f"steps={body.steps} exceeds the {canvas} tokens to decode (at most one step per "
                           "token)", "steps")
        longest = max(len(ids) for ids in prompts)
        if self.max_positions is not None and longest + canvas > self.max_positions:
            if longest >= self.max_positions:
                param = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
            else:  # max_tokens itself, or max_tokens rounded up to whole blocks
                param = "max_tokens" if longest + max_tokens > self.max_positions else "block_length"
            raise APIError(400, f"the prompt ({longest} tokens) + {canvas} new tokens (max_tokens={max_tokens} in "
                           f"blocks of {block_length}) exceed the model's {self.max_positions} positions", param)
        overrides = {**body.generation_overrides(), "max_new_tokens": canvas, "block_length": block_length,
                     "steps": body.steps or canvas}
        try:  # the sampler's own checks (DLMGenerationConfig, the engine)
            params = self.engine.sampling_params(**overrides, seed=body.seed)
        except ValueError as error:
            raise refused(error) from None
        seeds = [None if body.seed is None else body.seed + i for i in range(body.n)]
        return CheckedRequest(prompts, max_tokens, [replace(params, seed=seed) for _ in prompts for seed in seeds])

    def _tokenize(self, text: str, param: str, **options) -> list[int]:
        try:
            return list(self.tokenizer(text, **options)["input_ids"])
        except Exception as error:  # noqa: BLE001 (e.g. a lone UTF-16 surrogate, which JSON allows and UTF-8 not)
            raise APIError(400, f"{param}: the tokenizer cannot encode this text ({type(error).__name__}: {error})",
                           param) from None

    def prompts(self, body) -> list[list[int]]:
        limit = self.settings.max_prompt_tokens
        if isinstance(body, ChatCompletionRequest):
            template = self.settings.chat_template or getattr(self.tokenizer, "chat_template", None)
            if not template:
                raise APIError(400, NO_CHAT_TEMPLATE, "messages")
            try:
                text = self.tokenizer.apply_chat_template([m.model_dump(exclude_none=True) for m in body.messages],
                                                          chat_template=template, tokenize=False,
                                                          add_generation_prompt=True)
            except Exception as error:  # noqa: BLE001 (templates raise on role orders they do not support)
                raise APIError(400, f"messages: the chat template refused them ({error})", "messages") from None
            prompts, param = [self._tokenize(text, "messages", add_special_tokens=False)], "messages"
        elif isinstance(body.prompt, str):
            prompts, param = [self._tokenize(body.prompt, "prompt")], "prompt"
        elif not body.prompt:
            raise APIError(400, "prompt: the list is empty (give a text, texts or token ids)", "prompt")
        elif isinstance(body.prompt[0], int):
            if any(t < 0 or t >= self.vocab_size for t in body.prompt):
                raise APIError(400, f"prompt token ids must lie in [0, {self.vocab_size})", "prompt")
            prompts, param = [list(body.prompt)], "prompt"
        else:
            prompts, param = [self._tokenize(p, "prompt") for p in body.prompt], "prompt"
        for ids in prompts:
            if not ids:
                raise APIError(400, "the prompt is empty", param)
            if len(ids) > limit:
                raise APIError(400, f"the prompt has {len(ids)} tokens; this server takes at most {limit}", param)
        return prompts
