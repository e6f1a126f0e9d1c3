"""Reader and writer for Megatron-core's indexed token files (`PREFIX.bin` + `PREFIX.idx`).

Hand-written because the only implementation lives inside megatron-core, which hf-dlm does not depend
on; files written here open in Megatron / MegaDLMs and theirs open here (tests check both ways).

`.bin`: the token ids of every sequence, back to back, in one numpy dtype, nothing else.
`.idx` (all little-endian):

    9 bytes   b"MMIDIDX\\x00\\x00"
    uint64    version, always 1
    uint8     dtype code (see `DTYPE_CODES`)
    uint64    S, the number of sequences
    uint64    D, the number of entries of the document index (documents + 1)
    int32[S]  sequence lengths, in tokens
    int64[S]  sequence pointers, byte offsets into `.bin`
    int64[D]  document index: 0, then after each document the number of sequences written so far
    int8[S]   sequence modes (multimodal files only; not written here, ignored when present)

Writes are atomic: both files are written under temporary names and renamed at `finalize()`, `.bin`
first, `.idx` last, so a `.idx` at the final name always belongs to a complete `.bin`.
"""

from __future__ import annotations

import os
import struct

import numpy as np

INDEX_HEADER = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}
_CODE_OF_DTYPE = {np.dtype(dtype): code for code, dtype in DTYPE_CODES.items()}
_HEADER_BYTES = len(INDEX_HEADER) + 8 + 1 + 8 + 8  # 34


