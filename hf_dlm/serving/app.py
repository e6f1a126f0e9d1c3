"""The OpenAI-compatible FastAPI app over a `ContinuousBatchingEngine`.

Endpoints: POST /v1/completions, POST /v1/chat/completions (server-sent events with `stream`, one
event per committed block), GET /v1/models, /health, /metrics (Prometheus text format). Errors use
OpenAI's body `{"error": {"message", "type", "param", "code"}}`: 400 for values the sampler or the model
cannot take, 404 `model_not_found` for a model name not in /v1/models, 422 for schema errors, 401 without
the API key, 429 when the queue is full, 500 when a request's own row fails, 503 while draining or after
the engine stopped.

No request can break the server: every field is checked before the request is queued (protocol.py: types
and ranges; validation.py: seeds, the model's positions and vocabulary, the server's limits), a row that fails answers its own request with an error,
an engine thread that dies fails the open requests with 503 and turns /health to 503, and SIGTERM drains
for at most `drain_timeout` seconds before the requests still open are answered 503 (`serve`).
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
from starlette.exceptions import HTTPException

from .engine import ContinuousBatchingEngine
from .protocol import ChatCompletionRequest, CompletionRequest, error_param
from .requests import EngineStoppedError, GenerationRequest, QueueFullError, decode_answer
from .validation import APIError, RequestChecker, refused

@dataclass
class ServerSettings:
    model_name: str = "hf-dlm"  # the id in /v1/models and in responses
    aliases: tuple[str, ...] = ()  # further names a request's `model` may use (also listed in /v1/models)
    max_prompt_tokens: int = 4096  # longer prompts: 400
    max_output_tokens: int = 1024  # larger max_tokens: 400
    default_max_tokens: int = 64  # max_tokens of a request without one
    max_sequences: int = 64  # most sequences (prompts x n) in one request
    max_body_bytes: int = 4 * 2**20  # larger request bodies: 413 (declared: unread; chunked: counted, `BodyLimit`)
    api_key: str | None = None  # when set, /v1/* needs `Authorization: Bearer <api_key>` (else 401)
    drain_timeout: float = 30.0  # SIGTERM: seconds open requests may still run before they are answered 503
    chat_template: str | None = None  # a Jinja chat template used instead of the tokenizer's own

    @property
    def model_names(self) -> tuple[str, ...]:
        return (self.model_name, *(a for a in self.aliases if a != self.model_name))


def _error_response(status: int, message: str, param: str | None, kind: str, code: str | None = None):
    return JSONResponse(APIError(status, message, param, kind, code).body(), status_code=status)


def answer_token_count(tokenizer, generated: list[int], eos_ids, stops: list[str], max_tokens: int) -> int:
    """How many generated token ids the answer took: up to max_tokens, through the EOS that ended it, or
    through the token that completed a stop sequence (the smallest prefix whose text holds one). Counted on
    the ids themselves: re-tokenizing the decoded text gives another number."""
    tokens = generated[:max_tokens]
    eos = next((i for i, t in enumerate(tokens) if t in eos_ids), None)
    if eos is not None:
        tokens = tokens[: eos + 1]

    def stopped(k: int) -> bool:
        text = tokenizer.decode(tokens[:k], skip_special_tokens=True)
        return any(s in text for s in stops)

    if not stops or not stopped(len(tokens)):
        return len(tokens)
    low, high = 0, len(tokens)  # stopped(high) holds; a stop sequence, once in the text, stays there
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if stopped(middle) else (middle, high)
    return high


class _Choice:
    """One choice of an API call: its engine request and the text produced so far (stop sequences,
    EOS and max_tokens applied)."""

    def __init__(self, server, prompt_ids, params, max_tokens: int, stops: list[str], loop, index: int):
        self.server, self.max_tokens, self.stops, self.index = server, max_tokens, stops, index
        self.events: asyncio.Queue = asyncio.Queue()
        self.sent = 0  # characters already streamed
        self._decoded = (-1, ("", None))  # (tokens decoded, text()): a stream's last event asks twice
        post = lambda *event: loop.call_soon_threadsafe(self.events.put_nowait, event)  # noqa: E731
        self.request = GenerationRequest(prompt_ids, params, on_block=lambda r, ids: post("block", None),
                                         on_done=lambda r, reason, error: post("done", error),
                                         stop_check=self._stopped)

    def text(self) -> tuple[str, str | None]:
        """(text so far, finish reason if already decided by EOS / stop sequence / max_tokens)."""
        generated = self.request.generated  # only grows: its length keys the decoded text
        count, answer = self._decoded
        if count != len(generated):
            count = len(generated)
            answer = decode_answer(self.server.tokenizer, generated[:count], self.server.engine.eos_ids, self.stops,
                                   self.max_tokens)
            self._decoded = (count, answer)
        return answer

    def _stopped(self, generated) -> bool:  # engine thread, at a block boundary
        if not self.stops:  # EOS and max_tokens read from the ids: no decode of every row's text inside a step
            eos = self.server.engine.eos_ids
            return len(generated) >= self.max_tokens or any(t in eos for t in generated[: self.max_tokens])
        return self.text()[1] is not None

    def completion_tokens(self) -> int:
        return answer_token_count(self.server.tokenizer, self.request.generated, self.server.engine.eos_ids,
                                  self.stops, self.max_tokens)

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
    def __init__(self, engine: ContinuousBatchingEngine, tokenizer, settings: ServerSettings, log=print):
        self.engine, self.tokenizer, self.settings, self.log = engine, tokenizer, settings, log
        self.http_status: Counter = Counter()
        self.accepted = self.completed = 0
        self.open: set[_Choice] = set()  # choices queued or running, failed together on drain / engine death
        self.engine_failure: str | None = None  # set once the engine thread has stopped on its own
        self.draining = False
        self.loop: asyncio.AbstractEventLoop | None = None  # the app's event loop, set at startup
        self.check = RequestChecker(engine, tokenizer, settings)

    # ---- request -> engine requests ------------------------------------------------------------
    # ---- responses -----------------------------------------------------------------------------
    def check_engine(self):
        if self.engine_failure is not None:
            raise APIError(503, self.engine_failure, None, "server_error")
        if self.draining:
            raise APIError(503, "the server is shutting down", None, "server_error")

    async def handle(self, body, request: Request, chat: bool):
        self.check_engine()
        # a long prompt is tokenized and templated in a worker thread, so as not to stall the other requests
        loop = asyncio.get_running_loop()
        checked = self.check(body) if self.check.is_light(body) else await asyncio.to_thread(self.check, body)
        pairs = zip((ids for ids in checked.prompts for _ in range(body.n)), checked.params)
        choices = [_Choice(self, ids, params, checked.max_tokens, body.stop_list(), loop, index)
                   for index, (ids, params) in enumerate(pairs)]
        try:
            self.engine.submit([c.request for c in choices])
        except ValueError as error:  # the engine's own refusals (its checks come after the server's)
            raise refused(error) from None
        except QueueFullError as error:
            raise APIError(429, f"server busy: {error}; retry later", None, "rate_limit_error") from None
        except EngineStoppedError as error:
            raise APIError(503, str(error), None, "server_error") from None
        self.open.update(choices)
        self.accepted += 1
        prompt_tokens = sum(len(c.request.prompt_ids) for c in choices[:: body.n])
        meta = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
                "model": body.model or self.settings.model_name}
        if body.stream:
            return StreamingResponse(self.stream(choices, meta, chat, request), media_type="text/event-stream")
        try:
            for choice in choices:
                await self.wait(choice)
        finally:  # an error, or the client gone: the other rows of the call leave the batch
            self.close(choices)
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

    def close(self, choices):
        for choice in choices:
            self.open.discard(choice)
            if choice.request.finish_reason is None:
                choice.request.cancelled = True

    def fail_open(self, error: APIError):
        """Answer every open choice with `error` (event-loop thread); their rows leave the batch."""
        for choice in list(self.open):
            choice.request.cancelled = True
            choice.events.put_nowait(("done", error))
        self.open.clear()

    async def wait(self, choice: _Choice, block_events: bool = False):
        """Wait for the next event of `choice` (block_events) or for its end. A failed row -> 500; a
        server-side end (drain, engine stopped) -> its own APIError."""
        while True:
            kind, error = await choice.events.get()
            if kind == "done" and isinstance(error, APIError):
                raise error
            if kind == "done" and error is not None:
                raise APIError(500, f"generation failed: {type(error).__name__}: {error}", None, "server_error")
            if kind == "done" or block_events:
                return kind

    async def stream(self, choices, meta, chat: bool, request: Request):
        kind = "chat.completion.chunk" if chat else "text_completion"

        def event(choice, text, reason):
            delta = {"delta": {"role": "assistant", "content": text}} if chat else {"text": text, "logprobs": None}
            payload = {**meta, "object": kind, "choices": [{"index": choice.index, **delta, "finish_reason": reason}]}
            return f"data: {json.dumps(payload)}\n\n"

        failed, pending = False, {}
        try:
            pending = {asyncio.ensure_future(self.wait(c, block_events=True)): c for c in choices}
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    choice = pending.pop(task)
                    try:
                        finished = task.result() == "done"
                    except APIError as error:
                        yield f"data: {json.dumps(error.body())}\n\n"
                        failed = True
                        continue
                    text = choice.delta(final=finished)
                    if text or finished:
                        yield event(choice, text, (choice.text()[1] or "length") if finished else None)
                    if not finished:
                        pending[asyncio.ensure_future(self.wait(choice, block_events=True))] = choice
            yield "data: [DONE]\n\n"
            self.completed += not failed
        finally:  # client gone: its rows leave the batch
            for task in pending:
                task.cancel()
            self.close(choices)

    # ---- lifecycle -------------------------------------------------------------------------------
    async def watch_engine(self, interval: float = 0.2):
        """An engine thread that stopped without being asked to fails the open requests (503) and /health."""
        while self.engine_failure is None:
            await asyncio.sleep(interval)
            thread = getattr(self.engine, "thread", None)
            if thread is not None and not thread.is_alive() and not self.engine.stopping:
                self.engine_failure = "the generation engine stopped unexpectedly (see the server log); restart " \
                                      "the server"
                self.log(f"hf-dlm serve: ERROR: {self.engine_failure}; failing {len(self.open)} open request(s)")
                self.fail_open(APIError(503, self.engine_failure, None, "server_error"))

    def begin_drain(self):
        """SIGTERM (event-loop thread): take no new requests; after `drain_timeout` answer the open ones 503."""
        if self.draining:
            return
        self.draining = True
        timeout = self.settings.drain_timeout
        self.log(f"hf-dlm serve: draining {len(self.open)} open request(s) for at most {timeout:g} s")
        error = APIError(503, f"the server shut down before this request finished (drain timeout {timeout:g} s)",
                         None, "server_error")
        asyncio.get_running_loop().call_later(timeout, self.fail_open, error)

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
        metric("hf_dlm_graph_captures_total", "counter", "step shapes captured as CUDA graphs (each capture costs "
               "about three forwards; a shape is captured the second time it is seen)", stats["graph_captures"])
        metric("hf_dlm_engine_steps_total", "counter", "engine steps (each: admit, one forward, commit)",
               stats["engine_steps"])
        metric("hf_dlm_engine_step_seconds_total", "counter", "wall seconds inside engine steps (over elapsed time: "
               "the engine's busy share)", stats["step_seconds"])
        metric("hf_dlm_queue_waiting", "gauge", "sequences waiting to join the batch", engine.num_waiting)
        metric("hf_dlm_running_rows", "gauge", "sequences in the running batch", engine.num_running)
        metric("hf_dlm_generated_tokens_total", "counter", "tokens committed", stats["generated_tokens"])
        metric("hf_dlm_sequences_finished_total", "counter", "sequences finished (stop or length)",
               stats["requests_finished"])
        metric("hf_dlm_sequences_failed_total", "counter", "sequences failed", stats["requests_failed"])
        metric("hf_dlm_sequences_cancelled_total", "counter", "sequences cancelled (their client left)",
               stats["requests_cancelled"])
        metric("hf_dlm_time_to_first_block_seconds_sum", "counter", "submit to first committed block",
               stats["first_block_seconds_sum"])
        metric("hf_dlm_time_to_first_block_seconds_count", "counter", "sequences with a first block",
               stats["first_block_count"])
        metric("hf_dlm_engine_up", "gauge", "0 once the engine thread stopped on its own (the server answers 503)",
               int(self.engine_failure is None))
        metric("hf_dlm_api_requests_accepted_total", "counter", "API calls queued", self.accepted)
        metric("hf_dlm_api_requests_completed_total", "counter", "API calls answered in full", self.completed)
        for (path, status), count in sorted(self.http_status.items()):
            metric("hf_dlm_http_responses_total", "counter", "HTTP responses", count,
                   f'{{path="{path}",status="{status}"}}')
        return "\n".join(lines) + "\n"


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes is answered 413 before the app sees it. A declared
    Content-Length over the limit is refused unread; any other body (chunked transfer has no Content-Length, and a
    declared length may understate) is counted as it streams in and refused as soon as the count passes the limit,
    so no more than `limit` bytes are ever held. Bodies within the limit are replayed to the app unchanged."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            return await self._refuse(scope, receive, send, f"the body has {int(declared)} bytes")
        messages, size = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":  # the client left: the app hears it at once
                break
            size += len(message.get("body", b""))
            if size > self.limit:
                return await self._refuse(scope, receive, send, f"the body has more than {self.limit} bytes")
            if not message.get("more_body", False):
                break
        pending = iter(messages)

        async def replay():
            return next(pending, None) or await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope, receive, send, what: str):
        response = _error_response(413, f"{what}; this server takes at most {self.limit}", None,
                                   "invalid_request_error")
        await response(scope, receive, send)


class KeyAndStatus:
    """ASGI middleware: /v1/* needs the API key (else 401), and every response's status is counted by path
    (/metrics). Plain ASGI where Starlette's `@app.middleware("http")` would run every response, each streamed
    event included, through a memory stream and a task of its own: event-loop time that a burst of requests
    waits for."""

    def __init__(self, app, server: DLMServer):
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, key, status = scope["path"], self.server.settings.api_key, None

        async def send_counted(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            if key and path.startswith("/v1/") and \
                    dict(scope["headers"]).get(b"authorization") != f"Bearer {key}".encode():
                response = _error_response(401, "missing or wrong API key (Authorization: Bearer ...)", None,
                                           "authentication_error")
                await response(scope, receive, send_counted)
            else:
                await self.app(scope, receive, send_counted)
        finally:  # an exception before any answer: the outer error middleware answers 500
            self.server.http_status[(path, status or 500)] += 1


def create_app(engine: ContinuousBatchingEngine, tokenizer, settings: ServerSettings | None = None,
               log=print) -> FastAPI:
    """The FastAPI app; the engine's loop starts with the app and stops at shutdown (uvicorn first waits for
    the open requests; `serve` bounds that wait by `drain_timeout`)."""
    from contextlib import asynccontextmanager

    server = DLMServer(engine, tokenizer, settings or ServerSettings(), log)

    @asynccontextmanager
    async def lifespan(app):
        server.loop = asyncio.get_running_loop()
        engine.start()
        watcher = asyncio.create_task(server.watch_engine())
        yield
        watcher.cancel()
        server.fail_open(APIError(503, "the server shut down before this request finished", None, "server_error"))
        # bounded: a row stuck in a forward must not keep the process up (the engine thread is a daemon)
        await asyncio.to_thread(engine.shutdown, server.settings.drain_timeout)
        if engine.thread is not None and engine.thread.is_alive():
            log(f"hf-dlm serve: the engine did not stop within {server.settings.drain_timeout:g} s; exiting anyway")
        log(f"hf-dlm serve: drained; {server.accepted} requests accepted, {server.completed} completed")

    app = FastAPI(title="hf-dlm", lifespan=lifespan)
    app.state.server = server
    app.add_middleware(BodyLimit, limit=server.settings.max_body_bytes)  # inside the one below: 413s counted
    app.add_middleware(KeyAndStatus, server=server)

    @app.exception_handler(APIError)
    async def api_error(request, error: APIError):
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(HTTPException)
    async def http_error(request, error: HTTPException):  # unknown paths, wrong methods, unreadable bodies
        return _error_response(error.status_code, str(error.detail), None, "invalid_request_error")

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, error: RequestValidationError):
        problems = error.errors() or [{"loc": (), "msg": "invalid request", "type": ""}]
        if problems[0].get("type") == "json_invalid":  # the location is a byte offset, not a field
            detail = (problems[0].get("ctx") or {}).get("error", "")
            return _error_response(400, f"the body is not valid JSON ({detail} at character "
                                   f"{problems[0]['loc'][-1]})", None, "invalid_request_error")
        message = "; ".join(f"{error_param(e) or 'body'}: {e['msg']}" for e in problems[:8])
        return _error_response(422, message, error_param(problems[0]), "invalid_request_error")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await server.handle(body, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await server.handle(body, request, chat=True)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "hf-dlm"}
                                           for name in server.settings.model_names]}

    @app.get("/health")
    async def health():
        state = {"waiting": engine.num_waiting, "running": engine.num_running}
        if server.engine_failure is not None:
            return JSONResponse({"status": "error", "error": server.engine_failure, **state}, status_code=503)
        if server.draining or engine.stopping:
            return JSONResponse({"status": "draining", **state}, status_code=503)
        return {"status": "ok", **state}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(server.metrics(), media_type="text/plain; version=0.0.4")

    return app


def serve(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info"):
    """Run `app` under uvicorn until SIGTERM / Ctrl-C, then drain: new connections are refused, open requests
    run for at most `ServerSettings.drain_timeout` seconds and are then answered 503, and the engine stops."""
    import uvicorn

    server = app.state.server

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame):  # a signal handler: hand the drain to the event loop
            if server.loop is not None:
                server.loop.call_soon_threadsafe(server.begin_drain)
            super().handle_exit(sig, frame)

    # uvicorn's own bound (it cancels the request tasks) is a backstop in case an answer cannot be written
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=server.settings.drain_timeout + 5)
    _Server(config).run()
