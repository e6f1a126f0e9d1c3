"""Seconds the serving engine's compiled step takes to compile (`ContinuousBatchingEngine.warmup()`, what
`hf-dlm serve --compile` does before it listens), against the model's depth.

The step compiles with dynamic sizes (one graph for every batch and phase); compiled as a whole forward, the
compiler's symbolic work grows with the layers, not with the width, so a narrow model of the real depth shows it
on a CPU (Qwen3-1.7B's 28 layers at hidden 64 by default). Prints one JSON line per depth and `--graph` form.

    python benchmarks/engine_compile_time.py --layers 28            # Inductor (compile=True), CPU
    python benchmarks/engine_compile_time.py --tiny                 # 2 layers, Dynamo tracing only (seconds)
    python benchmarks/engine_compile_time.py --layers 2,6 --compile aot_eager --fake-ops 15
    python benchmarks/engine_compile_time.py --layers 6 --compile aot_eager --cprofile 25
    python benchmarks/engine_compile_time.py --layers 2,6,28 --graph regional,whole

`--graph`: the engine compiles each decoder layer through one shared graph (regional, the default); `whole`
compiles the whole forward as one graph, as the engine did before (its time grows with the depth).

`--fake-ops N`: the compiler's fake-tensor propagation (shapes, strides and their symbols, op by op; Dynamo and
AOT autograd both run it) timed per aten operator, the N costliest printed: which operators the compile time
goes to.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import time


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="2 layers, compile='eager' (Dynamo only): a smoke run")
    p.add_argument("--layers", default="28", help="comma-separated depths")
    p.add_argument("--compile", default="default", help="a DLMGenerationConfig.compile value, or aot_eager (Dynamo "
                   "and AOT autograd without Inductor: the compiler's stages apart)")
    p.add_argument("--graph", default="regional", help="comma-separated: regional (the engine's step: one graph "
                   "per kind of decoder layer, CompiledRaggedForward) and / or whole (the whole forward as one graph, "
                   "the engine's step before 2026-12-07)")
    p.add_argument("--fake-ops", type=int, default=0, help="time fake-tensor propagation per operator; print the "
                   "N costliest (0: off)")
    p.add_argument("--cprofile", type=int, default=0, help="print the warm-up's N costliest Python functions by own "
                   "time (cProfile; 0: off; the warm-up seconds then include its overhead): the compiler's time outside any "
                   "one operator")
    p.add_argument("--out", default=os.environ.get("OUT"))
    args = p.parse_args()
    if args.tiny:
        args.layers, args.compile, args.fake_ops, args.graph = "2", "eager", args.fake_ops or 5, "regional,whole"
        args.cprofile = args.cprofile or 5

    import torch
    from torch._dynamo.utils import counters

    from hf_dlm import DLMConfig, DLMForDiffusionLM
    from hf_dlm.generation.compiled_step import COMPILE_CHOICES
    from hf_dlm.generation.slot_cache import CompiledRaggedForward, ragged_forward
    from hf_dlm.serving.engine import ContinuousBatchingEngine

    rows = []
    fake_ops = time_fake_ops() if args.fake_ops else None
    graphs = args.graph.split(",")
    if set(graphs) - {"regional", "whole"}:
        raise SystemExit(f"--graph: unknown {sorted(set(graphs) - {'regional', 'whole'})} (choose from regional, whole)")
    for layers, graph in [(int(n), g) for n in args.layers.split(",") for g in graphs]:
        config = DLMConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                           qk_norm=True, tie_word_embeddings=True, mask_token_id=511, eos_token_id=510,
                           pad_token_id=509, attention_mode="bidirectional")
        config._attn_implementation = "sdpa"
        torch.manual_seed(0)
        model = DLMForDiffusionLM(config).eval()
        torch._dynamo.reset()
        counters.clear()
        engine = ContinuousBatchingEngine(model, max_batch_size=8, preallocate=True, max_length=128,
                                          compile="eager" if args.compile == "aot_eager" else args.compile)
        options = dict(backend="aot_eager") if args.compile == "aot_eager" else COMPILE_CHOICES[engine.compile_choice]
        engine.compiled = CompiledRaggedForward(**options) if graph == "regional" else torch.compile(
            ragged_forward, dynamic=True, **options)
        if fake_ops is not None:
            fake_ops.clear()
        profile = cProfile.Profile() if args.cprofile else None
        start = time.monotonic()
        if profile is not None:
            profile.enable()
        done = engine.warmup()
        if profile is not None:
            profile.disable()
            pstats.Stats(profile).sort_stats("tottime").print_stats(args.cprofile)
        rows.append({"layers": layers, "graph": graph, "compile": args.compile, "warmup_s": round(time.monotonic() - start, 1),
                     "forwards": done["forwards"], "graphs": counters["stats"]["unique_graphs"],
                     "torch": torch.__version__, "threads": torch.get_num_threads()})
        if fake_ops is not None:
            rows[-1]["fake_propagation_s"] = round(sum(s for s, _ in fake_ops.values()), 2)
            rows[-1]["fake_ops"] = [{"op": op, "seconds": round(s, 3), "calls": n} for op, (s, n) in
                                    sorted(fake_ops.items(), key=lambda item: -item[1][0])[: args.fake_ops]]
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "engine_compile_time.json"), "w") as f:
            json.dump(rows, f, indent=2)


def time_fake_ops() -> dict:
    """{aten op: [seconds, calls]} of the outermost FakeTensorMode.dispatch calls from now on. FakeTensorMode
    has no public hook per operator; this wraps its (private) dispatch method, for this diagnostic only."""
    from torch._subclasses import fake_tensor

    totals, depth, dispatch = {}, [0], fake_tensor.FakeTensorMode.dispatch

    def timed(self, func, types, args=(), kwargs=None):
        depth[0] += 1
        start = time.perf_counter()
        try:
            return dispatch(self, func, types, args, kwargs)
        finally:
            depth[0] -= 1
            if depth[0] == 0:  # nested calls (decompositions) count in their outer operator
                entry = totals.setdefault(str(func), [0.0, 0])
                entry[0] += time.perf_counter() - start
                entry[1] += 1

    fake_tensor.FakeTensorMode.dispatch = timed
    return totals


if __name__ == "__main__":
    main()
