"""Training datasets: packing, blending, seeded epochs, resume, rank shards, HF streams, SFT data."""

import itertools

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, default_collate

from hf_dlm.modeling.masks import document_ids_from_position_ids
from hf_dlm.data.streams import (BlendedDataset, DistributedSampleStream, PackedDataset, ShuffledSamples,
                                      blend_schedule, build_pretraining_dataset)
from hf_dlm.data.indexed_dataset import IndexedDatasetWriter


def write_docs(prefix, docs, dtype=np.int32):
    with IndexedDatasetWriter(str(prefix), dtype) as writer:
        for doc in docs:
            writer.add_document(doc)
    return str(prefix)


@pytest.fixture
def corpus(tmp_path):
    """Documents whose tokens encode (document, offset): token = 1000 * d + offset."""
    rng = np.random.default_rng(0)
    docs = [1000 * d + np.arange(n) for d, n in enumerate(rng.integers(1, 40, size=60))]
    return write_docs(tmp_path / "c", docs), docs


def test_packing_windows_and_restarting_positions(corpus):
    prefix, docs = corpus
    packed = PackedDataset(prefix, seq_length=16)
    stream = np.concatenate(docs)
    assert len(packed) == len(stream) // 16
    for i in range(len(packed)):
        sample = packed[i]
        ids, positions = sample["input_ids"], sample["position_ids"]
        assert ids.dtype == positions.dtype == torch.long and ids.shape == positions.shape == (16,)
        assert ids.tolist() == stream[16 * i:16 * (i + 1)].tolist()
        offsets = ids % 1000
        # a position restarts at 0 exactly where a document starts; the first token of a window is 0
        assert positions[0] == 0
        assert torch.equal(positions[1:] == 0, offsets[1:] == 0)
        assert torch.equal(positions[1:], torch.where(offsets[1:] == 0, 0, positions[:-1] + 1))
        # the model's packed-document masks recover the documents from these positions
        document_ids = document_ids_from_position_ids(positions[None])[0]
        assert torch.equal(document_ids[1:] != document_ids[:-1], offsets[1:] == 0)


