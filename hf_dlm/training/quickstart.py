"""The main job on an embedded default: a tiny DLM trained on CPU, offline, on short English stories.

stories from a small grammar (data/simple_english.py) + a word-level tokenizer -> packed windows ->
masked-diffusion training
(bounded by the wall clock, with a progress bar) -> held-out ELBO before and after -> `save_pretrained`
-> reload through `AutoModelForMaskedLM` -> a sample from the low-confidence sampler.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from ..data.corpus import cached_prose_corpus, corpus_words
from ..data.simple_english import stories_corpus
from ..data.memory_dataset import pack_documents
from ..diffusion.elbo import elbo_nll
from ..diffusion.objective import MaskedDiffusionObjective
from ..modeling import DLMConfig, DLMForDiffusionLM
from ..utils.errors import FieldError


@dataclass
class QuickstartConfig:
    output_dir: str = "outputs/quickstart"
    max_seconds: float = 220.0
    max_steps: int = 100_000
    corpus: str = "stories"  # or "python-docs" (Python's own prose: harder, learns word frequencies only)
    vocab_size: int = 1024  # word-level: every token a word, so even a weak model samples words
    # 32-token windows and 2 layers: 4x the steps of 64 and 4 in the same time, and a tiny model uses little
    # context beyond a sentence (150 s of one thread at load ~4.5: 675 steps, held-out ELBO -51%, against 185
    # steps, -28%, still at the word-frequency level)
    seq_len: int = 32
    batch_size: int = 32
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    learning_rate: float = 3e-3
    warmup_steps: int = 30
    eval_windows: int = 64  # 64 x 32 held-out tokens x 4 mask draws: a few seconds, seeded, the same draws twice
    mc_num: int = 4
    seed: int = 0
    prompt: str = "The old man"
    max_new_tokens: int = 32
    # the sample: blocks of 4, Gumbel sampling at T 0.8 among the 40 likeliest tokens (seeded); greedy
    # low-confidence decoding of a model this small repeats its likeliest phrases ("the woman gave the
    # king. the old fisherman gave the young fisherman the book. the woman gave the king. ..."); T 0.3-0.5
    # or blocks of 8-32 read no better (measured on one checkpoint, three seeds each)
    sample_block_length: int = 4
    sample_temperature: float = 0.8
    sample_top_k: int = 40
    threads: int | None = None  # None: what trains fastest on a shared machine (see choose_threads)
    corpus_max_files: int | None = None  # python-docs: read only the first N standard-library files (tests)
    cache_dir: str | None = None  # python-docs corpus + tokenizer cache (default: $HF_DLM_CACHE or ~/.cache/hf_dlm)
    min_elbo_drop: float = 0.3  # below this relative drop the run counts as too short to learn
    allow_undertrained: bool = False  # exit 0 even when the run trained too little


def choose_threads(cpus: int | None = None, load: float | None = None) -> int:
    """Threads for a small model on a possibly shared machine: the cores that other processes leave idle.

    torch's default (one thread per core) oversubscribes a busy machine: its threads wait for each other
    at every op, and on 2 cores with one busy process a step took 4.3 s with 2 threads against 0.27 s with
    1 (issue 29). The 1-minute load average, read before this process starts working, counts the busy ones.
    """
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if load is None:
        try:
            load = os.getloadavg()[0]
        except OSError:  # not on this platform: assume a shared machine
            load = cpus - 1
    return max(1, min(cpus, int(cpus - load + 0.5)))


def process_seconds() -> float:
    """Seconds since this process started (imports included), so `max_seconds` bounds the whole command;
    0 where /proc is unavailable."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = float(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


def pack_windows(tokenizer, docs: list[str], seq_len: int) -> torch.Tensor:
    """Documents joined by EOS and cut into (N, seq_len) windows."""
    encoded = tokenizer(docs, add_special_tokens=False)["input_ids"]
    return pack_documents(encoded, seq_len, tokenizer.eos_token_id)[0]


