"""Megatron indexed files and `hf-dlm preprocess`: format, interoperability, atomicity, bad input."""

import gzip
import json
import os
import struct
import warnings

import numpy as np
import pytest

from hf_dlm.cli import main as cli_main
from hf_dlm.data.corpus import stdlib_documents, train_bpe_tokenizer
from hf_dlm.data import preprocess as preprocess_module
from hf_dlm.data.indexed_dataset import DTYPE_CODES, IndexedDataset, IndexedDatasetWriter
from hf_dlm.data.preprocess import PreprocessConfig, PreprocessError, preprocess

DOCS = [d[:400] for d in stdlib_documents(max_files=15)[:60]]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    train_bpe_tokenizer(DOCS, vocab_size=300).save_pretrained(str(path))
    return str(path)


def write_jsonl(path, records):
    with open(path, "wb") as f:
        for record in records:
            f.write(record if isinstance(record, bytes) else (json.dumps(record) + "\n").encode())
    return str(path)


def files_of(prefix):
    return {ext: open(f"{prefix}.{ext}", "rb").read() for ext in ("bin", "idx")}


def leftovers(directory):
    return [name for name in os.listdir(directory) if ".tmp-" in name]


@pytest.mark.parametrize("code", sorted(DTYPE_CODES))
def test_round_trip_every_dtype(tmp_path, code):
    dtype = np.dtype(DTYPE_CODES[code])
    rng = np.random.default_rng(code)
    docs = [(rng.integers(0, 100, size=n) * (1 if dtype.kind in "iu" else 1.5)).astype(dtype) for n in (5, 0, 17, 1)]
    with IndexedDatasetWriter(str(tmp_path / "d"), dtype) as writer:
        for doc in docs[:3]:
            writer.add_document(doc)
        writer.add_document(np.concatenate([docs[3], docs[0]]), sequence_lengths=[1, 5])  # two sequences
    idx = open(tmp_path / "d.idx", "rb").read()
    assert idx[:9] == b"MMIDIDX\x00\x00" and struct.unpack("<QB", idx[9:18]) == (1, code)
    data = IndexedDataset(str(tmp_path / "d"))
    assert data.dtype == dtype and len(data) == 5 and data.num_documents == 4
    for got, want in zip([data[i] for i in range(5)], docs[:3] + [docs[3], docs[0]]):
        assert got.dtype == dtype and np.array_equal(got, want)
    assert data.document_indices.tolist() == [0, 1, 2, 3, 5]
    assert data.document_lengths().tolist() == [5, 0, 17, 6]
    assert np.array_equal(data.document(3), np.concatenate([docs[3], docs[0]]))
    assert np.array_equal(data.get(2, offset=3, length=4), docs[2][3:7])
    assert data.is_contiguous() and len(data.token_stream()) == 28


def test_reads_a_file_built_from_the_specification(tmp_path):
    # two documents: [7, 8, 9] as one sequence, then [1, 2] + [65535] as two sequences; uint16 (code 8)
    lengths, pointers, document_index = [3, 2, 1], [0, 6, 10], [0, 1, 3]
    idx = (b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 8) + struct.pack("<Q", 3)
           + struct.pack("<Q", 3) + struct.pack("<3i", *lengths) + struct.pack("<3q", *pointers)
           + struct.pack("<3q", *document_index))
    (tmp_path / "s.idx").write_bytes(idx)
    (tmp_path / "s.bin").write_bytes(struct.pack("<6H", 7, 8, 9, 1, 2, 65535))
    data = IndexedDataset(str(tmp_path / "s"))
    assert data.dtype == np.uint16 and [data[i].tolist() for i in range(3)] == [[7, 8, 9], [1, 2], [65535]]
    assert data.num_documents == 2 and data.document(1).tolist() == [1, 2, 65535]
    # and hf-dlm's writer produces exactly these bytes
    with IndexedDatasetWriter(str(tmp_path / "w"), np.uint16) as writer:
        writer.add_document([7, 8, 9])
        writer.add_document([1, 2, 65535], sequence_lengths=[2, 1])
    assert files_of(tmp_path / "w") == files_of(tmp_path / "s")


