"""Small in-memory datasets that follow the hf-dlm data contract (see collator.py), for tests, the
tiny example config and quick experiments. Large corpora use the Megatron indexed / packed datasets.

`TokenWindowDataset` is map-style: the Trainer's seeded sampler orders it and resumes by skipping
batches. For a stream that resumes from its own saved position, wrap it as the indexed data is wrapped:
`DistributedSampleStream(ShuffledSamples(TokenWindowDataset(ids), seed, num_epochs=None))`.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset


def pack_documents(documents: list[list[int]], seq_len: int, eos_token_id: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate token lists (each followed by `eos_token_id` if given) and cut them into windows.

    Returns input_ids (N, seq_len) and position_ids (N, seq_len), restarting at 0 at every document start."""
    from .streams import packed_position_ids

    tail = [eos_token_id] if eos_token_id is not None else []
    lengths = np.array([len(d) + len(tail) for d in documents], dtype=np.int64)
    ids = np.fromiter((t for d in documents for t in (*d, *tail)), dtype=np.int64, count=int(lengths.sum()))
    n = len(ids) // seq_len
    if n == 0:
        raise ValueError(f"pack_documents: {len(ids)} tokens do not fill one window of {seq_len}")
    starts = np.concatenate([[0], np.cumsum(lengths[lengths > 0])[:-1]])
    positions = packed_position_ids(starts[starts < len(ids)], len(ids))
    shape = (n, seq_len)
    return (torch.from_numpy(ids[: n * seq_len].reshape(shape)),
            torch.from_numpy(positions[: n * seq_len].reshape(shape)))


class TokenWindowDataset(Dataset):
    """Windows of token ids (N, L). `sample_index` is `epoch * N + i`, unique across epochs; the Trainer
    (through accelerate) calls `set_epoch` at the start of every epoch."""

    def __init__(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None):
        if input_ids.dim() != 2:
            raise ValueError(f"TokenWindowDataset: input_ids must be (N, L), got shape {tuple(input_ids.shape)}")
        self.input_ids = input_ids.long()
        self.position_ids = position_ids
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def __getitem__(self, index: int) -> dict:
        sample = {"input_ids": self.input_ids[index], "sample_index": self.epoch * len(self) + int(index)}
        if self.position_ids is not None:
            sample["position_ids"] = self.position_ids[index]
        return sample
