"""One-GPU measurements for the parallel layer (issue 18): the memory planner's prediction against the
measured peak, and the cost of context parallel's code paths at long sequences.

Part A (planner): Qwen3-1.7B shape (28 layers, hidden 2048, 16 heads, 8 KV heads, ffn 6144, vocab 151936,
tied), seq 4096, micro-batch 4, bf16 autocast over fp32 weights, fused AdamW, eager, masked-only head;
activation checkpointing off and on. Peak = torch.cuda.max_memory_allocated over the second optimizer
step (AdamW state exists), against `plan_layout(..., Layout(1, 1, 1, 1))`.

Part B (context parallel on one GPU): the same layer shape with 4 layers (attention dominates at these
lengths), activation checkpointing, micro-batch 1, seq 32k and 128k: plain SDPA against
`apply_context_parallel` over a 1-rank mesh with the all-gather-KV path and with PyTorch's ring attention.
With one rank the collectives move nothing: this is the overhead of the code paths (hooks, DTensor
dispatch, the ring kernels) at long sequence, and the loss must match the plain run.

    PYTHONUNBUFFERED=1 python benchmarks/parallel_memory_cp.py [--out results.json]
    python benchmarks/parallel_memory_cp.py --tiny   # CPU smoke run: a 2-layer 64-wide shape, seq 64, gloo;
                                                     # no peak memory on CPU, the CP losses must match plain
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from hf_dlm import DLMConfig, DLMForDiffusionLM
from hf_dlm.parallel.parallelize import parallelize_dlm
from hf_dlm.parallel.planner import Layout, ModelShape, plan_layout
from hf_dlm.diffusion.objective import MaskedDiffusionObjective

GIB = 1024**3
DEVICE = "cuda"  # --tiny: "cpu"
SHAPE = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
             num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
             mask_token_id=151935, qk_norm=True)


def build(layers: int, max_positions: int):
    config = DLMConfig(**{**SHAPE, "num_hidden_layers": layers, "max_position_embeddings": max_positions})
    config._attn_implementation = "sdpa"
    with torch.device(DEVICE):
        torch.manual_seed(0)
        model = DLMForDiffusionLM(config)
    return model.train()


def step_fn(model, optimizer, batch, sample_index):
    objective = MaskedDiffusionObjective(mask_token_id=SHAPE["mask_token_id"], normalization="batch", seed=0)
    inputs = objective.corrupt(batch, sample_index)
    kwargs = {k: v for k, v in inputs.items() if k not in ("t", "masked") and v is not None}
    with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=DEVICE == "cuda"):
        loss = model(**kwargs).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss)


def measure(model, micro_batch: int, seq: int, timed_steps: int) -> dict:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=DEVICE == "cuda")
    generator = torch.Generator().manual_seed(1)
    batch = torch.randint(0, SHAPE["vocab_size"] - 1, (micro_batch, seq), generator=generator).to(DEVICE)
    sample_index = torch.arange(1, micro_batch + 1)  # sample 0's hashed t masks nothing at seq 64 (--tiny)
    first_loss = step_fn(model, optimizer, batch, sample_index)  # warm-up; AdamW state allocated
    cuda = DEVICE == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(timed_steps):
        step_fn(model, optimizer, batch, sample_index)
    if cuda:
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / timed_steps
    return dict(first_loss=first_loss, step_s=seconds, tokens_per_s=micro_batch * seq / seconds,
                peak_gib=torch.cuda.max_memory_allocated() / GIB if cuda else float("nan"),
                reserved_gib=torch.cuda.max_memory_reserved() / GIB if cuda else float("nan"))


def release(*objects):
    del objects
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def part_a(rows: list, layers: int = 28, seq: int = 4096, micro_batch: int = 4):
    shape = ModelShape.from_config(DLMConfig(**{**SHAPE, "num_hidden_layers": layers}))
    for checkpointing in (False, True):
        model = build(layers, seq)
        parallelize_dlm(model, activation_checkpointing=checkpointing)
        result = measure(model, micro_batch, seq, timed_steps=2)
        predicted = plan_layout(shape, Layout(1, 1, 1, 1), seq, micro_batch,
                                activation_checkpointing=checkpointing).peak_gib
        rows.append(dict(part="planner", setup=f"{layers} layers mb{micro_batch} seq{seq} AC={'on' if checkpointing else 'off'}",
                         predicted_gib=predicted, error=(predicted - result["peak_gib"]) / result["peak_gib"], **result))
        print(rows[-1], flush=True)
        release(model)


def part_b(rows: list, seqs, variants=("plain", "all_gather", "ring")):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from hf_dlm.parallel.context_parallel import apply_context_parallel

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29512")
    dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo", rank=0, world_size=1)
    mesh = init_device_mesh(DEVICE, (1,), mesh_dim_names=("cp",))
    shape = ModelShape.from_config(DLMConfig(**{**SHAPE, "num_hidden_layers": 4}))
    for seq in seqs:
        for variant in variants:
            try:
                model = build(4, seq)
                parallelize_dlm(model, activation_checkpointing=True)
                if variant != "plain":
                    apply_context_parallel(model, mesh, backend=variant)
                result = measure(model, 1, seq, timed_steps=2 if seq <= 32768 else 1)
                predicted = plan_layout(shape, Layout(1, 1, 1, 1), seq, 1, activation_checkpointing=True).peak_gib
                rows.append(dict(part="context parallel", setup=f"4 layers seq {seq} AC {variant}",
                                 predicted_gib=predicted, **result))
                release(model)
            except Exception as error:  # report and go on: one failing path must not lose the other rows
                rows.append(dict(part="context parallel", setup=f"4 layers seq {seq} AC {variant}", failed=repr(error)[:300]))
                release()
            print(rows[-1], flush=True)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "parallel_memory_cp.json"))
    parser.add_argument("--seqs", default="32768,131072")
    parser.add_argument("--skip-planner", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run (2 layers of 64, seq 64, gloo)")
    args = parser.parse_args()
    global DEVICE
    if args.tiny:
        DEVICE = "cpu"
        SHAPE.update(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, mask_token_id=511)
    print(torch.__version__, torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", flush=True)
    rows = []
    if args.tiny:
        part_a(rows, layers=2, seq=64, micro_batch=2)
        part_b(rows, [64], variants=("plain", "all_gather"))
    else:
        if not args.skip_planner:
            part_a(rows)
        part_b(rows, [int(s) for s in args.seqs.split(",")])
    print(f"\n{'setup':<36} {'tokens/s':>10} {'step s':>8} {'peak GiB':>9} {'planner':>8} {'loss':>8}")
    for row in rows:
        if "failed" in row:
            print(f"{row['setup']:<36} failed: {row['failed']}")
            continue
        print(f"{row['setup']:<36} {row['tokens_per_s']:10.0f} {row['step_s']:8.3f} {row['peak_gib']:9.2f} "
              f"{row['predicted_gib']:8.2f} {row['first_loss']:8.4f}")
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    if args.tiny:  # every row ran; one-rank context parallel computes the plain run's loss
        assert not [row for row in rows if "failed" in row], rows
        cp = {row["setup"].split()[-1]: row["first_loss"] for row in rows if row["part"] == "context parallel"}
        assert cp["plain"] > 0 and abs(cp["all_gather"] - cp["plain"]) < 1e-4 * cp["plain"], cp


if __name__ == "__main__":
    main()
