"""The serving engine's host work per step, counted: the aten operators an engine step dispatches outside the model
forward (planning the packed step, committing, the schedule), on serving_throughput.py's core schedules. CPU,
deterministic (counts, not seconds): on the GPU each such operator costs host time while the device waits for the
step's one sync, and a compiled, CUDA-graph-replayed forward leaves these as the step's host cost. Also counted:
the packed-step plans (`RaggedStep`) built, against the engine steps.

    python benchmarks/engine_host_ops.py            # the GPU benchmark's sizes (64 + 256 tokens, block 32, 16 / 64 rows)
    python benchmarks/engine_host_ops.py --tiny     # small sizes (the test suite)
"""

from __future__ import annotations

import json
import os


def parse_args():
    from step_shapes import parse_schedule_args, schedule_parser  # this script's folder is on sys.path

    p = schedule_parser(__doc__)
    p.add_argument("--batches", default="16", help="all at once at these batch sizes too, beside --requests")
    args = parse_schedule_args(p)
    if args.tiny:
        args.batches = "4"
    return args


def main():
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from hf_dlm.serving import engine as engine_module
    from serving_throughput import drive  # the same schedules (this script's folder is on sys.path)
    from step_shapes import save_with_table, stand_in_model

    args = parse_args()

    class Counter(TorchDispatchMode):
        """Counts every aten operator; `inside` those of the model forward."""

        total = inside = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Counter.total += 1
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model = stand_in_model(args)
    forward_window = model.model.forward_window

    def counted_forward(*a, **k):
        before = Counter.total
        out = forward_window(*a, **k)
        Counter.inside += Counter.total - before
        return out

    model.model.forward_window = counted_forward
    plans, plan_class = [], engine_module.RaggedStep
    engine_module.RaggedStep = lambda *a, **k: plans.append(1) or plan_class(*a, **k)
    options = dict(max_new_tokens=args.new_tokens, block_length=args.block_length, steps=args.new_tokens,
                   cache="dual", temperature=0.0, stop_on_eos=False)
    schedules = [(f"batch {b}, all at once", b, 0) for b in sorted({*map(int, args.batches.split(",")), args.requests})]
    schedules.append((f"{args.requests} arriving one per {args.arrival_every} steps", args.requests, args.arrival_every))
    report = []
    for name, count, every in schedules:
        prompts = torch.randint(0, 120, (count, args.prompt_tokens), generator=torch.Generator().manual_seed(0))
        engine = engine_module.ContinuousBatchingEngine(model, max_batch_size=count, max_waiting=4 * count,
                                                        max_length=args.prompt_tokens + args.new_tokens,
                                                        preallocate=True)
        Counter.total = Counter.inside = 0
        plans.clear()
        with torch.inference_mode(), Counter():
            drive(engine, [engine_module.GenerationRequest(p.tolist(), engine.sampling_params(**options))
                           for p in prompts], every)
        steps = engine.stats["engine_steps"]
        row = {"schedule": name, "engine_steps": steps, "plans_built": len(plans),
               "ops_per_step_outside_forward": round((Counter.total - Counter.inside) / steps, 1),
               "ops_per_step_in_forward": round(Counter.inside / steps, 1)}
        report.append(row)
        print(json.dumps(row), flush=True)
    save_with_table(args, "engine_host_ops.json", {"args": vars(args), "schedules": report},
                    [("schedule", "schedule"), ("engine steps", "engine_steps"), ("plans built", "plans_built"),
                     ("aten ops per step outside the forward", "ops_per_step_outside_forward"),
                     ("in the forward (1 layer)", "ops_per_step_in_forward")], report)


if __name__ == "__main__":
    main()
