"""End to end: `hf-dlm preprocess` output and chat JSONL feeding `hf-dlm train` through the YAML data kinds."""

import json
import os

import pytest
import torch

from hf_dlm.data.corpus import split_documents
from hf_dlm.data.preprocess import PreprocessConfig, preprocess
from hf_dlm.training.runner import ConfigError, build_trainer, load_config, run_pretraining


MODEL = {"attn_implementation": "sdpa",
         "config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                    "max_position_embeddings": 128}}
TRAINING = {"use_cpu": True, "max_steps": 4, "per_device_train_batch_size": 4, "save_steps": 2,
            "logging_steps": 2, "report_to": "none", "disable_tqdm": True, "learning_rate": 1e-3}


def _config(tmp_path, data, **training):
    import yaml

    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"model": MODEL, "data": data,
                                    "training": {**TRAINING, "output_dir": str(tmp_path / "out"), **training}}))
    return str(path)


def test_preprocessed_indexed_files_train_and_checkpoint_their_position(tmp_path, tokenizer_dir):
    tokenizer_path, docs = tokenizer_dir
    train_docs, heldout = split_documents(docs, heldout_fraction=0.2)
    for name, part in (("train", train_docs), ("heldout", heldout)):
        with open(tmp_path / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps({"text": d}) + "\n" for d in part)
        preprocess(PreprocessConfig(inputs=[str(tmp_path / f"{name}.jsonl")], output_prefix=str(tmp_path / name),
                                    tokenizer=str(tokenizer_path), append_eod=True, progress=False))
    data = {"kind": "indexed", "prefixes": [str(tmp_path / "train")], "tokenizer": str(tokenizer_path),
            "seq_len": 32, "eval_prefix": str(tmp_path / "heldout"), "eval_windows": 4}
    metrics = run_pretraining(_config(tmp_path, data))
    assert metrics["train_loss"] > 0 and metrics["eval_nll_per_token"] > 0
    state = torch.load(tmp_path / "out" / "checkpoint-4" / "data_state_rank0.pt", weights_only=False)
    assert state == {"consumed_samples": 16}  # 4 steps of 4 windows
    # evaluation windows keep their documents' positions, so the ELBO attends like training
    from hf_dlm.data.streams import PackedDataset

    eval_set = build_trainer(load_config(_config(tmp_path, data)))[0].eval_dataset
    assert len(eval_set) == 4
    torch.testing.assert_close(eval_set[3]["position_ids"], PackedDataset(str(tmp_path / "heldout"), 32)[3]["position_ids"])


def test_sft_chat_jsonl_trains_without_supervising_the_prompt(tmp_path, tokenizer_dir):
    tokenizer_path, _ = tokenizer_dir
    rows = [{"messages": [{"role": "user", "content": f"What does statement {i} do?"},
                          {"role": "assistant", "content": "It runs a loop."}]} for i in range(8)]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = {"kind": "sft", "train_file": str(tmp_path / "chat.jsonl"), "tokenizer": str(tokenizer_path),
            "max_length": 48}
    trainer, tokenizer = build_trainer(load_config(_config(tmp_path, data, objective_preset="llada")))
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(8)])
    inputs = trainer._corrupt(batch, torch.device("cpu"))
    supervised = inputs["labels"] != -100
    assert supervised.any() and not (supervised & batch["prompt_mask"]).any()
    assert trainer.train().training_loss > 0


def test_bad_data_sections_name_the_field_file_and_line(tmp_path, tokenizer_dir):
    tokenizer_path, _ = tokenizer_dir
    with pytest.raises(ConfigError, match="data.prefixes"):
        build_trainer(load_config(_config(tmp_path, {"kind": "indexed", "tokenizer": str(tokenizer_path)})))
    with pytest.raises(ConfigError, match="data.tokenizer"):
        build_trainer(load_config(_config(tmp_path, {"kind": "indexed", "prefixes": ["x"]})))
    (tmp_path / "bad.jsonl").write_text('{"messages": []}\n{oops\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: malformed JSON"):
        build_trainer(load_config(_config(tmp_path, {"kind": "sft", "train_file": str(tmp_path / "bad.jsonl"),
                                                     "tokenizer": str(tokenizer_path)})))
    missing = tmp_path / "missing"
    with pytest.raises(ConfigError, match="missing"):
        build_trainer(load_config(_config(tmp_path, {"kind": "indexed", "prefixes": [str(missing)],
                                                     "tokenizer": str(tokenizer_path)})))
    assert not os.path.exists(tmp_path / "out" / "checkpoint-2")


def test_pack_documents_by_hand():
    from hf_dlm.data.memory_dataset import pack_documents

    ids, positions = pack_documents([[5, 6, 7], [8], [9, 10, 11, 12]], 3, eos_token_id=1)
    assert ids.tolist() == [[5, 6, 7], [1, 8, 1], [9, 10, 11]]
    assert positions.tolist() == [[0, 1, 2], [3, 0, 1], [0, 1, 2]]  # restarts at each document start
    ids, positions = pack_documents([[5, 6, 7], [], [9, 10]], 2)  # empty documents start nothing
    assert ids.tolist() == [[5, 6], [7, 9]] and positions.tolist() == [[0, 1], [2, 0]]
    with pytest.raises(ValueError, match="one window"):
        pack_documents([[1]], 4)
