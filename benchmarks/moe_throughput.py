"""MoE against dense training throughput on one GPU: forward + backward, bf16 weights, hf-dlm's masked head.

Shapes (about 1B active parameters): 18 layers, hidden 2048, 16 heads, 8 KV heads, vocab 32000, seq 4096,
micro-batch 4. Dense: SwiGLU width 5632. MoE: 8 experts, top-2, expert width 2816 (so each token runs
2 x 2816 = 5632 columns, the dense width: equal active parameters), load-balancing loss on. The experts
run through one `grouped_mm` per projection or a loop over experts. Eager (no compile) for every variant,
SDPA attention (cuDNN first). Before timing, a bf16 check of grouped_mm against the loop (output and
gradients of one MoE block).

    python benchmarks/moe_throughput.py            # prints a markdown table, writes $OUT/moe_throughput.json
    python benchmarks/moe_throughput.py --tiny     # a CPU-sized run of the script itself
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402

from hf_dlm import DLMConfig, DLMForDiffusionLM  # noqa: E402
from hf_dlm.modeling.moe import DLMSparseMoeBlock, active_parameter_count  # noqa: E402


def shapes(tiny: bool) -> dict:
    if tiny:
        common = dict(vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64)
        return {"common": common, "dense_ffn": 128, "expert_ffn": 64, "seq": 32, "mbs": 2}
    common = dict(vocab_size=32000, hidden_size=2048, num_hidden_layers=18, num_attention_heads=16,
                  num_key_value_heads=8, max_position_embeddings=4096)
    return {"common": common, "dense_ffn": 5632, "expert_ffn": 2816, "seq": 4096, "mbs": 4}


# variant name -> MoE options (None: the dense model). Every MoE variant has the dense model's active
# parameters: top-2 of 8 experts of half the dense width, or expert choice at capacity factor 1 with k = 2.
ROUTERS = {
    "dense": None,
    "moe grouped_mm": dict(moe_implementation="grouped_mm"),
    "moe loop": dict(moe_implementation="loop"),
    "moe sigmoid": dict(moe_implementation="grouped_mm", moe_router="sigmoid", n_group=4, topk_group=2,
                        moe_router_enable_expert_bias=True, moe_router_bias_update_rate=1e-3),
    "moe expert_choice batch": dict(moe_implementation="grouped_mm", moe_router="expert_choice",
                                    expert_choice_level="batch"),
    "moe expert_choice sequence": dict(moe_implementation="grouped_mm", moe_router="expert_choice",
                                       expert_choice_level="sequence"),
}


def build(spec: dict, variant: str, device: str) -> DLMForDiffusionLM:
    """`variant` is a key of ROUTERS, optionally followed by " compiled" (per-block torch.compile, as the
    trainer's `compile` option applies it)."""
    compiled = variant.endswith(" compiled")
    router = ROUTERS[variant.removesuffix(" compiled")]
    options = dict(spec["common"], mask_token_id=spec["common"]["vocab_size"] - 1, qk_norm=True)
    if router is None:
        config = DLMConfig(**options, intermediate_size=spec["dense_ffn"])
    else:
        if not torch.cuda.is_available() and router.get("moe_implementation") == "grouped_mm":
            router = dict(router, moe_implementation="auto")  # the CPU takes the loop
        config = DLMConfig(**options, intermediate_size=spec["dense_ffn"], num_experts=8, num_experts_per_tok=2,
                           moe_intermediate_size=spec["expert_ffn"], router_aux_loss_coef=0.01, **router)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = DLMForDiffusionLM(config)
    model = model.to(torch.bfloat16).train()
    if compiled:
        for layer in model.model.layers:  # regional compile, in place
            layer.compile()
        model.compile_loss_head = True
    return model


def check_grouped_against_loop(spec: dict, device: str) -> dict:
    """One MoE block in bf16: grouped_mm output and gradients against the loop's."""
    options = dict(spec["common"], intermediate_size=spec["dense_ffn"], num_experts=8, num_experts_per_tok=2,
                   moe_intermediate_size=spec["expert_ffn"])
    torch.manual_seed(0)
    block = DLMSparseMoeBlock(DLMConfig(**options)).to(device)
    with torch.no_grad():
        for parameter in block.parameters():
            parameter.normal_(0, 0.02)
    block = block.to(torch.bfloat16)
    x = torch.randn(spec["mbs"], spec["seq"], spec["common"]["hidden_size"], device=device, dtype=torch.bfloat16)
    results = {}
    for implementation in ("loop", "grouped_mm"):
        block.experts.implementation = implementation
        block.zero_grad()
        x_ = x.clone().requires_grad_()
        out = block(x_)
        out.float().square().mean().backward()
        results[implementation] = (out.float(), x_.grad.float(), block.experts.gate_up_proj.grad.float())
    diffs = {name: float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))
             for name, a, b in zip(("output", "input grad", "gate_up grad"), results["grouped_mm"], results["loop"])}
    return diffs


