"""A continuous-batching engine: the decoding core (`hf_dlm.generation`) with rows admitted and released
between steps.

Every request (row) carries its own canvas, block schedule (`RowSchedule`), sampling settings and random
generator, and decodes exactly as `model.generate` would decode it alone. One `step()`:
1. releases cancelled rows (their lanes are free at once) and admits waiting rows up to `max_batch_size`
   (each takes a lane of the preallocated per-slot storage, `SlotStorage`);
2. runs ONE forward for every row with work, whatever its phase: uncached rows and cached rows at a block
   start send their whole canvas (keys / values stored), cached rows mid-block their window, a row with
   `cfg_scale` its unconditional copy beside it; the spans are packed (`RaggedStep`), only each row's block
   goes through the LM head;
3. commits with the core's rules (`generation.commit_rules.decide_step`), rows with equal settings together;
4. at a row's block end (early departure: each row on its own schedule): copies the block to the host without
   waiting and moves the row on; the next step, its forward queued, streams the block (`on_block`), applies
   `stop_on_eos` and the caller's stop check; a finished row frees its lanes.

Why hand-written: a server needs rows that arrive and leave at different times with different settings,
which no library offers for diffusion LMs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

import torch
from torch.fx.experimental import _config as fx_config

from ..generation.commit_rules import CommitSettings, block_candidates, decide_step, warm_compiled_scores
from ..generation.compiled_step import COMPILE_CHOICES, MAX_COMPILED_GRAPHS, StepGraphs, resolve_compile
from ..generation.row_schedule import RowSchedule
from ..generation.sampling import block_bounds, finished_rows
from ..generation.slot_cache import (CompiledRaggedForward, RaggedStep, SlotStorage, first_ragged_forward,
                                     ragged_forward)
from ..utils.errors import FieldError
# the request types' home is requests.py; imported here too, where callers have always found them
from .requests import EngineStoppedError, GenerationRequest, QueueFullError, SamplingParams, decode_answer  # noqa: F401

logger = logging.getLogger(__name__)


class _Row:
    """A request's decoding state: its lanes in the storage, its schedule and, with `credit_alpha`, its credit over
    the current block (width, V), None at a block start."""

    def __init__(self, request: GenerationRequest, lane: int, uncond_lane: int | None, shift: int,
                 device: torch.device):
        params = request.params
        self.request, self.params, self.lane, self.uncond_lane = request, params, lane, uncond_lane
        self.prompt_len = len(request.prompt_ids)
        self.settings = params.settings
        self.schedule = RowSchedule(self.prompt_len, params.max_new_tokens, params.block_length, params.steps,
                                    self.settings, params.cache, params.max_post_steps, shift, params.align_blocks,
                                    params.schedule, params.schedule_eps)
        self.generator = None if params.seed is None else torch.Generator(device).manual_seed(params.seed)
        self.credit: torch.Tensor | None = None

    @property
    def lanes(self) -> list[int]:
        return [self.lane] if self.uncond_lane is None else [self.lane, self.uncond_lane]


class ContinuousBatchingEngine:
    """Decodes `GenerationRequest`s with continuous batching. Use `submit` + `step` (synchronous), or
    `start()` to run the loop on a background thread (the server), `cancel(request)` when its client is
    gone, `shutdown()` to drain and stop."""

    def __init__(self, model, max_batch_size: int = 32, max_waiting: int = 256, eos_token_id=None, compile=None,
                 max_length: int | None = None, preallocate: bool | None = None):
        """max_batch_size: the most sequences in one forward (a guided row's unconditional copy is one more: it
        takes a lane of its own). compile: as `DLMGenerationConfig.compile` (True, a torch.compile mode or
        backend): the step's forward through torch.compile with dynamic sizes, on CUDA replayed as one CUDA graph
        per bucketed shape. max_length: the longest canvas (prompt + max_new_tokens) taken (default: the model's
        max_position_embeddings). preallocate: allocate the slot storage for max_batch_size lanes of max_length
        slots up front (default: when the step is captured as CUDA graphs), so that it never grows and each
        bucketed shape is captured once in a run; the keys / values then take layers x 2 x max_batch_size x
        max_length x kv heads x head size elements (lower max_length to bound them)."""
        self.model = model
        self.device = next(model.parameters()).device
        self.mask_id = model.config.mask_token_id
        if self.mask_id is None:
            raise ValueError("the serving engine needs model.config.mask_token_id")
        eos = eos_token_id if eos_token_id is not None else getattr(model.config, "eos_token_id", None)
        self.eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        self.eos_tensor = torch.tensor(self.eos_ids, dtype=torch.long)
        self.mask_dtype = model.get_input_embeddings().weight.dtype  # the attention mask as an additive bias
        self.shift = int(getattr(model.config, "label_alignment", "same") == "shift")
        self.attention_mode = getattr(model.config, "attention_mode", "bidirectional")
        self.block_size = getattr(model.config, "block_size", None) if self.attention_mode == "block" else None
        self.max_positions = getattr(model.config, "max_position_embeddings", None)
        if max_length is not None and (max_length < 1 or (self.max_positions or max_length) < max_length):
            raise FieldError("max_length", f"max_length must be in [1, max_position_embeddings "
                             f"({self.max_positions})], got {max_length}", max_length)
        self.max_length = max_length or self.max_positions
        self.max_batch_size, self.max_waiting = max_batch_size, max_waiting
        self.waiting: deque[GenerationRequest] = deque()
        self.running: list[_Row] = []
        self.storage = SlotStorage(self.device, self.mask_id)
        self.free_lanes: list[int] = []
        self.lock = threading.Condition()
        self.stopping = False
        self.thread: threading.Thread | None = None
        self.compile_choice = resolve_compile(compile, self.device)
        self.compiled = None if self.compile_choice is None else CompiledRaggedForward(
            **COMPILE_CHOICES[self.compile_choice])
        self.graphs, self.graphs_storage = None, None
        self.ended_blocks = None  # [[(row, host tokens, more blocks after it, last), ...], copy event]: read next step
        # deferred on an asynchronous device only: on a CPU the next forward runs before the read, a step of latency
        self.defer_block_reads = self.device.type == "cuda"
        self.plan_key, self.plan = None, None  # the last step's RaggedStep: reused while no row changes its span
        # a step mixing block starts (whole canvases) with windows attends in two calls (`RaggedStep(split=...)`)
        self.split_attention = True
        self.captures = self.compile_choice not in (None, "eager") and self.device.type == "cuda"  # StepGraphs
        if preallocate if preallocate is not None else self.captures:
            if self.max_length is None:
                raise FieldError("max_length", "preallocating the slot storage needs max_length (the model config "
                                 "names no max_position_embeddings)", None)
            self.storage.reserve(max_batch_size, self.max_length)  # keys / values: at the first forward
        # counters read by /metrics
        self.stats = {"forward_passes": 0, "forward_rows": 0, "forward_tokens": 0, "max_forward_rows": 0,
                      "engine_steps": 0, "requests_admitted": 0, "requests_finished": 0, "requests_failed": 0,
                      "requests_cancelled": 0, "generated_tokens": 0, "first_block_seconds_sum": 0.0,
                      "first_block_count": 0, "graph_captures": 0, "step_seconds": 0.0}

    def sampling_params(self, **overrides) -> SamplingParams:
        return self.sampling_params_for(self.model, **overrides)

    @staticmethod
    def sampling_params_for(model, **overrides) -> SamplingParams:
        """`SamplingParams` of `model`'s generation config with `overrides`, before an engine exists (a caller
        that sizes the engine's `max_length` from its requests)."""
        implementation = getattr(model.config, "_attn_implementation", None) or "eager"
        return SamplingParams.from_generation_config(getattr(model, "generation_config", None),
                                                     getattr(model.config, "attention_mode", "bidirectional"),
                                                     implementation, **overrides)

    @staticmethod
    def canvas_length(prompt_length: int, params: SamplingParams) -> int:
        """Slots a row takes: prompt + max_new_tokens, with aligned blocks to the end of its last block."""
        return block_bounds(prompt_length, params.max_new_tokens, params.block_length,
                            0 if params.align_blocks else None)[1]

    # ---- admission ----------------------------------------------------------------------------
    def submit(self, requests: list[GenerationRequest]):
        """Queue requests (all or none: the n choices of one API call). Raises ValueError when a prompt plus its
        max_new_tokens exceeds the model's positions, QueueFullError when the waiting queue would exceed
        `max_waiting`, EngineStoppedError while shutting down."""
        for request in requests:
            params = request.params
            length = self.canvas_length(len(request.prompt_ids), params)
            if not request.prompt_ids:
                raise FieldError("prompt", "the prompt is empty", request.prompt_ids)
            if self.max_length is not None and length > self.max_length:
                limit = ("the model's max_position_embeddings" if self.max_length == self.max_positions
                         else "the engine's max_length")
                to_block_end = " to the end of its last block" if params.align_blocks else ""
                raise FieldError("max_new_tokens", f"prompt ({len(request.prompt_ids)} tokens) + max_new_tokens "
                                 f"({params.max_new_tokens}){to_block_end} exceeds {limit} ({self.max_length})",
                                 params.max_new_tokens)
            if params.cfg_scale and self.max_batch_size < 2:
                raise FieldError("cfg_scale", "cfg_scale: a guided row and its unconditional copy take two lanes; "
                                 f"this engine runs at most max_batch_size={self.max_batch_size}", params.cfg_scale)
        with self.lock:
            if self.stopping:
                raise EngineStoppedError("the server is shutting down")
            # requests whose clients left while they waited free their places now, not when lanes free up
            gone = [request for request in self.waiting if request.cancelled]
            if gone:
                self.waiting = deque(request for request in self.waiting if not request.cancelled)
                for request in gone:
                    self._done(request, "cancelled")
            if len(self.waiting) + len(requests) > self.max_waiting:
                raise QueueFullError(f"the queue holds {len(self.waiting)} waiting requests (max {self.max_waiting})")
            self.waiting.extend(requests)
            self.lock.notify()

    def cancel(self, request: GenerationRequest):
        """The caller is gone: the row leaves at the next step and its lanes are free for the next admission."""
        request.cancelled = True
        with self.lock:
            self.lock.notify()

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.ended_blocks)

    def _take_lane(self) -> int:
        if self.free_lanes:
            self.free_lanes.sort()
            return self.free_lanes.pop(0)
        used = {lane for row in self.running for lane in row.lanes}
        return next(lane for lane in range(len(used) + 1) if lane not in used)

    def _admit(self):
        with self.lock:
            lanes = sum(len(row.lanes) for row in self.running)
            while self.waiting and lanes + (2 if self.waiting[0].params.cfg_scale else 1) <= self.max_batch_size:
                request = self.waiting.popleft()
                self.stats["requests_admitted"] += 1
                if request.cancelled:
                    self._done(request, "cancelled")
                    continue
                lane = self._take_lane()
                request.admitted_at = time.monotonic()
                try:
                    row = _Row(request, lane, None, self.shift, self.device)
                except Exception as error:  # noqa: BLE001 (a request the engine cannot start fails alone)
                    self.free_lanes.append(lane)
                    self._done(request, "error", error)
                    continue
                self.running.append(row)
                if request.params.cfg_scale:
                    row.uncond_lane = self._take_lane()
                lanes += len(row.lanes)
                length = row.schedule.length
                self.storage.reserve(max(max(row.lanes) + 1, 2), length)  # 2+ lanes: a one-row step compiles apart
                canvas = request.prompt_ids + [self.mask_id] * (length - row.prompt_len)
                self.storage.canvas[lane, :length] = torch.tensor(canvas).to(self.device, non_blocking=True)

    # ---- one scheduler iteration ---------------------------------------------------------------
    @torch.inference_mode()  # always: a compiled step guards on the grad mode (another mode recompiles the model)
    def step(self):
        """Release cancelled rows, admit, one forward for every row with work, commit, end blocks."""
        start = time.perf_counter()
        try:
            self._step()
        finally:  # wall time in steps (the commit waits for the device): against a run's wall, the engine's busy share
            self.stats["step_seconds"] += time.perf_counter() - start

    def _step(self):
        for row in [row for row in self.running if row.request.cancelled]:
            self._finish(row, "cancelled")
        self._admit()
        self.stats["engine_steps"] += 1
        work = [row for row in self.running if not row.schedule.block_done() and row.schedule.needs_forward()]
        if work:
            try:
                logits = self._forward(work)
            except Exception as error:  # noqa: BLE001 (a failed forward fails its rows, not the server)
                for row in work:
                    self._finish(row, "error", error)
            else:
                self._commit(work, logits)
        # the previous step's block ends are read now, with this step's forward queued: the read waits for that
        # step's commit only, not for the device to drain (rows end blocks on staggered steps once requests arrive
        # apart, so reading at once would stall the device almost every step)
        self._read_block_ends()
        for row in list(self.running):
            while row in self.running and row.schedule.block_done():
                self._end_block(row)
        if self.ended_blocks is not None:
            self.ended_blocks[1] = self._record_event()
            if not self.running or not self.defer_block_reads:  # no forward left to overlap with
                self._read_block_ends()

    def run_until_idle(self):
        while self.has_work():
            self.step()

    def warmup(self, rows: int = 2, prompt_tokens: int = 4) -> dict:
        """Compiles the step before traffic, on the calling thread (vLLM compiles and captures at start-up too):
        `rows` requests of `prompt_tokens` tokens decode one block, and the commit's rules compile (greedy and
        sampled), so the first client does not wait for the compiler. The compiled step has dynamic sizes: later
        batches, refreshes and windows reuse its graph.
        The counters are restored (warm-up is not traffic); returns {"seconds", "forwards", "graph_captures"}."""
        if self.has_work() or (self.thread is not None and self.thread.is_alive()):
            raise RuntimeError("warmup() runs before the engine takes requests (before start())")
        block = self.sampling_params().block_length
        if self.max_length is not None:  # a canvas the engine takes
            block = max(1, min(block, self.max_length - prompt_tokens))
        params = self.sampling_params(max_new_tokens=block, block_length=block, steps=2, temperature=0.0)
        token = next(t for t in range(self.model.config.vocab_size) if t != self.mask_id and t not in self.eos_ids)
        requests = [GenerationRequest([token] * prompt_tokens, params) for _ in range(rows)]
        stats, start = dict(self.stats), time.monotonic()
        self.submit(requests)
        self.run_until_idle()
        failed = next((r for r in requests if r.error is not None), None)
        if failed is not None:
            raise RuntimeError(f"the engine's warm-up request failed: {failed.error!r}") from failed.error
        if self.compile_choice is not None:  # the commit's graphs for the other rules, sampling and a lone row
            with torch.inference_mode():
                warm_compiled_scores(self.compile_choice, self.model.config.vocab_size,
                                     self.model.get_input_embeddings().weight.dtype, self.device, self.mask_id)
        done = {"seconds": time.monotonic() - start, "forwards": self.stats["forward_passes"] - stats["forward_passes"],
                "graph_captures": self.stats["graph_captures"] - stats["graph_captures"]}
        self.stats.update(stats)  # in place: /metrics and callers may hold the dict
        return done

    def _forward(self, rows: list[_Row]) -> torch.Tensor:
        """ONE forward over every row's query span (+ guided rows' unconditional copies) -> logits (b, W, V) of
        each row's current block, guided where asked."""
        entries = [(row, row.lane, False) for row in rows]
        entries += [(row, row.uncond_lane, True) for row in rows if row.uncond_lane is not None]
        spans = [row.schedule.query_span() for row, _, _ in entries]
        compiled = self.compiled is not None and bool(self.storage.keys)  # the first forward allocates, eagerly
        heads = [(row.schedule.window[0] - self.shift, row.schedule.width) for row, _, _ in entries]
        lanes, lengths = [lane for _, lane, _ in entries], [row.schedule.length for row, _, _ in entries]
        extra = {"canvas_lanes": [row.lane for row, _, _ in entries],  # a copy reads its row's canvas
                 "masked_prompt": [row.prompt_len if copy else 0 for row, _, copy in entries]}
        # the steps inside a block repeat the plan (the same rows, spans and keys): its host work and upload (about
        # 100 operators a step, benchmarks/engine_host_ops.py) are paid when a row joins, leaves or moves on
        key = (compiled, self.storage.lanes, self.storage.capacity, tuple(lanes), tuple(spans), tuple(lengths),
               tuple(heads), *(tuple(v) for v in extra.values()))
        if key != self.plan_key:
            self.plan_key, self.plan = key, RaggedStep(
                self.storage, lanes, [s for s, _ in spans], [e - s for s, e in spans], lengths, self.attention_mode,
                self.block_size, buckets=compiled, heads=heads, extra=extra, mask_dtype=self.mask_dtype, by_lane=True,
                split=self.split_attention)
        step = self.plan
        tensors = dict(step.tensors)  # input_ids join per step
        token_row = tensors["token_row"]
        input_ids = self.storage.canvas[step.extra["canvas_lanes"][token_row], tensors["token_slot"]]
        if len(entries) > len(rows):  # unconditional copies see their prompt masked
            input_ids = input_ids.masked_fill(tensors["token_slot"] < step.extra["masked_prompt"][token_row],
                                              self.mask_id)
        tensors["input_ids"] = input_ids.unsqueeze(0)
        if not compiled:
            logits = first_ragged_forward(self.model, self.storage, **tensors) if not self.storage.keys else \
                ragged_forward(self.model, **tensors, keys=self._layers(self.storage.keys),
                               values=self._layers(self.storage.values))
        else:
            logits = self._compiled_forward(tensors)
        logits = logits[: len(entries)]  # the LM head's rows are the entries', in their order, then filler rows
        self._count_forward(len(entries), step.num_tokens)
        if len(entries) == len(rows):
            return logits
        cond, uncond = logits[: len(rows)].clone(), logits[len(rows):]
        guided = [i for i, row in enumerate(rows) if row.uncond_lane is not None]
        scale = torch.tensor([rows[i].params.cfg_scale for i in guided], device=self.device, dtype=logits.dtype)
        cond[guided] = uncond + (scale.view(-1, 1, 1) + 1) * (cond[guided] - uncond)
        return cond

    @staticmethod
    def _layers(store: dict) -> list:
        return [store[i] for i in range(len(store))]

    def _compiled_forward(self, tensors: dict) -> torch.Tensor:
        """The compiled step (one Inductor graph with dynamic sizes) and, on CUDA, a CUDA graph per bucketed shape
        (`StepGraphs`, the sampler's graphs), captured against the current storage: a storage that grew (longer
        canvas, more lanes; never when preallocated, the default on CUDA) starts new graphs."""
        storage = (self.storage.canvas.data_ptr(), tuple(self.storage.keys[0].shape))
        keys, values = self._layers(self.storage.keys), self._layers(self.storage.values)
        if self.graphs is None or self.graphs_storage != storage:
            self.graphs = StepGraphs(self.model, enabled=self.captures)
            self.graphs_storage = storage
            # the storage's sizes are fixed while these graphs live: static, they spare the compiler a few symbols
            # per layer (dynamic, a 28-layer step compiled 2.2x slower: 442 s against 197 s, tiny width, CPU)
            for tensor in keys + values:
                torch._dynamo.mark_static(tensor)
        captured = self.graphs.captured
        # no duck sizing: sizes that happen to be equal (rows and lanes, queries and LM-head columns) would become
        # guards, and each later step that breaks one would recompile the whole model
        with torch._dynamo.config.patch(recompile_limit=MAX_COMPILED_GRAPHS), \
                fx_config.patch(use_duck_shape=False):
            logits = self.graphs(self.compiled, tensors, keys=keys, values=values)
        self.stats["graph_captures"] += self.graphs.captured - captured
        return logits

    def _commit(self, rows: list[_Row], logits: torch.Tensor):
        """The core's commit rules, rows with equal settings in one call. A seeded row's generator draws its own
        Gumbel noise (`_row_noise`), so it shares the call; only random remasking, whose second draw comes from
        the generator inside the rule, keeps a seeded row to a call of its own."""
        groups: dict = {}
        for i, row in enumerate(rows):
            own_call = row.generator is not None and row.settings.remasking == "random"
            key = (row.settings, i if own_call else None)
            groups.setdefault(key, []).append(i)
        results, order = [], []
        for (settings, _), index in groups.items():
            group = [rows[i] for i in index]
            try:
                # rows in a run (one group: all of them) are a view; a list index gathers a copy of their logits
                contiguous = index == list(range(index[0], index[0] + len(index)))
                rows_logits = logits[index[0]: index[0] + len(index)] if contiguous else logits[index]
                results.append(self._commit_group(group, rows_logits, settings))
                order += index
            except Exception as error:  # noqa: BLE001 (one group's failure is its rows' alone)
                for row in group:
                    self._finish(row, "error", error)
        if not results:
            return
        if not any(rows[i].schedule.parallel or rows[i].schedule.editing for i in order):
            # budget rules end a block after its steps: nothing to read back, so the host plans and queues the
            # next step while the device runs this one (a read here waits for the device every step)
            for i in order:
                rows[i].schedule.after_step()
            return
        flags = torch.cat(results).tolist()  # the step's one host sync
        for i, (has_masks, began_with_masks, edited) in zip(order, flags):
            rows[i].schedule.after_step(has_masks, began_with_masks, edited)

    def _commit_group(self, group: list[_Row], logits: torch.Tensor, settings: CommitSettings) -> torch.Tensor:
        """-> (g, 3) bool: has masks after the step, had masks before it, edited."""
        # the group's own width: a seeded row draws its noise for its block only, as generate alone does
        width = max(row.schedule.width for row in group)  # aligned: a partial block is narrower
        columns = torch.arange(width, device=self.device)
        budgets = [row.schedule.step_budget or 0 for row in group]
        starts, lengths, lanes, budget, offsets = torch.tensor(  # one upload
            [[row.schedule.window[0] for row in group], [row.schedule.width for row in group],
             [row.lane for row in group], budgets, [row.schedule.offset for row in group]]).to(self.device, non_blocking=True)
        valid = columns.unsqueeze(0) < lengths.unsqueeze(1)  # (g, W): a shorter block's columns beyond it
        cols = torch.where(valid, starts.unsqueeze(1) + columns, self.storage.trash)
        lanes = lanes.unsqueeze(1)
        current = self.storage.canvas[lanes, cols]
        masks = current.eq(self.mask_id) & valid
        candidates = block_candidates(masks, offsets, settings)
        editable = ~masks & valid if settings.editing_threshold is not None else None
        if settings.count_rule != "budget":
            budget = None
        credit = None
        if settings.credit_alpha is not None:  # the rows' own credits, side by side (zeros at a block start)
            credit = torch.zeros((len(group), width, logits.shape[-1]), dtype=torch.float32, device=self.device)
            for i, row in enumerate(group):
                if row.credit is not None:
                    credit[i, : row.credit.shape[0]] = row.credit
        tokens, edited = decide_step(logits[:, :width], current, candidates, settings, budget, group[0].generator,
                                     editable, self.mask_id, credit, self.compile_choice,
                                     self._row_noise(group, settings, width, logits.shape[-1]))
        if credit is not None:
            for i, row in enumerate(group):
                row.credit = credit[i, : row.schedule.width]
        self.storage.canvas[lanes, cols] = tokens
        return torch.stack([(tokens.eq(self.mask_id) & valid).any(1), masks.any(1), edited], 1)

    def _row_noise(self, group: list[_Row], settings: CommitSettings, width: int, vocab: int):
        """A sampled step's uniforms when some row of the group has a seed: each row draws (1, its width, V) from its
        own generator (the global one if unseeded), as `model.generate` alone draws them, so its tokens do not
        depend on its neighbours; None (one draw in `decide_step`) otherwise."""
        if settings.temperature == 0 or settings.remasking == "random" or all(r.generator is None for r in group):
            return None
        noise = torch.empty((len(group), width, vocab), dtype=torch.float64, device=self.device)
        for i, row in enumerate(group):  # drawn in place: torch.rand is empty().uniform_(), the same numbers
            noise[i, : row.schedule.width].uniform_(generator=row.generator)
            noise[i, row.schedule.width:] = 0.5  # columns past a narrower block: they commit nothing
        return noise

    def _count_forward(self, rows: int, tokens: int):
        self.stats["forward_passes"] += 1
        self.stats["forward_tokens"] += tokens  # query positions through the model
        self.stats["forward_rows"] += rows
        self.stats["max_forward_rows"] = max(self.stats["max_forward_rows"], rows)

    def _end_block(self, row: _Row):
        """Copies the row's finished block to the host without waiting (read at the next step) and moves the row
        on; a row past its last block leaves now (its tokens are copied, its lanes free)."""
        row.credit = None  # dInfer's credit is per block
        start, end = row.schedule.window
        end = min(end, row.schedule.output_length)  # aligned blocks: the last one runs past max_new_tokens
        block = self.storage.canvas[row.lane, start:end]
        tokens = block.clone() if block.device.type == "cpu" else block.to("cpu", non_blocking=True)  # pinned
        last = not row.schedule.next_block()
        if self.ended_blocks is None:
            self.ended_blocks = [[], None]
        self.ended_blocks[0].append((row, tokens, end < row.schedule.output_length, last))
        if last:
            self.running.remove(row)
            self.free_lanes += row.lanes

    def _record_event(self):
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def _read_block_ends(self):
        """The ended blocks' tokens: streamed (`on_block`), then `stop_on_eos` and the stop check; a row that
        stops here ran one step of its next block, whose tokens are dropped (generate stops at the same block)."""
        if self.ended_blocks is None:
            return
        ended, event = self.ended_blocks
        self.ended_blocks = None
        if event is not None:
            event.synchronize()
        for row, tokens, more_to_come, last in ended:
            request, params = row.request, row.params
            if request.finish_reason is not None:  # stopped at an earlier block, cancelled or failed
                continue
            try:
                new_tokens = tokens.tolist()
                finished = False
                if params.stop_on_eos and self.eos_ids and more_to_come:
                    # the block ends in EOS and is EOS after its first EOS: the rest of the row would be EOS
                    finished = bool(finished_rows(tokens.unsqueeze(0), self.eos_tensor)[0])
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
                elif last:  # "stop" when the answer holds an EOS (the text ends there)
                    self._finish(row, "stop" if any(t in self.eos_ids for t in request.generated) else "length")
            except Exception as error:  # noqa: BLE001 (a raising callback fails its own row)
                self._finish(row, "error", error)

    def _finish(self, row: _Row, reason: str, error: Exception | None = None):
        if row in self.running:
            self.running.remove(row)
            self.free_lanes += row.lanes
        self._done(row.request, reason, error)

    def _done(self, request: GenerationRequest, reason: str, error: Exception | None = None):
        if request.finish_reason is not None:  # already answered (a callback raised after its on_done)
            return
        request.finish_reason, request.error, request.finished_at = reason, error, time.monotonic()
        self.stats["requests_failed" if error is not None else "requests_cancelled" if reason == "cancelled"
                   else "requests_finished"] += 1
        if request.on_done is not None:
            try:
                request.on_done(request, reason, error)
            except Exception:  # noqa: BLE001 (the caller's callback; the other rows go on)
                logger.exception("on_done of request %s raised", request.request_id)

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
