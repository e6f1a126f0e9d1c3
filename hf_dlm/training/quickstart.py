"""The main job on an embedded default: a tiny DLM trained on CPU on Python's own documentation.

corpus -> byte-level BPE tokenizer -> packed windows -> masked-diffusion training (time-bounded, with a
progress bar) -> held-out ELBO before and after -> `save_pretrained` -> reload through
`AutoModelForMaskedLM` -> a sample from the low-confidence sampler.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from ..modeling import DLMConfig, DLMForDiffusionLM
from ..data.corpus import split_documents, stdlib_documents, train_bpe_tokenizer
from ..diffusion.elbo import elbo_nll
from ..data.memory_dataset import pack_documents
from ..diffusion.objective import MaskedDiffusionObjective


@dataclass
class QuickstartConfig:
    output_dir: str = "outputs/quickstart"
    max_seconds: float = 170.0
    max_steps: int = 100_000
    vocab_size: int = 2048  # whole-word BPE tokens: 384 gave sub-word fragments ("Thhess the *he")
    seq_len: int = 128
    batch_size: int = 16
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    learning_rate: float = 3e-3
    warmup_steps: int = 30
    eval_windows: int = 64
    mc_num: int = 8
    objective_preset: str = "mdlm"
    seed: int = 0
    prompt: str = "The for statement is used to"
    max_new_tokens: int = 32
    # the sample: blocks of 4, Gumbel sampling at T 0.8 among the 40 likeliest tokens (seeded); greedy
    # low-confidence decoding of a model this small repeats its likeliest token ("the the the ...")
    sample_block_length: int = 4
    sample_temperature: float = 0.8
    sample_top_k: int = 40
    threads: int | None = None


def pack_windows(tokenizer, docs: list[str], seq_len: int) -> torch.Tensor:
    """Documents joined by EOS and cut into (N, seq_len) windows."""
    encoded = tokenizer(docs, add_special_tokens=False)["input_ids"]
    return pack_documents(encoded, seq_len, tokenizer.eos_token_id)[0]


def run_quickstart(cfg: QuickstartConfig, log=print) -> dict:
    """Everything, corpus to sample, within about `cfg.max_seconds`: training gets what the corpus, the
    two held-out evaluations, the save and the sample leave (the last three estimated from the first
    evaluation and a timed sampler forward)."""
    run_start = time.perf_counter()
    torch.manual_seed(cfg.seed)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    log("building the corpus from Python's own documentation ...")
    train_docs, heldout_docs = split_documents(stdlib_documents())
    tokenizer = train_bpe_tokenizer(train_docs, cfg.vocab_size)
    train = pack_windows(tokenizer, train_docs, cfg.seq_len)
    heldout = pack_windows(tokenizer, heldout_docs, cfg.seq_len)[: cfg.eval_windows]
    log(f"corpus: {len(train_docs)} train / {len(heldout_docs)} held-out documents, "
        f"{train.numel():,} train tokens, vocab {len(tokenizer)}")

    config = DLMConfig(
        vocab_size=len(tokenizer), hidden_size=cfg.hidden_size, intermediate_size=3 * cfg.hidden_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, qk_norm=True,
        max_position_embeddings=cfg.seq_len * 2, tie_word_embeddings=True,
        mask_token_id=tokenizer.mask_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config._attn_implementation = "sdpa"
    model = DLMForDiffusionLM(config)
    objective = MaskedDiffusionObjective.from_model_config(config, preset=cfg.objective_preset,
                                                           seed=cfg.seed)
    n_params = sum(p.numel() for p in model.parameters())
    model.eval()
    eval_start = time.perf_counter()
    before = elbo_nll(model, heldout, mc_num=cfg.mc_num, seed=cfg.seed, subs=objective.subs)["nll_per_token"]
    eval_seconds = time.perf_counter() - eval_start
    log(f"model: {n_params / 1e6:.2f}M parameters; held-out ELBO at init: {before:.3f} nats/token")
    with torch.no_grad():  # one sampler forward, to budget the sample (one forward per new token)
        probe = torch.zeros(1, cfg.seq_len // 4 + cfg.max_new_tokens, dtype=torch.long)
        forward_start = time.perf_counter()
        model(input_ids=probe)
        sample_seconds = (time.perf_counter() - forward_start) * cfg.max_new_tokens
    finish_seconds = eval_seconds + sample_seconds + 1.0  # + save and reload
    setup_seconds = time.perf_counter() - run_start
    train_budget = max(0.0, cfg.max_seconds - setup_seconds - finish_seconds)

    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, betas=(0.9, 0.95), weight_decay=0.1)
    order = torch.randperm(train.shape[0], generator=torch.Generator().manual_seed(cfg.seed))
    model.train()
    start, step, losses = time.perf_counter(), 0, []
    bar = tqdm(total=int(train_budget), unit="s", desc="training", bar_format="{l_bar}{bar}| {n:.0f}/{total}s {postfix}")
    while step < cfg.max_steps and (elapsed := time.perf_counter() - start) < train_budget:
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
        if step % 10 == 0:
            bar.set_postfix(step=step, loss=f"{sum(losses[-50:]) / len(losses[-50:]):.3f}", refresh=False)
            bar.update(min(time.perf_counter() - start, bar.total) - bar.n)  # never past the total
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
    result = {
        "steps": step, "train_seconds": round(train_seconds, 1), "tokens_seen": step * cfg.batch_size * cfg.seq_len,
        "heldout_elbo_before": round(before, 4), "heldout_elbo_after": round(after, 4),
        "relative_drop": round(1 - after / before, 4), "checkpoint": cfg.output_dir,
        "prompt": cfg.prompt, "sample": sample, "total_seconds": round(time.perf_counter() - run_start, 1),
        "budget": {"setup_seconds": setup_seconds, "train_seconds": train_budget, "finish_seconds": finish_seconds},
    }
    log(f"trained {step} steps in {train_seconds:.0f}s; held-out ELBO {before:.3f} -> {after:.3f} nats/token "
        f"({100 * result['relative_drop']:.1f}% lower)")
    log(f"checkpoint: {cfg.output_dir} (loads with AutoModelForMaskedLM.from_pretrained)")
    log(f"sample: {cfg.prompt!r} -> {sample!r}")
    return result
