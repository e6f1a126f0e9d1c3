"""Tokenize JSONL (plain, .gz, .zst), Parquet, saved or hub HF datasets into Megatron indexed files.

The main process reads raw records in chunks; a pool of workers decodes, parses and tokenizes them and
sends back one token array per chunk; the main process appends the chunks in input order, so the
output is the same for any number of workers. Output goes through `IndexedDatasetWriter` (temporary
files renamed at the end), so an error or an interrupt never leaves a file that looks complete and
never touches a finished output unless `overwrite` is set.
"""

from __future__ import annotations

import collections
import dataclasses
import gzip
import zlib
import io
import itertools
import json
import multiprocessing
import os
import time
from collections.abc import Iterator

import numpy as np

from ..utils.import_utils import require
from .indexed_dataset import IndexedDatasetWriter, best_fitting_dtype, data_file_path, index_file_path


@dataclasses.dataclass
class PreprocessConfig:
    inputs: list[str] = dataclasses.field(
        metadata={"help": "JSONL files (.jsonl, .jsonl.gz, .jsonl.zst), Parquet files, saved HF dataset "
                          "directories or hub dataset names, read in this order"})
    output_prefix: str = dataclasses.field(metadata={"help": "writes OUTPUT_PREFIX.bin and OUTPUT_PREFIX.idx"})
    tokenizer: str = dataclasses.field(metadata={"help": "name or path for AutoTokenizer.from_pretrained"})
    json_key: str = dataclasses.field(default="text", metadata={"help": "field (column) holding each document's text"})
    workers: int = dataclasses.field(default=1, metadata={"help": "tokenizer processes (1: tokenize in this process)"})
    append_eod: bool = dataclasses.field(default=False, metadata={"help": "append the tokenizer's EOS id to every document"})
    overwrite: bool = dataclasses.field(default=False, metadata={"help": "replace an existing finished output"})
    skip_bad_lines: bool = dataclasses.field(
        default=False, metadata={"help": "skip bad records (count them, report the first few) instead of stopping"})
    split: str = dataclasses.field(default="train", metadata={"help": "split of a saved DatasetDict or hub dataset"})
    dtype: str | None = dataclasses.field(
        default=None, metadata={"help": "token dtype in .bin (default: uint16 below 65500 ids, else int32)"})
    chunk_size: int = dataclasses.field(default=1024, metadata={"help": "documents per worker task"})
    progress: bool = dataclasses.field(default=True, metadata={"help": "show a tqdm progress bar"})


class PreprocessError(ValueError):
    """A bad input record; the message starts with `file:line N` (or `row N`)."""


@dataclasses.dataclass
class PreprocessReport:
    documents: int
    tokens: int
    seconds: float
    skipped: int
    bad_locations: list[str]
    output_prefix: str

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)

    def __str__(self) -> str:
        lines = [f"wrote {data_file_path(self.output_prefix)} and {index_file_path(self.output_prefix)}",
                 f"documents: {self.documents:,}  tokens: {self.tokens:,}  time: {self.seconds:.1f}s  "
                 f"tokens/s: {self.tokens_per_second:,.0f}"]
        if self.skipped:
            lines.append(f"skipped {self.skipped:,} bad records; first: " + "; ".join(self.bad_locations))
        return "\n".join(lines)


# ---------------------------------------------------------------- reading raw records (main process)
# A chunk is (kind, source, first_record_number, records): kind "jsonl" carries raw lines (bytes),
# kind "values" carries already-decoded column values (str or anything else, checked in the worker).

def _open_jsonl(path: str):
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    if path.endswith(".zst"):
        require("zstandard", "reading .zst files")
        import zstandard

        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True))
    return open(path, "rb")


def _is_parquet(path: str) -> bool:
    return os.path.isfile(path) and path.endswith((".parquet", ".pq"))


def _is_saved_dataset(path: str) -> bool:
    return os.path.isdir(path) and any(
        os.path.exists(os.path.join(path, name)) for name in ("dataset_info.json", "state.json", "dataset_dict.json"))