def best_fitting_dtype(vocab_size: int | None) -> type:
    """Megatron's choice: uint16 below 65500 token ids, else int32."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def data_file_path(prefix: str) -> str:
    return f"{prefix}.bin"


def index_file_path(prefix: str) -> str:
    return f"{prefix}.idx"


class IndexedDatasetWriter:
    """Append documents, then `finalize()`; `abort()` (or leaving a `with` block on an exception) removes
    the temporary files and leaves whatever was at `prefix` before untouched."""

    def __init__(self, prefix: str, dtype=np.int32, overwrite: bool = False):
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODE_OF_DTYPE:
            raise ValueError(f"dtype {self.dtype} has no Megatron code; use one of "
                             f"{sorted(str(np.dtype(d)) for d in DTYPE_CODES.values())}")
        if not overwrite and (os.path.exists(index_file_path(prefix)) or os.path.exists(data_file_path(prefix))):
            raise FileExistsError(f"{index_file_path(prefix)} or {data_file_path(prefix)} already exists; "
                                  "pass overwrite=True (--overwrite) to replace it")
        directory = os.path.dirname(os.path.abspath(prefix))
        os.makedirs(directory, exist_ok=True)
        tag = f".tmp-{os.getpid()}"
        self._bin_tmp, self._idx_tmp = data_file_path(prefix) + tag, index_file_path(prefix) + tag
        self._bin = open(self._bin_tmp, "wb")
        self._sequence_lengths: list[np.ndarray] = []
        self._document_ends: list[int] = []  # sequences written after each document
        self._num_sequences = 0
        self.num_tokens = 0
        self._open = True

    @property
    def num_documents(self) -> int:
        return len(self._document_ends)

    def add_document(self, tokens, sequence_lengths=None) -> None:
        """One document: `tokens` (N,) of ints, split into sequences of `sequence_lengths` (default: one)."""
        tokens = np.asarray(tokens)
        if tokens.ndim != 1:
            raise ValueError(f"a document is a 1-D array of token ids, got shape {tokens.shape}")
        lengths = np.asarray([len(tokens)] if sequence_lengths is None else sequence_lengths, dtype=np.int64)
        if int(lengths.sum()) != len(tokens):
            raise ValueError(f"sequence lengths sum to {int(lengths.sum())}, document has {len(tokens)} tokens")
        self.add_documents(tokens, lengths, document_ends=np.array([len(lengths)]))

    def add_documents(self, tokens: np.ndarray, sequence_lengths, document_ends=None) -> None:
        """Many documents at once (the fast path): `tokens` is their concatenation, `sequence_lengths`
        (S,) each sequence's length, `document_ends` the number of sequences after each document within
        this call (default: one sequence per document)."""
        self._check_open()
        lengths = np.asarray(sequence_lengths, dtype=np.int64)
        if lengths.size and (lengths.min() < 0 or lengths.max() > np.iinfo(np.int32).max):
            raise ValueError("sequence lengths must be in [0, 2**31)")
        if np.issubdtype(self.dtype, np.integer) and tokens.size:
            low, high = int(tokens.min()), int(tokens.max())
            info = np.iinfo(self.dtype)
            if low < info.min or high > info.max:
                raise ValueError(f"token ids in [{low}, {high}] do not fit {self.dtype}; choose a wider dtype")
        self._bin.write(np.ascontiguousarray(tokens, dtype=self.dtype).tobytes())
        self._sequence_lengths.append(lengths)
        ends = np.arange(1, len(lengths) + 1) if document_ends is None else np.asarray(document_ends, dtype=np.int64)
        self._document_ends.extend((ends + self._num_sequences).tolist())
        self._num_sequences += len(lengths)
        self.num_tokens += int(lengths.sum())

    def finalize(self) -> None:
        """Write the index, flush both files to disk and move them to their final names."""
        self._check_open()
        try:
            self._bin.flush()
            os.fsync(self._bin.fileno())
            self._bin.close()
            lengths = np.concatenate(self._sequence_lengths) if self._sequence_lengths else np.zeros(0, np.int64)
            pointers = np.zeros(len(lengths), dtype=np.int64)
            np.cumsum(lengths[:-1] * self.dtype.itemsize, out=pointers[1:])
            document_index = np.asarray([0] + self._document_ends, dtype=np.int64)
            with open(self._idx_tmp, "wb") as f:
                f.write(INDEX_HEADER)
                f.write(struct.pack("<Q", INDEX_VERSION))
                f.write(struct.pack("<B", _CODE_OF_DTYPE[self.dtype]))
                f.write(struct.pack("<Q", len(lengths)))
                f.write(struct.pack("<Q", len(document_index)))
                f.write(lengths.astype("<i4").tobytes())
                f.write(pointers.astype("<i8").tobytes())
                f.write(document_index.astype("<i8").tobytes())
                f.flush()
                os.fsync(f.fileno())
            # an old .idx must not pair with the new .bin in between the two renames
            if os.path.exists(index_file_path(self.prefix)):
                os.remove(index_file_path(self.prefix))
            os.replace(self._bin_tmp, data_file_path(self.prefix))
            os.replace(self._idx_tmp, index_file_path(self.prefix))
        except BaseException:
            self.abort()
            raise
        self._open = False

    def abort(self) -> None:
        """Drop everything written so far; the final paths are not touched."""
        if not self._bin.closed:
            self._bin.close()
        for path in (self._bin_tmp, self._idx_tmp):
            if os.path.exists(path):
                os.remove(path)
        self._open = False

    def _check_open(self):
        if not self._open:
            raise RuntimeError(f"the writer for {self.prefix} is already finalized or aborted")

    def __enter__(self) -> "IndexedDatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb):
        if self._open:
            self.abort() if exc_type is not None else self.finalize()


class IndexedDataset:
    """Memory-mapped read access to `PREFIX.bin` / `PREFIX.idx`; `dataset[i]` is sequence i (np array)."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        idx_path, bin_path = index_file_path(prefix), data_file_path(prefix)
        for path in (idx_path, bin_path):
            if not os.path.exists(path):
                raise FileNotFoundError(f"{path} does not exist (expected PREFIX.bin and PREFIX.idx)")
        with open(idx_path, "rb") as f:
            head = f.read(_HEADER_BYTES)
        if len(head) < _HEADER_BYTES or head[:9] != INDEX_HEADER:
            raise ValueError(f"{idx_path}: not a Megatron indexed-dataset index (header {head[:9]!r}, "
                             f"expected {INDEX_HEADER!r})")
        version, code, num_sequences, num_document_entries = struct.unpack("<QBQQ", head[9:])
        if version != INDEX_VERSION:
            raise ValueError(f"{idx_path}: index version {version}, only version {INDEX_VERSION} is known")
        if code not in DTYPE_CODES:
            raise ValueError(f"{idx_path}: unknown dtype code {code}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        index = np.memmap(idx_path, dtype=np.uint8, mode="r")
        needed = _HEADER_BYTES + num_sequences * 12 + num_document_entries * 8
        if index.size < needed:
            raise ValueError(f"{idx_path}: truncated ({index.size} bytes, the header announces {needed})")
        offset = _HEADER_BYTES
        self.sequence_lengths = np.frombuffer(index, "<i4", num_sequences, offset)
        offset += num_sequences * 4
        self.sequence_pointers = np.frombuffer(index, "<i8", num_sequences, offset)
        offset += num_sequences * 8
        self.document_indices = np.frombuffer(index, "<i8", num_document_entries, offset)
        self.num_tokens = int(self.sequence_lengths.sum(dtype=np.int64))
        bin_size = os.path.getsize(bin_path)
        end = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize if num_sequences else 0
        if bin_size < end:
            raise ValueError(f"{bin_path}: {bin_size} bytes, but the index points up to byte {end}")
        self._tokens = np.memmap(bin_path, dtype=self.dtype, mode="r") if bin_size else np.zeros(0, self.dtype)

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens `offset : offset + length` of sequence `i` (a read-only view of the memory map)."""
        if not -len(self) <= i < len(self):
            raise IndexError(f"sequence {i} out of range for {len(self)} sequences")
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize + offset
        length = int(self.sequence_lengths[i]) - offset if length is None else length
        return self._tokens[start:start + length]

    @property
    def num_documents(self) -> int:
        return max(len(self.document_indices) - 1, 0)

    def document(self, d: int) -> np.ndarray:
        """All tokens of document `d` (its sequences are contiguous in `.bin`)."""
        first, last = int(self.document_indices[d]), int(self.document_indices[d + 1])
        if first == last:
            return np.zeros(0, self.dtype)
        start = int(self.sequence_pointers[first]) // self.dtype.itemsize
        return self._tokens[start:start + int(self.sequence_lengths[first:last].sum())]

    def document_lengths(self) -> np.ndarray:
        """(num_documents,) tokens per document."""
        sequence_ends = np.concatenate([[0], np.cumsum(self.sequence_lengths, dtype=np.int64)])
        return np.diff(sequence_ends[self.document_indices])

    def is_contiguous(self) -> bool:
        """True when `.bin` holds the sequences back to back in order (always so for files written by
        hf-dlm or Megatron's builder), so the token stream can be read as one array."""
        expected = np.zeros(len(self), np.int64)
        np.cumsum(self.sequence_lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=expected[1:])
        return bool(np.array_equal(expected, self.sequence_pointers))

    def token_stream(self) -> np.ndarray:
        """Every token of every document in order, as one memory-mapped array."""
        if not self.is_contiguous():
            raise ValueError(f"{self.prefix}: sequences are not stored back to back; cannot read them as one stream")
        start = int(self.sequence_pointers[0]) // self.dtype.itemsize if len(self) else 0
        return self._tokens[start:start + self.num_tokens]
