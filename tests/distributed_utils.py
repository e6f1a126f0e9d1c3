"""Multi-process CPU tests: spawn gloo workers that rendezvous through a file and hand rank 0's results back."""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def spawn_workers(worker, nprocs: int, *args):
    """Run `worker(rank, init_file, out_file, *args)` in `nprocs` processes; returns what rank 0 passed to
    `finish(results, out_file)`."""
    with tempfile.TemporaryDirectory() as folder:
        out_file = os.path.join(folder, "results.pt")
        mp.spawn(worker, args=(os.path.join(folder, "init"), out_file, *args), nprocs=nprocs, join=True)
        return torch.load(out_file)


def finish(results, out_file: str) -> None:
    """Rank 0 writes `results`; every rank then leaves the process group."""
    if dist.get_rank() == 0:
        torch.save(results, out_file)
    dist.barrier()
    dist.destroy_process_group()
