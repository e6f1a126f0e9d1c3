"""User mistakes on every hf-dlm command: one line on stderr naming the file, field or value, exit status
2, no traceback; `--debug` or HF_DLM_DEBUG=1 raises instead."""

import gzip
import json

import pytest

from hf_dlm.cli import main as cli_main

from tests.utils import save_ar_checkpoint

TINY_MODEL = ("model:\n  config: {vocab_size: 99, mask_token_id: 98, hidden_size: 32, intermediate_size: 64,\n"
              "           num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2,\n"
              "           max_position_embeddings: 64}\n")


def one_line_error(capsys, argv, *expected):
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip()
    messages = [line for line in err.splitlines() if line.startswith("hf-dlm")]  # progress bars aside
    assert len(messages) == 1 and "Traceback" not in err, err
    err = messages[0]
    for text in expected:
        assert text in err, err
    return err


def test_missing_local_model_path_is_named(capsys, monkeypatch):
    one_line_error(capsys, ["generate", "--model", "./no/such/model", "--prompt", "x"], "'./no/such/model'",
                   "no such local folder")
    with pytest.raises(FileNotFoundError):
        cli_main(["generate", "--model", "./no/such/model", "--prompt", "x", "--debug"])
    monkeypatch.setenv("HF_DLM_DEBUG", "1")
    with pytest.raises(FileNotFoundError):
        cli_main(["verify", "./no/such/a", "./no/such/b"])


@pytest.mark.parametrize("training,data,expected", [
    ("max_steps: 0", "{kind: random}", "DLMTrainingArguments.max_steps must be >= 1"),
    ("per_device_train_batch_size: 0", "{kind: random}", "per_device_train_batch_size must be >= 1"),
    ("max_steps: 2", "{kind: random, seq_len: 0}", "data.seq_len must be an integer >= 2, got 0"),
    ("max_steps: 2", "{kind: random, seq_len: 128}", "data.seq_len (128) exceeds the model's max_position_embeddings (64)"),
])
def test_train_config_mistakes_name_the_field(tmp_path, capsys, training, data, expected):
    path = tmp_path / "run.yaml"
    path.write_text(TINY_MODEL + f"data: {data}\ntraining: {{output_dir: {tmp_path / 'out'}, use_cpu: true, {training}}}\n")
    one_line_error(capsys, ["train", str(path)], str(path), expected)


def test_an_empty_config_is_refused(tmp_path, capsys):
    (tmp_path / "empty.yaml").write_text("\n# nothing\n")
    one_line_error(capsys, ["train", str(tmp_path / "empty.yaml")], "the config is empty")


def test_a_vocabulary_smaller_than_the_tokenizer_is_refused():
    from types import SimpleNamespace

    from hf_dlm.training.runner import ConfigError, _check_model_fits_data

    class Tokenizer:
        mask_token_id = 3

        def __len__(self):
            return 120

    config = SimpleNamespace(vocab_size=99, max_position_embeddings=64, mask_token_id=3)
    with pytest.raises(ConfigError, match="the tokenizer has 120 tokens but the model's vocab_size is 99"):
        _check_model_fits_data(config, {"seq_len": 16}, Tokenizer(), "run.yaml")
    config.vocab_size = 120
    config.mask_token_id = 7
    with pytest.raises(ConfigError, match=r"mask token id \(3\) differs from the model's mask_token_id \(7\)"):
        _check_model_fits_data(config, {"seq_len": 16}, Tokenizer(), "run.yaml")


