"""Training datasets over indexed token files: packed windows, blends, seeded epochs, rank shards.

Every sample is a dict (the contract with the trainer):
  input_ids     LongTensor (L,)
  position_ids  LongTensor (L,), restarting at 0 wherever a document starts (the model builds its
                packed-document masks from exactly that); the first token of a window is always 0
  sample_index  int, a GLOBAL index unique per draw (epoch * samples_per_epoch + position in the epoch);
                the diffusion noise is keyed by it, so it never depends on rank, world size or batch size
SFT samples add `attention_mask` and `prompt_mask` (see `sft_data.py`). `torch.utils.data.default_collate` (the DataLoader's default) stacks samples.

Layers, each usable from plain PyTorch:
  PackedDataset          map-style: window i of one indexed dataset (no shuffling)
  BlendedDataset         map-style: several datasets mixed by weight (exact ratios, seeded)
  ShuffledSamples        map-style over global positions: epochs, each a fresh seeded permutation
  DistributedSampleStream  IterableDataset: this rank's share of the global positions, resumable
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from .indexed_dataset import IndexedDataset


def packed_position_ids(document_starts: np.ndarray, length: int) -> np.ndarray:
    """(length,) positions that restart at 0 at every offset in `document_starts` (offsets in [0, length))."""
    restart = np.zeros(length, dtype=np.int64)
    restart[document_starts] = document_starts
    np.maximum.accumulate(restart, out=restart)
    return np.arange(length, dtype=np.int64) - restart


class PackedDataset(Dataset):
    """Fixed-length windows over the concatenation of all documents of an indexed dataset.

    Window i holds tokens [i * seq_length, (i + 1) * seq_length) of the token stream; documents run on
    across windows, the tail that does not fill a window is dropped. Nothing is padded.
    """

    def __init__(self, data: str | IndexedDataset, seq_length: int):
        self.indexed = data if isinstance(data, IndexedDataset) else IndexedDataset(data)
        self.seq_length = seq_length
        self.tokens = self.indexed.token_stream()
        lengths = self.indexed.document_lengths()
        self.document_starts = np.concatenate([[0], np.cumsum(lengths[lengths > 0])[:-1]]).astype(np.int64)
        self.num_windows = len(self.tokens) // seq_length
        if self.num_windows == 0:
            raise ValueError(f"{self.indexed.prefix}: {len(self.tokens)} tokens, fewer than one window of {seq_length}")

    def __len__(self) -> int:
        return self.num_windows

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < self.num_windows:
            raise IndexError(f"window {i} out of range for {self.num_windows} windows")
        start = i * self.seq_length
        end = start + self.seq_length
        first, last = np.searchsorted(self.document_starts, [start, end])
        position_ids = packed_position_ids(self.document_starts[first:last] - start, self.seq_length)
        return {
            "input_ids": torch.from_numpy(self.tokens[start:end].astype(np.int64)),
            "position_ids": torch.from_numpy(position_ids),
            "sample_index": i,
        }


def blend_schedule(weights, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Which dataset each of `size` samples comes from, and the how-manieth draw from it that is.

    Dataset d's k-th draw is placed at time (k + 0.5) / w_d and samples take the earliest times, so after
    any n samples dataset d has given n * w_d samples to within one (Megatron reaches the same with a
    greedy loop in C++; this is the vectorised equivalent)."""
    weights = np.asarray(weights, dtype=np.float64)
    if weights.ndim != 1 or len(weights) == 0 or (weights < 0).any() or weights.sum() <= 0:
        raise ValueError(f"blend weights must be non-negative with a positive sum, got {weights.tolist()}")
    weights = weights / weights.sum()
    times, owners, draws = [], [], []
    for d, w in enumerate(weights):
        if w == 0:
            continue
        k = np.arange(int(np.ceil(size * w)) + 1)
        times.append((k + 0.5) / w)
        owners.append(np.full(len(k), d, dtype=np.int64))
        draws.append(k)
    order = np.argsort(np.concatenate(times), kind="stable")[:size]
    return np.concatenate(owners)[order], np.concatenate(draws)[order]


class BlendedDataset(Dataset):
    """Mixes map-style datasets by weight. Each dataset is read in its own seeded order and re-permuted
    when it runs out (upsampling), so every sample of a small dataset is seen before any repeats."""

    def __init__(self, datasets: list[Dataset], weights: list[float], size: int | None = None, seed: int = 0):
        if len(datasets) != len(weights):
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        self.datasets, self.seed = datasets, seed
        self.size = sum(len(d) for d in datasets) if size is None else size
        self.dataset_index, self.dataset_draw = blend_schedule(weights, self.size)

    def __len__(self) -> int:
        return self.size

    def _order(self, d: int, epoch: int) -> np.ndarray:
        return _recent_order(self, (self.seed, d, epoch), len(self.datasets[d]), keep=2 * len(self.datasets))

    def __getitem__(self, i: int) -> dict:
        d, draw = int(self.dataset_index[i]), int(self.dataset_draw[i])
        epoch, j = divmod(draw, len(self.datasets[d]))
        sample = dict(self.datasets[d][int(self._order(d, epoch)[j])])
        sample["sample_index"] = i
        return sample


def _recent_order(owner, seed: tuple, n: int, keep: int) -> np.ndarray:
    """The permutation of range(n) seeded by `seed`, memoised on `owner` (the last `keep` of them). Not
    `functools.lru_cache` on a method: that is one cache shared by every instance, so two datasets read
    in turn would evict each other's orders and redraw an O(n) permutation per sample."""
    orders = owner.__dict__.setdefault("_orders", {})
    if seed not in orders:
        if len(orders) >= keep:
            orders.pop(next(iter(orders)))
        orders[seed] = np.random.default_rng(list(seed)).permutation(n)
    return orders[seed]


