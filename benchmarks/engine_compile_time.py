"""Seconds the serving engine's compiled step takes to compile (`ContinuousBatchingEngine.warmup()`, what
`hf-dlm serve --compile` does before it listens), against the model's depth.

The step compiles with dynamic sizes (one graph for every batch and phase); the compiler's symbolic work grows
with the layers, not with the width, so a narrow model of the real depth shows it on a CPU (Qwen3-1.7B's 28
layers at hidden 64 by default). Prints one JSON line per depth.

    python benchmarks/engine_compile_time.py --layers 28            # Inductor (compile=True), CPU
    python benchmarks/engine_compile_time.py --tiny                 # 2 layers, Dynamo tracing only (seconds)
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="2 layers, compile='eager' (Dynamo only): a smoke run")
    p.add_argument("--layers", default="28", help="comma-separated depths")
    p.add_argument("--compile", default="default", help="a DLMGenerationConfig.compile value")
    p.add_argument("--out", default=os.environ.get("OUT"))
    args = p.parse_args()
    if args.tiny:
        args.layers, args.compile = "2", "eager"

    import torch
    from torch._dynamo.utils import counters

    from hf_dlm import DLMConfig, DLMForDiffusionLM
    from hf_dlm.serving.engine import ContinuousBatchingEngine

    rows = []
    for layers in [int(n) for n in args.layers.split(",")]:
        config = DLMConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                           qk_norm=True, tie_word_embeddings=True, mask_token_id=511, eos_token_id=510,
                           pad_token_id=509, attention_mode="bidirectional")
        config._attn_implementation = "sdpa"
        torch.manual_seed(0)
        model = DLMForDiffusionLM(config).eval()
        torch._dynamo.reset()
        counters.clear()
        engine = ContinuousBatchingEngine(model, max_batch_size=8, compile=args.compile, preallocate=True,
                                          max_length=128)
        start = time.monotonic()
        done = engine.warmup()
        rows.append({"layers": layers, "compile": args.compile, "warmup_s": round(time.monotonic() - start, 1),
                     "forwards": done["forwards"], "graphs": counters["stats"]["unique_graphs"],
                     "torch": torch.__version__, "threads": torch.get_num_threads()})
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "engine_compile_time.json"), "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
