"""The OpenAI-compatible FastAPI app over a `ContinuousBatchingEngine`.

Endpoints: POST /v1/completions, POST /v1/chat/completions (server-sent events with `stream`, one
event per committed block), GET /v1/models, /health, /metrics (Prometheus text format). Errors use
OpenAI's body `{"error": {"message", "type", "param", "code"}}`: 400 for values the sampler cannot
run, 422 for schema errors, 401 without the API key, 429 when the queue is full, 503 while draining.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import Counter
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from .engine import ContinuousBatchingEngine, EngineStoppedError, GenerationRequest, QueueFullError, decode_answer
from .protocol import ChatCompletionRequest, CompletionRequest

# request fields named in 400 answers when the sampler's message mentions them
_FIELDS = ("max_tokens", "block_length", "steps", "threshold", "cache", "remasking", "cfg_scale", "top_p", "top_k",
           "temperature")


@dataclass
class ServerSettings:
    model_name: str = "hf-dlm"  # the id in /v1/models
    max_prompt_tokens: int = 4096  # longer prompts: 400
    max_output_tokens: int = 1024  # larger max_tokens: 400
    default_max_tokens: int = 64  # max_tokens of a request without one
    api_key: str | None = None  # when set, /v1/* needs `Authorization: Bearer <api_key>` (else 401)


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


def _error_response(status: int, message: str, param: str | None, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status_code=status)


class _Choice:
    """One choice of an API call: its engine request and the text produced so far (stop sequences,
    EOS and max_tokens applied)."""

    def __init__(self, server, prompt_ids, params, max_tokens: int, stops: list[str], loop, index: int):
        self.server, self.max_tokens, self.stops, self.index = server, max_tokens, stops, index
        self.events: asyncio.Queue = asyncio.Queue()
        self.sent = 0  # characters already streamed
        post = lambda *event: loop.call_soon_threadsafe(self.events.put_nowait, event)  # noqa: E731
        self.request = GenerationRequest(prompt_ids, params, on_block=lambda r, ids: post("block", None),
                                         on_done=lambda r, reason, error: post("done", error),
                                         stop_check=self._stopped)

    def text(self) -> tuple[str, str | None]:
        """(text so far, finish reason if already decided by EOS / stop sequence / max_tokens)."""
        return decode_answer(self.server.tokenizer, self.request.generated, self.server.engine.eos_ids, self.stops,
                             self.max_tokens)

    def _stopped(self, generated) -> bool:  # engine thread, at a block boundary
        return self.text()[1] is not None

    def completion_tokens(self) -> int:
        return len(self.server.tokenizer(self.text()[0], add_special_tokens=False)["input_ids"])

    def delta(self, final: bool) -> str:
        """New text safe to stream: not a possible stop-sequence prefix, not half a UTF-8 character."""
        text, reason = self.text()
        end = len(text)
        if not final and reason is None:
            hold = max((len(s) - 1 for s in self.stops), default=0)
            end = max(self.sent, end - hold)
            while end > self.sent and text[end - 1] == "\ufffd":
                end -= 1
        out, self.sent = text[self.sent : end], max(self.sent, end)
        return out


class DLMServer:
    def __init__(self, engine: ContinuousBatchingEngine, tokenizer, settings: ServerSettings):
        self.engine, self.tokenizer, self.settings = engine, tokenizer, settings
        self.http_status: Counter = Counter()
        self.accepted = self.completed = 0

    # ---- request -> engine requests ------------------------------------------------------------
    def prompts(self, body) -> list[list[int]]:
        limit = self.settings.max_prompt_tokens
        if isinstance(body, ChatCompletionRequest):
            if not getattr(self.tokenizer, "chat_template", None):
                raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions", "messages")
            text = self.tokenizer.apply_chat_template([m.model_dump(exclude_none=True) for m in body.messages],
                                                      tokenize=False, add_generation_prompt=True)
            prompts, param = [self.tokenizer(text, add_special_tokens=False)["input_ids"]], "messages"
        elif isinstance(body.prompt, str):
            prompts, param = [self.tokenizer(body.prompt)["input_ids"]], "prompt"
        elif body.prompt and isinstance(body.prompt[0], int):
            vocab = len(self.tokenizer)
            if any(t < 0 or t >= vocab for t in body.prompt):
                raise APIError(400, f"prompt token ids must lie in [0, {vocab})", "prompt")
            prompts, param = [list(body.prompt)], "prompt"
        else:
            prompts, param = [self.tokenizer(p)["input_ids"] for p in body.prompt], "prompt"
        for ids in prompts:
            if not ids:
                raise APIError(400, "the prompt is empty", param)
            if len(ids) > limit:
                raise APIError(400, f"the prompt has {len(ids)} tokens; this server takes at most {limit}", param)
        return prompts

    def choices(self, body, loop) -> list[_Choice]:
        max_tokens = body.max_tokens or self.settings.default_max_tokens
        if max_tokens > self.settings.max_output_tokens:
            raise APIError(400, f"max_tokens={max_tokens} exceeds this server's limit of "
                           f"{self.settings.max_output_tokens}", "max_tokens")
        if len(body.stop_list()) > 4:
            raise APIError(400, "at most 4 stop sequences", "stop")
        prompts = self.prompts(body)
        defaults = getattr(self.engine.model, "generation_config", None)
        block_length = body.block_length or min(getattr(defaults, "block_length", None) or max_tokens, max_tokens)
        canvas = -(-max_tokens // block_length) * block_length  # whole blocks; the answer is cut at max_tokens
        choices = []
        for p, ids in enumerate(prompts):
            for i in range(body.n):
                try:
                    params = self.engine.sampling_params(
                        max_new_tokens=canvas, block_length=block_length, steps=body.steps or canvas,
                        temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, threshold=body.threshold,
                        cache=body.cache, remasking=body.remasking, cfg_scale=body.cfg_scale,
                        seed=None if body.seed is None else body.seed + i)
                except ValueError as error:
                    message = str(error)
                    first = message.split(" ")[0]
                    # a message that starts with a field names it; else the first field it mentions
                    param = first.rstrip(":") if first.rstrip(":") in _FIELDS else next(
                        (f for f in _FIELDS if f in first or f"{f} " in message or f"{f}=" in message
                         or f".{f}" in message), None)
                    raise APIError(400, message, param) from None
                choices.append(_Choice(self, ids, params, max_tokens, body.stop_list(), loop, p * body.n + i))
        return choices

    # ---- responses -----------------------------------------------------------------------------
    async def handle(self, body, request: Request, chat: bool):
        loop = asyncio.get_running_loop()
        choices = self.choices(body, loop)
        try:
            self.engine.submit([c.request for c in choices])
        except QueueFullError as error:
            raise APIError(429, f"server busy: {error}; retry later", None, "rate_limit_error") from None
        except EngineStoppedError as error:
            raise APIError(503, str(error), None, "server_error") from None
        self.accepted += 1
        prompt_tokens = sum(len(c.request.prompt_ids) for c in choices[:: body.n])
        meta = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
                "model": self.settings.model_name}
        if body.stream:
            return StreamingResponse(self.stream(choices, meta, chat, request), media_type="text/event-stream")
        try:
            for choice in choices:
                await self.wait(choice)
        except asyncio.CancelledError:
            for choice in choices:
                choice.request.cancelled = True
            raise
        items = []
        for choice in choices:
            text, reason = choice.text()
            item = ({"message": {"role": "assistant", "content": text}} if chat else {"text": text, "logprobs": None})
            items.append({"index": choice.index, **item, "finish_reason": reason or "length"})
        completion_tokens = sum(c.completion_tokens() for c in choices)
        self.completed += 1
        return {**meta, "object": "chat.completion" if chat else "text_completion", "choices": items,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "total_tokens": prompt_tokens + completion_tokens}}

    async def wait(self, choice: _Choice, block_events: bool = False):
        """Wait for the next event of `choice` (block_events) or for its end; engine errors -> 500."""
        while True:
            kind, error = await choice.events.get()
            if kind == "done" and error is not None:
                raise APIError(500, f"generation failed: {error}", None, "server_error")
            if kind == "done" or block_events:
                return kind

    async def stream(self, choices, meta, chat: bool, request: Request):
        kind = "chat.completion.chunk" if chat else "text_completion"

        def event(choice, text, reason):
            delta = {"delta": {"role": "assistant", "content": text}} if chat else {"text": text, "logprobs": None}
            payload = {**meta, "object": kind, "choices": [{"index": choice.index, **delta, "finish_reason": reason}]}
            return f"data: {json.dumps(payload)}\n\n"

        try:
            pending = {asyncio.ensure_future(self.wait(c, block_events=True)): c for c in choices}
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    choice = pending.pop(task)
                    try:
                        finished = task.result() == "done"
                    except APIError as error:
                        yield f"data: {json.dumps({'error': {'message': error.message, 'type': error.kind}})}\n\n"
                        finished = True
                        continue
                    text = choice.delta(final=finished)
                    if text or finished:
                        yield event(choice, text, (choice.text()[1] or "length") if finished else None)
                    if not finished:
                        pending[asyncio.ensure_future(self.wait(choice, block_events=True))] = choice
            yield "data: [DONE]\n\n"
            self.completed += 1
        finally:  # client gone: its rows leave the batch
            for choice in choices:
                if choice.request.finish_reason is None:
                    choice.request.cancelled = True

    def metrics(self) -> str:
        stats, engine = self.engine.stats, self.engine
        passes = max(stats["forward_passes"], 1)
        lines = []

        def metric(name, kind, help_text, value, labels=""):
            if not any(line.startswith(f"# HELP {name} ") for line in lines):
                lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"])
            lines.append(f"{name}{labels} {value}")

        metric("hf_dlm_forward_passes_total", "counter", "batched forward passes", stats["forward_passes"])
        metric("hf_dlm_forward_rows_total", "counter", "rows summed over forward passes", stats["forward_rows"])
        metric("hf_dlm_forward_tokens_total", "counter", "query positions through the model (padding included)",
               stats["forward_tokens"])
        metric("hf_dlm_rows_per_forward", "gauge", "mean rows per forward pass", stats["forward_rows"] / passes)
        metric("hf_dlm_max_rows_per_forward", "gauge", "largest forward batch so far", stats["max_forward_rows"])
        metric("hf_dlm_queue_waiting", "gauge", "sequences waiting to join the batch", engine.num_waiting)
        metric("hf_dlm_running_rows", "gauge", "sequences in the running batch", engine.num_running)
        metric("hf_dlm_generated_tokens_total", "counter", "tokens committed", stats["generated_tokens"])
        metric("hf_dlm_sequences_finished_total", "counter", "sequences finished", stats["requests_finished"])
        metric("hf_dlm_sequences_failed_total", "counter", "sequences failed", stats["requests_failed"])
        metric("hf_dlm_time_to_first_block_seconds_sum", "counter", "submit to first committed block",
               stats["first_block_seconds_sum"])
        metric("hf_dlm_time_to_first_block_seconds_count", "counter", "sequences with a first block",
               stats["first_block_count"])
        metric("hf_dlm_api_requests_accepted_total", "counter", "API calls queued", self.accepted)
        metric("hf_dlm_api_requests_completed_total", "counter", "API calls answered in full", self.completed)
        for (path, status), count in sorted(self.http_status.items()):
            metric("hf_dlm_http_responses_total", "counter", "HTTP responses", count,
                   f'{{path="{path}",status="{status}"}}')
        return "\n".join(lines) + "\n"


def create_app(engine: ContinuousBatchingEngine, tokenizer, settings: ServerSettings | None = None,
               log=print) -> FastAPI:
    """The FastAPI app; the engine's loop starts with the app and drains at shutdown (uvicorn first
    waits for every open request, so no accepted request is dropped)."""
    from contextlib import asynccontextmanager

    server = DLMServer(engine, tokenizer, settings or ServerSettings())

    @asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        await asyncio.to_thread(engine.shutdown)
        log(f"hf-dlm serve: drained; {server.accepted} requests accepted, {server.completed} completed")

    app = FastAPI(title="hf-dlm", lifespan=lifespan)
    app.state.server = server

    @app.middleware("http")
    async def check_key_and_count(request: Request, call_next):
        key = server.settings.api_key
        if key and request.url.path.startswith("/v1/") and request.headers.get("authorization") != f"Bearer {key}":
            response = _error_response(401, "missing or wrong API key (Authorization: Bearer ...)", None,
                                       "authentication_error")
        else:
            response = await call_next(request)
        server.http_status[(request.url.path, response.status_code)] += 1
        return response

    @app.exception_handler(APIError)
    async def api_error(request, error: APIError):
        return _error_response(error.status, error.message, error.param, error.kind)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, error: RequestValidationError):
        problems = error.errors()
        first = problems[0] if problems else {"loc": (), "msg": "invalid request"}
        param = ".".join(str(part) for part in first["loc"] if part != "body") or None
        message = "; ".join(f"{'.'.join(str(p) for p in e['loc'] if p != 'body')}: {e['msg']}" for e in problems)
        return _error_response(422, message, param, "invalid_request_error")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await server.handle(body, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await server.handle(body, request, chat=True)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.settings.model_name, "object": "model", "created": 0,
                                            "owned_by": "hf-dlm"}]}

    @app.get("/health")
    async def health():
        return {"status": "draining" if engine.stopping else "ok", "waiting": engine.num_waiting,
                "running": engine.num_running}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(server.metrics(), media_type="text/plain; version=0.0.4")

    return app
