"""Training throughput of hf-dlm against plain HF transformers, one GPU.

Qwen3-1.7B shape (28 layers, hidden 2048, 16 heads, 8 KV heads, ffn 6144, vocab 151936, tied), seq 4096,
bf16 autocast over fp32 weights, AdamW, the masked-diffusion loss with 1/t weights normalised by B * L
(hf-dlm's `MaskedDiffusionObjective`, LLaDA pretraining convention: the same loss as the baseline).

One run of this script times one configuration and prints one JSON line:

    python benchmarks/train_throughput.py --attn cudnn --head masked --compile block --mbs 4

`--suite NAME` runs a list of configurations, each in its own process (clean memory peaks; the Inductor
cache on disk is shared, so identical decoder blocks compile once), plus the plain-HF baseline script
(`--baseline-script`, eager and `--compile`) and an SDPA kernel micro-benchmark, and prints a markdown
table. `--tiny` shrinks everything to a CPU-sized model to debug the script itself.

FLOPs per token: 6N + 12 * layers * hidden * seq (PaLM convention with full attention, the right count
for a bidirectional model); MFU against 989 TFLOP/s (H100/H200 dense bf16).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

# name -> command-line flags of one configuration; "main" is hf-dlm's recommended setup
MAIN = "dlm main (block compile, cuDNN SDPA, masked head with gradients in forward, fused AdamW)"
SUITES = {
    "core": {
        MAIN: "",
        "dlm main + float8 tensorwise": "--float8 tensorwise --profile",
        "dlm main + float8 tensorwise, fast accumulation in backward GEMMs too": "--float8 tensorwise --float8-fast-accum",
        "dlm main, micro-batch 8": "--mbs 8",
    },
    "levers": {
        "attention: flash": "--attn flash",
        "head: full vocabulary on every position": "--head full",
        "head: logits recomputed in backward (checkpointed chunks)": "--head-recompute",
        "optimizer: foreach AdamW (not fused)": "--no-fused-optimizer",
        "float8 rowwise": "--float8 rowwise",
        "Inductor coordinate-descent tuning": "--coordinate-descent",
        "compile scope: none (eager)": "--compile none",
        "activation checkpointing, micro-batch 8": "--activation-checkpointing --mbs 8",
        "compile scope: whole step": "--compile step",
    },
}
# one-GPU FSDP2 (weights cast once per step, float8 all-gather) and micro-batch 8, bf16 and float8
FP8 = "--float8 tensorwise --float8-fast-accum"
SUITES["weights"] = {
    MAIN: "",
    "dlm main, micro-batch 8": "--mbs 8",
    "FSDP2 on one GPU (bf16 weights gathered once per step)": "--fsdp",
    "float8 tensorwise, fast accumulation": FP8 + " --profile",
    "float8 + FSDP2 float8 all-gather, scales precomputed once per step": FP8 + " --fsdp --float8-all-gather --profile",
    "float8 in the MLPs only": FP8 + " --float8-skip lm_head self_attn",
    "float8, micro-batch 8": FP8 + " --mbs 8",
    "float8 + FSDP2 float8 all-gather, micro-batch 8": FP8 + " --fsdp --float8-all-gather --mbs 8",
    "FSDP2 on one GPU, micro-batch 8": "--fsdp --mbs 8",
}
# the residual stream in bf16 (what bf16 weights give) with and without float8
RES = " --low-precision-residual"
SUITES["residual"] = {
    MAIN: "",
    "bf16 residual stream": RES + " --profile",
    "bf16 residual stream, micro-batch 8": RES + " --mbs 8",
    "float8 tensorwise, fast accumulation": FP8,
    "float8 tensorwise, fast accumulation, bf16 residual stream": FP8 + RES + " --profile",
    "float8 tensorwise, fast accumulation, bf16 residual stream, micro-batch 8": FP8 + RES + " --mbs 8",
    "float8 tensorwise, bf16 residual stream (default accumulation)": "--float8 tensorwise" + RES,
}
# next: where the GPU waits (host syncs, launch overhead) at micro-batch 8, the bf16 target's last gap
SUITES["idle"] = {
    MAIN: "",
    "bf16 residual stream, micro-batch 8": RES + " --mbs 8 --profile",
    "float8 tensorwise, fast accumulation, bf16 residual stream, micro-batch 8": FP8 + RES + " --mbs 8 --profile",
    "bf16 residual stream, micro-batch 8, blocks as CUDA graphs (reduce-overhead)":
        RES + " --mbs 8 --compile-mode reduce-overhead --profile",
}
# delayed scaling (hf_dlm/parallel/float8_delayed.py) against torchao's dynamic tensorwise, bf16 residual stream
DELAYED = "--float8 delayed --float8-fast-accum" + RES
SUITES["delayed"] = {
    "bf16 residual stream": RES,
    "float8 tensorwise (torchao), fast accumulation, bf16 residual stream": FP8 + RES,
    "float8 delayed, fast accumulation, bf16 residual stream": DELAYED + " --profile",
    "float8 delayed, bf16 residual stream (default accumulation)": "--float8 delayed" + RES,
    "bf16 residual stream, micro-batch 8": RES + " --mbs 8",
    "float8 delayed, fast accumulation, bf16 residual stream, micro-batch 8": DELAYED + " --mbs 8 --profile",
}
# the same after the amaxes became row-wise first (one kernel with the cast), with torchao at both batches
SUITES["delayed2"] = {
    "bf16 residual stream": RES,
    "float8 tensorwise (torchao), fast accumulation, bf16 residual stream": FP8 + RES,
    "float8 delayed, fast accumulation, bf16 residual stream": DELAYED + " --profile",
    "bf16 residual stream, micro-batch 8": RES + " --mbs 8",
    "float8 tensorwise (torchao), fast accumulation, bf16 residual stream, micro-batch 8": FP8 + RES + " --mbs 8",
    "float8 delayed, fast accumulation, bf16 residual stream, micro-batch 8": DELAYED + " --mbs 8 --profile",
}
# a repeat, after the history became a ring (two kernels per layer and step instead of five)
SUITES["delayed3"] = {
    "bf16 residual stream": RES,
    "float8 delayed, fast accumulation, bf16 residual stream": DELAYED + " --profile",
    "bf16 residual stream, micro-batch 8": RES + " --mbs 8",
    "float8 delayed, fast accumulation, bf16 residual stream, micro-batch 8": DELAYED + " --mbs 8",
}
# the next session's one call: every target's row in the same run (about 5 minutes with the compiled baseline)
SUITES["headline"] = {
    "bf16 residual stream": RES,
    "float8 delayed, fast accumulation, bf16 residual stream": DELAYED,
    "bf16 residual stream, micro-batch 8": RES + " --mbs 8",
    "float8 delayed, fast accumulation, bf16 residual stream, micro-batch 8": DELAYED + " --mbs 8",
}
# the call after "headline": micro-batch 12 (the largest bf16 fits in memory) and torchao's recipe for reference
SUITES["batch12"] = {
    "bf16 residual stream": RES,
    "float8 tensorwise (torchao), fast accumulation, bf16 residual stream": FP8 + RES,
    "bf16 residual stream, micro-batch 12": RES + " --mbs 12",
    "float8 delayed, fast accumulation, bf16 residual stream, micro-batch 12": DELAYED + " --mbs 12",
}
# the best bf16 rows against the compiled baseline in one run (micro-batch 12 was only measured beside it)
SUITES["bf16best"] = {
    "bf16 residual stream, micro-batch 12": RES + " --mbs 12",
    "bf16 residual stream, micro-batch 8": RES + " --mbs 8",
}
# packed documents (the indexed-data path: position_ids restart at every document) against unpacked windows;
# the default picks FlexAttention for them on CUDA (hf_dlm/modeling/masks.py), "--dense-mask" is the old SDPA path
SUITES["packed"] = {
    "unpacked, bf16 residual stream": RES,
    "packed documents (~650 tokens), default kernel (FlexAttention)": RES + " --packed-docs 650",
    "packed documents (~650 tokens), SDPA with a dense mask (before)": RES + " --packed-docs 650 --dense-mask",
}
SUITES["all"] = {**SUITES["core"], **SUITES["levers"]}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny model on CPU (debug the script, no timing value)")
    p.add_argument("--layers", type=int, default=28, help="decoder layers")
    p.add_argument("--hidden", type=int, default=2048, help="hidden size")
    p.add_argument("--heads", type=int, default=16, help="attention heads")
    p.add_argument("--kv-heads", type=int, default=8, help="key/value heads")
    p.add_argument("--ffn", type=int, default=6144, help="MLP intermediate size")
    p.add_argument("--vocab", type=int, default=151936, help="vocabulary size (the last id is the mask token)")
    p.add_argument("--seq", type=int, default=4096, help="sequence length")
    p.add_argument("--mbs", type=int, default=4, help="micro-batch size (sequences per step)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps (compilation happens here)")
    p.add_argument("--steps", type=int, default=5, help="timed steps (the median is reported)")
    p.add_argument("--attn", default="cudnn", choices=["cudnn", "flash", "efficient", "default"],
                   help="SDPA backend tried first (DLMConfig.sdpa_backends); default = PyTorch's own order")
    p.add_argument("--repeat-kv", action="store_true",
                   help="expand K/V to all query heads before SDPA instead of passing enable_gqa")
    p.add_argument("--head", default="masked", choices=["masked", "full"],
                   help="masked: logits only at supervised positions; full: every position (weight 0 elsewhere)")
    p.add_argument("--compile", default="block", choices=["none", "block", "step"],
                   help="none: eager; block: per-decoder-layer torch.compile (parallelize_dlm); step: the whole loss step")
    p.add_argument("--compile-mode", default=None,
                   help="torch.compile mode for the blocks, e.g. max-autotune-no-cudagraphs (default: Inductor's)")
    p.add_argument("--coordinate-descent", action="store_true",
                   help="Inductor coordinate_descent_tuning for the blocks' generated kernels")
    p.add_argument("--head-recompute", action="store_true",
                   help="the masked head's chunks checkpointed (logits recomputed in backward) instead of "
                        "computing the head's gradients in forward")
    p.add_argument("--no-compile-loss", action="store_true",
                   help="keep the masked head's chunks (linear + cross-entropy) eager under --compile block")
    p.add_argument("--no-fused-optimizer", action="store_true", help="foreach AdamW instead of fused")
    p.add_argument("--float8", default=None, choices=["tensorwise", "rowwise", "delayed"],
                   help="float8 recipe: torchao's tensorwise / rowwise, or hf-dlm's delayed scaling")
    p.add_argument("--float8-fast-accum", action="store_true", help="fast accumulation in backward float8 GEMMs")
    p.add_argument("--float8-all-gather", action="store_true",
                   help="with --fsdp and tensorwise: weights all-gathered in float8, scales precomputed once per step")
    p.add_argument("--float8-skip", nargs="*", default=["lm_head"],
                   help="module names (any dotted part) kept in bf16, e.g. self_attn for float8 in the MLPs only")
    p.add_argument("--fsdp", action="store_true",
                   help="FSDP2 over this one GPU (a 1-rank mesh): bf16 parameter copies gathered once per step "
                        "and kept to backward (reshard_after_forward=False) instead of autocast casting each "
                        "weight in every forward and backward")
    p.add_argument("--float8-min-features", type=int, default=2048,
                   help="convert a linear to float8 only if its in and out features are both at least this")
    p.add_argument("--low-precision-residual", action="store_true",
                   help="residual stream in bf16 under autocast (embeddings cast), as bf16 weights would give")
    p.add_argument("--activation-checkpointing", action="store_true", help="checkpoint every decoder layer")
    p.add_argument("--packed-docs", type=int, default=0,
                   help="pack documents of this mean length (uniform in [mean/6, 11 mean/6]) into every row: "
                        "position_ids restart at each document, as the indexed-data path gives (0: unpacked)")
    p.add_argument("--dense-mask", action="store_true",
                   help="packed: SDPA with a dense (B, 1, L, L) mask instead of the kernel hf-dlm picks")
    p.add_argument("--loss-chunk", type=int, default=4096, help="DLMConfig.loss_chunk_size")
    p.add_argument("--peak", type=float, default=989e12, help="peak FLOP/s for MFU")
    p.add_argument("--profile", action="store_true",
                   help="after timing, profile one step: GPU time by kernel category and the attention kernels")
    p.add_argument("--suite", default=None, choices=sorted(SUITES), help="run a list of configurations")
    p.add_argument("--baseline-script", default=os.path.join(HERE, "hf_baseline.py"),
                   help="plain-HF baseline script to time eager and --compile in a suite ('' to skip)")
    p.add_argument("--sdpa-bench", action="store_true", help="time SDPA fwd+bwd per backend at the model's shape")
    p.add_argument("--skip", nargs="*", default=[], help="suite: configuration names to leave out")
    p.add_argument("--time-budget", type=float, default=560.0,
                   help="suite: skip the configurations left once this many seconds have passed")
    p.add_argument("--out", default=None, help="suite: write the JSON lines and the table under this folder")
    return p.parse_args(argv)


def build_model(a, device):
    import torch

    from hf_dlm import DLMConfig, DLMForDiffusionLM

    backends = {"cudnn": ["cudnn", "flash", "efficient"], "flash": ["flash", "efficient"],
                "efficient": ["efficient"], "default": []}[a.attn]
    config = DLMConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.ffn, num_hidden_layers=a.layers,
                       num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, head_dim=a.hidden // a.heads,
                       max_position_embeddings=a.seq, tie_word_embeddings=True, qk_norm=True,
                       mask_token_id=a.vocab - 1, attention_mode="bidirectional", sdpa_backends=backends,
                       loss_chunk_size=a.loss_chunk)
    config._attn_implementation = "sdpa_repeat_kv" if a.repeat_kv else "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = DLMForDiffusionLM(config)
    return model.train()


def register_repeat_kv_attention():
    """SDPA with K/V expanded to every query head: some SDPA backends refuse `enable_gqa`."""
    import torch
    from transformers import AttentionInterface
    from transformers.models.llama.modeling_llama import repeat_kv

    def sdpa_repeat_kv(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        key, value = repeat_kv(key, module.num_key_value_groups), repeat_kv(value, module.num_key_value_groups)
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling,
            is_causal=module.is_causal and attention_mask is None)
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register("sdpa_repeat_kv", sdpa_repeat_kv)


def run_one(a) -> dict:
    import torch

    from hf_dlm.diffusion.objective import MaskedDiffusionObjective
    from hf_dlm.parallel.parallelize import parallelize_dlm

    device = "cpu" if a.tiny else "cuda"
    if a.repeat_kv:
        register_repeat_kv_attention()
    if a.float8_all_gather and not (a.float8 == "tensorwise" and a.fsdp):
        raise SystemExit("--float8-all-gather needs --float8 tensorwise and --fsdp")
    model = build_model(a, device)
    n_params = sum(p.numel() for p in model.parameters())
    t_build = time.perf_counter()
    if a.fsdp:
        import torch.distributed as dist

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        dist.init_process_group("gloo" if a.tiny else "nccl", rank=0, world_size=1)
    if a.float8:
        from hf_dlm.parallel.float8 import convert_to_float8, precompute_float8_scales

        convert_to_float8(model, recipe=a.float8, min_features=a.float8_min_features, skip=a.float8_skip,
                          fast_accum=a.float8_fast_accum, fsdp_all_gather=a.float8_all_gather)
    parallelize_dlm(model, activation_checkpointing=a.activation_checkpointing,
                    low_precision_residual=a.low_precision_residual,
                    compile=a.compile == "block", fsdp=a.fsdp, reshard_after_forward=False,
                    param_dtype=torch.bfloat16 if a.fsdp else None,
                    compile_options={"mode": a.compile_mode} if a.compile_mode else
                    {"options": {"coordinate_descent_tuning": True}} if a.coordinate_descent else None)
    if a.no_compile_loss:
        model.compile_loss_head = False
    model.loss_grad_in_forward = not a.head_recompute
    objective = MaskedDiffusionObjective.from_model_config(model.config, preset="llada", random_length_prob=0.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=not a.no_fused_optimizer and not a.tiny,
                                  foreach=True if a.no_fused_optimizer or a.tiny else None)
    autocast = torch.autocast(device, dtype=torch.bfloat16)

    if a.dense_mask:  # the path before packed batches took FlexAttention on CUDA
        from hf_dlm.modeling import masks

        masks.document_attention_implementation = lambda implementation, device: implementation

    def loss_fn(input_ids, sample_index, position_ids=None):
        inputs = objective.corrupt(input_ids, sample_index)
        if position_ids is not None:
            inputs["position_ids"] = position_ids
        if a.head == "full":  # same loss, but every position goes through the head
            inputs["labels"] = input_ids
        kwargs = {k: v for k, v in inputs.items() if k not in ("t", "masked")}
        with autocast:
            return model(**kwargs).loss

    step_loss = torch.compile(loss_fn) if a.compile == "step" else loss_fn

    def optimizer_step():
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if a.float8_all_gather:  # the next all-gather's float8 scales, all weights at once
            precompute_float8_scales(model)
    from torch._dynamo.utils import counters

    counters.clear()

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    # bidirectionality probe on the model as it trains (compiled, same shapes: no recompilation)
    probe = torch.randint(0, a.vocab - 1, (a.mbs, a.seq), device=device)
    changed = probe.clone()
    changed[:, -1] = (changed[:, -1] + 1) % (a.vocab - 1)

    def first_position(input_ids):  # through the outer model: FSDP2's root hooks run there
        out = model(input_ids=input_ids, return_logits=False, output_hidden_states=True)
        return out.hidden_states[-1][:, 0].float()

    with autocast, torch.no_grad():
        first, second = first_position(probe), first_position(changed)
    bidirectional = bool((first - second).abs().max() > 0)
    del first, second
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()

    times, losses = [], []
    for i in range(a.warmup + a.steps):
        input_ids = torch.randint(0, a.vocab - 1, (a.mbs, a.seq), device=device)
        sample_index = torch.arange(i * a.mbs, (i + 1) * a.mbs, device=device)
        position_ids = packed_positions(a, i, device) if a.packed_docs else None
        sync()
        t0 = time.perf_counter()
        loss = step_loss(input_ids, sample_index, position_ids)
        loss.backward()
        optimizer_step()
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
    timed = sorted(times[a.warmup:])
    dt = timed[len(timed) // 2]
    tokens = a.mbs * a.seq
    flops_per_token = 6 * n_params + 12 * a.layers * a.hidden * a.seq
    result = dict(params=n_params, mbs=a.mbs, tokens_per_s=tokens / dt, step_s=dt, step_spread_s=timed[-1] - timed[0],
                  mfu=flops_per_token * tokens / dt / a.peak, tflops=flops_per_token * tokens / dt / 1e12,
                  peak_mem_gib=torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0,
                  first_step_s=times[0], setup_s=time.perf_counter() - t_build - sum(times), loss=losses[-1],
                  loss_finite=all(map(lambda x: x == x and abs(x) != float("inf"), losses)),
                  bidirectional=bidirectional, graph_breaks=sum(counters["graph_break"].values()))
    if a.packed_docs:
        result["documents_per_row"] = a.seq / a.packed_docs
    if a.profile and device == "cuda":
        try:
            result.update(profile_step(step_loss, optimizer_step, a, device))
        except Exception as error:  # the timing above stands even if the profiler fails
            result["profile_error"] = repr(error)[:300]
    return result


def packed_positions(a, step: int, device):
    """(mbs, seq) position ids of documents packed back to back, lengths uniform in [mean/6, 11 mean/6]."""
    import torch

    g = torch.Generator().manual_seed(step)
    low, high = max(1, a.packed_docs // 6), a.packed_docs * 11 // 6
    rows = []
    for _ in range(a.mbs):
        parts, filled = [], 0
        while filled < a.seq:
            n = min(int(torch.randint(low, high + 1, (1,), generator=g)), a.seq - filled)
            parts.append(torch.arange(n))
            filled += n
        rows.append(torch.cat(parts))
    return torch.stack(rows).to(device)


# kernel-name fragments -> category, first match wins (cuBLAS / CUTLASS GEMMs are "nvjet", "xmma", "gemm")
KERNEL_CATEGORIES = (
    ("attention", ("sdpa", "fmha", "flash_fwd", "flash_bwd", "attention")),
    ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "splitk", "matmul")),
    ("optimizer", ("adam", "multi_tensor")),
    ("inductor (triton)", ("triton",)),
    ("index / embedding / scatter", ("index", "embedding", "scatter", "gather", "nonzero")),
    ("copy / memset", ("memcpy", "memset", "copy", "cat")),
    ("aten elementwise / reduce", ("elementwise", "reduce", "vectorized")),
)


def profile_step(step_loss, optimizer_step, a, device) -> dict:
    """One full step (forward, backward, optimizer) under the profiler: GPU time by kernel category, the
    step's wall time, and the attention kernels that ran (which SDPA backend really ran)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    input_ids = torch.randint(0, a.vocab - 1, (a.mbs, a.seq), device=device)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        step_loss(input_ids, torch.arange(a.mbs, device=device)).backward()
        optimizer_step()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t0) * 1e3

    def device_ms(e):
        return getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) / 1e3

    kernels = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start]
    events = [e for e in prof.key_averages() if device_ms(e) > 0]
    categories, examples = {}, {}
    for e in events:
        name = e.key.lower()
        category = next((c for c, keys in KERNEL_CATEGORIES if any(k in name for k in keys)), "other")
        categories[category] = categories.get(category, 0.0) + device_ms(e)
        examples.setdefault(category, []).append((device_ms(e), e.key[:80], e.count))
    busy = sum(categories.values())
    return dict(
        profiled_step_wall_ms=round(wall_ms, 1), gpu_kernel_ms=round(busy, 1),
        kernel_ms_by_category={c: round(v, 1) for c, v in sorted(categories.items(), key=lambda kv: -kv[1])},
        top_kernels_by_category={c: [(round(ms, 2), n, k) for ms, n, k in sorted(v, reverse=True)[:12]]
                                 for c, v in examples.items()},
        **gpu_idle_gaps(kernels),
        attention_kernels=sorted({e.key[:90] for e in events if any(
            k in e.key.lower() for k in ("fmha", "flash", "attn", "attention", "cudnn", "sdpa"))}),
    )


