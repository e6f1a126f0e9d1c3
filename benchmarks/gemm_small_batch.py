"""The 8B sampler's GEMMs at decode sizes (LLaDA-8B shape, bf16, one GPU): separate against fused
projections (q / k / v as one, gate / up as one), M = batch x 32-token window. Weight-bandwidth figures
count the weight read only; each timing cycles over enough weight copies that none stays in L2.

    python benchmarks/gemm_small_batch.py          # one H200, ~20 s
    python benchmarks/gemm_small_batch.py --tiny   # CPU smoke run: 1/32 of the shapes, float32, seconds
"""

from __future__ import annotations

import argparse
import time

import torch

DEVICE, DTYPE = "cuda", torch.bfloat16


def time_gemm(m: int, k: int, n: int, copies: int, iters: int = 50) -> float:
    """ms per (m, k) @ (k, n) with a weight not in L2."""
    x = torch.randn(m, k, device=DEVICE, dtype=DTYPE)
    weights = [torch.randn(n, k, device=DEVICE, dtype=DTYPE) for _ in range(copies)]
    for w in weights:
        torch.nn.functional.linear(x, w)
    if DEVICE != "cuda":  # --tiny on CPU: wall clock
        start = time.perf_counter()
        for i in range(iters):
            torch.nn.functional.linear(x, weights[i % copies])
        return (time.perf_counter() - start) * 1e3 / iters
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(iters):
        torch.nn.functional.linear(x, weights[i % copies])
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokens", default="32,512")
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: shapes / 32, float32, few iterations")
    a = p.parse_args()
    global DEVICE, DTYPE
    h, f, v = 4096, 12288, 126464
    if a.tiny:
        DEVICE, DTYPE, a.tokens = "cpu", torch.float32, "4"
        h, f, v = h // 32, f // 32, v // 32
    layer = {"separate": [("q", h, h), ("k", h, h), ("v", h, h), ("o", h, h), ("gate", h, f), ("up", h, f), ("down", f, h)],
             "fused": [("qkv", h, 3 * h), ("o", h, h), ("gate_up", h, 2 * f), ("down", f, h)]}
    print("| tokens | GEMM (k -> n) | ms | weight GB/s | TFLOP/s |\n|---|---|---|---|---|")
    for m in map(int, a.tokens.split(",")):
        totals = {}
        for kind, gemms in layer.items():
            total = 0.0
            for name, k, n in gemms:
                ms = time_gemm(m, k, n, copies=2 if a.tiny else max(2, int(200e6 // (k * n * 2)) + 1),
                               iters=3 if a.tiny else 50)
                total += ms
                print(f"| {m} | {kind} {name} ({k} -> {n}) | {ms:.4f} | {k * n * 2 / ms / 1e6:,.0f} | "
                      f"{2 * m * k * n / ms / 1e9:,.0f} |")
            totals[kind] = total
        ms = time_gemm(m, h, v, copies=2, iters=3 if a.tiny else 50)
        print(f"| {m} | lm_head ({h} -> {v}) | {ms:.4f} | {h * v * 2 / ms / 1e6:,.0f} | {2 * m * h * v / ms / 1e9:,.0f} |")
        for kind, total in totals.items():
            print(f"| {m} | {kind}: one layer's GEMMs, x32 layers + head | {total * 32 + ms:.3f} | | |")


if __name__ == "__main__":
    main()
