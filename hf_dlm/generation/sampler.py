"""`model.generate` for DLMs: LLaDA's semi-autoregressive masked-diffusion sampler and Fast-dLLM's
threshold decoding and KV caches.

Canvas = prompt + `max_new_tokens` masks, split into blocks of `block_length` decoded left to right
(`align_blocks`: blocks on multiples of block_length in the row's positions, the prompt's partial block first,
the canvas run on to the end of the last block and the output cut at max_new_tokens, as LLaDA2.x / SDAR /
Fast-dLLM v2 generate); `steps` forward passes are shared evenly over the blocks, and a block's steps commit
masks // steps each (LLaDA) or Dream's timestep counts (`schedule="dream"`). Each step (LLaDA `generate.py`
semantics):
candidates `x0 = argmax(logits + Gumbel noise at temperature T)` (float64 noise; T = 0 is argmax), a
confidence per position (`remasking`), -inf after the current block and on committed tokens, then the
`num_transfer_tokens` most confident masked positions are committed (or, with `threshold`, every one
whose confidence is >= threshold and at least the best; `credit_alpha`, dInfer's credit decoding, decides on logits
raised by a credit each row keeps over its block's steps). Masks inside the prompt (infilling) compete
with the current block, as in LLaDA. Fast-dLLM v2 narrows a step's candidates (`block_candidates`): the first
sub-block of `sub_block_length` with masks left, and a block's first token alone (`first_token_alone`).

Caches (`cache`):
- bidirectional models: `prefix` / `dual` are Fast-dLLM's caches and APPROXIMATE by nature: at each
  block start one full forward stores every position's keys / values; later steps of the block
  recompute only the block (`dual`) or the block and everything after it (`prefix`), reusing the
  stored, slightly stale keys / values of the rest.
- attention_mode 'block' (and 'causal', block size 1) models: either value selects an EXACT cache.
  Tokens of finished model blocks never see later tokens, so their keys / values are final; each step
  recomputes only the model blocks that overlap the current sampler block (per row, so left padding is
  handled), and the result equals the uncached sampler.

`compile` (generation_compile.py) runs the forward through `torch.compile` with static shapes (whole
batch, block-sized windows) so that CUDA graphs can capture it; the tokens equal the eager sampler's.
Without it, an approximate cache's window step with every row in the forward goes through the same
static `static_forward` and, on CUDA, replays a CUDA graph captured the second time its shape is seen
(`CapturedStep`, no compilation): at 8B and batch 1 the eager window step is otherwise launch-bound.
Host syncs: one per step (whether any row still has work: which rows go into the forward, or, compiled,
whether the block is done), one per block (are all rows done; the exact cache adds its span), and the
streamer one per step.

Every row is decoded as if alone: left padding with an attention mask works in every mode and cache
setting, and a row leaves the forward batch once it has nothing left to commit in the current block
(threshold decoding, exhausted budget) or has finished (EOS to the end): it then costs no compute. With
`align_blocks`, rows whose left padding puts their block boundaries on different slots are decoded as separate
batches, one after the other (`_block_phase_groups`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import GenerationConfig
from transformers.utils import ModelOutput

from .cache import DLMKVCache
from .compiled_step import MAX_COMPILED_GRAPHS, StepGraphs, compiled_forward, resolve_compile, static_forward
from .configuration import DLM_GENERATION_FIELDS, EXTRA_GENERATE_KWARGS, DLMGenerationConfig
from .commit_rules import CommitSettings, block_candidates, decide_step
from .sampling import block_bounds, finished_rows, transfer_schedule


@dataclass
class DLMGenerateOutput(ModelOutput):
    """`generate(..., return_dict_in_generate=True)`: sequences (B, P + N); forward_batch_sizes: rows in
    each forward pass (CFG counts a row twice), so len() is the number of forward passes."""

    sequences: torch.LongTensor | None = None
    forward_batch_sizes: list[int] | None = None


class DLMGenerationMixin:
    """Adds `generate` to DLM models (named *GenerationMixin so transformers gives them a
    `generation_config`, which is always a `DLMGenerationConfig`: saved with its diffusion fields)."""

    @property
    def generation_config(self):
        return self.__dict__.get("_dlm_generation_config")

    @generation_config.setter
    def generation_config(self, value):
        # transformers (and from_pretrained) assign plain GenerationConfigs: keep the diffusion fields
        if value is not None and not isinstance(value, DLMGenerationConfig):
            value = DLMGenerationConfig.from_any(value, validate=False)
        self.__dict__["_dlm_generation_config"] = value

    def adjust_generation_fn(self, generation_config, from_auto_class, from_pipeline, pretrained_model_name_or_path,
                             cache_dir=None, force_download=False, proxies=None, local_files_only=False, token=None,
                             revision=None, subfolder="", trust_remote_code=None, **kwargs):
        """Called by `from_pretrained` (transformers' GenerationMixin hook): the checkpoint's
        generation_config.json, else the one built from the model config; `generation_config=` wins."""
        if generation_config is not None:
            self.generation_config = generation_config
            return
        if pretrained_model_name_or_path is None:
            return
        try:
            loaded = GenerationConfig.from_pretrained(
                pretrained_model_name_or_path, cache_dir=cache_dir, force_download=force_download, proxies=proxies,
                local_files_only=local_files_only, token=token, revision=revision, subfolder=subfolder,
                _from_auto=from_auto_class, _from_pipeline=from_pipeline)
        except OSError:
            return  # no generation_config.json: keep the one built from the model config
        self.generation_config = self.loaded_generation_config(loaded)

    def loaded_generation_config(self, loaded: GenerationConfig) -> GenerationConfig:
        """Hook for models whose checkpoints may carry a generation_config.json written for another sampler (the
        published families, `FamilyModelMixin`): the file as loaded -> the config to use. Default: the file."""
        return loaded

    @torch.no_grad()
    def generate(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None,
                 generation_config=None, streamer=None, callback=None, generator: torch.Generator | None = None,
                 **kwargs):
        """Prompt (B, P), left-padded with `attention_mask` for mixed lengths -> sequences
        (B * num_return_sequences, P + N), or a `DLMGenerateOutput` with `return_dict_in_generate=True`.

        kwargs override `generation_config` (default: `model.generation_config`) fields, see
        `DLMGenerationConfig`; an unknown keyword or an option the sampler cannot honour raises a
        ValueError naming it. streamer: a transformers streamer (`put` / `end`, batch 1) that receives
        the prompt, then the completion's committed left-to-right prefix as it grows. callback:
        `callback(canvas=(B, P + N) tensor, step=int, block=int)` after every forward pass (read-only
        canvas, for UIs that show intermediate states). generator: seeds Gumbel and random remasking."""
        base = generation_config if generation_config is not None else self.generation_config
        unknown = sorted(set(kwargs) - _known_generate_kwargs() - set(base.to_dict() if base is not None else ()))
        if unknown:
            raise ValueError(f"generate: unknown keyword argument(s) {unknown}; see DLMGenerationConfig "
                             "(hf_dlm/generation/configuration.py) for the supported options")
        for name in EXTRA_GENERATE_KWARGS:
            kwargs.pop(name, None)
        config = DLMGenerationConfig.from_any(base, **kwargs)
        config.max_new_tokens = _resolve_new_tokens(self, config, input_ids.shape[1], "max_length" in kwargs)
        copies = config.num_return_sequences or 1
        if copies > 1:  # transformers' order: the copies of a prompt are adjacent
            input_ids = input_ids.repeat_interleave(copies, dim=0)
            if attention_mask is not None:
                attention_mask = attention_mask.repeat_interleave(copies, dim=0)
        sequences, forward_batch_sizes = None, []
        for rows in _block_phase_groups(config, input_ids, attention_mask):
            sampler = DiffusionSampler(self, config, generator)
            if rows is None:
                sequences = sampler.run(input_ids, attention_mask, streamer, callback)
            else:  # rows whose padding puts their aligned blocks on other slots: decoded as another batch
                out = sampler.run(input_ids[rows], attention_mask[rows], streamer, callback)
                if sequences is None:
                    sequences = out.new_zeros(input_ids.shape[0], out.shape[1])
                sequences[rows] = out
            forward_batch_sizes += sampler.forward_batch_sizes
        if config.return_dict_in_generate:
            return DLMGenerateOutput(sequences=sequences, forward_batch_sizes=forward_batch_sizes)
        return sequences


def _block_phase_groups(config: DLMGenerationConfig, input_ids, attention_mask) -> list:
    """[None] (one batch), or with `align_blocks` and left padding that differs mod block_length between rows,
    the row indices of each group of rows whose aligned blocks fall on the same canvas slots."""
    if not config.align_blocks or attention_mask is None:
        return [None]
    phase = _pad_phases(attention_mask, input_ids.shape[1], _block_length(config))
    values = phase.unique()
    if values.numel() == 1:
        return [None]
    return [(phase == value).nonzero().squeeze(1) for value in values]


def _block_length(config: DLMGenerationConfig) -> int:
    return config.block_length or config.max_new_tokens or 64


def _pad_phases(attention_mask: torch.Tensor, prompt_len: int, block_length: int) -> torch.Tensor:
    """(B,) each row's left padding mod block_length: rows of one phase have their aligned blocks on the same slots."""
    return (prompt_len - attention_mask.sum(-1)) % block_length


def _known_generate_kwargs() -> set:
    return set(GenerationConfig().to_dict()) | set(DLM_GENERATION_FIELDS) | set(EXTRA_GENERATE_KWARGS)


def _resolve_new_tokens(model, config: DLMGenerationConfig, prompt_length: int, max_length_given: bool) -> int:
    """max_new_tokens, else max_length - prompt length when max_length was asked for (transformers'
    default of 20 is not taken as a request), else 64; the canvas must fit the model's positions."""
    if config.max_new_tokens is not None:
        new_tokens = config.max_new_tokens
    elif max_length_given or config.max_length not in (None, GenerationConfig().max_length or 20):
        new_tokens = int(config.max_length) - prompt_length
        if new_tokens < 1:
            raise ValueError(f"generate: max_length={config.max_length} leaves no room after the prompt of "
                             f"{prompt_length} tokens; raise max_length or set max_new_tokens")
    else:
        new_tokens = 64
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if limit is not None and prompt_length + new_tokens > limit:
        raise ValueError(f"generate: prompt ({prompt_length} tokens) + max_new_tokens ({new_tokens}) = "
                         f"{prompt_length + new_tokens} exceeds the model's max_position_embeddings ({limit})")
    return new_tokens


class DiffusionSampler:
    # eager cached window steps replay a CUDA graph on CUDA (`CapturedStep`); False: plain eager steps
    capture_steps: bool = True

    def __init__(self, model, config: DLMGenerationConfig, generator=None):
        self.model, self.config, self.generator = model, config, generator
        self.mask_id = config.mask_token_id if config.mask_token_id is not None else model.config.mask_token_id
        if self.mask_id is None:
            raise ValueError("generate needs mask_token_id (in the model config or the generation config)")
        eos = config.eos_token_id if config.eos_token_id is not None else getattr(model.config, "eos_token_id", None)
        self.eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        self.shift = int(getattr(model.config, "label_alignment", "same") == "shift")
        mode = getattr(model.config, "attention_mode", "bidirectional")
        self.exact_cache = config.cache != "none" and mode in ("block", "causal")
        self.cache_block = model.config.block_size if mode == "block" else 1
        self.forward_batch_sizes: list[int] = []
        self.compiled = None  # set by run() when config.compile asks for it
        self.cudagraphs = False  # the compiled forward brings its own CUDA graphs (reduce-overhead, cudagraphs)
        # cached window steps through `static_forward` need the backbone / LM-head split
        self.static_head = isinstance(getattr(model, "model", None), torch.nn.Module) and isinstance(
            getattr(model, "lm_head", None), torch.nn.Module)
        self.graphs = None  # StepGraphs, set by run()

    def _forward(self, tokens, attention_mask, cache, keep: tuple[int, int]) -> torch.Tensor:
        """Logits aligned to positions [keep[0], keep[1]) of `tokens` (shifted models: i - 1 predicts i,
        position 0 repeats its own row). Only those positions go through the LM head."""
        kwargs = {"kv_cache": cache} if cache is not None else {"attention_mask": attention_mask}
        lo, hi = keep[0] - self.shift, keep[1] - self.shift
        backbone, head = getattr(self.model, "model", None), getattr(self.model, "lm_head", None)
        if isinstance(backbone, torch.nn.Module) and isinstance(head, torch.nn.Module):
            hidden_states = backbone(input_ids=tokens, **kwargs).last_hidden_state
            logits = head(hidden_states[:, max(lo, 0) : hi])
        else:  # any module returning `.logits` (hand-built test models)
            logits = self.model(input_ids=tokens, **kwargs).logits[:, max(lo, 0) : hi]
        self.forward_batch_sizes.append(tokens.shape[0])
        return torch.cat([logits[:, :1], logits], dim=1) if lo < 0 else logits

    def _static_logits(self, x, mask, window, query, store):
        """Compiled sampler: logits (b, W, V) of the window through `static_forward` (every row)."""
        query_start = min(query[0], window[0] - self.shift)
        device = x.device
        positions = self.static_positions.repeat(x.shape[0] // self.static_positions.shape[0], 1)
        tensors = dict(input_ids=x, position_ids=positions,
                       key_padding=None if self.static_unpadded and not self.cudagraphs else mask,
                       key_position_ids=positions,
                       head_index=(torch.arange(window[0], window[1], device=device) - self.shift - query_start).clamp(min=0))
        if self.config.cache == "none" or query_start == 0:
            if self.config.cache != "none" and store:
                logits, keys, values = self._call_compiled(tensors, return_kv=True)
                if self.static_past is None:
                    self.static_past = (keys.clone(), values.clone())
                else:
                    self.static_past[0].copy_(keys)
                    self.static_past[1].copy_(values)
            else:
                logits = self._call_compiled(tensors)
        else:
            tensors.update(input_ids=x[:, query_start : query[1]], position_ids=positions[:, query_start : query[1]],
                           slots=torch.arange(query_start, query[1], device=device))
            # in place: Inductor's own CUDA graphs would skip a graph that mutates an input
            logits = self._call_compiled(tensors, past=self.static_past, in_place=not self.cudagraphs)
        self.forward_batch_sizes.append(x.shape[0])
        return logits.clone() if self.cudagraphs else logits  # a graph's output is overwritten by its next replay

    def _call_compiled(self, tensors, **fixed):
        # every static shape (batch, canvas, each prefix-cache block) is one graph of the same function:
        # past Dynamo's default limit of 8 it would silently run eager
        with torch._dynamo.config.patch(recompile_limit=MAX_COMPILED_GRAPHS):
            if self.cudagraphs:  # Inductor's / Dynamo's own CUDA graphs
                torch.compiler.cudagraph_mark_step_begin()
                return self.compiled(self.model, **tensors, **fixed)
            return self.graphs(self.compiled, tensors, **fixed)  # hf-dlm's graphs around Inductor's kernels

    def _logits(self, canvas, rows, window, query, key_end, store):
        """Guided logits (b, W, V) for the canvas positions `window` of the rows `rows` (None: all rows,
        through the compiled forward)."""
        cfg, batch = self.config, canvas.shape[0]
        every = slice(None) if rows is None else rows
        x, mask = canvas[every], self.full_mask[every]
        if cfg.cfg_scale:  # unconditional copy: the prompt masked; both go through one forward
            x = torch.cat([x, x.masked_fill(self.prompt_tokens[every], self.mask_id)])
            mask = torch.cat([mask, mask])
            rows = None if rows is None else torch.cat([rows, rows + batch])
        if rows is None:
            logits = self._static_logits(x, mask, window, query, store)
        elif self.cache is None:
            logits = self._forward(x, mask, None, window)
        else:
            query_start = min(query[0], window[0] - self.shift)
            all_rows = rows.numel() == self.cache.full_attention_mask.shape[0]
            if all_rows and not store and not self.exact_cache and self.static_head:
                logits = self._window_step(x, window, query_start, query[1])
                return logits if not cfg.cfg_scale else self._guided(logits)
            self.cache.window(query_start, key_end, store, None if all_rows else rows)
            keep = (window[0] - query_start, window[1] - query_start)
            logits = self._forward(x[:, query_start : query[1]], None, self.cache, keep)
        return logits if not cfg.cfg_scale else self._guided(logits)

    def _guided(self, logits):
        cond, uncond = logits.chunk(2)
        return uncond + (self.config.cfg_scale + 1) * (cond - uncond)

    def _window_step(self, x, window, query_start, query_end):
        """An approximate cache's window step with every row in the forward: `static_forward` against the
        stored keys / values (the refresh at the block start wrote them), the same shapes at every step
        of a block. On CUDA the second step of a shape captures it as a CUDA graph (`CapturedStep`) and
        later steps replay it: one launch instead of ~45 per layer, no host work per kernel."""
        device = x.device
        positions = self.cache.full_position_ids
        tensors = dict(
            input_ids=x[:, query_start:query_end], position_ids=positions[:, query_start:query_end],
            key_padding=self.cache_key_padding, key_position_ids=positions,
            head_index=(torch.arange(window[0], window[1], device=device) - self.shift - query_start).clamp(min=0),
            slots=torch.arange(query_start, query_end, device=device),
        )
        layers = self.cache.layers
        past = ([layers[i][0] for i in range(len(layers))], [layers[i][1] for i in range(len(layers))])
        self.forward_batch_sizes.append(x.shape[0])
        return self.graphs(static_forward, tensors, past=past, in_place=True)

    def run(self, input_ids, attention_mask, streamer, callback):
        cfg, mask_id = self.config, self.mask_id
        batch, prompt_len = input_ids.shape
        new_tokens, block_length = cfg.max_new_tokens or 64, _block_length(cfg)
        if streamer is not None and batch != 1:
            raise ValueError("generate(streamer=...) streams one sequence; pass a batch of 1 or use callback")
        phase = None
        if cfg.align_blocks:  # every row's left padding must put block boundaries on the same canvas slots
            phases = {0} if attention_mask is None else set(_pad_phases(attention_mask, prompt_len, block_length).tolist())
            if len(phases) > 1:
                raise ValueError("align_blocks: the rows' padding puts their block boundaries on different slots; "
                                 "generate() decodes such rows in groups (DiffusionSampler.run takes one group)")
            phase = phases.pop()
        elif new_tokens % block_length:
            raise ValueError(f"max_new_tokens ({new_tokens}) must be a multiple of block_length ({block_length})")
        blocks, total = block_bounds(prompt_len, new_tokens, block_length, phase)
        num_blocks = len(blocks)
        if cfg.steps is not None and cfg.steps % num_blocks:
            raise ValueError(f"steps ({cfg.steps}) must be a multiple of the number of blocks ({num_blocks})")
        steps_per_block = block_length if cfg.steps is None else cfg.steps // num_blocks
        limit = getattr(self.model.config, "max_position_embeddings", None)
        if limit is not None and total > limit:
            raise ValueError(f"generate(align_blocks=True): the canvas, extended to the end of its last block, has "
                             f"{total} positions, over the model's max_position_embeddings ({limit})")

        device, out_end = input_ids.device, prompt_len + new_tokens
        canvas = torch.full((batch, total), mask_id, dtype=torch.long, device=device)
        canvas[:, :prompt_len] = input_ids
        self.full_mask = torch.ones_like(canvas)
        if attention_mask is not None:
            self.full_mask[:, :prompt_len] = attention_mask
        self.prompt_tokens = torch.zeros_like(canvas, dtype=torch.bool)
        self.prompt_tokens[:, :prompt_len] = self.full_mask[:, :prompt_len].bool()
        infill = bool((canvas[:, :prompt_len].eq(mask_id) & self.prompt_tokens[:, :prompt_len]).any())
        settings = CommitSettings.from_config(cfg)
        if infill and (settings.sub_block_length or settings.first_token_alone):
            raise ValueError("sub_block_length / first_token_alone decide a block's masks in order; masks inside the "
                             "prompt (infilling) are not supported with them")
        if infill and cfg.cache != "none":
            raise ValueError("masks inside the prompt (infilling) need cache='none': cached steps never revisit the prompt")
        choice = resolve_compile(cfg.compile, device)
        if choice is not None:
            if infill or self.exact_cache or cfg.align_blocks:
                raise ValueError("generate(compile=...) supports neither infilling (masks inside the prompt), the "
                                 "exact cache of attention_mode='block' / 'causal' models nor align_blocks (blocks of "
                                 "several sizes); use compile=None there")
            if not (isinstance(getattr(self.model, "model", None), torch.nn.Module)
                    and isinstance(getattr(self.model, "lm_head", None), torch.nn.Module)):
                raise ValueError("generate(compile=...) needs a DLM with .model (backbone) and .lm_head")
            self.compiled = compiled_forward(self.model, choice)
            self.cudagraphs = choice in ("reduce-overhead", "max-autotune", "cudagraphs") and device.type == "cuda"
            self.static_positions = (self.full_mask.cumsum(-1) - 1).clamp(min=0)
            self.static_unpadded = bool(self.full_mask.all())  # no padding: no mask (SDPA's fastest kernels)
            self.static_past = None
        self.graphs = StepGraphs(self.model, enabled=device.type == "cuda" and self.capture_steps
                                 and not self.cudagraphs and choice != "eager")
        self.cache = None
        if cfg.cache != "none" and self.compiled is None:
            positions = (self.full_mask.cumsum(-1) - 1).clamp(min=0)
            repeat = 2 if cfg.cfg_scale else 1
            self.cache = DLMKVCache(self.full_mask.repeat(repeat, 1), positions.repeat(repeat, 1))
            # no padding anywhere: window steps pass no mask (SDPA's fast kernels, nothing to sync on)
            self.cache_key_padding = None if bool(self.full_mask.all()) else self.cache.full_attention_mask
            pads = (prompt_len - self.full_mask[:, :prompt_len].sum(-1)).view(-1, 1)  # (B, 1) left pads per row
        eos_ids = torch.tensor(self.eos_ids, device=device)
        if streamer is not None:
            streamer.put(input_ids.cpu())
        streamed, step_count, query_floor = 0, 0, 0
        done = torch.zeros(batch, dtype=torch.bool, device=device)
        parallel = settings.count_rule != "budget"  # the rule decides how many: the block runs until it is done
        editing = settings.editing_threshold is not None

        for block, (start, end, offset) in enumerate(blocks):
            window = (0 if infill else start, end)  # positions this block's steps may commit
            # LLaDA's budget counts the block's masks; infilling masks of the prompt are eligible too, so
            # they join the budget (LLaDA would leave masks behind when they take the block's share)
            budget = transfer_schedule(canvas[:, window[0] : end].eq(mask_id).sum(1), steps_per_block, cfg.schedule,
                                       cfg.schedule_eps)
            if self.exact_cache:  # the model blocks overlapping this sampler block, per row
                size = self.cache_block
                block_start = pads + torch.div(start - pads, size, rounding_mode="floor") * size
                block_end = pads + (torch.div(end - 1 - pads, size, rounding_mode="floor") + 1) * size
                query_lo, key_end = int(block_start.min()), min(total, int(block_end.max()))
            step = forwards = 0
            # compiled, budget rules: `done` and the budgets are fixed within a block, so which steps have work is
            # read once here; a read per step makes the host wait for the device before it queues the next step
            busy_steps = None
            if self.compiled is not None and not parallel:
                busy_steps = ((budget > 0) & ~done.unsqueeze(1)).any(0).tolist()  # the block's one host sync
            credit = None  # dInfer's credit (credit_alpha): (batch, W, V), zeros at every block start
            if editing:  # LLaDA2.1: a block ends at a mask-free step without edits, or after max_post_steps of them
                settled = torch.zeros_like(done)
                post_steps = torch.zeros(batch, dtype=torch.long, device=device)
            while parallel or step < steps_per_block:
                # rows with something to commit in this block; the others leave the forward batch
                if not parallel:
                    active = ~done & (budget[:, step] > 0)
                else:
                    has_masks = canvas[:, window[0] : end].eq(mask_id).any(1)
                    active = ~done & (has_masks | ~settled if editing else has_masks)
                if self.compiled is not None:  # static shapes: every row goes through the forward
                    has_work = busy_steps[step] if busy_steps is not None else bool(active.any())  # a host sync
                    rows = None if has_work else active.new_zeros(0)
                else:
                    rows = active.nonzero().squeeze(1)  # the step's one host sync
                if rows is not None and rows.numel() == 0:
                    if parallel:
                        break
                    step += 1  # budget exhausted for every row: LLaDA's step commits nothing
                    continue
                if cfg.cache == "none":
                    query, k_end, store = (0, total), total, False
                elif self.exact_cache:
                    query, k_end, store = (query_floor if not forwards else query_lo, key_end), key_end, True
                elif not forwards:  # Fast-dLLM: refresh every position's keys / values at the block's first forward
                    query, k_end, store = (0, total), total, True
                elif cfg.cache == "dual":
                    query, k_end, store = (start, end), total, False
                else:  # prefix: the block and everything after it are recomputed
                    query, k_end, store = (start, total), total, False
                logits = self._logits(canvas, rows, window, query, k_end, store)
                forwards += 1  # not `step`: a step of count 0 (Dream's schedule) runs no forward
                if rows is None:  # compiled: every row; rows with nothing to commit stay as they are
                    rows = slice(None)
                current = canvas[rows, window[0] : window[1]]
                masks = current.eq(mask_id)
                candidates = block_candidates(masks, offset, settings)  # the window is the block unless infilling
                editable = None
                if editing:  # committed tokens of the current block (never the prompt: the block starts after it)
                    editable = ~masks
                    editable[:, : start - window[0]] = False
                row_budget = None if parallel else budget[rows, step]
                row_credit = None
                if settings.credit_alpha is not None:
                    if credit is None:
                        credit = logits.new_zeros((batch, *logits.shape[1:]), dtype=torch.float32)
                    row_credit = credit[rows]  # a copy for an index tensor: written back below
                tokens, edited = decide_step(logits, current, candidates, settings, row_budget, self.generator, editable,
                                             mask_id, row_credit, choice)
                if row_credit is not None:
                    credit[rows] = row_credit
                if isinstance(rows, slice):
                    tokens = torch.where(active.unsqueeze(1), tokens, current)
                canvas[rows, window[0] : window[1]] = tokens
                if editing:
                    began_free = torch.zeros_like(done)
                    began_free[rows] = ~masks.any(1)
                    began_free &= active
                    post_steps += began_free.long()
                    row_edited = torch.zeros_like(done)
                    row_edited[rows] = edited
                    settled |= began_free & (~row_edited | (post_steps >= cfg.max_post_steps))
                step, step_count = step + 1, step_count + 1
                if callback is not None:
                    callback(canvas=canvas, step=step_count, block=block)
                if streamer is not None:
                    pending = canvas[0, prompt_len:out_end].eq(mask_id).nonzero()
                    ready = int(pending[0]) if len(pending) else new_tokens
                    if editing:  # the current block's tokens may still be edited: stream finished blocks only
                        ready = min(ready, start - prompt_len)
                    if ready > streamed:
                        streamer.put(canvas[0, prompt_len + streamed : prompt_len + ready].cpu())
                        streamed = ready
            if editing and streamer is not None and min(end, out_end) - prompt_len > streamed:  # the block is settled
                streamer.put(canvas[0, prompt_len + streamed : min(end, out_end)].cpu())
                streamed = min(end, out_end) - prompt_len
            if self.exact_cache:
                query_floor = query_lo
            if cfg.stop_on_eos and self.eos_ids and end < out_end:
                newly = finished_rows(canvas[:, start:end], eos_ids) & ~done
                # LLaDA-style models pad the answer with EOS: the rest of the row is EOS (no host sync)
                tail = canvas[:, end:]
                canvas[:, end:] = tail.masked_fill(tail.eq(mask_id) & newly.unsqueeze(1), self.eos_ids[0])
                done |= newly
                if bool(done.all()):  # the block's one host sync
                    break
        if streamer is not None:
            if streamed < new_tokens:
                streamer.put(canvas[0, prompt_len + streamed : out_end].cpu())
            streamer.end()
        return canvas[:, :out_end]
