"""Sampler throughput on a DLM trained here with hf-dlm: the reference loop against threshold decoding, the
Fast-dLLM caches and the compiled (CUDA-graph) sampler. One command, training included (~200 s on an H200).

1. Trains a small bidirectional DLM (hf-dlm model + MaskedDiffusionObjective, bf16 autocast) for
   `--train-seconds` on a mix of the stdlib corpus and a synthetic COPY TASK whose completion is
   predictable from the prompt, so that a confident model exists to decode in parallel: the prompt
   `n1 ... nm repeat: w1 ... w7 |` (a preamble of 0-16 random words that only varies the length, then 7
   distinct words of a fixed list of 42) is continued by ` w1 ... w7 | w1 ... w7 | ...` (period 8 tokens;
   training: the prompt is never masked, as in SFT).
2. Two held-out prompt sets, each left-padded to one width (so every batch has the same canvas shape):
   `task`: new copy-task instances (their word lists never occur in training), mixed lengths;
   `docs`: openings (16 to `--prompt-width` tokens) of held-out stdlib documents, as in the first run.
3. For each set, batch size (1: the first prompt alone, padded like the batch; 16: the whole set) and
   mode, one timed `generate` (after an untimed warm-up of every shape): tokens/s, forward passes per
   generated token and token agreement with the reference loop on the same batch. Timing runs in bf16
   autocast. Agreement is also measured in float32 (eager modes, largest batch), where near-ties of bf16
   no longer flip greedy choices, and the noise floor is the reference loop's own agreement between a
   prompt inside the batch and the same prompt alone (bf16; alone both with the batch's padding and
   without padding).
4. Writes `generation_throughput.json` and `generation_throughput.md` to `--out`.

    PYTHONPATH=$PWD PYTHONUNBUFFERED=1 python benchmarks/generation_throughput.py --out results/
    PYTHONPATH=$PWD python benchmarks/generation_throughput.py --tiny --out results-tiny/  # CPU smoke run, ~35 s
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch
from tqdm.auto import tqdm

from hf_dlm.modeling import DLMConfig, DLMForDiffusionLM
from hf_dlm.data.corpus import split_documents, stdlib_documents, train_bpe_tokenizer
from hf_dlm.diffusion.objective import MaskedDiffusionObjective
from hf_dlm.training.quickstart import pack_windows

WORDS = ("file list value name string object type data class function module number error line path key time "
         "test index result method default argument return set dict text code format item node user size mode "
         "case field table view state event order group").split()
EAGER_MODES = {  # name -> generate kwargs on top of the shared ones
    "reference (1 token/step)": dict(threshold=None, cache="none"),
    "threshold": dict(cache="none"),
    "threshold + prefix cache": dict(cache="prefix"),
    "threshold + dual cache": dict(cache="dual"),
}
COMPILED_MODES = {  # the prefix cache's query width changes per block: one graph each, so it is left out
    "reference, compiled": dict(threshold=None, cache="none"),
    "threshold, compiled": dict(cache="none"),
    "threshold + dual cache, compiled": dict(cache="dual"),
}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: small model, short training and generation")
    p.add_argument("--train-seconds", type=float, default=90.0, help="training time budget")
    p.add_argument("--hidden-size", type=int, default=512, help="model width")
    p.add_argument("--num-layers", type=int, default=6, help="decoder layers")
    p.add_argument("--num-heads", type=int, default=8, help="attention heads")
    p.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary")
    p.add_argument("--seq-len", type=int, default=384, help="training window length")
    p.add_argument("--batch-size", type=int, default=64, help="training micro-batch")
    p.add_argument("--task-fraction", type=float, default=0.5, help="share of copy-task rows in each training batch")
    p.add_argument("--learning-rate", type=float, default=2e-3, help="peak AdamW learning rate")
    p.add_argument("--gen-length", type=int, default=256, help="generated tokens per prompt")
    p.add_argument("--block-length", type=int, default=32, help="sampler block length")
    p.add_argument("--threshold", type=float, default=0.9, help="confidence threshold of the fast modes")
    p.add_argument("--num-prompts", type=int, default=16, help="held-out prompts per set (the largest batch)")
    p.add_argument("--prompt-width", type=int, default=64, help="prompts are left-padded to this many tokens")
    p.add_argument("--batch-sizes", type=str, default="1,16", help="comma-separated generation batch sizes")
    p.add_argument("--compile", type=str, default=None,
                   help="generate(compile=...) value of the compiled modes (default: cudagraphs on CUDA, eager "
                        "tracing on CPU; 'none' skips them)")
    p.add_argument("--max-files", type=int, default=None, help="limit the stdlib files read (smoke tests)")
    p.add_argument("--budget-seconds", type=float, default=200.0,
                   help="optional parts (noise floor, float32 agreement) are skipped past this wall time")
    p.add_argument("--device", type=str, default="cuda" if torch.cuda.is_available() else "cpu", help="device")
    p.add_argument("--out", type=str, default=None, help="folder for generation_throughput.json / .md")
    args = p.parse_args()
    if args.tiny:
        args.__dict__.update(train_seconds=min(args.train_seconds, 8), hidden_size=64, num_layers=2, num_heads=4,
                             vocab_size=1024, seq_len=96, batch_size=16, gen_length=32, block_length=8,
                             num_prompts=4, prompt_width=16, batch_sizes="1,4", max_files=args.max_files or 40)
    if args.compile is None:
        args.compile = "cudagraphs" if args.device.startswith("cuda") else "eager"
    return args


class CopyTask:
    """`n1 ... nm repeat: w1 ... wk |` -> ` w1 ... wk |` repeated: a preamble of m = 0..max_preamble random
    words (it only varies the prompt length), then k distinct words to copy, period k + 1 tokens (fixed:
    every answer token is the prompt's token a multiple of k + 1 back, so a model can predict the whole
    answer in parallel). Every word (with its leading space) and the bar are single BPE tokens."""

    def __init__(self, tokenizer, words=7, max_preamble=16):
        single = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"]) == 1  # noqa: E731
        self.words = [tokenizer.convert_tokens_to_ids(tokenizer.tokenize(" " + w))[0] for w in WORDS if single(" " + w)]
        bars = [b for b in (" |", " ;", " ,", " .") if single(b)]
        if len(self.words) < 16 or not bars:
            raise ValueError(f"the BPE vocabulary splits the task's words: {len(self.words)} single-token words")
        self.bar = tokenizer.convert_tokens_to_ids(tokenizer.tokenize(bars[0]))[0]
        self.prefix = tokenizer(" repeat:", add_special_tokens=False)["input_ids"]
        self.k, self.max_preamble = words, max_preamble

    def draw(self, generator: torch.Generator, exclude: set = frozenset()):
        """-> (preamble, items) token tuples; `exclude`: word lists (items) not to draw."""
        while True:
            m = int(torch.randint(self.max_preamble + 1, (1,), generator=generator))
            preamble = tuple(self.words[i] for i in torch.randint(len(self.words), (m,), generator=generator).tolist())
            picks = torch.randperm(len(self.words), generator=generator)[: self.k].tolist()
            items = tuple(self.words[i] for i in picks)
            if items not in exclude:
                return preamble, items

    def prompt(self, instance) -> list[int]:
        preamble, items = instance
        return list(preamble) + self.prefix + list(items) + [self.bar]

    def sequence(self, instance, length: int) -> tuple[list[int], int]:
        """(prompt + periodic answer cut to `length` tokens, prompt length)."""
        prompt, period = self.prompt(instance), list(instance[1]) + [self.bar]
        reps = math.ceil(max(length - len(prompt), 0) / len(period))
        return (prompt + period * reps)[:length], len(prompt)

    @staticmethod
    def texts(words, count=1000):  # a few instances for the tokenizer's training text
        generator = torch.Generator().manual_seed(1)
        return ["repeat:" + " ".join([""] + [words[i] for i in torch.randint(len(words), (6,), generator=generator)]) +
                " |" for _ in range(count)]


def task_windows(task, count, seq_len, exclude, seed):
    """(n <= count, seq_len) copy-task rows (vectorised `CopyTask.sequence`; rows whose word list is in
    `exclude` are dropped) and their prompt masks."""
    generator = torch.Generator().manual_seed(seed)
    words = torch.tensor(task.words)
    items = words[torch.rand(count, len(task.words), generator=generator).argsort(-1)[:, : task.k]]  # distinct words
    period = torch.cat([items, torch.full((count, 1), task.bar)], 1)  # (N, k + 1)
    body = torch.cat([torch.tensor(task.prefix).expand(count, -1), period.repeat(1, seq_len // (task.k + 1) + 2)], 1)
    preamble_len = torch.randint(task.max_preamble + 1, (count, 1), generator=generator)
    preamble = words[torch.randint(len(task.words), (count, task.max_preamble), generator=generator)]
    column = torch.arange(seq_len).unsqueeze(0)
    from_body = body.gather(1, (column - preamble_len).clamp(min=0))
    rows = torch.where(column < preamble_len, preamble.gather(1, column.clamp(max=task.max_preamble - 1).expand(
        count, -1)) if task.max_preamble else from_body, from_body)
    prompt_mask = column < preamble_len + len(task.prefix) + task.k + 1
    keep = torch.tensor([tuple(row) not in exclude for row in items.tolist()])
    return rows[keep], prompt_mask[keep]


def train(args, device, task, tokenizer, windows, heldout_lists):
    config = DLMConfig(vocab_size=len(tokenizer), hidden_size=args.hidden_size, intermediate_size=3 * args.hidden_size,
                       num_hidden_layers=args.num_layers, num_attention_heads=args.num_heads, qk_norm=True,
                       max_position_embeddings=2048, tie_word_embeddings=True, mask_token_id=tokenizer.mask_token_id,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    config._attn_implementation = "sdpa"
    model = DLMForDiffusionLM(config).to(device)
    n_task = round(args.batch_size * args.task_fraction)
    n_text = args.batch_size - n_task
    # copy-task rows, drawn fresh (the held-out word lists excluded)
    task_rows, task_prompt = task_windows(task, max(4096, n_task * 2500), args.seq_len, heldout_lists, seed=10)
    pool = task_rows.shape[0]
    print(f"model {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters; {windows.numel() / 1e6:.2f}M "
          f"stdlib training tokens; {pool} copy-task rows; batch {n_text} text + {n_task} task rows")
    objective = MaskedDiffusionObjective.from_model_config(config, preset="mdlm", seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, betas=(0.9, 0.95), weight_decay=0.1,
                                  fused=device.type == "cuda")
    order = torch.randperm(windows.shape[0], generator=torch.Generator().manual_seed(0))
    windows, task_rows, task_prompt = windows.to(device), task_rows.to(device), task_prompt.to(device)
    text_prompt = torch.zeros(n_text, args.seq_len, dtype=torch.bool, device=device)
    model.train()
    start, step, losses = time.perf_counter(), 0, []
    bar = tqdm(total=int(args.train_seconds), unit="s", desc="training")
    while (elapsed := time.perf_counter() - start) < args.train_seconds:
        progress = elapsed / args.train_seconds
        lr = args.learning_rate * min(1.0, (step + 1) / 100) * max(0.05, 0.5 * (1 + math.cos(math.pi * progress)))
        for group in optimizer.param_groups:
            group["lr"] = lr
        text = order[torch.arange(step * n_text, (step + 1) * n_text) % windows.shape[0]].to(device)
        tasks = torch.arange(step * n_task, (step + 1) * n_task, device=device) % pool
        input_ids = torch.cat([windows[text], task_rows[tasks]])
        prompt_mask = torch.cat([text_prompt, task_prompt[tasks]])
        draw = torch.arange(step * args.batch_size, (step + 1) * args.batch_size)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss, _ = objective(model, input_ids, sample_index=draw, prompt_mask=prompt_mask)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if step % 25 == 0:
            losses.append(loss.item())
            bar.set_postfix(step=step, loss=f"{losses[-1]:.3f}", refresh=False)
            bar.update(int(min(time.perf_counter() - start, args.train_seconds)) - bar.n)
    bar.close()
    print(f"trained {step} steps ({step * args.batch_size * args.seq_len / 1e6:.1f}M tokens) in "
          f"{time.perf_counter() - start:.0f}s; last losses {[round(x, 3) for x in losses[-4:]]}")
    model.eval()  # fp32 weights; generation runs under bf16 autocast (RoPE's inv_freq stays exact)
    return model, dict(steps=step, last_losses=losses[-4:])


def doc_prompts(tokenizer, docs, count, width, seed=0):
    """Openings of held-out documents, 16 to `width` tokens (mixed lengths)."""
    generator = torch.Generator().manual_seed(seed)
    prompts = []
    for doc in docs:
        ids = tokenizer(doc, add_special_tokens=False)["input_ids"]
        length = int(torch.randint(min(16, width), width + 1, (1,), generator=generator))
        if len(ids) >= length:
            prompts.append(torch.tensor(ids[:length]))
        if len(prompts) == count:
            return prompts
    raise ValueError(f"only {len(prompts)} held-out documents are long enough for {count} prompts")


def left_pad(prompts, pad_id, device, width=None):
    width = width or max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :], attention_mask[row, width - len(prompt) :] = prompt, 1
    return input_ids.to(device), attention_mask.to(device)


def timed_generate(model, input_ids, attention_mask, options, device):
    """-> (completions (b, G) cpu, seconds, forward passes, row-forwards)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(input_ids, attention_mask=attention_mask, return_dict_in_generate=True, **options)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    completions = out.sequences[:, input_ids.shape[1] :].cpu()
    return completions, seconds, len(out.forward_batch_sizes), sum(out.forward_batch_sizes)