def _read_chunks(path: str, config: PreprocessConfig) -> Iterator[tuple]:
    size = config.chunk_size
    if _is_parquet(path):
        require("pyarrow", "reading Parquet")
        import pyarrow.parquet as pq

        parquet = pq.ParquetFile(path)
        if config.json_key not in parquet.schema_arrow.names:
            raise PreprocessError(f"{path}: missing column {config.json_key!r} (columns: {parquet.schema_arrow.names})")
        row = 1
        for batch in parquet.iter_batches(batch_size=size, columns=[config.json_key]):
            values = batch.column(0).to_pylist()
            yield ("values", path, row, values)
            row += len(values)
    elif _is_saved_dataset(path) or not os.path.exists(path):
        yield from _read_hf_dataset(path, config)
    elif os.path.isfile(path):
        with _open_jsonl(path) as f:
            line = 1
            while True:
                try:
                    lines = list(itertools.islice(f, size))
                except (EOFError, OSError, zlib.error) as error:  # truncated or corrupt .gz / .zst
                    raise PreprocessError(f"{path}: cannot be read past line {line} ({type(error).__name__}: "
                                          f"{error}); the file is truncated or corrupt") from None
                if not lines:
                    break
                yield ("jsonl", path, line, lines)
                line += len(lines)
    else:
        raise PreprocessError(f"{path}: not a JSONL / Parquet file or a saved HF dataset directory")


def _read_hf_dataset(name: str, config: PreprocessConfig) -> Iterator[tuple]:
    require("datasets", "reading HF datasets")
    import datasets

    if os.path.exists(name):
        dataset = datasets.load_from_disk(name)
        if isinstance(dataset, datasets.DatasetDict):
            if config.split not in dataset:
                raise PreprocessError(f"{name}: no split {config.split!r} (splits: {list(dataset)})")
            dataset = dataset[config.split]
    else:  # a hub dataset, streamed so that nothing but the text column is materialised
        dataset = datasets.load_dataset(name, split=config.split, streaming=True)
    names = dataset.column_names
    if names is not None and config.json_key not in names:
        raise PreprocessError(f"{name}: missing column {config.json_key!r} (columns: {names})")
    row = 1
    for batch in dataset.select_columns([config.json_key]).iter(batch_size=config.chunk_size):
        values = batch[config.json_key]
        yield ("values", name, row, values)
        row += len(values)


# ---------------------------------------------------------------- tokenizing (worker processes)
_worker: dict = {}


def _init_worker(tokenizer, json_key: str, eod_id: int | None, dtype: str, single_threaded: bool) -> None:
    """tokenizer: a name or path (worker processes load their own) or the loaded tokenizer (in process)."""
    if single_threaded:  # the worker processes are the parallelism; Rust threads would oversubscribe the cores
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    if isinstance(tokenizer, str):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer)
    _worker.update(encode=_batch_encoder(tokenizer), json_key=json_key, eod_id=eod_id, dtype=np.dtype(dtype))


def _batch_encoder(tokenizer):
    """texts -> lists of ids without special tokens. For a fast tokenizer, the Rust backend's
    `encode_batch_fast` (no offsets, no Python-side BatchEncoding) when it gives the same ids as the
    tokenizer itself on a probe text; otherwise the tokenizer's own `__call__`."""
    def slow(texts):
        return tokenizer(texts, add_special_tokens=False)["input_ids"]

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "encode_batch_fast"):
        return slow

    def fast(texts):
        return [encoding.ids for encoding in backend.encode_batch_fast(texts, add_special_tokens=False)]

    probe = ["Hello world, 123 \u00fcn\u00efc\u00f6de\n  spaced\tout <|endoftext|> text", " leading space"]
    return fast if fast(probe) == slow(probe) else slow


def _record_text(kind: str, record, key: str) -> str:
    """The document text of one record, or a ValueError saying what is wrong with it."""
    if kind == "jsonl":
        try:
            line = record.decode("utf-8-sig")  # -sig: a byte-order mark at the start of a file is not JSON
        except UnicodeDecodeError as error:
            raise ValueError(f"not valid UTF-8 (byte {error.start})") from None
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"malformed JSON ({error.msg} at column {error.colno})") from None
        if not isinstance(record, dict) or key not in record:
            found = list(record)[:8] if isinstance(record, dict) else type(record).__name__
            raise ValueError(f"missing key {key!r} (found {found})")
        record = record[key]
    if record is None:
        raise ValueError(f"missing value for {key!r} (null)")
    if not isinstance(record, str):
        raise ValueError(f"{key!r} is a {type(record).__name__}, expected a string")
    if not record.strip():
        raise ValueError("empty document")
    return record


