"""HF `datasets` (in memory or streaming) as training input: the same sample dicts as `datasets.py`.

Rows are tokenized on the fly (or read from an `input_ids` column), concatenated and cut into windows
of `seq_length` with restarting `position_ids`. Window g of epoch e has `sample_index` =
e * 2**40 + g when the number of windows per epoch is unknown in advance (streaming), so indices stay
globally unique across epochs without a pass over the data. Ranks take every world_size-th window.

`HFRowStream` streams already prepared rows (trl's SFT rows) unchanged, keyed the same way, and resumes from
the datasets library's own saved position instead of re-reading the data.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from .streams import _check_rank, packed_position_ids

EPOCH_STRIDE = 2 ** 40  # more windows than any epoch has


class HFPackedStream(IterableDataset):
    """Pack an HF `Dataset` or `IterableDataset` into fixed-length windows.

    dataset: rows with `text_column` (tokenized with `tokenizer`) or an `input_ids` column.
    shuffle: `dataset.shuffle(seed=seed + epoch)` per epoch for in-memory datasets; for streaming ones
    `shuffle(seed=seed, buffer_size=...)` once and `set_epoch(epoch)` (the datasets library's way).
    Resume with `load_state_dict`: the stream re-reads the data up to that point (tokenizing it again)
    and skips it, which is exact but not free; pre-tokenized indexed files resume instantly.
    """

    def __init__(self, dataset, seq_length: int, tokenizer=None, text_column: str = "text", append_eod: bool = True,
                 seed: int = 0, shuffle: bool = True, shuffle_buffer_size: int = 10_000, num_epochs: int | None = 1,
                 rank: int = 0, world_size: int = 1, micro_batch_size: int = 1, batch_size: int = 256):
        self.dataset, self.seq_length, self.tokenizer = dataset, seq_length, tokenizer
        self.text_column, self.append_eod, self.seed, self.shuffle = text_column, append_eod, seed, shuffle
        self.shuffle_buffer_size, self.num_epochs, self.batch_size = shuffle_buffer_size, num_epochs, batch_size
        _check_rank(rank, world_size)  # as in DistributedSampleStream: keep 0 / 1 under accelerate
        self.rank, self.world_size, self.micro_batch_size = rank, world_size, micro_batch_size
        self.start = (0, 0)  # (epoch, window) to resume from
        self._position = self.start
        if tokenizer is None and "input_ids" not in (dataset.column_names or []):
            raise ValueError(f"no tokenizer given and the dataset has no 'input_ids' column ({dataset.column_names})")
        if append_eod and tokenizer is not None and tokenizer.eos_token_id is None:
            raise ValueError("append_eod needs a tokenizer with an EOS token")

    def _epoch_rows(self, epoch: int):
        import datasets

        data = self.dataset
        streaming = isinstance(data, datasets.IterableDataset)
        if self.shuffle:
            if streaming:
                data = data.shuffle(seed=self.seed, buffer_size=self.shuffle_buffer_size)
            else:
                data = data.shuffle(seed=self.seed + epoch)
        if streaming:
            data.set_epoch(epoch)
        column = "input_ids" if self.tokenizer is None else self.text_column
        for batch in data.select_columns([column]).iter(batch_size=self.batch_size):
            if self.tokenizer is None:
                yield from batch[column]
            else:
                yield from self.tokenizer(batch[column], add_special_tokens=False)["input_ids"]

    def _windows(self, epoch: int):
        """(window number, tokens (L,), document starts within the window) for one epoch."""
        eod = [self.tokenizer.eos_token_id] if self.append_eod and self.tokenizer is not None else []
        buffer, starts, number = [], [], 0
        for ids in self._epoch_rows(epoch):
            starts.append(len(buffer))
            buffer.extend(ids)
            buffer.extend(eod)
            head = 0  # windows are cut at an offset, and the buffer is trimmed once per document: a long
            while len(buffer) - head >= self.seq_length:  # document costs linear, not quadratic, time
                end = head + self.seq_length
                inside = np.asarray([s - head for s in starts if s < end], dtype=np.int64)
                yield number, buffer[head:end], inside
                starts = [s for s in starts if s >= end]
                head, number = end, number + 1
            del buffer[:head]
            starts = [s - head for s in starts]

    def __iter__(self):
        worker = get_worker_info()
        self.start = self._position  # a new iteration goes on where the last stopped
        epoch = self.start[0]
        while self.num_epochs is None or epoch < self.num_epochs:
            for number, tokens, starts in self._windows(epoch):
                if (epoch, number) < self.start or number % self.world_size != self.rank:
                    continue
                # DataLoader workers take whole micro-batches in turn, so batches come out in window order
                local_batch = number // self.world_size // self.micro_batch_size
                if worker is not None and local_batch % worker.num_workers != worker.id:
                    continue
                self._position = (epoch, number + 1)
                yield {"input_ids": torch.tensor(tokens, dtype=torch.long),
                       "position_ids": torch.from_numpy(packed_position_ids(starts, self.seq_length)),
                       "sample_index": epoch * EPOCH_STRIDE + number}
            epoch += 1

    def state_dict(self) -> dict:
        """The next (epoch, window) to read: exact with num_workers=0, and inside a worker right after it
        yields a batch (where a collate_fn reads it)."""
        return {"epoch": self._position[0], "window": self._position[1]}

    def load_state_dict(self, state: dict) -> None:
        self.start = self._position = (int(state["epoch"]), int(state["window"]))


class HFRowStream(IterableDataset):
    """The rows of an HF streaming `IterableDataset`, pass after pass without end (a trainer stops it with
    max_steps), each with `sample_index` = pass * EPOCH_STRIDE + its row number in the pass, so every pass draws
    new diffusion noise. `state_dict()` is (pass, row, the datasets library's state of the pass) right after the
    last row yielded; `load_state_dict` re-opens that pass at that row (`IterableDataset.load_state_dict`), so
    a resumed run reads exactly the rows the interrupted one would have read next, without re-reading what
    came before. Exact with num_workers <= 1 and without a shuffle buffer (the datasets library does not save
    the buffer: a resume refills it). The stream sets `dataset`'s epoch and state: give each stream its own."""

    def __init__(self, dataset):
        self.dataset = dataset
        self._pass, self._row = 0, 0
        self._start: dict | None = None  # a saved position to resume from
        self._iterated = False

    def __iter__(self):
        worker = get_worker_info()
        if worker is not None and worker.num_workers > 1:
            raise RuntimeError("HFRowStream numbers rows in one process: use num_workers <= 1 (the datasets library "
                               "splits shards over workers, each of which would count from 0)")
        # a new iteration goes on where the last stopped (in this process), or from a loaded position
        start = self._start if self._start is not None else (self.state_dict() if self._iterated else None)
        self._start, self._iterated = None, True
        self._pass, self._row = (0, 0) if start is None else (int(start["epoch"]), int(start["row"]))
        while True:
            self.dataset.set_epoch(self._pass)
            if start is not None:  # applies to this pass only: the datasets library keys it by epoch
                self.dataset.load_state_dict(start["dataset"])
            rows_before = self._row
            for row in self.dataset:
                self._row += 1
                yield {**row, "sample_index": self._pass * EPOCH_STRIDE + self._row - 1}
            if self._row == 0 and rows_before == 0:
                raise ValueError("HFRowStream: the dataset yielded no rows")
            self._pass, self._row, start = self._pass + 1, 0, None

    def state_dict(self) -> dict:
        return {"epoch": self._pass, "row": self._row, "dataset": self.dataset.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self._start = state
