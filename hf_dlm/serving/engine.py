"""A continuous-batching engine for the diffusion sampler: many requests share each forward pass.

Every request (row) carries its own canvas (prompt + masks), block schedule, sampling settings and
random generator, exactly as `model.generate` would decode it alone. One `step()`:
1. admits waiting rows into the running batch (up to `max_batch_size`); a row joins at its own block
   boundary (the start of its first block), the running rows are not disturbed;
2. runs ONE forward over every uncached row that has something to commit at this step, left-padded to
   the longest canvas (the model derives positions from the attention mask, so padding shifts nothing),
   and sends only each row's current block through the LM head (cached rows: one forward for those at
   a block start, one for the windows of the others; a row with `cfg_scale` brings its unconditional copy);
3. commits tokens per row with the sampler's own arithmetic (`generation_sampling`: LLaDA budgets,
   float64 Gumbel-max, confidence, Fast-dLLM threshold);
4. at a row's block boundary: reports the committed block (streaming), applies `stop_on_eos` and the
   caller's stop check; a finished row leaves the batch at once.

Why hand-written: `DiffusionSampler.run` decodes a fixed batch that starts together; a server needs
rows that arrive and leave at different times with different settings, which no library offers for
diffusion LMs. The per-row result equals `model.generate(prompt, generator=Generator().manual_seed(seed))`
(cache='none'; tests/test_serving_engine.py checks it).

The `cache` knob: Fast-dLLM's prefix / dual caches of bidirectional models run per row (row_cache.py),
with `model.generate(cache=...)`'s semantics (approximate, as Fast-dLLM's); for attention_mode
'block' / 'causal' models the exact cache gives the uncached tokens, so those rows decode uncached.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..generation.configuration import DLMGenerationConfig
from ..generation.commit_rules import CommitSettings, decide_step
from ..generation.sampling import finished_rows, num_transfer_tokens
from .row_cache import cached_hidden_states


class QueueFullError(RuntimeError):
    """The engine's waiting queue is full (the server answers 429)."""


class EngineStoppedError(RuntimeError):
    """The engine is shutting down and takes no new requests (the server answers 503)."""


@dataclass
class SamplingParams:
    """Per-request sampler settings (the `DLMGenerationConfig` fields the engine honours)."""

    max_new_tokens: int
    block_length: int
    steps: int
    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None
    threshold: float | None = None
    remasking: str = "low_confidence"
    stop_on_eos: bool = True
    seed: int | None = None
    cache: str = "none"  # "prefix" / "dual": Fast-dLLM's caches (bidirectional models)
    cfg_scale: float = 0.0  # classifier-free guidance: an unconditional copy (prompt masked) joins the forward

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
            raise ValueError(f"block_length must be positive, got {block_length}")
        if new_tokens % block_length:
            raise ValueError(f"max_tokens ({new_tokens}) must be a multiple of block_length ({block_length})")
        num_blocks = new_tokens // block_length
        steps = config.steps or new_tokens
        if steps <= 0 or steps % num_blocks:
            raise ValueError(f"steps ({steps}) must be a positive multiple of the number of blocks ({num_blocks})")
        # the exact cache of 'block' / 'causal' models gives the uncached tokens: those rows run uncached
        cache = config.cache if attention_mode == "bidirectional" else "none"
        if cache != "none" and attention_implementation not in ("eager", "sdpa"):
            raise ValueError(f"cache={cache!r} in the serving engine needs attn_implementation 'sdpa' or 'eager', "
                             f"not {attention_implementation!r}")
        if config.cfg_scale and cache != "none":
            raise ValueError(f"cfg_scale: the serving engine guides rows without a KV cache only (asked: {cache!r})")
        return cls(max_new_tokens=new_tokens, block_length=block_length, steps=steps,
                   temperature=config.sampling_temperature, top_p=config.top_p, top_k=config.top_k,
                   threshold=config.threshold, remasking=config.remasking, stop_on_eos=config.stop_on_eos, seed=seed,
                   cache=cache, cfg_scale=config.cfg_scale or 0.0)


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
    submitted_at: float = field(default_factory=time.monotonic)
    first_block_at: float | None = None


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