def agreement(a, b):
    return a.eq(b).float().mean().item()


def main():
    args = parse_args()
    wall = time.perf_counter()
    device = torch.device(args.device)
    torch.manual_seed(0)
    train_docs, heldout_docs = split_documents(stdlib_documents(max_files=args.max_files))
    tokenizer = train_bpe_tokenizer(train_docs + CopyTask.texts(WORDS), args.vocab_size)
    task = CopyTask(tokenizer)
    task.max_preamble = min(task.max_preamble, args.prompt_width - len(task.prompt(((), ()))) - task.k)
    generator = torch.Generator().manual_seed(12345)
    heldout = []  # new instances: their word lists never occur in training
    while len(heldout) < args.num_prompts:
        heldout.append(task.draw(generator, {items for _, items in heldout}))
    heldout_lists = {items for _, items in heldout}
    windows = pack_windows(tokenizer, train_docs, args.seq_len)
    model, train_info = train(args, device, task, tokenizer, windows, heldout_lists)
    # the copy task's true answers, to score correctness (not only agreement)
    answers = torch.stack([torch.tensor(task.sequence(instance, len(task.prompt(instance)) + args.gen_length)[0][
        len(task.prompt(instance)) :]) for instance in heldout])
    sets = {"task": [torch.tensor(task.prompt(instance)) for instance in heldout],
            "docs": doc_prompts(tokenizer, heldout_docs, args.num_prompts, args.prompt_width)}
    pad = tokenizer.pad_token_id
    shared = dict(max_new_tokens=args.gen_length, block_length=args.block_length, steps=args.gen_length,
                  temperature=0.0, threshold=args.threshold)
    modes = dict(EAGER_MODES)
    if args.compile != "none":
        # one graph per (batch, canvas) shape and cache phase
        setattr(torch._dynamo.config, "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit")
                else "cache_size_limit", 64)
        modes.update({name: {**options, "compile": args.compile} for name, options in COMPILED_MODES.items()})
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    batches = {(name, b): left_pad(prompts[:b], pad, device, args.prompt_width)
               for name, prompts in sets.items() for b in batch_sizes}
    elapsed = lambda: time.perf_counter() - wall  # noqa: E731

    rows, outputs, warmup_seconds, errors, noise, fp32 = [], {}, {}, {}, {}, {}
    partial = None
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        partial = open(os.path.join(args.out, "generation_throughput_rows.jsonl"), "w")  # survives a killed run
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    phase = dict(args=args, model=model, sets=sets, batches=batches, batch_sizes=batch_sizes, shared=shared,
                 device=device, outputs=outputs, rows=rows, answers=answers, warmup_seconds=warmup_seconds,
                 errors=errors, elapsed=elapsed, partial=partial)
    # eager modes first: a compile failure (even one that breaks the CUDA context) cannot cost their rows
    with autocast:
        run_phase(modes={k: v for k, v in modes.items() if "compile" not in v}, **phase)
    backends = list(model.config.sdpa_backends or [])
    try:
        with autocast:
            run_phase(modes={k: v for k, v in modes.items() if "compile" in v}, **phase)
        if model.config.sdpa_backends != backends:
            errors["note"] = f"compiled modes ran with sdpa_backends={model.config.sdpa_backends} (eager: {backends})"
            model.config.sdpa_backends = backends
        big = max(batch_sizes)
        with autocast:  # noise floor: the reference on prompt 0 inside the largest batch vs alone (same padding / none)
            for set_name, prompts in sets.items():
                if elapsed() > args.budget_seconds - 25 or 1 not in batch_sizes:
                    print(f"[{elapsed():.0f}s] noise floor skipped (time budget)")
                    break
                in_batch = outputs[(set_name, big, "reference (1 token/step)")][:1]
                unpadded = timed_generate(model, prompts[0][None].to(device), None, {**shared, **EAGER_MODES[
                    "reference (1 token/step)"]}, device)[0]
                noise[set_name] = dict(unpadded=agreement(in_batch, unpadded), same_padding=agreement(
                    in_batch, outputs[(set_name, 1, "reference (1 token/step)")]))
        # float32 agreement of the eager modes at the largest batch (no autocast: near-ties no longer flip)
        for set_name in sets:
            if elapsed() > args.budget_seconds - 20:
                print(f"[{elapsed():.0f}s] float32 agreement of {set_name!r} skipped (time budget)")
                continue
            reference = None
            for mode, options in EAGER_MODES.items():
                completions = timed_generate(model, *batches[(set_name, big)], {**shared, **options}, device)[0]
                reference = completions if reference is None else reference
                fp32[f"{set_name} / {mode}"] = agreement(completions, reference)
            print(f"[{elapsed():.0f}s] float32 agreement {set_name}: " + json.dumps(
                {k: round(v, 4) for k, v in fp32.items() if k.startswith(set_name)}))
    except Exception as error:  # report what was measured whatever happens after the eager rows
        errors["after the eager rows"] = f"{type(error).__name__}: {error}"[:2000]
        print(f"[{elapsed():.0f}s] stopped early: {errors['after the eager rows']}")
    report(args, rows, noise, fp32, warmup_seconds, errors, train_info, sets, outputs, tokenizer, elapsed(), device)


