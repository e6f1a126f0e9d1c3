"""How many CUDA graphs the serving engine captures and how many graphs Dynamo compiles, run by run, on the
schedules of serving_throughput.py's core part (all at once; requests arriving one per `--arrival-every` engine
steps). CPU only, seconds: the step shapes depend on the lengths, not on the model's width, so a one-layer
model stands in for the 8B one, and the engine's compile runs Dynamo without Inductor (`compile="eager"`):
on the GPU each Dynamo graph is a whole-model Inductor compile.

A compiled engine step is replayed from a CUDA graph per bucketed shape, captured the second time the shape is
seen (`StepGraphs`); a capture records the forward once more. A schedule whose shapes occur once per run
captures them during its second run: the count says how many runs a benchmark must repeat before its timed
run is the engine's steady state.

It also counts the padding of each schedule's steps: packed tokens (the GEMMs' rows) and attention query-key
pairs, bucketed against real. A step's attention pads every row to the widest row's query count, so a step that
mixes a row at a block start (a refresh: the whole canvas) with rows mid-block (the block) computes the block
rows' attention at the canvas width.

    python benchmarks/step_shapes.py            # the GPU benchmark's sizes (64 + 256 tokens, block 32, 64 rows)
    python benchmarks/step_shapes.py --tiny     # small sizes (the test suite)
"""

from __future__ import annotations

import argparse
import json
import os


def schedule_parser(doc: str) -> argparse.ArgumentParser:
    """The arguments of the core part's schedules replayed on CPU (this script and engine_host_ops.py): all at once,
    and `--requests` arriving one per `--arrival-every` engine steps."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--block-length", type=int, default=32)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--arrival-every", type=int, default=8)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    return p


def parse_schedule_args(p: argparse.ArgumentParser) -> argparse.Namespace:
    args = p.parse_args()
    if args.tiny:
        args.prompt_tokens, args.new_tokens, args.block_length, args.requests, args.arrival_every = 8, 32, 8, 8, 2
    return args


def parse_args():
    p = schedule_parser(__doc__)
    p.add_argument("--runs", type=int, default=3)
    return parse_schedule_args(p)


def stand_in_model(args):
    """One layer at hidden 32: what these counts depend on (lengths, rows, schedule) is not the model's width."""
    from hf_dlm import DLMConfig, DLMForDiffusionLM

    config = DLMConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=2, head_dim=16, mask_token_id=127,
                       max_position_embeddings=args.prompt_tokens + args.new_tokens)
    return DLMForDiffusionLM(config).eval()


class CountedGraph:
    """CPU stand-in for `CapturedStep` (a CUDA graph): inputs copied into buffers made at capture, then the forward
    (a real graph replays its kernels without calling Dynamo again); the engine counts the captures."""

    def __init__(self, forward, tensors, fixed, pool=None, warmups=None):
        self.forward, self.fixed = forward, fixed
        self.inputs = {name: None if t is None else t.clone() for name, t in tensors.items()}

    def __call__(self, tensors):
        for name, t in tensors.items():
            if t is not None:
                self.inputs[name].copy_(t)
        return self.forward(**self.inputs, **self.fixed)


class WorkCounter:
    """Wraps `StepGraphs.__call__`: per step, packed tokens and attention query-key pairs, bucketed and real."""

    def __init__(self, call):
        self.call, self.totals = call, dict.fromkeys(("tokens", "real_tokens", "pairs", "real_pairs"), 0)

    def __call__(self, graphs, forward, tensors, **fixed):
        import torch

        slots = tensors["token_slot"]  # (T,)
        real = slots != fixed["keys"][0].shape[1] - 1  # not the trash slot
        masks = [m for m in (tensors["mask"], tensors.get("long_mask")) if m is not None]  # (rows, 1, Q, K) each
        out = tensors.get("token_out")  # a split step: the tokens' places in the two calls' (rows x Q) laid end to end
        if out is None:
            out = tensors["token_row"] * masks[0].shape[2] + tensors["token_qpos"]
        self.totals["tokens"] += slots.numel()
        self.totals["real_tokens"] += int(real.sum())
        self.totals["pairs"] += sum(m.shape[0] * m.shape[2] * m.shape[3] for m in masks)
        # an additive bias or a boolean mask: the keys each (row, query) sees
        seen = torch.cat([(m == 0 if m.dtype.is_floating_point else m).sum(-1).flatten() for m in masks])
        self.totals["real_pairs"] += int(seen[out[real]].sum())
        return self.call(graphs, forward, tensors, **fixed)