class ShuffledSamples(Dataset):
    """Global position g -> sample `perm_epoch[g % N]` of `dataset`, with `sample_index = g`.

    `perm_epoch` is a permutation seeded by (seed, epoch), epoch = g // N, so each epoch has its own
    order and the whole stream is a pure function of (seed, g). `num_epochs=None`: endless (no len;
    for trainers driven by max_steps)."""

    def __init__(self, dataset: Dataset, seed: int = 0, shuffle: bool = True, num_epochs: int | None = 1):
        self.dataset, self.seed, self.shuffle, self.num_epochs = dataset, seed, shuffle, num_epochs
        self.samples_per_epoch = len(dataset)

    def __len__(self) -> int:
        if self.num_epochs is None:
            raise TypeError("an endless ShuffledSamples (num_epochs=None) has no length")
        return self.samples_per_epoch * self.num_epochs

    def _order(self, epoch: int) -> np.ndarray:
        return _recent_order(self, (self.seed, epoch), self.samples_per_epoch, keep=2)

    def __getitem__(self, g: int) -> dict:
        epoch, j = divmod(int(g), self.samples_per_epoch)
        if g < 0 or (self.num_epochs is not None and epoch >= self.num_epochs):
            raise IndexError(f"position {g} outside {self.num_epochs} epochs of {self.samples_per_epoch} samples")
        item = int(self._order(epoch)[j]) if self.shuffle else j
        sample = dict(self.dataset[item])
        sample["sample_index"] = int(g)
        return sample


def data_parallel_rank_and_world() -> tuple[int, int]:
    """(rank, world size) of torch.distributed, (0, 1) when it is not initialised: for plain PyTorch DDP
    loops. Under DLMTrainer / accelerate keep the default (0, 1): accelerate shards an iterable dataset
    itself (`IterableDatasetShard`: every rank reads the whole stream and keeps its slice of each
    global batch), and sharding here as well would silently drop data."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _check_rank(rank: int, world_size: int) -> None:
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world size {world_size}")


class DistributedSampleStream(IterableDataset):
    """This rank's share of the global positions of `samples`, starting after `consumed_samples`.

    Rank r of W takes positions consumed + r, consumed + r + W, ...: ranks never overlap, and after s
    steps of B samples per rank the ranks together have consumed exactly positions [0, s * W * B).
    Pass rank / world size for loops that shard themselves (`data_parallel_rank_and_world()`); keep 0 / 1
    under DLMTrainer / accelerate, which shard iterable datasets on their own.
    DataLoader workers split this rank's positions by whole micro-batches of `micro_batch_size`, so
    batches come out in order. `state_dict()` is the position right after the last sample this process
    yielded: exact with num_workers=0, and inside a worker right after it yields a batch (where a
    collate_fn reads it, as DLMDataCollator does); the main process's copy does not move when workers
    read, so there resume from `{"consumed_samples": steps * W * B}`. A new iteration goes on where the last
    one stopped (in this process, or in persistent workers), so no sample index is drawn twice.
    `max_samples` (default: len(samples), or endless for an endless `samples`) ends the stream.
    """

    def __init__(self, samples: ShuffledSamples, rank: int = 0, world_size: int = 1,
                 micro_batch_size: int = 1, consumed_samples: int = 0, max_samples: int | None = -1):
        self.samples = samples
        _check_rank(rank, world_size)
        self.rank, self.world_size = rank, world_size
        self.micro_batch_size = micro_batch_size
        endless = getattr(samples, "num_epochs", 1) is None
        self.max_samples = (None if endless else len(samples)) if max_samples == -1 else max_samples
        self.consumed_samples = consumed_samples
        self._next_k = 0  # this rank's local index after the last yielded sample

    def _positions(self):
        g = self.consumed_samples + self.rank
        while self.max_samples is None or g < self.max_samples:
            yield g
            g += self.world_size

    def __iter__(self):
        worker = get_worker_info()
        self.consumed_samples += self._next_k * self.world_size  # a new iteration goes on where the last stopped
        self._next_k = 0
        for k, g in enumerate(self._positions()):
            if worker is not None and (k // self.micro_batch_size) % worker.num_workers != worker.id:
                continue
            sample = self.samples[g]
            self._next_k = k + 1
            yield sample

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples + self._next_k * self.world_size}

    def load_state_dict(self, state: dict) -> None:
        self.consumed_samples, self._next_k = int(state["consumed_samples"]), 0


def build_pretraining_dataset(prefixes: list[str], seq_length: int, weights: list[float] | None = None,
                              seed: int = 0, num_epochs: int | None = 1, blend_size: int | None = None,
                              rank: int = 0, world_size: int = 1, micro_batch_size: int = 1,
                              consumed_samples: int = 0) -> DistributedSampleStream:
    """The usual stack: packed windows of each prefix, blended by `weights` (default: by size), shuffled
    per epoch, this rank's share. Feed it to `torch.utils.data.DataLoader(...)`, whose default collate
    stacks the samples.
    `num_epochs=None` streams without end (for a trainer stopped by max_steps)."""
    packed = [PackedDataset(prefix, seq_length) for prefix in prefixes]
    if len(packed) == 1 and weights is None:
        source = packed[0]
    else:
        source = BlendedDataset(packed, weights or [len(p) for p in packed], size=blend_size, seed=seed)
    return DistributedSampleStream(ShuffledSamples(source, seed=seed, num_epochs=num_epochs), rank=rank,
                                   world_size=world_size, micro_batch_size=micro_batch_size,
                                   consumed_samples=consumed_samples)