def gpu_idle_gaps(kernels, top: int = 8) -> dict:
    """GPU idle time between the first and last kernel of a step, from (name, start_us, end_us) kernel
    intervals (overlapping streams merged): the total, and the largest gaps with the kernels around them
    (the kernel after a gap is what the GPU waited for: a host sync, Python overhead, a launch)."""
    kernels = sorted(kernels, key=lambda k: k[1])
    gaps, busy_until, before = [], None, None
    for name, start, end in kernels:
        if busy_until is not None and start > busy_until:
            gaps.append((start - busy_until, before, name))
        if busy_until is None or end > busy_until:
            busy_until, before = end, name
    gaps.sort(key=lambda g: -g[0])
    return dict(gpu_idle_ms=round(sum(g[0] for g in gaps) / 1e3, 2),
                largest_gpu_gaps=[(round(us / 1e3, 3), prev[:60], nxt[:60]) for us, prev, nxt in gaps[:top]])


def sdpa_bench(a) -> list[dict]:
    """fwd+bwd TFLOP/s of non-causal SDPA at the model's shape, per backend, with enable_gqa or K/V repeated."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    hd = a.hidden // a.heads
    rows = []
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        for gqa in (True, False):
            q = torch.randn(a.mbs, a.heads, a.seq, hd, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            kv_heads = a.kv_heads if gqa else a.heads
            k = torch.randn(a.mbs, kv_heads, a.seq, hd, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            v = torch.randn_like(k, requires_grad=True)
            try:
                with sdpa_kernel([backend]):
                    def once():
                        F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa).sum().backward()
                    for _ in range(3):
                        once()
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(10):
                        once()
                    torch.cuda.synchronize()
                dt = (time.perf_counter() - t0) / 10
                flops = 4 * a.mbs * a.heads * a.seq * a.seq * hd * 3.5  # fwd 2 matmuls, bwd 5 (2.5x fwd)
                rows.append(dict(backend=name, enable_gqa=gqa, ms=dt * 1e3, tflops=flops / dt / 1e12))
            except RuntimeError as error:
                rows.append(dict(backend=name, enable_gqa=gqa, error=str(error).splitlines()[0][:120]))
    return rows


def run_suite(a) -> int:
    out = a.out or os.environ.get("OUT") or "."
    os.makedirs(out, exist_ok=True)
    log = open(os.path.join(out, "train_throughput.jsonl"), "a")
    common = ["--warmup", str(a.warmup), "--steps", str(a.steps)] + (["--tiny"] if a.tiny else [])
    results = []

    suite_start = time.perf_counter()

    def launch(tag, cmd):
        t0 = time.perf_counter()
        left = a.time_budget - (t0 - suite_start)
        if left < 30:
            print(f"skipped (time budget): {tag}", flush=True)
            return
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=left)
        except subprocess.TimeoutExpired as error:
            proc = subprocess.CompletedProcess(cmd, 124, "", f"timed out after {left:.0f} s: {error}")
        line = next((l for l in reversed(proc.stdout.splitlines()) if l.startswith("{")), None)
        result = json.loads(line) if line and proc.returncode == 0 else {"error": (proc.stderr or proc.stdout)[-600:]}
        result.update(tag=tag, wall_s=time.perf_counter() - t0)
        results.append(result)
        log.write(json.dumps(result) + "\n")
        log.flush()
        print(json.dumps(result), flush=True)

    if a.sdpa_bench and not a.tiny:
        import torch  # noqa: F401

        for row in sdpa_bench(a):
            print("sdpa", json.dumps(row), flush=True)
            log.write(json.dumps(dict(tag="sdpa", **row)) + "\n")
    if a.baseline_script and os.path.exists(a.baseline_script) and not a.tiny:
        base = [sys.executable, a.baseline_script, "--mbs", "4", "--warmup", str(a.warmup), "--steps", str(a.steps)]
        for tag, flags in (("plain HF, eager (baseline)", []), ("plain HF, torch.compile of the step (baseline)",
                                                                 ["--compile"])):
            if tag not in a.skip:
                launch(tag, base + flags)
    for tag, flags in SUITES[a.suite].items():
        if tag in a.skip:
            continue
        launch(tag, [sys.executable, os.path.abspath(__file__)] + common + flags.split()
               + (["--profile"] if tag == MAIN or a.profile else []))
    table = format_table(results)
    print(table)
    with open(os.path.join(out, "train_throughput.md"), "w") as f:
        f.write(table + "\n")
    return 0


def format_table(results) -> str:
    lines = ["| setup | mbs | tokens/s | TFLOP/s | MFU | peak GiB | first step s | notes |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['tag']} | | failed | | | | | {r['error'].splitlines()[-1][:100] if r['error'] else ''} |")
            continue
        notes = []
        if r.get("bidirectional") is False:
            notes.append("NOT bidirectional")
        if r.get("graph_breaks"):
            notes.append(f"{r['graph_breaks']} graph breaks")
        if r.get("loss_finite") is False:
            notes.append("loss not finite")
        if r.get("attention_kernels"):
            notes.append("kernels: " + ", ".join(k[:40] for k in r["attention_kernels"][:3]))
        lines.append(f"| {r['tag']} | {r.get('mbs', 4)} | {r['tokens_per_s']:,.0f} | {r['tflops']:.0f} | "
                     f"{100 * r['mfu']:.1f}% | {r.get('peak_mem_gib', r.get('peak_mem_gb', 0)):.1f} | "
                     f"{r.get('first_step_s', float('nan')):.1f} | {'; '.join(notes)} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.tiny:
        a.layers, a.hidden, a.heads, a.kv_heads, a.ffn, a.vocab, a.seq = 2, 64, 4, 2, 128, 512, 64
        a.mbs = min(a.mbs, 2)
        a.warmup, a.steps = min(a.warmup, 1), min(a.steps, 2)
    if a.suite:
        return run_suite(a)
    result = run_one(a)
    result.update(config={k: v for k, v in vars(a).items() if k not in ("suite", "out", "baseline_script")})
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