def test_truncated_gzip_is_named(tmp_path, capsys):
    data = gzip.compress(b"".join(json.dumps({"text": f"line {i} " * 20}).encode() + b"\n" for i in range(200)))
    (tmp_path / "part.jsonl.gz").write_bytes(data[: len(data) // 2])
    from hf_dlm.data.corpus import train_bpe_tokenizer

    train_bpe_tokenizer(["line one two three"] * 20, vocab_size=280).save_pretrained(str(tmp_path / "tok"))
    one_line_error(capsys, ["preprocess", "--input", str(tmp_path / "part.jsonl.gz"), "--output-prefix",
                            str(tmp_path / "out"), "--tokenizer", str(tmp_path / "tok")], "part.jsonl.gz",
                   "truncated or corrupt")


def test_convert_mistakes(tmp_path, capsys):
    save_ar_checkpoint("llama", tmp_path / "llama")
    one_line_error(capsys, ["convert", "--from", "qwen2", str(tmp_path / "llama"), str(tmp_path / "out")],
                   "--from qwen2, but the checkpoint is a 'llama' checkpoint")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    one_line_error(capsys, ["convert", str(tmp_path / "llama"), str(tmp_path / "full")], "is not empty", "--overwrite")
    truncated = tmp_path / "broken"
    save_ar_checkpoint("llama", truncated)
    weights = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    one_line_error(capsys, ["convert", str(truncated), str(tmp_path / "out2")], "model.safetensors",
                   "truncated or corrupt")
    assert cli_main(["convert", str(tmp_path / "llama"), str(tmp_path / "auto")]) == 0  # --from read from config.json
    assert "converted llama checkpoint" in capsys.readouterr().out


def test_offline_push_says_the_local_folder_is_complete(tmp_path, capsys, monkeypatch):
    import huggingface_hub.constants

    save_ar_checkpoint("llama", tmp_path / "llama")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    err = one_line_error(capsys, ["convert", str(tmp_path / "llama"), str(tmp_path / "out"), "--push-to-hub",
                                  "someone/model"], "is complete, but the upload to someone/model failed")
    assert (tmp_path / "out" / "model.safetensors").is_file() and str(tmp_path / "out") in err


def test_artefacts_model_card_training_record_file_modes_and_pad_token(tmp_path):
    """The card's pipeline loads the model; DLMTrainer records its run in the card; files are 0644
    (under umask 022); a converted AR tokenizer without a pad token gets one (batched generation)."""
    import os
    import stat

    from transformers import AutoTokenizer, pipeline

    from hf_dlm.data.corpus import train_bpe_tokenizer
    from tests.utils import make_trainer

    trainer = make_trainer(tmp_path / "run", max_steps=2)
    trainer.train()
    tokenizer = train_bpe_tokenizer(["a b c d e f g"] * 20, vocab_size=99)
    trainer.processing_class = tokenizer
    final = tmp_path / "run" / "final"
    previous = os.umask(0o022)
    try:
        trainer.save_model(str(final))
    finally:
        os.umask(previous)
    card = (final / "README.md").read_text()
    assert "pipeline_tag: fill-mask" in card and "| global_step | `2` |" in card and "| objective_preset | `mdlm` |" in card
    for name in os.listdir(final):
        assert stat.S_IMODE(os.stat(final / name).st_mode) == 0o644, name
    fill = pipeline("fill-mask", model=str(final))  # the card's pipeline loads this model
    assert type(fill.model).__name__ == "DLMForDiffusionLM"

    save_ar_checkpoint("llama", tmp_path / "llama")
    ar_tokenizer = train_bpe_tokenizer(["a b c d e f g"] * 20, vocab_size=90)
    ar_tokenizer.pad_token = None
    ar_tokenizer.save_pretrained(tmp_path / "llama")
    assert cli_main(["convert", str(tmp_path / "llama"), str(tmp_path / "converted")]) == 0
    converted = AutoTokenizer.from_pretrained(tmp_path / "converted")
    assert converted.pad_token == converted.eos_token and converted.pad_token_id is not None
    config = json.loads((tmp_path / "converted" / "config.json").read_text())
    assert config["pad_token_id"] == converted.pad_token_id
    assert stat.S_IMODE(os.stat(tmp_path / "converted" / "config.json").st_mode) & 0o044 == 0o044
