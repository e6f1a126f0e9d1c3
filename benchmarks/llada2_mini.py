"""LLaDA2.0-mini shape (random weights) through hf-dlm's native `llada2_moe` family, on one GPU:

1. training throughput: forward + backward of the masked-diffusion loss under LLaDA2's block-causal attention
   (block 32), bf16 weights, no optimizer step (tokens/s, model TFLOP/s over the active parameters);
2. the same step for a dense model of equal active parameters (every MoE layer's FFN replaced by one SwiGLU of
   width k x expert + shared experts = 8 x 512 + 512 = 4608): the MoE / dense step-time ratio;
3. generation throughput at batch 1 and 16 through `model.generate` (the decoding core): blocks of 32, threshold
   0.95 (LLaDA2's published decoding), exact block cache. With random weights a position rarely reaches 0.95,
   so about one token is committed per forward: the forwards per token are printed to scale to a trained
   model's commit rate.

Shape (inclusionAI/LLaDA2.0-mini config.json): hidden 2048, 20 layers (the first dense, width 5120), 16 heads,
4 KV heads, head_dim 128, partial rotary 0.5, 256 experts of width 512, top-8 in 4 of 8 groups (sigmoid router,
expert bias, routed_scaling_factor 2.5), one shared expert, vocab 157184: 16.3B parameters, 1.4B active.

    python benchmarks/llada2_mini.py           # H200: prints a markdown table, writes $OUT/llada2_mini.json
    python benchmarks/llada2_mini.py --compile # training steps with per-layer compile (the MoE / dense ratio compiled)
    python benchmarks/llada2_mini.py --tiny    # CPU-sized run of the script itself
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

from hf_dlm.modeling.families import LLaDA2MoeConfig, LLaDA2MoeModelLM  # noqa: E402
from hf_dlm.modeling.moe import active_parameter_count  # noqa: E402
from hf_dlm.parallel.parallelize import apply_compile  # noqa: E402

MINI = dict(vocab_size=157184, hidden_size=2048, intermediate_size=5120, moe_intermediate_size=512,
            num_hidden_layers=20, num_attention_heads=16, num_key_value_heads=4, head_dim=128, num_experts=256,
            num_experts_per_tok=8, n_group=8, topk_group=4, num_shared_experts=1, first_k_dense_replace=1,
            routed_scaling_factor=2.5, partial_rotary_factor=0.5, rope_theta=600000, rms_norm_eps=1e-6,
            max_position_embeddings=32768, use_qkv_bias=False, use_bias=False, use_qk_norm=True,
            score_function="sigmoid", norm_topk_prob=True, tie_word_embeddings=False)
TINY = dict(MINI, vocab_size=320, hidden_size=64, intermediate_size=128, moe_intermediate_size=16,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=16,
            num_experts_per_tok=4, n_group=4, topk_group=2, max_position_embeddings=512, mask_token_id=319)
# published LLaDA2.x decoding speeds (tokens/s), quoted for comparison (REFERENCE.md section 7)
PUBLISHED = {"LLaDA2.1-mini (their engine)": 1586.9, "LLaDA2.1-flash FP8, HumanEval+": 891.7,
             "SGLang LLaDA2.1-mini, H20, 128 concurrent, tuned": 2181}


def build(shape: dict, dense: bool, device: str, attn: str) -> LLaDA2MoeModelLM:
    """The LLaDA2 model (or its dense twin of equal active parameters), bf16, random weights on `device`."""
    config = LLaDA2MoeConfig(**shape)
    if dense:  # every layer a SwiGLU; MoE layers get width k * expert + shared experts * expert
        width = (shape["num_experts_per_tok"] + shape["num_shared_experts"]) * shape["moe_intermediate_size"]
        config = LLaDA2MoeConfig(**{**shape, "num_experts": 0, "num_shared_experts": 0, "n_group": 1, "topk_group": 1,
                                    "intermediate_size": width})
    config._attn_implementation = attn
    if not torch.cuda.is_available():
        config.moe_implementation = "loop"
    torch.manual_seed(0)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # 16B parameters: never materialised in fp32
    try:
        with torch.device(device):
            model = LLaDA2MoeModelLM(config)
    finally:
        torch.set_default_dtype(default_dtype)
    return model.to(torch.bfloat16)


def train_step_time(model, seq: int, mbs: int, warmup: int, steps: int, device: str) -> dict:
    """Seconds per forward + backward of the masked loss (half the tokens masked), bf16."""
    model.train()
    vocab, mask = model.config.vocab_size, model.config.mask_token_id or model.config.vocab_size - 1
    generator = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(0, vocab - 1, (mbs, seq), device=device, generator=generator)
    masked = torch.rand(mbs, seq, device=device, generator=generator) < 0.5
    inputs, labels = torch.where(masked, mask, ids), torch.where(masked, ids, -100)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for step in range(warmup + steps):
        if step == warmup:
            synchronize(device)
            start = time.perf_counter()
        out = model(input_ids=inputs, labels=labels)
        out.loss.backward()
        model.zero_grad(set_to_none=True)
    synchronize(device)
    elapsed = (time.perf_counter() - start) / steps
    active = active_parameter_count(model)
    flops = 6 * active + 12 * model.config.num_hidden_layers * model.config.hidden_size * seq
    return {"step_s": elapsed, "tokens_per_s": mbs * seq / elapsed, "model_tflops": mbs * seq / elapsed * flops / 1e12,
            "params": sum(p.numel() for p in model.parameters()), "active_params": active,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None}


def generation_rate(model, batch: int, prompt: int, new_tokens: int, repeats: int, device: str) -> dict:
    """Generated tokens/s of `model.generate` (blocks of 32, threshold 0.95, exact block cache)."""
    model.eval()
    generator = torch.Generator(device=device).manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size - 2, (batch, prompt), device=device, generator=generator)
    forwards = []

    def count(*_):
        forwards[-1] += 1

    settings = dict(max_new_tokens=new_tokens, block_length=32, threshold=0.95, cache="prefix", do_sample=False)
    hook = model.model.register_forward_hook(count)
    try:
        forwards.append(0)
        model.generate(ids, **settings)  # warm-up
        synchronize(device)
        start = time.perf_counter()
        for _ in range(repeats):
            forwards.append(0)
            model.generate(ids, **settings)
        synchronize(device)
    finally:
        hook.remove()
    elapsed = (time.perf_counter() - start) / repeats
    return {"batch": batch, "tokens_per_s": batch * new_tokens / elapsed, "s_per_generate": elapsed,
            "forwards_per_token": sum(forwards[1:]) / repeats / new_tokens}


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="CPU-sized shapes (debug the script)")
    parser.add_argument("--seq", type=int, default=None, help="training sequence length (default 4096; tiny 64)")
    parser.add_argument("--mbs", type=int, default=None, help="training micro-batch (default 2; tiny 2)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=None, help="generated tokens (default 256; tiny 32)")
    parser.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 128; tiny 32)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--attn", default="sdpa", help="attention implementation (sdpa: training forwards take "
                        "FlexAttention with the block-causal BlockMask on CUDA, the decoding windows a dense mask)")
    parser.add_argument("--skip", nargs="*", default=[], choices=["train", "dense", "generate"])
    parser.add_argument("--compile", action="store_true", help="training steps with each decoder layer compiled "
                        "(`apply_compile`, as DLMTrainingArguments.compile_blocks; --tiny: Dynamo tracing only)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    shape = TINY if args.tiny else MINI
    seq, mbs = args.seq or (64 if args.tiny else 4096), args.mbs or 2
    new_tokens, prompt = args.new_tokens or (32 if args.tiny else 256), args.prompt or (32 if args.tiny else 128)
    if args.tiny:  # a run of the script itself: one timed step is enough
        args.warmup, args.steps = min(args.warmup, 1), min(args.steps, 1)
    attn = args.attn
    report = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
              "shape": "tiny" if args.tiny else "LLaDA2.0-mini", "seq": seq, "mbs": mbs, "attn": attn,
              "published_tokens_per_s": PUBLISHED}
    model = build(shape, dense=False, device=device, attn=attn)
    compile_options = ({"backend": "eager"} if args.tiny else {}) if args.compile else None
    report["compile"] = compile_options is not None
    if "train" not in args.skip:
        if compile_options is not None:
            apply_compile(model, compile_options)
        report["train_moe"] = train_step_time(model, seq, mbs, args.warmup, args.steps, device)
        print(json.dumps({"train_moe": report["train_moe"]}), flush=True)
    if "generate" not in args.skip:
        report["generate"] = [generation_rate(model, b, prompt, new_tokens, 1 if args.tiny else 3, device)
                              for b in args.batches]
        print(json.dumps({"generate": report["generate"]}), flush=True)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    if "dense" not in args.skip:
        dense = build(shape, dense=True, device=device, attn=attn)
        if compile_options is not None:
            apply_compile(dense, compile_options)
        report["train_dense_equal_active"] = train_step_time(dense, seq, mbs, args.warmup, args.steps, device)
        print(json.dumps({"train_dense_equal_active": report["train_dense_equal_active"]}), flush=True)
        if "train_moe" in report:
            report["moe_over_dense_step"] = report["train_moe"]["step_s"] / report["train_dense_equal_active"]["step_s"]
    print(f"\n{report['shape']} on {report['device']} (seq {seq}, micro-batch {mbs}, {attn})\n")
    print("| measure | value |\n|---|---|")
    for name in ("train_moe", "train_dense_equal_active"):
        if name in report:
            row = report[name]
            print(f"| {name} tokens/s | {row['tokens_per_s']:,.0f} ({row['active_params'] / 1e9:.2f}B active of "
                  f"{row['params'] / 1e9:.2f}B, {row['model_tflops']:.0f} TFLOP/s) |")
    if "moe_over_dense_step" in report:
        print(f"| MoE / dense step time | {report['moe_over_dense_step']:.2f}x |")
    for row in report.get("generate", []):
        print(f"| generate batch {row['batch']} tokens/s | {row['tokens_per_s']:,.1f} "
              f"({row['forwards_per_token']:.2f} forwards / token) |")
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, "llada2_mini.json"), "w") as handle:
            json.dump(report, handle, indent=2)


if __name__ == "__main__":
    main()