def test_blend_ratios_within_one_percent_on_10k_samples(tmp_path):
    sources = [write_docs(tmp_path / f"s{k}", [k * 100_000 + 200 * j + np.arange(200) for j in range(20)]) for k in range(3)]
    packed = [PackedDataset(p, seq_length=8) for p in sources]  # 500 windows each
    weights = [0.5, 0.3, 0.2]
    blended = BlendedDataset(packed, weights, size=10_000, seed=3)
    origin = np.array([int(blended[i]["input_ids"][0]) // 100_000 for i in range(10_000)])
    counts = np.bincount(origin, minlength=3) / 10_000
    assert np.abs(counts - weights).max() < 0.01
    # exact at every prefix, not only at the end
    index, _ = blend_schedule(weights, 10_000)
    for n in (10, 101, 2_345):
        assert np.abs(np.bincount(index[:n], minlength=3) - n * np.array(weights)).max() <= 1
    # upsampling: every window of a source appears once before any repeats
    first = [blended[i]["input_ids"].tolist() for i in range(10_000) if origin[i] == 2][:500]
    assert len({tuple(w) for w in first}) == 500


def test_shuffle_is_deterministic_per_seed_and_epoch(corpus):
    packed = PackedDataset(corpus[0], seq_length=16)
    n = len(packed)
    take = lambda s: [s[g]["input_ids"][0].item() for g in range(2 * n)]  # noqa: E731
    a, b = take(ShuffledSamples(packed, seed=1, num_epochs=2)), take(ShuffledSamples(packed, seed=1, num_epochs=2))
    c = take(ShuffledSamples(packed, seed=2, num_epochs=2))
    assert a == b and a != c
    assert a[:n] != a[n:] and sorted(a[:n]) == sorted(a[n:])  # each epoch is a new order of the same windows
    samples = ShuffledSamples(packed, seed=1, num_epochs=2)
    assert [samples[g]["sample_index"] for g in range(2 * n)] == list(range(2 * n))  # unique across epochs


def test_resume_gives_the_same_stream(corpus):
    make = lambda: build_pretraining_dataset([corpus[0]], seq_length=16, seed=5, num_epochs=3)  # noqa: E731
    full = [s["sample_index"] for s in make()]
    full_ids = [s["input_ids"] for s in make()]
    stream = make()
    it = iter(stream)
    head = [next(it) for _ in range(17)]
    state = stream.state_dict()
    assert state == {"consumed_samples": 17}
    resumed = make()
    resumed.load_state_dict(state)
    tail = list(resumed)
    assert [s["sample_index"] for s in head + tail] == full
    # in one process a new iteration goes on where the last stopped: no index is drawn twice
    again = make()
    first = [s["sample_index"] for s in itertools.islice(iter(again), 10)]
    assert first + [s["sample_index"] for s in again] == full
    endless = build_pretraining_dataset([corpus[0]], seq_length=16, seed=5, num_epochs=None, rank=0, world_size=2)
    assert [s["sample_index"] for s in itertools.islice(iter(endless), 200)] == list(range(0, 400, 2))
    assert all(torch.equal(s["input_ids"], want) for s, want in zip(head + tail, full_ids))


def test_rank_shards_are_disjoint_and_cover_everything(corpus):
    samples = ShuffledSamples(PackedDataset(corpus[0], seq_length=16), seed=0, num_epochs=2)
    shards = [[s["sample_index"] for s in DistributedSampleStream(samples, rank=r, world_size=3)] for r in range(3)]
    assert all(set(a).isdisjoint(b) for i, a in enumerate(shards) for b in shards[i + 1:])
    assert sorted(sum(shards, [])) == list(range(len(samples)))
    # a sample's index and content do not depend on the world size
    single = {s["sample_index"]: s["input_ids"] for s in DistributedSampleStream(samples, rank=0, world_size=1)}
    sharded = DistributedSampleStream(samples, rank=1, world_size=3)
    assert all(torch.equal(s["input_ids"], single[s["sample_index"]]) for s in sharded)


def test_dataloader_workers_keep_order_and_collate(corpus):
    samples = ShuffledSamples(PackedDataset(corpus[0], seq_length=16), seed=0)
    stream = DistributedSampleStream(samples, rank=1, world_size=2, micro_batch_size=4, max_samples=40)
    batches = list(DataLoader(stream, batch_size=4, num_workers=2))
    assert [b["sample_index"].tolist() for b in batches[:2]] == [[1, 3, 5, 7], [9, 11, 13, 15]]
    # a collate_fn running in the worker sees the exact position after its batch
    stateful = lambda samples: {**default_collate(samples), "state": stream.state_dict()["consumed_samples"]}  # noqa: E731
    states = [b["state"] for b in DataLoader(stream, batch_size=4, num_workers=2, collate_fn=stateful)]
    assert states == [8 * (s + 1) for s in range(len(states))]
    batch = batches[0]
    assert batch["input_ids"].shape == batch["position_ids"].shape == (4, 16)
    assert batch["sample_index"].dtype == torch.long and batch["sample_index"].shape == (4,)


def test_hf_row_stream_keys_rows_by_pass_and_resumes_from_the_datasets_state():
    """HFRowStream: the rows of a streaming dataset unchanged, pass after pass, keyed pass * 2**40 + row; a
    stream built afresh from a saved state (two shards, mid second pass) reads on from exactly that row, and a
    new iteration of the same stream goes on where the last one stopped."""
    datasets = pytest.importorskip("datasets")
    from hf_dlm.data.hf_stream import EPOCH_STRIDE, HFRowStream

    table = datasets.Dataset.from_dict({"x": list(range(7)), "y": [str(i) for i in range(7)]})
    source = lambda: table.to_iterable_dataset(num_shards=2).map(lambda r: {"z": r["x"] * 2})  # noqa: E731
    expected = [(p * EPOCH_STRIDE + row, row) for p in range(3) for row in range(7)]  # (key, x): shards in order
    rows = list(itertools.islice(HFRowStream(source()), 21))
    assert [(r["sample_index"], r["x"]) for r in rows] == expected
    assert all(r["y"] == str(r["x"]) and r["z"] == 2 * r["x"] for r in rows)
    stream = HFRowStream(source())
    iterator = iter(stream)
    for _ in range(10):  # 7 rows of pass 0, 3 of pass 1
        next(iterator)
    state = stream.state_dict()
    assert (state["epoch"], state["row"]) == (1, 3)
    resumed = HFRowStream(source())
    resumed.load_state_dict(state)
    assert [(r["sample_index"], r["x"]) for r in itertools.islice(resumed, 11)] == expected[10:]
    again = next(iter(stream))  # the same stream iterated anew
    assert (again["sample_index"], again["x"]) == expected[10]


def test_hf_stream_packs_streaming_datasets_and_resumes(tmp_path):
    datasets = pytest.importorskip("datasets")
    from hf_dlm.data.hf_stream import HFPackedStream

    rows = {"input_ids": [list(range(1000 * d, 1000 * d + n)) for d, n in enumerate([5, 12, 3, 9, 20, 7, 11, 4])]}
    in_memory = datasets.Dataset.from_dict(rows)
    streaming = in_memory.to_iterable_dataset(num_shards=2)
    for source in (in_memory, streaming):
        make = lambda **kw: HFPackedStream(source, seq_length=8, append_eod=False, seed=1, num_epochs=2, **kw)  # noqa: E731
        full = list(make())
        assert len(full) == 2 * (71 // 8)
        assert len({s["sample_index"] for s in full}) == len(full)
        for sample in full:
            offsets = sample["input_ids"] % 1000
            positions = sample["position_ids"]
            assert positions[0] == 0 and torch.equal(positions[1:] == 0, offsets[1:] == 0)
            # inside a window a document goes on token by token: nothing skipped or repeated
            assert torch.equal(positions[1:] != 0, offsets[1:] - offsets[:-1] == 1)
        first_epoch = torch.cat([s["input_ids"] for s in full[: len(full) // 2]])
        assert first_epoch.unique().numel() == first_epoch.numel()  # no token twice in one epoch
        stream = make()
        it = iter(stream)
        head = [next(it) for _ in range(5)]
        resumed = make()
        resumed.load_state_dict(stream.state_dict())
        assert [s["sample_index"] for s in head + list(resumed)] == [s["sample_index"] for s in full]
        assert list(resumed) == []  # exhausted: a new iteration does not start over
        shards = [{s["sample_index"] for s in make(rank=r, world_size=2)} for r in range(2)]
        assert shards[0].isdisjoint(shards[1]) and shards[0] | shards[1] == {s["sample_index"] for s in full}
    # DataLoader workers: batches in window order, and the worker-side state resumes exactly after a batch
    stream = HFPackedStream(in_memory, seq_length=8, append_eod=False, seed=1, micro_batch_size=2)
    stateful = lambda samples: {**default_collate(samples), "state": stream.state_dict()}  # noqa: E731
    batches = list(DataLoader(stream, batch_size=2, num_workers=2, collate_fn=stateful))
    assert [b["sample_index"].tolist() for b in batches] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    resumed = HFPackedStream(in_memory, seq_length=8, append_eod=False, seed=1)
    resumed.load_state_dict(batches[0]["state"])
    assert [s["sample_index"] for s in resumed] == list(range(2, 8))


@pytest.fixture(scope="module")
def chat_tokenizer():
    from hf_dlm.data.corpus import stdlib_documents, train_bpe_tokenizer
    from tests.utils import SFT_CHAT_TEMPLATE

    tokenizer = train_bpe_tokenizer([d[:300] for d in stdlib_documents(max_files=10)[:40]], vocab_size=300)
    tokenizer.chat_template = SFT_CHAT_TEMPLATE
    return tokenizer


def test_sft_prompt_mask_and_both_padding_policies(chat_tokenizer):
    from hf_dlm.data.sft_data import SFTDataConfig, SFTDataset

    tok = chat_tokenizer
    rows = [{"messages": [{"role": "user", "content": "What is a for statement?"},
                          {"role": "assistant", "content": "A loop."}]}]
    prompt = tok("<|user|>What is a for statement?<|endoftext|><|assistant|>", add_special_tokens=False)["input_ids"]
    answer = tok("A loop.<|endoftext|>", add_special_tokens=False)["input_ids"]
    eos = SFTDataset(rows, tok, SFTDataConfig(max_length=48, padding_policy="eos"))[0]
    used = len(prompt) + len(answer)
    assert eos["input_ids"][:used].tolist() == prompt + answer
    assert (eos["input_ids"][used:] == tok.eos_token_id).all() and eos["attention_mask"].all()
    assert eos["prompt_mask"].tolist() == [True] * len(prompt) + [False] * (48 - len(prompt))
    assert eos["position_ids"].tolist() == list(range(48)) and eos["sample_index"] == 0
    excl = SFTDataset(rows, tok, SFTDataConfig(max_length=48, padding_policy="exclude"))[0]
    assert (excl["input_ids"][used:] == tok.pad_token_id).all()
    assert excl["attention_mask"].tolist() == [1] * used + [0] * (48 - used)
    # the objective never noises prompt tokens, and trains on EOS padding only under the "eos" policy
    from hf_dlm.diffusion.objective import MaskedDiffusionObjective

    objective = MaskedDiffusionObjective(mask_token_id=tok.mask_token_id)
    for sample, padding_supervised in ((eos, True), (excl, False)):
        batch = default_collate([sample] * 8)
        inputs = objective.corrupt(batch["input_ids"], batch["sample_index"] + torch.arange(8),
                                   batch["attention_mask"], batch["prompt_mask"])
        assert torch.equal(inputs["input_ids"][:, :len(prompt)], batch["input_ids"][:, :len(prompt)])
        assert ((inputs["labels"][:, used:] != -100).any()) == padding_supervised
    datasets = pytest.importorskip("datasets")
    from_hf = SFTDataset(datasets.Dataset.from_list(rows), tok, SFTDataConfig(max_length=48))[0]
    assert all(torch.equal(from_hf[key], eos[key]) for key in ("input_ids", "attention_mask", "prompt_mask"))
    with pytest.raises(ValueError, match="row 0: the prompt has"):
        SFTDataset(rows, tok, SFTDataConfig(max_length=len(prompt)))[0]
    with pytest.raises(ValueError, match="padding_policy must be one of"):
        SFTDataConfig(padding_policy="left")


def test_packed_batches_drive_the_model_and_documents_stay_apart(tmp_path):
    from hf_dlm.diffusion.objective import MaskedDiffusionObjective
    from tests.utils import MASK_ID, tiny_model

    rng = np.random.default_rng(1)
    prefix = write_docs(tmp_path / "m", [rng.integers(0, MASK_ID, size=n) for n in (5, 30, 11, 9, 40, 17)])
    loader = DataLoader(build_pretraining_dataset([prefix], seq_length=24, seed=0), batch_size=2)
    batch = next(iter(loader))
    model = tiny_model()
    objective = MaskedDiffusionObjective(mask_token_id=MASK_ID)
    loss, _ = objective(model, batch["input_ids"], batch["sample_index"], position_ids=batch["position_ids"])
    assert torch.isfinite(loss) and loss > 0
    # a window holding several documents: logits of one document ignore the tokens of the others
    window = PackedDataset(prefix, seq_length=24)[0]  # documents of 5 and 30 tokens: starts at 0 and 5
    assert window["position_ids"][5] == 0
    ids, changed = window["input_ids"][None], window["input_ids"][None].clone()
    changed[0, 5:] = (changed[0, 5:] + 1) % MASK_ID
    with torch.no_grad():
        a = model(input_ids=ids, position_ids=window["position_ids"][None], return_logits=True).logits
        b = model(input_ids=changed, position_ids=window["position_ids"][None], return_logits=True).logits
    torch.testing.assert_close(a[0, :5], b[0, :5])
    assert not torch.allclose(a[0, 5:], b[0, 5:])


def test_accelerate_sharding_of_the_full_stream_keeps_global_indices(corpus):
    from accelerate.data_loader import IterableDatasetShard

    samples = ShuffledSamples(PackedDataset(corpus[0], seq_length=16), seed=0, num_epochs=2)
    shards = []
    for process_index in range(2):  # what DLMTrainer's accelerate does with rank 0 / world size 1 streams
        stream = DistributedSampleStream(samples)
        shard = IterableDatasetShard(stream, batch_size=3, num_processes=2, process_index=process_index, drop_last=True)
        shards.append([s["sample_index"] for s in shard])
        assert stream.state_dict()["consumed_samples"] == len(samples)  # every rank reads the whole stream
    assert set(shards[0]).isdisjoint(shards[1])
    assert sorted(shards[0] + shards[1]) == list(range(len(samples) // 6 * 6))


def test_each_dataset_keeps_its_own_epoch_orders(monkeypatch):
    """Datasets read in turn do not evict each other's permutations (one draw per dataset and epoch)."""
    from hf_dlm.data import streams as datasets_module

    draws = []
    real_rng = np.random.default_rng
    monkeypatch.setattr(datasets_module.np.random, "default_rng", lambda seed: draws.append(seed) or real_rng(seed))
    base = [{"input_ids": torch.tensor([i])} for i in range(10)]
    streams = [ShuffledSamples(base, seed=s, num_epochs=1) for s in range(3)]
    blended = BlendedDataset([base, base[:5]], [0.5, 0.5], seed=7)
    for i in range(10):
        for stream in streams:
            stream[i]
        blended[i]
    assert len(draws) == 3 + 2  # 3 streams x 1 epoch, 2 blended sources x 1 epoch
    assert sorted(int(streams[0][i]["input_ids"]) for i in range(10)) == list(range(10))