def main():
    import torch
    from torch._dynamo.utils import counters

    from hf_dlm.generation import compiled_step
    from hf_dlm.serving.engine import ContinuousBatchingEngine, GenerationRequest
    from serving_throughput import drive  # the same schedules (this script's folder is on sys.path)

    args = parse_args()
    compiled_step.CapturedStep = CountedGraph
    torch.cuda.graph_pool_handle = object  # a CPU build has no CUDA pool handle (`CountedGraph` ignores it)
    work = WorkCounter(compiled_step.StepGraphs.__call__)
    compiled_step.StepGraphs.__call__ = lambda graphs, forward, tensors, **fixed: work(graphs, forward, tensors, **fixed)
    model = stand_in_model(args)
    prompts = torch.randint(0, 120, (args.requests, args.prompt_tokens), generator=torch.Generator().manual_seed(0))
    options = dict(max_new_tokens=args.new_tokens, block_length=args.block_length, steps=args.new_tokens,
                   cache="dual", temperature=0.0, stop_on_eos=False)
    report = []
    for name, every in (("all at once", 0), (f"one per {args.arrival_every} steps", args.arrival_every)):
        torch._dynamo.reset()
        counters.clear()
        engine = ContinuousBatchingEngine(model, max_batch_size=args.requests, max_waiting=4 * args.requests,
                                          max_length=args.prompt_tokens + args.new_tokens, preallocate=True,
                                          compile="eager")
        engine.captures = True  # the captured path, `CountedGraph` standing in for the CUDA graphs
        for run in range(1, args.runs + 1):
            before, work_before = dict(engine.stats), dict(work.totals)
            with torch.inference_mode():
                drive(engine, [GenerationRequest(p.tolist(), engine.sampling_params(**options)) for p in prompts],
                      every)
            row = {"schedule": name, "run": run, "engine_steps": engine.stats["engine_steps"] - before["engine_steps"],
                   "shapes_seen": len(engine.graphs.graphs),
                   "captures": engine.stats["graph_captures"] - before["graph_captures"],
                   "dynamo_graphs_so_far": counters["stats"]["unique_graphs"]}
            done = {name: work.totals[name] - work_before[name] for name in work.totals}
            row.update(token_padding=round(done["tokens"] / done["real_tokens"], 3),
                       attention_padding=round(done["pairs"] / done["real_pairs"], 3), **done)
            report.append(row)
            print(json.dumps(row), flush=True)
    columns = [("schedule", "schedule"), ("run", "run"), ("engine steps", "engine_steps"),
               ("distinct shapes seen so far", "shapes_seen"), ("graphs captured in the run", "captures"),
               ("Dynamo graphs so far", "dynamo_graphs_so_far"), ("packed tokens / real", "token_padding"),
               ("attention pairs / real", "attention_padding")]
    save_with_table(args, "step_shapes.json", {"args": vars(args), "runs": report}, columns, report)


def save_with_table(args, filename: str, payload: dict, columns: list[tuple[str, str]], rows: list[dict]) -> None:
    """`payload` as JSON in --out, and `rows` printed as a markdown table of `columns` (title, key)."""
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, filename), "w") as f:
        json.dump(payload, f, indent=2)
    print("| " + " | ".join(title for title, _ in columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        print("| " + " | ".join(str(row[key]) for _, key in columns) + " |")


if __name__ == "__main__":
    main()