def _encode_chunk(chunk: tuple) -> tuple[np.ndarray, np.ndarray, list[tuple[str, str]]]:
    """-> (tokens of all good records concatenated, their lengths, [(location, reason)] of bad ones)."""
    kind, source, first, records = chunk
    unit = "line" if kind == "jsonl" else "row"
    texts, errors = [], []
    for number, record in enumerate(records, start=first):
        if kind == "jsonl" and not record.strip():
            continue  # blank lines (a trailing newline, say) hold no record
        try:
            texts.append((number, _record_text(kind, record, _worker["json_key"])))
        except ValueError as error:
            errors.append((f"{source}:{unit} {number}", str(error)))
    ids = _worker["encode"]([text for _, text in texts]) if texts else []
    eod = _worker["eod_id"]
    if eod is not None:
        for row in ids:
            row.append(eod)
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    if lengths.size and lengths.min() == 0:  # text that tokenizes to nothing (only possible without EOD)
        for (number, _), length in zip(texts, lengths):
            if length == 0:
                errors.append((f"{source}:{unit} {number}", "empty document (no tokens)"))
        ids = [row for row in ids if row]
        lengths = lengths[lengths > 0]
    tokens = np.fromiter(itertools.chain.from_iterable(ids), dtype=_worker["dtype"], count=int(lengths.sum()))
    errors.sort(key=lambda e: int(e[0].rsplit(" ", 1)[1]))
    return tokens, lengths, errors


# ---------------------------------------------------------------- the driver
def _bounded_imap(pool, chunks, in_flight: int):
    """Ordered results like `pool.imap`, but reading at most `in_flight` chunks ahead (`imap` reads the whole
    input into memory as fast as it can)."""
    pending = collections.deque()
    for chunk in chunks:
        pending.append(pool.apply_async(_encode_chunk, (chunk,)))
        if len(pending) >= in_flight:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def preprocess(config: PreprocessConfig) -> PreprocessReport:
    """Tokenize `config.inputs` into `config.output_prefix`.{bin,idx}; raise `PreprocessError` on the first
    bad record unless `skip_bad_lines`. Earlier output at the prefix is untouched on any failure."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.tokenizer)
    eod_id = None
    if config.append_eod:
        eod_id = tokenizer.eos_token_id
        if eod_id is None:
            raise ValueError(f"--append-eod needs an EOS token, and tokenizer {config.tokenizer!r} has none")
    dtype = np.dtype(config.dtype) if config.dtype else np.dtype(best_fitting_dtype(len(tokenizer)))
    for path in config.inputs:
        looks_local = path.endswith((".jsonl", ".json", ".gz", ".zst", ".parquet", ".pq")) or path.startswith((os.sep, "."))
        if looks_local and not os.path.exists(path):
            raise FileNotFoundError(f"{path} does not exist")
    init_args = (config.tokenizer, config.json_key, eod_id, dtype.str, config.workers > 1)
    skipped, bad_locations = 0, []
    start = time.perf_counter()
    chunks = (chunk for path in config.inputs for chunk in _read_chunks(path, config))
    pool = None
    if config.workers > 1:
        method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
        pool = multiprocessing.get_context(method).Pool(config.workers, _init_worker, init_args)
        results = _bounded_imap(pool, chunks, in_flight=2 * config.workers)
    else:
        _init_worker(tokenizer, *init_args[1:])  # the tokenizer loaded above, not a second load
        results = map(_encode_chunk, chunks)
    from tqdm.auto import tqdm

    bar = tqdm(desc="tokenizing", unit=" docs", disable=not config.progress)
    try:
        with IndexedDatasetWriter(config.output_prefix, dtype, overwrite=config.overwrite) as writer:
            for tokens, lengths, errors in results:
                if errors and not config.skip_bad_lines:
                    location, reason = errors[0]
                    raise PreprocessError(f"{location}: {reason} (pass --skip-bad-lines to skip bad records)")
                skipped += len(errors)
                bad_locations += [f"{location} ({reason})" for location, reason in errors[:5 - len(bad_locations)]]
                writer.add_documents(tokens, lengths)
                bar.update(len(lengths))
                bar.set_postfix(tokens=f"{writer.num_tokens:,}", refresh=False)
            if writer.num_documents == 0:
                raise PreprocessError(f"no documents found in {config.inputs}; nothing written")
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()
            pool.join()
    return PreprocessReport(documents=writer.num_documents, tokens=writer.num_tokens,
                            seconds=time.perf_counter() - start, skipped=skipped, bad_locations=bad_locations,
                            output_prefix=config.output_prefix)