class _Row:
    """A request's decoding state on the engine's device."""

    def __init__(self, request: GenerationRequest, mask_id: int, device: torch.device):
        params = request.params
        self.request, self.params = request, params
        self.prompt_len = len(request.prompt_ids)
        self.canvas = torch.tensor(request.prompt_ids + [mask_id] * params.max_new_tokens, device=device)
        self.num_blocks = params.max_new_tokens // params.block_length
        self.steps_per_block = params.steps // self.num_blocks
        self.generator = None if params.seed is None else torch.Generator(device).manual_seed(params.seed)
        self.block, self.step = 0, 0
        # at a block start every position of the block is masked: LLaDA's budget needs no device read
        self.budget = num_transfer_tokens(torch.tensor([params.block_length]), self.steps_per_block)[0].tolist()
        self.block_has_masks = True
        self.kv: dict = {}  # cached rows: layer -> (keys, values) stored at the block start

    @property
    def window(self) -> tuple[int, int]:
        start = self.prompt_len + self.block * self.params.block_length
        return start, start + self.params.block_length

    def block_done(self) -> bool:
        if self.params.threshold is not None:
            return not self.block_has_masks
        return self.step >= self.steps_per_block

    def needs_forward(self) -> bool:
        """False: LLaDA's step commits nothing for this row (its budget is 0), which costs no forward."""
        if self.params.threshold is not None:
            return True
        if self.budget[self.step] > 0:
            return True
        self.step += 1
        return False

    def commit(self, logits: torch.Tensor, mask_id: int, mask_index: torch.Tensor):
        """logits (W, V) of the current block -> commit this step's tokens (generate()'s arithmetic)."""
        p = self.params
        start, end = self.window
        current = self.canvas[start:end].unsqueeze(0)  # (1, W)
        logits = logits.unsqueeze(0)
        settings = CommitSettings(p.temperature, p.top_k, p.top_p, p.remasking, p.threshold)
        budget = None if p.threshold is not None else torch.tensor([self.budget[self.step]], device=logits.device)
        tokens, _ = decide_step(logits, current, current.eq(mask_id), settings, budget, self.generator,
                                mask_index=mask_index)
        self.canvas[start:end] = tokens[0]
        self.step += 1
        if p.threshold is not None:
            self.block_has_masks = bool(self.canvas[start:end].eq(mask_id).any())