def test_corrupt_files_give_clear_errors(tmp_path):
    with IndexedDatasetWriter(str(tmp_path / "d"), np.int32) as writer:
        writer.add_document([1, 2, 3])
    idx = (tmp_path / "d.idx").read_bytes()
    (tmp_path / "d.idx").write_bytes(b"NOTANIDX!" + idx[9:])
    with pytest.raises(ValueError, match="d.idx: not a Megatron"):
        IndexedDataset(str(tmp_path / "d"))
    (tmp_path / "d.idx").write_bytes(idx[:-4])
    with pytest.raises(ValueError, match="truncated"):
        IndexedDataset(str(tmp_path / "d"))
    (tmp_path / "d.idx").write_bytes(idx)
    (tmp_path / "d.bin").write_bytes(b"\x00" * 4)
    with pytest.raises(ValueError, match="d.bin: 4 bytes"):
        IndexedDataset(str(tmp_path / "d"))
    with pytest.raises(ValueError, match="do not fit"):
        IndexedDatasetWriter(str(tmp_path / "e"), np.uint8).add_document([300])


def test_megatron_core_reads_our_files_and_we_read_theirs(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronIndexedDataset
            from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
        except ImportError as error:
            pytest.skip(f"megatron-core is not installed ({error})")
    docs = [np.arange(n, dtype=np.int32) * 7 for n in (4, 9, 1)]
    with IndexedDatasetWriter(str(tmp_path / "ours"), np.int32) as writer:
        for doc in docs:
            writer.add_document(doc)
    theirs = MegatronIndexedDataset(str(tmp_path / "ours"))
    assert len(theirs) == 3 and all(np.array_equal(theirs[i], docs[i]) for i in range(3))
    assert theirs.document_indices.tolist() == [0, 1, 2, 3]
    builder = IndexedDatasetBuilder(str(tmp_path / "theirs.bin"), dtype=np.uint16)
    for doc in docs:
        builder.add_document(doc.astype(np.uint16), [len(doc)])
    builder.finalize(str(tmp_path / "theirs.idx"))
    ours = IndexedDataset(str(tmp_path / "theirs"))
    assert ours.dtype == np.uint16 and [ours[i].tolist() for i in range(3)] == [d.tolist() for d in docs]


def test_preprocess_every_input_kind_gives_the_same_tokens(tmp_path, tokenizer_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    expected = [tokenizer(d, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for d in DOCS]
    jsonl = write_jsonl(tmp_path / "c.jsonl", [{"text": d, "id": i} for i, d in enumerate(DOCS)])
    with open(jsonl, "rb") as src, gzip.open(tmp_path / "c.jsonl.gz", "wb") as dst:
        dst.write(src.read())
    import datasets

    table = datasets.Dataset.from_dict({"text": DOCS})
    table.to_parquet(str(tmp_path / "c.parquet"))
    table.save_to_disk(str(tmp_path / "saved"))
    inputs = {"jsonl": jsonl, "gz": str(tmp_path / "c.jsonl.gz"), "parquet": str(tmp_path / "c.parquet"),
              "saved": str(tmp_path / "saved")}
    try:
        import zstandard

        (tmp_path / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(open(jsonl, "rb").read()))
        inputs["zst"] = str(tmp_path / "c.jsonl.zst")
    except ImportError:
        warnings.warn("zstandard is not installed: .zst input not tested")  # optional; in the test extra
    for name, path in inputs.items():
        report = preprocess(PreprocessConfig(inputs=[path], output_prefix=str(tmp_path / name), tokenizer=tokenizer_dir,
                                             append_eod=True, chunk_size=16, progress=False))
        data = IndexedDataset(str(tmp_path / name))
        assert [data[i].tolist() for i in range(len(data))] == expected, name
        assert data.dtype == np.uint16 and report.documents == len(DOCS)
        assert report.tokens == sum(map(len, expected)) and report.tokens_per_second > 0


def test_cli_with_two_workers_matches_one_and_refuses_to_overwrite(tmp_path, tokenizer_dir, capsys):
    jsonl = write_jsonl(tmp_path / "c.jsonl", [{"text": d} for d in DOCS])
    base = ["preprocess", "--input", jsonl, jsonl, "--tokenizer", tokenizer_dir, "--chunk-size", "8", "--no-progress"]
    assert cli_main(base + ["--output-prefix", str(tmp_path / "one"), "--workers", "1"]) == 0
    assert cli_main(base + ["--output-prefix", str(tmp_path / "two"), "--workers", "2"]) == 0
    out = capsys.readouterr().out
    assert f"documents: {2 * len(DOCS)}" in out and "tokens/s:" in out
    assert files_of(tmp_path / "one") == files_of(tmp_path / "two")
    before = files_of(tmp_path / "one")
    assert cli_main(base + ["--output-prefix", str(tmp_path / "one"), "--append-eod"]) == 2  # a user mistake: exit status 2
    assert "already exists" in capsys.readouterr().err and files_of(tmp_path / "one") == before
    assert cli_main(base + ["--output-prefix", str(tmp_path / "one"), "--append-eod", "--overwrite"]) == 0
    assert files_of(tmp_path / "one") != before and not leftovers(tmp_path)


BAD_RECORDS = {
    "malformed JSON": b'{"text": "unterminated\n',
    "missing key 'text'": b'{"body": "no text here"}\n',
    "not valid UTF-8": b'{"text": "caf\xe9"}\n',
    "empty document": b'{"text": "   "}\n',
}


@pytest.mark.parametrize("reason", sorted(BAD_RECORDS))
def test_bad_record_names_file_and_line_and_keeps_earlier_output(tmp_path, tokenizer_dir, reason):
    good = [{"text": d} for d in DOCS[:5]]
    prefix = str(tmp_path / "out")
    preprocess(PreprocessConfig(inputs=[write_jsonl(tmp_path / "good.jsonl", good)], output_prefix=prefix,
                                tokenizer=tokenizer_dir, progress=False))
    before = files_of(prefix)
    bad = write_jsonl(tmp_path / "bad.jsonl", good[:3] + [BAD_RECORDS[reason]] + good[3:])
    config = PreprocessConfig(inputs=[bad], output_prefix=prefix, tokenizer=tokenizer_dir, overwrite=True,
                              progress=False, chunk_size=2)
    with pytest.raises(PreprocessError, match=rf"bad\.jsonl:line 4: {reason}"):
        preprocess(config)
    assert files_of(prefix) == before and not leftovers(tmp_path)
    config.skip_bad_lines = True
    report = preprocess(config)
    assert report.documents == 5 and report.skipped == 1
    assert report.bad_locations[0].startswith(f"{bad}:line 4 ({reason}")
    assert "skipped 1 bad records" in str(report)


def test_interrupted_run_leaves_nothing_that_looks_complete(tmp_path, tokenizer_dir, monkeypatch):
    jsonl = write_jsonl(tmp_path / "c.jsonl", [{"text": d} for d in DOCS])
    real, calls = preprocess_module._encode_chunk, []

    def interrupted(chunk):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(chunk)

    monkeypatch.setattr(preprocess_module, "_encode_chunk", interrupted)
    with pytest.raises(KeyboardInterrupt):
        preprocess(PreprocessConfig(inputs=[jsonl], output_prefix=str(tmp_path / "out"), tokenizer=tokenizer_dir,
                                    chunk_size=8, progress=False))
    assert sorted(os.listdir(tmp_path)) == ["c.jsonl"]


def test_hub_names_stream_through_datasets_and_missing_columns_are_named(tmp_path, tokenizer_dir, monkeypatch):
    import datasets

    calls = []

    def fake_load_dataset(name, split, streaming):  # no network here: a local stream stands in for the hub
        calls.append((name, split, streaming))
        return datasets.Dataset.from_dict({"text": DOCS[:7], "meta": list(range(7))}).to_iterable_dataset()

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    report = preprocess(PreprocessConfig(inputs=["someone/corpus"], output_prefix=str(tmp_path / "hub"),
                                         tokenizer=tokenizer_dir, split="validation", chunk_size=3, progress=False))
    assert calls == [("someone/corpus", "validation", True)] and report.documents == 7
    datasets.Dataset.from_dict({"body": DOCS[:3]}).to_parquet(str(tmp_path / "b.parquet"))
    with pytest.raises(PreprocessError, match=r"b\.parquet: missing column 'text'"):
        preprocess(PreprocessConfig(inputs=[str(tmp_path / "b.parquet")], output_prefix=str(tmp_path / "p"),
                                    tokenizer=tokenizer_dir, progress=False))
    with pytest.raises(FileNotFoundError, match="nowhere.jsonl"):
        preprocess(PreprocessConfig(inputs=[str(tmp_path / "nowhere.jsonl")], output_prefix=str(tmp_path / "q"),
                                    tokenizer=tokenizer_dir, progress=False))
    assert not any(name.startswith(("p.", "q.")) for name in os.listdir(tmp_path)) and not leftovers(tmp_path)


def test_bad_column_values_are_located_by_row(tmp_path, tokenizer_dir):
    import datasets

    rows = datasets.Dataset.from_dict({"text": [DOCS[0], None, DOCS[1], "", DOCS[2]]})
    datasets.DatasetDict({"valid": rows}).save_to_disk(str(tmp_path / "saved"))
    rows.to_parquet(str(tmp_path / "r.parquet"))
    for path, extra in ((str(tmp_path / "r.parquet"), {}), (str(tmp_path / "saved"), {"split": "valid"})):
        config = PreprocessConfig(inputs=[path], output_prefix=str(tmp_path / "o"), tokenizer=tokenizer_dir,
                                  progress=False, overwrite=True, **extra)
        with pytest.raises(PreprocessError, match=r":row 2: missing value for 'text' \(null\)"):
            preprocess(config)
        config.skip_bad_lines = True
        report = preprocess(config)
        assert report.documents == 3 and report.skipped == 2
        assert [location.split(":")[-1] for location in report.bad_locations] == ["row 2 (missing value for 'text' (null))",
                                                                                   "row 4 (empty document)"]
    with pytest.raises(PreprocessError, match="no split 'train'"):
        preprocess(PreprocessConfig(inputs=[str(tmp_path / "saved")], output_prefix=str(tmp_path / "t"),
                                    tokenizer=tokenizer_dir, progress=False))


def test_killed_run_leaves_only_temporary_files(tmp_path, tokenizer_dir):
    import signal
    import subprocess
    import sys
    import time

    jsonl = write_jsonl(tmp_path / "c.jsonl", [b"\xef\xbb\xbf" + json.dumps({"text": DOCS[0]}).encode() + b"\n"]
                        + [{"text": d} for d in DOCS])
    script = (  # every chunk after the first takes a long time, so the kill lands mid-run
        "import sys, time\n"
        "from hf_dlm.data import preprocess as p\n"
        "real = p._encode_chunk\n"
        "def slow(chunk):\n"
        "    if chunk[2] > 1: time.sleep(60)\n"
        "    return real(chunk)\n"
        "p._encode_chunk = slow\n"
        f"p.preprocess(p.PreprocessConfig(inputs=[{jsonl!r}], output_prefix={str(tmp_path / 'out')!r}, "
        f"tokenizer={tokenizer_dir!r}, chunk_size=4, progress=False))\n")
    process = subprocess.Popen([sys.executable, "-c", script], env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 60
    while not leftovers(tmp_path) and time.time() < deadline and process.poll() is None:
        time.sleep(0.1)
    time.sleep(0.5)  # the first chunk gets written
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert leftovers(tmp_path) and not os.path.exists(tmp_path / "out.idx") and not os.path.exists(tmp_path / "out.bin")
    with pytest.raises(FileNotFoundError, match="out.idx does not exist"):
        IndexedDataset(str(tmp_path / "out"))
    # the next run ignores the dead run's temporary files; the BOM on line 1 is not an error
    report = preprocess(PreprocessConfig(inputs=[jsonl], output_prefix=str(tmp_path / "out"), tokenizer=tokenizer_dir,
                                         progress=False))
    assert report.documents == len(DOCS) + 1 and IndexedDataset(str(tmp_path / "out")).num_documents == len(DOCS) + 1
