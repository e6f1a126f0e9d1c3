"""Where an 8B dual-cache sampler step spends its time (LLaDA-8B shape, random bf16 weights, one GPU).

One window step of the dual cache (32 query tokens per row against a 320-token canvas) and the block-start
refresh (the whole canvas), at each batch size, in several forms:

- eager: `static_forward` as the eager sampler runs it without a graph (wall time per call, synced);
- kernels: a profile of one eager window forward: kernel count and GPU time by kind (GEMM, attention, other);
- graph: the eager forward captured as one CUDA graph (`CapturedStep`, what the eager sampler replays);
- compiled graph: `static_forward` through Inductor as generate compiles it (`CompiledStaticForward`: one
  graph shared by the decoder layers; `--compile-mode`, no Inductor CUDA graphs) and then
  captured as one CUDA graph the same way (CUDA events around the replay);
- sampling: the sampler's per-step arithmetic after the forward (greedy, low-confidence remasking);
- roofline: the weight-read bound at 4.8 TB/s and the matmul-FLOP bound at 800 TFLOP/s for the step.

    python benchmarks/generation_step_profile.py --out results/       # one H200, ~4 minutes
    python benchmarks/generation_step_profile.py --tiny               # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402


def build_model(tiny: bool, device: str):
    from hf_dlm import DLMConfig, DLMForDiffusionLM

    shape = (dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4) if tiny else
             dict(vocab_size=126464, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32))
    config = DLMConfig(**shape, mask_token_id=shape["vocab_size"] - 1, qk_norm=False, tie_word_embeddings=False,
                       max_position_embeddings=4096, rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                       attention_mode="bidirectional")
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    torch.set_default_dtype(torch.float32 if tiny else torch.bfloat16)
    with torch.device(device):
        model = DLMForDiffusionLM(config).eval()
    torch.set_default_dtype(torch.float32)
    return model


def wall_ms(fn, iters: int, device: str) -> float:
    for _ in range(2):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e3


def kernel_table(fn, device: str) -> dict:
    """Kernel count and GPU microseconds by kind for one call of fn (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    activities = [ProfilerActivity.CUDA] if device == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
    kinds, names, count = defaultdict(float), defaultdict(float), 0
    for event in prof.events():
        if device == "cuda" and event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = event.name
        low = name.lower()
        if any(s in low for s in ("memcpy", "memset")) and device == "cuda":
            kind = "copy"
        elif any(s in low for s in ("flash", "fmha", "attention", "sdpa")):  # before GEMMs: cuDNN's names say sm90
            kind = "attention"
        elif any(s in low for s in ("gemm", "xmma", "nvjet", "cutlass", "matmul", "sm90")):
            kind = "gemm"
        else:
            kind = "other"
        us = event.device_time_total if device == "cuda" else event.cpu_time_total
        kinds[kind] += us
        names[name[:90]] += us
        count += 1
    top = sorted(names.items(), key=lambda kv: -kv[1])[:12]
    return dict(kernels=count, total_us=sum(kinds.values()), by_kind=dict(kinds), top=top)


class Graph:
    """fn captured as one CUDA graph (after warm-up on a side stream)."""

    def __init__(self, fn):
        self.fn = fn
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = fn()

    def replay_ms(self, iters: int = 30) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.graph.replay()
        start.record()
        for _ in range(iters):
            self.graph.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / iters


def step_inputs(model, batch: int, prompt: int, gen: int, block: int, device: str):
    from hf_dlm.generation.compiled_step import static_forward

    vocab = model.config.vocab_size
    total = prompt + gen
    canvas = torch.randint(0, vocab - 2, (batch, total), device=device)
    canvas[:, prompt:] = model.config.mask_token_id
    positions = torch.arange(total, device=device).expand(batch, -1).contiguous()
    refresh_head = torch.arange(prompt, prompt + block, device=device)
    _, keys, values = static_forward(model, canvas, positions, None, positions, refresh_head, return_kv=True)
    past = (list(keys.unbind(0)), list(values.unbind(0)))
    window = dict(input_ids=canvas[:, prompt : prompt + block], position_ids=positions[:, prompt : prompt + block],
                  key_padding=None, key_position_ids=positions, head_index=torch.arange(block, device=device),
                  past=past, slots=torch.arange(prompt, prompt + block, device=device))
    refresh = dict(input_ids=canvas, position_ids=positions, key_padding=None, key_position_ids=positions,
                   head_index=refresh_head, return_kv=True)
    return canvas, window, refresh


def sampling_fn(canvas, logits_holder, prompt: int, block: int, mask_id: int):
    """The eager sampler's per-step arithmetic (greedy, low_confidence, budget 1 per row)."""
    from hf_dlm.generation.commit_rules import budget_commits
    from hf_dlm.generation.sampling import confidence_scores, filter_logits

    mask_index = torch.tensor([mask_id], device=canvas.device)
    budget = torch.ones(canvas.shape[0], dtype=torch.long, device=canvas.device)

    def run():
        logits = logits_holder[0]
        current = canvas[:, prompt : prompt + block]
        candidates = filter_logits(logits.index_fill(-1, mask_index, -torch.inf), None, None)
        x0 = candidates.argmax(-1)
        confidence = confidence_scores(logits, x0, "low_confidence")
        confidence = confidence.masked_fill(current.ne(mask_id), -torch.inf)
        commit = budget_commits(confidence, budget)
        return torch.where(commit, x0, current)

    return run


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--compile-modes", default="default", help="comma-separated torch.compile modes ('' = none)")
    p.add_argument("--budget-seconds", type=float, default=420.0)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    from hf_dlm.generation.compiled_step import CompiledStaticForward, static_forward

    device = "cpu" if a.tiny else "cuda"
    t_start = time.perf_counter()
    model = build_model(a.tiny, device)
    cfg = model.config
    params = sum(p.numel() for p in model.parameters())
    prompt, gen, block = (16, 32, 8) if a.tiny else (64, 256, 32)
    weight_bytes = 2 * (params - cfg.vocab_size * cfg.hidden_size)  # the embedding is a gather, not a read
    rows = []
    inputs = {b: step_inputs(model, b, prompt, gen, block, device) for b in map(int, a.batch_sizes.split(","))}

    def record(**row):
        rows.append(row)
        print(json.dumps(row), flush=True)

    for batch, (canvas, window, refresh) in inputs.items():
        flops = 2 * (params - cfg.vocab_size * cfg.hidden_size) * batch * block
        head = cfg.vocab_size * cfg.hidden_size  # the refresh runs the LM head on the block only
        refresh_flops = 2 * (params - 2 * head) * batch * (prompt + gen) + 2 * head * batch * block
        record(batch=batch, form="roofline", window_weight_read_ms=weight_bytes / 4.8e12 * 1e3,
               window_flop_ms=flops / 800e12 * 1e3, refresh_flop_ms=refresh_flops / 800e12 * 1e3)
        win = lambda: static_forward(model, **window)  # noqa: E731
        ref = lambda: static_forward(model, **refresh)  # noqa: E731
        record(batch=batch, form="eager window", ms=wall_ms(win, 5, device))
        record(batch=batch, form="eager refresh", ms=wall_ms(ref, 3, device))
        record(batch=batch, form="eager window kernels", **kernel_table(win, device))
        holder = [win()]
        samp = sampling_fn(canvas, holder, prompt, block, cfg.mask_token_id)
        record(batch=batch, form="sampling (eager)", ms=wall_ms(samp, 10, device))
        if device == "cuda":
            graph = Graph(win)
            record(batch=batch, form="graph window", ms=graph.replay_ms())
            holder[0] = graph.out
            record(batch=batch, form="graph window + sampling", ms=Graph(lambda: (win(), samp())).replay_ms())
            del graph
    for mode in filter(None, a.compile_modes.split(",")):
        compiled = CompiledStaticForward(mode=mode)  # generate(compile=...)'s form: one graph per decoder layer
        for batch, (canvas, window, refresh) in inputs.items():
            if time.perf_counter() - t_start > a.budget_seconds:
                record(batch=batch, form=f"compiled ({mode})", skipped="time budget")
                continue
            win = lambda: compiled(model, **window)  # noqa: E731
            t0 = time.perf_counter()
            try:
                win()
                compile_s = time.perf_counter() - t0
                record(batch=batch, form=f"compiled ({mode}) window", ms=wall_ms(win, 5, device), compile_s=compile_s)
                record(batch=batch, form=f"compiled ({mode}) window kernels", **kernel_table(win, device))
                if device == "cuda":
                    record(batch=batch, form=f"compiled ({mode}) window, graph", ms=Graph(win).replay_ms())
            except Exception as error:  # noqa: BLE001 - one variant's failure must not cost the table
                record(batch=batch, form=f"compiled ({mode})", error=repr(error)[:400])
    print("\n| batch | form | ms | kernels | GPU ms (gemm / attention / other) |\n|---|---|---|---|---|")
    for r in rows:
        if r["form"] == "roofline":
            print(f"| {r['batch']} | roofline: weight read {r['window_weight_read_ms']:.2f} ms, window FLOPs "
                  f"{r['window_flop_ms']:.2f} ms, refresh FLOPs {r['refresh_flop_ms']:.2f} ms | | | |")
        elif "kernels" in r:
            k = r["by_kind"]
            print(f"| {r['batch']} | {r['form']} | | {r['kernels']} | {r['total_us'] / 1e3:.2f} ("
                  f"{k.get('gemm', 0) / 1e3:.2f} / {k.get('attention', 0) / 1e3:.2f} / {k.get('other', 0) / 1e3:.2f}) |")
        elif "ms" in r:
            print(f"| {r['batch']} | {r['form']} | {r['ms']:.2f} | | |")
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "generation_step_profile.json"), "w") as f:
            json.dump(dict(rows=rows, params=params, torch=torch.__version__), f, indent=1)


if __name__ == "__main__":
    main()
