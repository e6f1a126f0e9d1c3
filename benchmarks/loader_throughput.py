"""Training-loader throughput on CPU: samples/s of packed 4096-token samples from indexed files
(blend of two prefixes, shuffled, rank-sharded stream, DataLoader with its default collate).

    python benchmarks/loader_throughput.py --tokens 40_000_000 --samples 2000
    python benchmarks/loader_throughput.py --tiny    # seconds: 200k tokens, 64-token samples, 0 workers

The 1.7B H200 benchmark consumes about 10 samples/s of 4096 tokens (~39k tokens/s).
"""

from __future__ import annotations

import argparse
import os
import atexit
import shutil
import tempfile
import time

import numpy as np


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=40_000_000, help="tokens per prefix (random ids, int32)")
    parser.add_argument("--seq-length", type=int, default=4096, help="tokens per sample")
    parser.add_argument("--samples", type=int, default=2000, help="samples timed per setup")
    parser.add_argument("--batch-size", type=int, default=4, help="micro-batch size")
    parser.add_argument("--num-workers", type=int, nargs="+", default=[0, 2], help="DataLoader worker counts")
    parser.add_argument("--tiny", action="store_true", help="smoke run in seconds (small files, no worker processes)")
    args = parser.parse_args()
    if args.tiny:
        args.tokens, args.seq_length, args.samples, args.num_workers = 200_000, 64, 64, [0]

    import torch
    from torch.utils.data import DataLoader

    from hf_dlm.data.streams import build_pretraining_dataset
    from hf_dlm.data.indexed_dataset import IndexedDatasetWriter

    work = tempfile.mkdtemp(prefix="hf_dlm_loader_")
    atexit.register(shutil.rmtree, work, ignore_errors=True)
    rng = np.random.default_rng(0)
    prefixes = []
    for k in range(2):  # documents of log-normal length (median ~600 tokens), vocab of Qwen3 (int32 ids)
        prefix = os.path.join(work, f"p{k}")
        lengths = np.clip(rng.lognormal(6.4, 1.0, size=args.tokens // 400), 1, 100_000).astype(np.int64)
        lengths = lengths[np.cumsum(lengths) <= args.tokens]
        with IndexedDatasetWriter(prefix, np.int32) as writer:
            writer.add_documents(rng.integers(0, 151_936, size=int(lengths.sum()), dtype=np.int32), lengths)
        prefixes.append(prefix)
    print(f"{len(prefixes)} prefixes x {args.tokens:,} tokens, seq {args.seq_length}, micro-batch {args.batch_size}, "
          f"{os.cpu_count()} CPUs, torch {torch.__version__}")
    print("\n| DataLoader workers | samples/s | tokens/s |\n|---|---|---|")
    for num_workers in args.num_workers:
        stream = build_pretraining_dataset(prefixes, args.seq_length, weights=[0.7, 0.3], seed=0, num_epochs=None,
                                           rank=1, world_size=8,
                                           micro_batch_size=args.batch_size)
        loader = DataLoader(stream, batch_size=args.batch_size, num_workers=num_workers,
                            pin_memory=False)
        it = iter(loader)
        next(it)  # start-up (workers, permutations) is not throughput
        start, seen = time.perf_counter(), 0
        while seen < args.samples:
            batch = next(it)
            seen += batch["input_ids"].shape[0]
        seconds = time.perf_counter() - start
        assert batch["input_ids"].shape == (args.batch_size, args.seq_length), batch["input_ids"].shape
        print(f"| {num_workers} | {seen / seconds:,.0f} | {seen * args.seq_length / seconds:,.0f} |")


if __name__ == "__main__":
    main()