class ContinuousBatchingEngine:
    """Decodes `GenerationRequest`s with continuous batching. Use `submit` + `step` (synchronous), or
    `start()` to run the loop on a background thread (the server), `shutdown()` to drain and stop."""

    def __init__(self, model, max_batch_size: int = 32, max_waiting: int = 256, eos_token_id=None):
        self.model = model
        self.device = next(model.parameters()).device
        self.mask_id = model.config.mask_token_id
        if self.mask_id is None:
            raise ValueError("the serving engine needs model.config.mask_token_id")
        eos = eos_token_id if eos_token_id is not None else getattr(model.config, "eos_token_id", None)
        self.eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        self.eos_tensor = torch.tensor(self.eos_ids, device=self.device)
        self.mask_index = torch.tensor([self.mask_id], device=self.device)
        self.shift = int(getattr(model.config, "label_alignment", "same") == "shift")
        self.attention_mode = getattr(model.config, "attention_mode", "bidirectional")
        self.max_batch_size, self.max_waiting = max_batch_size, max_waiting
        self.waiting: deque[GenerationRequest] = deque()
        self.running: list[_Row] = []
        self.lock = threading.Condition()
        self.stopping = False
        self.thread: threading.Thread | None = None
        # counters read by /metrics
        self.stats = {"forward_passes": 0, "forward_rows": 0, "forward_tokens": 0, "max_forward_rows": 0,
                      "requests_admitted": 0, "requests_finished": 0, "requests_failed": 0, "generated_tokens": 0,
                      "first_block_seconds_sum": 0.0, "first_block_count": 0}

    def sampling_params(self, **overrides) -> SamplingParams:
        implementation = getattr(self.model.config, "_attn_implementation", None) or "eager"
        return SamplingParams.from_generation_config(getattr(self.model, "generation_config", None),
                                                     self.attention_mode, implementation, **overrides)

    # ---- admission ----------------------------------------------------------------------------
    def submit(self, requests: list[GenerationRequest]):
        """Queue requests (all or none: the n choices of one API call). Raises QueueFullError when the
        waiting queue would exceed `max_waiting`, EngineStoppedError while shutting down."""
        with self.lock:
            if self.stopping:
                raise EngineStoppedError("the server is shutting down")
            if len(self.waiting) + len(requests) > self.max_waiting:
                raise QueueFullError(f"the queue holds {len(self.waiting)} waiting requests (max {self.max_waiting})")
            self.waiting.extend(requests)
            self.lock.notify()

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _admit(self):
        with self.lock:
            while self.waiting and len(self.running) < self.max_batch_size:
                request = self.waiting.popleft()
                self.running.append(_Row(request, self.mask_id, self.device))
                self.stats["requests_admitted"] += 1  # a cancelled one leaves at once in step()

    # ---- one scheduler iteration ---------------------------------------------------------------
    def step(self):
        """Admit, one batched forward, commit, retire finished rows."""
        self._admit()
        for row in [row for row in self.running if row.request.cancelled]:
            self._finish(row, "cancelled")
        work = [row for row in self.running if not row.block_done() and row.needs_forward()]
        # uncached rows share one forward; cached rows refresh their keys at a block start (one forward)
        # and recompute only their window (dual: the block; prefix: the block and the rest) later on
        groups = [([r for r in work if r.params.cache == "none"], self._block_logits),
                  ([r for r in work if r.params.cache != "none" and r.step == 0], self._refresh_logits),
                  ([r for r in work if r.params.cache != "none" and r.step > 0], self._window_logits)]
        for rows, forward in groups:
            if not rows:
                continue
            try:
                logits = forward(rows)
                for row, row_logits in zip(rows, logits):
                    row.commit(row_logits[: row.params.block_length], self.mask_id, self.mask_index)
            except Exception as error:  # noqa: BLE001 (a failed forward fails its rows, not the server)
                for row in rows:
                    self._finish(row, "error", error)
        for row in list(self.running):
            while row in self.running and row.block_done():
                self._end_block(row)

    def run_until_idle(self):
        while self.has_work():
            self.step()

    def _block_logits(self, rows: list[_Row]) -> torch.Tensor:
        """One forward over `rows` (left-padded) -> logits (b, W_max, V) of each row's current block. A row with
        `cfg_scale` adds its unconditional copy (prompt masked) to the same forward; its logits are guided,
        uncond + (cfg_scale + 1) * (cond - uncond), as `model.generate(cfg_scale=...)` does."""
        guided = [i for i, row in enumerate(rows) if row.params.cfg_scale]
        unconditional = [rows[i].canvas.clone() for i in guided]
        for i, canvas in zip(guided, unconditional):
            canvas[: rows[i].prompt_len] = self.mask_id
        logits = self._forward_blocks(rows + [rows[i] for i in guided], [row.canvas for row in rows] + unconditional)
        if not guided:
            return logits
        cond, uncond = logits[guided], logits[len(rows):]
        scale = torch.tensor([rows[i].params.cfg_scale for i in guided], device=self.device, dtype=logits.dtype)
        logits = logits[: len(rows)].clone()
        logits[guided] = uncond + (scale.view(-1, 1, 1) + 1) * (cond - uncond)
        return logits

    def _forward_blocks(self, rows: list[_Row], canvases: list[torch.Tensor]) -> torch.Tensor:
        """One forward over `canvases` (left-padded) -> logits (b, W_max, V) of each row's current block."""
        input_ids = torch.nn.utils.rnn.pad_sequence(canvases, batch_first=True, padding_value=self.mask_id,
                                                    padding_side="left")  # (b, L)
        lengths = torch.tensor([c.numel() for c in canvases], device=self.device)
        total = input_ids.shape[1]
        attention_mask = (torch.arange(total, device=self.device) >= (total - lengths).unsqueeze(1)).long()
        width = max(row.params.block_length for row in rows)
        starts = torch.tensor([total - c.numel() + row.window[0] for row, c in zip(rows, canvases)], device=self.device)
        # shifted models: the logits at i - 1 predict token i (a prompt is never empty, so i - 1 >= 0)
        index = (starts.unsqueeze(1) + torch.arange(width, device=self.device) - self.shift).clamp(max=total - 1)
        backbone, head = getattr(self.model, "model", None), getattr(self.model, "lm_head", None)
        if isinstance(backbone, torch.nn.Module) and isinstance(head, torch.nn.Module):
            hidden_states = backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            picked = hidden_states.gather(1, index.unsqueeze(-1).expand(-1, -1, hidden_states.shape[-1]))
            logits = head(picked)  # (b, W_max, V): only the blocks go through the LM head
        else:  # any module returning `.logits`
            all_logits = self.model(input_ids=input_ids, attention_mask=attention_mask).logits
            logits = all_logits.gather(1, index.unsqueeze(-1).expand(-1, -1, all_logits.shape[-1]))
        self._count_forward(len(rows), input_ids.numel())
        return logits

    def _count_forward(self, rows: int, tokens: int):
        self.stats["forward_passes"] += 1
        self.stats["forward_tokens"] += tokens  # query positions through the model, padding included
        self.stats["forward_rows"] += rows
        self.stats["max_forward_rows"] = max(self.stats["max_forward_rows"], rows)

    def _refresh_logits(self, rows: list[_Row]) -> torch.Tensor:
        """Block start of cached rows: whole canvases, keys / values stored -> logits of the blocks."""
        hidden_states = cached_hidden_states(self.model.model, rows, [(0, r.canvas.numel()) for r in rows], True,
                                             self.mask_id)
        starts = [r.window[0] - self.shift for r in rows]
        return self._head(hidden_states, starts, rows)

    def _window_logits(self, rows: list[_Row]) -> torch.Tensor:
        """Later steps of cached rows: only the window goes through the model, against the stored keys."""
        spans = [(r.window[0] - self.shift, r.window[1] if r.params.cache == "dual" else r.canvas.numel())
                 for r in rows]
        hidden_states = cached_hidden_states(self.model.model, rows, spans, False, self.mask_id)
        return self._head(hidden_states, [0] * len(rows), rows)

    def _head(self, hidden_states, starts, rows) -> torch.Tensor:
        width = max(row.params.block_length for row in rows)
        index = (torch.tensor(starts, device=self.device).unsqueeze(1) + torch.arange(width, device=self.device))
        index = index.clamp(max=hidden_states.shape[1] - 1)
        picked = hidden_states.gather(1, index.unsqueeze(-1).expand(-1, -1, hidden_states.shape[-1]))
        self._count_forward(len(rows), hidden_states.shape[0] * hidden_states.shape[1])
        return self.model.lm_head(picked)

    def _end_block(self, row: _Row):
        request, params = row.request, row.params
        start, end = row.window
        block_tokens = row.canvas[start:end]
        total = row.canvas.numel()
        finished = False
        if params.stop_on_eos and self.eos_ids:
            # the block ends in EOS and is EOS after its first EOS: the rest of the row would be EOS
            finished = bool(finished_rows(block_tokens.unsqueeze(0), self.eos_tensor)[0]) and end < total
        new_tokens = block_tokens.tolist()
        request.generated.extend(new_tokens)
        self.stats["generated_tokens"] += len(new_tokens)
        if request.first_block_at is None:
            request.first_block_at = time.monotonic()
            self.stats["first_block_seconds_sum"] += request.first_block_at - request.submitted_at
            self.stats["first_block_count"] += 1
        if request.on_block is not None:
            request.on_block(request, new_tokens)
        if finished or (request.stop_check is not None and request.stop_check(request.generated)):
            self._finish(row, "stop")
        elif end >= total:  # "stop" when the answer holds an EOS (the text ends there), else "length"
            self._finish(row, "stop" if any(t in self.eos_ids for t in request.generated) else "length")
        else:
            row.block, row.step, row.block_has_masks = row.block + 1, 0, True

    def _finish(self, row: _Row, reason: str, error: Exception | None = None):
        if row in self.running:
            self.running.remove(row)
        row.request.finish_reason, row.request.error = reason, error
        self.stats["requests_failed" if error is not None else "requests_finished"] += 1
        if row.request.on_done is not None:
            row.request.on_done(row.request, reason, error)

    # ---- background loop (the server) ------------------------------------------------------------
    def start(self):
        self.thread = threading.Thread(target=self._loop, name="hf-dlm-engine", daemon=True)
        self.thread.start()

    def _loop(self):
        while True:
            with self.lock:
                while not self.has_work() and not self.stopping:
                    self.lock.wait(timeout=0.5)
                if self.stopping and not self.has_work():
                    return
            try:
                with torch.inference_mode():
                    self.step()
            except Exception as error:  # noqa: BLE001 (a bug in a callback must not hang every open request)
                for row in list(self.running):
                    self._finish(row, "error", error)

    def shutdown(self, timeout: float | None = None):
        """Take no new requests, finish every queued and running one, stop the loop."""
        with self.lock:
            self.stopping = True
            self.lock.notify()
        if self.thread is not None:
            self.thread.join(timeout)