def time_variant(spec: dict, variant: str, device: str, warmup: int, steps: int, profile: bool = False) -> dict:
    model = build(spec, variant, device)
    total, active = sum(p.numel() for p in model.parameters()), active_parameter_count(model)
    generator = torch.Generator(device=device).manual_seed(0)
    vocab, seq, mbs = spec["common"]["vocab_size"], spec["seq"], spec["mbs"]
    ids = torch.randint(0, vocab - 1, (mbs, seq), device=device, generator=generator)
    masked = torch.rand(mbs, seq, device=device, generator=generator) < 0.5
    inputs = torch.where(masked, vocab - 1, ids)
    labels = torch.where(masked, ids, -100)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for step in range(warmup + steps):
        if step == warmup:
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
        out = model(input_ids=inputs, labels=labels)
        out.loss.backward()
        model.zero_grad(set_to_none=True)
    if device == "cuda":
        torch.cuda.synchronize()
    elapsed = (time.perf_counter() - start) / steps
    if profile:  # one more step under the profiler: where the time goes, kernel by kernel
        activities = [torch.profiler.ProfilerActivity.CPU] + (
            [torch.profiler.ProfilerActivity.CUDA] if device == "cuda" else [])
        with torch.profiler.profile(activities=activities) as profiler:
            model(input_ids=inputs, labels=labels).loss.backward()
            model.zero_grad(set_to_none=True)
        sort_by = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
        print(f"profile of one '{variant}' step:\n" + profiler.key_averages().table(sort_by=sort_by, row_limit=18),
              flush=True)
    tokens = mbs * seq / elapsed
    flops = 6 * active + 12 * spec["common"]["num_hidden_layers"] * spec["common"]["hidden_size"] * seq
    row = {"variant": variant, "params": total, "active_params": active, "step_s": elapsed, "tokens_per_s": tokens,
           "model_tflops": tokens * flops / 1e12,
           "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
           "aux_loss": None if out.aux_loss is None else float(out.aux_loss.detach())}
    del model, out
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="CPU-sized shapes (debug the script)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--profile", nargs="*", default=[], help="variants to profile for one extra step")
    parser.add_argument("--variants", nargs="+", default=None,
                        help=f"subset to run: {', '.join(ROUTERS)}, each optionally with ' compiled'")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    spec = shapes(args.tiny)
    report = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
              "grouped_mm": hasattr(torch.nn.functional, "grouped_mm"), "private_grouped_mm": hasattr(torch, "_grouped_mm")}
    if device == "cuda":
        report["check_grouped_vs_loop_bf16_rel_max_diff"] = check_grouped_against_loop(spec, device)
        print(json.dumps(report), flush=True)
    variants = args.variants or (["dense", "moe grouped_mm", "moe loop"] if device == "cuda" else
                                 ["dense", "moe loop", "moe expert_choice sequence"])
    unknown = [v for v in variants if v.removesuffix(" compiled") not in ROUTERS]
    if unknown:
        parser.error(f"--variants: unknown {unknown}; choose from {list(ROUTERS)} (optionally + ' compiled')")
    rows = []
    for variant in variants:
        rows.append(time_variant(spec, variant, device, args.warmup, args.steps, variant in args.profile))
        print(json.dumps(rows[-1]), flush=True)
    report["rows"] = rows
    dense = rows[0]["tokens_per_s"]
    print("\n| variant | params | active | tokens/s | vs dense | model TFLOP/s | peak GiB |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        peak = f"{row['peak_gib']:.1f}" if row["peak_gib"] is not None else "-"
        print(f"| {row['variant']} | {row['params'] / 1e9:.2f}B | {row['active_params'] / 1e9:.2f}B | "
              f"{row['tokens_per_s']:,.0f} | {row['tokens_per_s'] / dense:.2f}x | {row['model_tflops']:.0f} | {peak} |")
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, "moe_throughput.json"), "w") as handle:
            json.dump(report, handle, indent=2)


if __name__ == "__main__":
    main()
