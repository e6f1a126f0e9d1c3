"""Pipeline bubble: measured stage times replayed through the GPipe and 1F1B schedules, against the theory
(p - 1) / (m + p - 1); and the pipeline runtime itself on one device.

One GPU cannot run two stages at once, so the bubble is measured in two parts:
1. every stage's forward and backward time per micro-batch is measured on the device (CUDA events, median
   of `--repeats`), with the real stage modules (`hf_dlm.parallel.pipeline.DLMPipelineStageModule`:
   embeddings on the first, the masked-only head and loss on the last);
2. those times are replayed through each schedule's per-rank action order with its dependencies (a
   forward waits for the previous stage's forward, a backward for the next stage's backward) to get the
   step time; bubble = 1 - busy / (p x step time).
Then one process runs both stages of a 2-stage cut through `ScheduleInterleaved1F1B` (a process group of
one; stages 0 and 1 on the same rank): its step time against the sum of the stage times is the schedule
machinery's overhead, and its loss is checked against the unsplit model.

    python benchmarks/pipeline_bubble.py --out results/pipeline_bubble.json          # H200 shape
    python benchmarks/pipeline_bubble.py --tiny                                       # CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hf_dlm import DLMConfig, DLMForDiffusionLM  # noqa: E402
from hf_dlm.parallel.pipeline import (DLMPipeline, DLMPipelineStageModule, PipelinePlan,  # noqa: E402
                                      pipeline_schedule_terms, split_layers)
from hf_dlm.diffusion.objective import MaskedDiffusionObjective  # noqa: E402


def rank_actions(schedule: str, p: int, m: int, rank: int) -> list[tuple[str, int]]:
    """("F" | "B", micro-batch) in the order rank `rank` runs them (torch's GPipe and 1F1B orders)."""
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warmup = min(p - 1 - rank, m)
    actions = [("F", i) for i in range(warmup)]
    forward, backward = warmup, 0
    while backward < m:
        if forward < m:
            actions.append(("F", forward))
            forward += 1
        actions.append(("B", backward))
        backward += 1
    return actions


def replay(schedule: str, forward: list[float], backward: list[float], m: int) -> dict:
    """Step time of a schedule from per-stage forward / backward times (one stage per rank)."""
    p = len(forward)
    orders = [rank_actions(schedule, p, m, r) for r in range(p)]
    done: dict[tuple[str, int, int], float] = {}
    position, clock = [0] * p, [0.0] * p
    while any(position[r] < len(orders[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            if position[r] == len(orders[r]):
                continue
            kind, i = orders[r][position[r]]
            needs = [("F", r - 1, i)] if kind == "F" and r > 0 else []
            if kind == "B":
                needs = [("F", r, i)] + ([("B", r + 1, i)] if r < p - 1 else [])
            if all(n in done for n in needs):
                start = max([clock[r]] + [done[n] for n in needs])
                clock[r] = start + (forward[r] if kind == "F" else backward[r])
                done[(kind, r, i)] = clock[r]
                position[r] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"{schedule}: the action orders deadlock")
    step = max(clock)
    busy = m * (sum(forward) + sum(backward))
    return {"step_ms": step, "bubble": 1 - busy / (p * step)}


def timed(fn, repeats: int, device: torch.device) -> float:
    """Median milliseconds of fn()."""
    times = []
    for _ in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[1:])


def stage_times(model, p: int, batch: dict, items, repeats: int, device) -> tuple[list[float], list[float]]:
    """Forward and forward+backward milliseconds of each of p stages for one micro-batch (backward = the
    difference). The inputs of stage s are the real hidden states of stage s - 1."""
    plan = PipelinePlan.from_model(model)
    stages = [DLMPipelineStageModule(model, r, s == 0, s == p - 1, plan) for s, r in enumerate(split_layers(
        model.config.num_hidden_layers, p))]
    stages[-1].loss_normaliser = items
    kwargs = {"labels": batch["labels"], "label_weights": batch["label_weights"]}
    inputs, forward, backward = batch["input_ids"], [], []
    for stage in stages:
        def run_forward(stage=stage, inputs=inputs):
            with torch.no_grad(), torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
                return stage(inputs, **kwargs)

        def run_both(stage=stage, inputs=inputs):
            leaf = inputs.detach().requires_grad_(inputs.is_floating_point())
            with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
                output = stage(leaf, **kwargs)
            output.backward(torch.ones_like(output))
            stage.zero_grad(set_to_none=True)

        f = timed(run_forward, repeats, device)
        forward.append(f)
        backward.append(max(timed(run_both, repeats, device) - f, 0.0))
        inputs = run_forward()
    return forward, backward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny model (smoke test)")
    parser.add_argument("--device", default=None, help="default: cuda, or cpu with --tiny")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--out", default=None, help="JSON file for the results")
    args = parser.parse_args()
    device = torch.device(args.device or ("cpu" if args.tiny else "cuda"))
    if args.tiny:
        shape = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4)
        args.seq = min(args.seq, 64)
    else:  # Qwen3-1.7B's layer shape, 16 layers, a 32k vocabulary
        shape = dict(vocab_size=32000, hidden_size=2048, intermediate_size=6144, num_hidden_layers=16,
                     num_attention_heads=16, num_key_value_heads=8)
    torch.manual_seed(0)
    config = DLMConfig(**shape, qk_norm=True, mask_token_id=shape["vocab_size"] - 1, max_position_embeddings=args.seq)
    config._attn_implementation = "sdpa"
    with torch.device(device):  # initialised on the device: seconds, not a minute of CPU init
        model = DLMForDiffusionLM(config).train()
    objective = MaskedDiffusionObjective(mask_token_id=config.mask_token_id, normalization="token")
    ids = torch.randint(0, config.vocab_size - 1, (args.micro_batch, args.seq), device=device)
    corrupted = objective.corrupt(ids, torch.arange(args.micro_batch, device=device))
    batch = {k: corrupted[k] for k in ("input_ids", "labels", "label_weights")}
    items = corrupted["num_items_in_batch"]
    results = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               "torch": torch.__version__, "shape": shape, "seq": args.seq, "micro_batch": args.micro_batch,
               "replay": []}
    print("| p | schedule | m | stage fwd ms | stage bwd ms | step ms | bubble measured | balanced stages | theory |")
    print("|---|---|---|---|---|---|---|---|---|")
    for p in (2, 4):
        forward, backward = stage_times(model, p, batch, items, args.repeats, device)
        for schedule in ("gpipe", "1f1b"):
            for m in (p, 2 * p, 4 * p, 8 * p):
                row = replay(schedule, forward, backward, m)
                # the same total work spread evenly over the stages: the replay then reproduces the theory
                even = replay(schedule, [sum(forward) / p] * p, [sum(backward) / p] * p, m)["bubble"]
                theory = pipeline_schedule_terms(config.num_hidden_layers, p, m, schedule)["bubble_fraction"]
                results["replay"].append({"p": p, "schedule": schedule, "m": m, "forward_ms": forward,
                                          "backward_ms": backward, **row, "balanced_bubble": even, "theory": theory})
                print(f"| {p} | {schedule} | {m} | {' / '.join(f'{t:.2f}' for t in forward)} | "
                      f"{' / '.join(f'{t:.2f}' for t in backward)} | {row['step_ms']:.1f} | {row['bubble']:.3f} | "
                      f"{even:.3f} | {theory:.3f} |", flush=True)

    save(results, args.out)  # the replay's rows survive a failure of the runtime part

    # the pipeline runtime on one process (group of one): GPipe and 1F1B with the whole model as one stage,
    # interleaved 1F1B with a 2-stage cut, both stages on this rank; losses against the unsplit model
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    dist.init_process_group("gloo" if device.type == "cpu" else "nccl", rank=0, world_size=1,
                            device_id=torch.device("cuda", torch.cuda.current_device()) if device.type == "cuda" else None)
    m = 8
    micro_batches = [batch] * m
    with torch.no_grad(), torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
        reference = float(DLMForDiffusionLM.forward(model, **batch, num_items_in_batch=items).loss)
    results["one_process"] = []
    print(f"\n| one process, {m} micro-batches | stages | pipeline step ms | stages alone ms | overhead | loss | "
          "unsplit loss |\n|---|---|---|---|---|---|---|")
    for schedule, stages in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)):
        try:
            pipeline = DLMPipeline(model, schedule=schedule, stages_per_rank=stages, device=device)
            pipeline.step(micro_batches, items * m)  # first step: the stages' metadata inference
            pipeline.model.zero_grad(set_to_none=True)
        except Exception as error:  # report and go on: the replay above is the measurement
            print(f"| {schedule} | {stages} | failed: {type(error).__name__}: {error} |||||", flush=True)
            results["one_process"].append({"schedule": schedule, "error": f"{type(error).__name__}: {error}"})
            continue
        forward, backward = stage_times(model, stages, batch, items, args.repeats, device)

        def pipeline_step(pipeline=pipeline):
            with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
                loss = pipeline.step(micro_batches, items * m)  # m copies: the loss is one micro-batch's
            pipeline.model.zero_grad(set_to_none=True)
            return loss.detach()

        pipeline_ms = timed(pipeline_step, args.repeats, device)
        loss = float(pipeline_step())
        serial = m * (sum(forward) + sum(backward))
        results["one_process"].append({"schedule": schedule, "stages": stages, "pipeline_step_ms": pipeline_ms,
                                       "stage_sum_ms": serial, "overhead": pipeline_ms / serial - 1, "loss": loss,
                                       "unsplit_loss": reference})
        print(f"| {schedule} | {stages} | {pipeline_ms:.1f} | {serial:.1f} | {pipeline_ms / serial - 1:+.1%} | "
              f"{loss:.5f} | {reference:.5f} |", flush=True)
    dist.destroy_process_group()
    save(results, args.out)


def save(results: dict, path: str | None):
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
