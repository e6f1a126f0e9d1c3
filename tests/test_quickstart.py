import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForMaskedLM

from hf_dlm import DLMForDiffusionLM
from hf_dlm.cli import main as cli_main
from hf_dlm.data.corpus import SPECIAL_TOKENS, split_documents, stdlib_documents, train_bpe_tokenizer
from hf_dlm.training.quickstart import QuickstartConfig, run_quickstart

ROOT = Path(__file__).resolve().parents[1]


def test_corpus_is_deterministic_english_with_special_tokens():
    docs = stdlib_documents(max_files=40)
    assert len(docs) > 50 and docs == stdlib_documents(max_files=40)
    assert any("statement" in d for d in docs)
    train, heldout = split_documents(docs, heldout_fraction=0.2)
    assert set(train).isdisjoint(heldout) and len(train) + len(heldout) == len(docs)
    tokenizer = train_bpe_tokenizer(train, vocab_size=300)
    for name, token in SPECIAL_TOKENS.items():
        assert getattr(tokenizer, name) == token and getattr(tokenizer, f"{name}_id") is not None
    text = "The for statement iterates."
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text


def test_quickstart_trains_saves_a_loadable_checkpoint_and_samples(tmp_path):
    cfg = QuickstartConfig(output_dir=str(tmp_path / "qs"), max_seconds=600, max_steps=25, vocab_size=320, seq_len=64,
                           batch_size=8, hidden_size=48, num_layers=2, num_heads=4, eval_windows=8, mc_num=2,
                           learning_rate=3e-3, warmup_steps=5, max_new_tokens=8)
    lines = []
    result = run_quickstart(cfg, log=lines.append)
    assert result["steps"] == 25  # max_steps first: the 600 s are not reached
    # --max-seconds bounds the whole command: training gets what the corpus and model set-up used and what
    # the evaluation, save and sample are estimated to need leave (before, training alone took max_seconds)
    budget = result["budget"]
    assert budget["setup_seconds"] > 0 and budget["finish_seconds"] > 1.0
    assert budget["setup_seconds"] + budget["train_seconds"] + budget["finish_seconds"] == pytest.approx(cfg.max_seconds)
    assert result["heldout_elbo_after"] < result["heldout_elbo_before"]
    assert any("held-out ELBO" in line for line in lines)
    model = AutoModelForMaskedLM.from_pretrained(tmp_path / "qs")
    assert isinstance(model, DLMForDiffusionLM) and model.config.mask_token_id is not None
    assert isinstance(result["sample"], str)

    # examples/usage.py runs against the checkpoint the quickstart wrote
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "usage.py"), str(tmp_path / "qs"),
                          "--max-new-tokens", "8"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "tokens masked" in out.stdout and "->" in out.stdout
    # the NELBO per token: near the held-out bound, not rescaled by the masked count (which gave ~60)
    nelbo = float(re.search(r"NELBO ([0-9.]+) nats per token", out.stdout).group(1))
    assert nelbo < 1.5 * math.log(cfg.vocab_size)


def test_cli_lists_commands_and_rejects_unknown(capsys):
    assert cli_main([]) == 2
    assert "quickstart" in capsys.readouterr().out
    try:
        cli_main(["nope"])
    except SystemExit as exit_:
        assert exit_.code == 2
    assert "unknown command 'nope'" in capsys.readouterr().err