def run_quickstart(cfg: QuickstartConfig, log=print, started_at: float | None = None) -> dict:
    """Everything, corpus to sample, within `cfg.max_seconds` counted from `started_at` (a
    `time.perf_counter()` value; the command passes its process start, default now): training gets
    what the corpus, the two held-out evaluations, the save and the sample leave (the last three estimated
    from the first evaluation and a timed sampler forward). result["undertrained"] says whether the
    held-out ELBO fell by less than `cfg.min_elbo_drop`."""
    run_start = time.perf_counter() if started_at is None else started_at
    if cfg.corpus not in ("stories", "python-docs"):
        raise FieldError("corpus", f"--corpus must be 'stories' or 'python-docs', got {cfg.corpus!r}", cfg.corpus)
    threads = cfg.threads or choose_threads()
    torch.set_num_threads(threads)
    torch.manual_seed(cfg.seed)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    log(f"{threads} thread(s) on {os.cpu_count()} cores (1-minute load average {load:.1f}; --threads to change)")
    if cfg.corpus == "stories":
        corpus = stories_corpus(cfg.vocab_size)
    else:
        corpus = cached_prose_corpus(cfg.vocab_size, cfg.cache_dir, cfg.corpus_max_files)
    tokenizer = corpus["tokenizer"]
    train = pack_documents(corpus["train_ids"], cfg.seq_len, tokenizer.eos_token_id)[0]
    heldout = pack_documents(corpus["heldout_ids"], cfg.seq_len, tokenizer.eos_token_id)[0][: cfg.eval_windows]
    unknown = float((heldout == tokenizer.unk_token_id).float().mean())
    log(f"corpus: {corpus['source']}, {train.numel():,} train / {heldout.numel():,} held-out tokens; "
        f"word-level vocabulary of {len(tokenizer)} (words, punctuation, specials; {100 * unknown:.1f}% of "
        "held-out tokens unknown)")

    config = DLMConfig(
        vocab_size=len(tokenizer), hidden_size=cfg.hidden_size, intermediate_size=3 * cfg.hidden_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, qk_norm=True,
        max_position_embeddings=max(cfg.seq_len, 256), tie_word_embeddings=True,
        mask_token_id=tokenizer.mask_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config._attn_implementation = "sdpa"
    model = DLMForDiffusionLM(config)
    # MDLM's linear schedule and antithetic t, each row's masked CE averaged over its masked tokens (L / k,
    # "measured"): the same ELBO in expectation as 1 / t weighting, with less variance from the masked count
    objective = MaskedDiffusionObjective.from_model_config(config, preset="mdlm", weighting="measured",
                                                           seed=cfg.seed)
    n_params = sum(p.numel() for p in model.parameters())
    model.eval()
    eval_start = time.perf_counter()
    before = elbo_nll(model, heldout, mc_num=cfg.mc_num, seed=cfg.seed, subs=objective.subs)["nll_per_token"]
    eval_seconds = time.perf_counter() - eval_start
    log(f"model: {n_params / 1e6:.2f}M parameters; held-out ELBO at init: {before:.3f} nats/token")
    with torch.no_grad():  # one sampler forward, to budget the sample (one forward per new token)
        prompt_ids = tokenizer(cfg.prompt, return_tensors="pt")["input_ids"]
        probe = torch.zeros(1, prompt_ids.shape[1] + cfg.max_new_tokens, dtype=torch.long)
        forward_start = time.perf_counter()
        model(input_ids=probe)
        sample_seconds = (time.perf_counter() - forward_start) * cfg.max_new_tokens
    # the final evaluation, sample, save and reload, with headroom: on a busy machine a second evaluation
    # took up to twice the first (measured: 237 s for a 220 s budget with 1x)
    finish_seconds = 2 * eval_seconds + sample_seconds + 3.0
    setup_seconds = time.perf_counter() - run_start
    train_budget = max(0.0, cfg.max_seconds - setup_seconds - finish_seconds)

    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, betas=(0.9, 0.95), weight_decay=0.1)
    order = torch.randperm(train.shape[0], generator=torch.Generator().manual_seed(cfg.seed))
    model.train()
    start, step, losses, step_seconds = time.perf_counter(), 0, [], 0.0
    bar = tqdm(total=max(1, round(train_budget)), unit="s", desc="training",
               bar_format="{l_bar}{bar}| {n:.0f}/{total}s {postfix}")
    # a step starts only if it can end within the budget (the last one's duration as the estimate)
    while step < cfg.max_steps and (elapsed := time.perf_counter() - start) + step_seconds < train_budget:
        step_start = time.perf_counter()
        # warmup then cosine decay over the time budget
        progress = min(elapsed / max(train_budget, 1e-9), 1.0)
        lr = cfg.learning_rate * min(1.0, (step + 1) / cfg.warmup_steps) * 0.5 * (1 + math.cos(math.pi * progress))
        for group in optimizer.param_groups:
            group["lr"] = max(lr, cfg.learning_rate * 0.02)
        draw = torch.arange(step * cfg.batch_size, (step + 1) * cfg.batch_size)
        batch = train[order[draw % train.shape[0]]]
        loss, _ = objective(model, batch, sample_index=draw)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        step += 1
        step_seconds = time.perf_counter() - step_start
        if step % 10 == 0:
            bar.set_postfix(step=step, loss=f"{sum(losses[-50:]) / len(losses[-50:]):.3f}", refresh=False)
            bar.update(min(time.perf_counter() - start, bar.total) - bar.n)  # never past the total
    bar.set_postfix(step=step, refresh=False)
    bar.update(bar.total - bar.n)  # done: the budget (or max_steps) is used up
    bar.close()
    train_seconds = time.perf_counter() - start

    model.eval()
    after = elbo_nll(model, heldout, mc_num=cfg.mc_num, seed=cfg.seed, subs=objective.subs)["nll_per_token"]
    model.save_pretrained(cfg.output_dir)
    tokenizer.save_pretrained(cfg.output_dir)

    from transformers import AutoModelForMaskedLM, AutoTokenizer

    loaded = AutoModelForMaskedLM.from_pretrained(cfg.output_dir).eval()
    loaded_tokenizer = AutoTokenizer.from_pretrained(cfg.output_dir)
    prompt = loaded_tokenizer(cfg.prompt, return_tensors="pt")["input_ids"]
    sequences = loaded.generate(prompt, max_new_tokens=cfg.max_new_tokens, steps=cfg.max_new_tokens,
                                block_length=cfg.sample_block_length, temperature=cfg.sample_temperature,
                                top_k=cfg.sample_top_k, generator=torch.Generator().manual_seed(cfg.seed))
    sample = loaded_tokenizer.decode(sequences[0, prompt.shape[1]:], skip_special_tokens=True)
    words = corpus_words(sample)
    drop = 1 - after / before
    result = {
        "steps": step, "train_seconds": round(train_seconds, 1), "tokens_seen": step * cfg.batch_size * cfg.seq_len,
        "threads": threads, "load_average": round(load, 2), "corpus": cfg.corpus, "vocab_size": len(tokenizer),
        "heldout_tokens": heldout.numel(), "heldout_unknown_share": round(unknown, 4),
        "heldout_elbo_before": round(before, 4), "heldout_elbo_after": round(after, 4),
        "relative_drop": round(drop, 4), "undertrained": drop < cfg.min_elbo_drop, "checkpoint": cfg.output_dir,
        "prompt": cfg.prompt, "sample": sample,
        "sample_corpus_word_share": round(sum(w in corpus["words"] for w in words) / max(1, len(words)), 3),
        "total_seconds": round(time.perf_counter() - run_start, 1),
        "budget": {"setup_seconds": setup_seconds, "train_seconds": train_budget, "finish_seconds": finish_seconds},
    }
    log(f"trained {step} steps in {train_seconds:.0f}s; held-out ELBO {before:.3f} -> {after:.3f} nats/token "
        f"({100 * drop:.1f}% lower)")
    log(f"checkpoint: {cfg.output_dir} (loads with AutoModelForMaskedLM.from_pretrained)")
    log(f"sample: {cfg.prompt!r} -> {sample!r}")
    if result["undertrained"]:
        log(f"too little training to learn: the held-out ELBO fell {100 * drop:.1f}%, less than "
            f"{100 * cfg.min_elbo_drop:.0f}% ({step} steps in {train_seconds:.0f}s, {threads} thread(s), load "
            f"{load:.1f}); give it more time (--max-seconds), free the cores, or pass --allow-undertrained")
    return result