def run_phase(args, model, modes, sets, batches, batch_sizes, shared, device, outputs, rows, answers, warmup_seconds,
              errors, elapsed, partial):
    """Warm up `modes` on every shape (untimed), then time each on every prompt set and batch size."""
    def warm_up(options):  # the same shapes in 1 (uncached) or 2 (cached: refresh + window) steps per block
        for b in batch_sizes:
            warm = {**shared, **options, "threshold": None,
                    "steps": args.gen_length // args.block_length * (1 if options["cache"] == "none" else 2)}
            model.generate(*batches[("task", b)], **warm)

    for mode, options in modes.items():  # warm-up: compile / capture / SDPA plans of every shape, untimed
        start = time.perf_counter()
        try:
            try:
                warm_up(options)
            except Exception as error:
                backends = model.config.sdpa_backends or []
                if "compile" not in options or not backends or backends[0] != "cudnn":
                    raise
                # one retry without cuDNN attention (in case its kernels refuse CUDA-graph capture)
                errors[f"{mode}, first try with cuDNN attention"] = f"{type(error).__name__}: {error}"[:2000]
                print(f"[{elapsed():.0f}s] {mode} failed with cuDNN attention first; retrying without: {error}")
                model.config.sdpa_backends = [b for b in backends if b != "cudnn"]
                torch._dynamo.reset()  # drops every graph: re-warm the compiled modes already warmed
                for other in [m for m in warmup_seconds if m in modes] + [mode]:
                    warm_up(modes[other])
        except Exception as error:  # a compile failure must not cost the other results of this one-shot run
            if "compile" not in options:
                raise
            errors[mode] = f"{type(error).__name__}: {error}"[:2000]
            print(f"[{elapsed():.0f}s] {mode} failed, left out: {errors[mode]}")
            continue
        warmup_seconds[mode] = time.perf_counter() - start
        print(f"[{elapsed():.0f}s] warm-up {mode}: {warmup_seconds[mode]:.1f}s")
    for set_name in sets:
        for b in batch_sizes:
            for mode, options in modes.items():
                if mode in errors:
                    continue
                try:
                    completions, seconds, forwards, row_forwards = timed_generate(
                        model, *batches[(set_name, b)], {**shared, **options}, device)
                except Exception as error:
                    if "compile" not in options:
                        raise
                    errors[mode] = f"{type(error).__name__}: {error}"[:2000]
                    print(f"[{elapsed():.0f}s] {mode} failed, left out: {errors[mode]}")
                    continue
                outputs[(set_name, b, mode)] = completions
                reference = outputs[(set_name, b, "reference (1 token/step)")]
                row = dict(prompts=set_name, batch_size=b, mode=mode, tokens_per_s=completions.numel() / seconds,
                           forward_passes_per_token=forwards / args.gen_length,
                           row_forwards_per_token=row_forwards / completions.numel(),
                           ms_per_forward=1000 * seconds / forwards,
                           agreement_with_reference=agreement(completions, reference), seconds=seconds)
                if set_name == "task":
                    row["task_accuracy"] = agreement(completions, answers[: completions.shape[0]])
                if "compile" in options:
                    eager_name = mode.replace(", compiled", "").replace("reference", "reference (1 token/step)")
                    row["agreement_with_eager_same_mode"] = agreement(completions, outputs[(set_name, b, eager_name)])
                rows.append(row)
                print(f"[{elapsed():.0f}s] " + json.dumps(row))
                if partial is not None:
                    partial.write(json.dumps(row) + "\n")
                    partial.flush()


def compiled_speedup(row) -> str:
    return f"{row['speedup_vs_compiled_reference']:.2f}x" if "speedup_vs_compiled_reference" in row else "-"


def report(args, rows, noise, fp32, warmup_seconds, errors, train_info, sets, outputs, tokenizer, wall, device):
    order = [*EAGER_MODES, *COMPILED_MODES]
    rows.sort(key=lambda r: (list(sets).index(r["prompts"]), r["batch_size"], order.index(r["mode"])))
    for row in rows:
        same = [r for r in rows if (r["prompts"], r["batch_size"]) == (row["prompts"], row["batch_size"])]
        row["speedup_vs_reference"] = row["tokens_per_s"] / same[0]["tokens_per_s"]
        compiled = [r for r in same if r["mode"] == "reference, compiled"]
        if compiled:
            row["speedup_vs_compiled_reference"] = row["tokens_per_s"] / compiled[0]["tokens_per_s"]
    lines = ["| prompts | batch | mode | tokens/s | vs reference | vs compiled reference | forward passes / token | "
             "ms / forward | agreement with reference (bf16) | copy-task accuracy |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        twin = r.get("agreement_with_eager_same_mode")
        extra = "" if twin is None else f" (eager same mode: {100 * twin:.1f}%)"
        lines.append(f"| {r['prompts']} | {r['batch_size']} | {r['mode']} | {r['tokens_per_s']:,.0f} | "
                     f"{r['speedup_vs_reference']:.2f}x | {compiled_speedup(r)} | "
                     f"{r['forward_passes_per_token']:.3f} | {r['ms_per_forward']:.2f} | "
                     f"{100 * r['agreement_with_reference']:.1f}%{extra} | "
                     + (f"{100 * r['task_accuracy']:.1f}% |" if "task_accuracy" in r else "- |"))
    lines.append("")
    lines.append("Float32 agreement with the float32 reference loop (largest batch): " +
                 (", ".join(f"{k} {100 * v:.1f}%" for k, v in fp32.items()) or "skipped"))
    lines.append("Noise floor, reference loop, prompt 0 in the largest batch vs alone (bf16): " +
                 (", ".join(f"{k}: same padding {100 * v['same_padding']:.1f}%, unpadded {100 * v['unpadded']:.1f}%"
                            for k, v in noise.items()) or "skipped"))
    lines.append("Warm-up (compile, capture, kernel plans; untimed) seconds: " +
                 ", ".join(f"{k} {v:.1f}" for k, v in warmup_seconds.items()))
    if errors:
        lines.append("Errors and notes (a failed compiled mode is left out): " + "; ".join(f"{k}: {v[:300]}" for k, v in errors.items()))
    last_losses = [round(x, 3) for x in train_info["last_losses"]]
    lines.append(f"Training: {train_info['steps']} steps, last losses {last_losses}; "
                 f"wall time of the whole run {wall:.0f}s.")
    table = "\n".join(lines)
    print(table)
    samples = {}
    for set_name, prompts in sets.items():
        largest = max(int(b) for b in args.batch_sizes.split(","))
        completion = outputs[(set_name, largest, "reference (1 token/step)")][0]
        samples[set_name] = (tokenizer.decode(prompts[0]) + " ||| "
                             + tokenizer.decode(completion, skip_special_tokens=True))
        print(f"sample {set_name} (prompt ||| reference completion): {samples[set_name][:300]!r}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "generation_throughput.json"), "w") as f:
            counters = torch._dynamo.utils.counters  # graphs, breaks, cudagraph skips: did the capture happen
            dynamo = {k: dict(counters[k]) for k in ("stats", "graph_break", "inductor") if k in counters}
            json.dump(dict(args=vars(args), rows=rows, float32_agreement=fp32, noise_floor=noise, dynamo=dynamo,
                           warmup_seconds=warmup_seconds, errors=errors, training=train_info, samples=samples,
                           wall_seconds=wall,
                           device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                           torch=torch.__version__), f, indent=1)
        with open(os.path.join(args.out, "generation_throughput.md"), "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
