"""The README's commands and snippets run as written, in the order written, on the models they name.

Snippets on a real checkpoint run against the quickstart's output (a tiny run); blocks that need GPUs or
the Hub say so in a comment next to them (checked here), and the rest of a block's commands are checked
for what makes them fail when run in order (each training run its own output_dir).
"""

import math
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def _commands(block: str) -> list[tuple[str, str]]:
    """(comment lines above, command) for each command of a bash block, continuation lines joined."""
    out, comment, current = [], [], ""
    for line in block.splitlines():
        if not current and line.lstrip().startswith("#"):
            comment.append(line)
            continue
        current += line.rstrip("\\").rstrip() + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            if current.strip():
                out.append(("\n".join(comment), current.strip()))
            comment, current = [], ""
    return out


def test_every_readme_snippet_imports_resolve():
    blocks = _blocks("python")
    assert len(blocks) >= 4
    imports = [line for block in blocks for line in block.splitlines()
               if re.match(r"(from hf_dlm\S* import|import hf_dlm)", line)]
    assert any("DLMTrainer" in line for line in imports)
    for line in imports:
        exec(line.split("#")[0], {})  # raises ImportError on a stale path or name


@pytest.fixture(scope="module")
def quickstart_model(tmp_path_factory):
    from hf_dlm.training.quickstart import QuickstartConfig, run_quickstart

    path = tmp_path_factory.mktemp("qs") / "quickstart"
    run_quickstart(QuickstartConfig(output_dir=str(path), max_seconds=600, max_steps=3, vocab_size=320, seq_len=64,
                                    batch_size=8, hidden_size=32, num_layers=2, num_heads=4, eval_windows=4,
                                    mc_num=1, max_new_tokens=8, corpus_max_files=60, threads=1),
                   log=lambda line: None)
    return path


def test_in_python_snippet_runs_on_the_quickstart_model(quickstart_model):
    block = next(b for b in _blocks("python") if "outputs/quickstart" in b)
    code = block.replace('"outputs/quickstart"', repr(str(quickstart_model)))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    match = re.search(r"NELBO (\d+\.\d+) nats per token \(\d+ of \d+ tokens masked\)", out.stdout)
    assert match, out.stdout
    # the NELBO-per-token scale (about log V = 5.8 for an untrained model), not per masked token (~60)
    assert float(match.group(1)) < 2 * math.log(320), out.stdout
    # the sampling call stays within the model's positions: prompt + max_new_tokens
    from transformers import AutoConfig

    new_tokens = int(re.search(r"max_new_tokens=(\d+)", block).group(1))
    assert 16 + new_tokens <= AutoConfig.from_pretrained(quickstart_model).max_position_embeddings


def test_the_chat_template_of_the_quickstart_model(quickstart_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(quickstart_model)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "The little girl ate an apple."}],
                                        add_generation_prompt=True)
    ids = ids if isinstance(ids, list) else ids["input_ids"]
    # word-level and lower-cased: the roles are words of its vocabulary, not unknown tokens
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == "user : the little girl ate an apple. assistant :"


def test_dlm_trainer_snippet_with_a_plain_eval_dataset(tmp_path, monkeypatch):
    """The DLMTrainer snippet as written (a plain eval_dataset of input_ids), on a tiny model and CPU."""
    from tests.utils import VOCAB, tiny_model

    block = next(b for b in _blocks("python") if "DLMTrainer(model=model" in b)
    generator = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(0, VOCAB - 1, (16,), generator=generator).tolist()} for _ in range(12)]
    code = block.replace("max_steps=1000, bf16=True", "max_steps=2, bf16=False, use_cpu=True, report_to=[]")
    assert code != block
    monkeypatch.chdir(tmp_path)
    namespace = {"model": tiny_model().train(), "train": rows[:8], "heldout": rows[8:]}
    exec(code, namespace)
    metrics = namespace["trainer"].evaluate()
    assert 0 < metrics["eval_loss"] < 3 * math.log(VOCAB)


def test_training_commands_run_in_order():
    """Every training run of a block writes its own output_dir (a second run into the first's checkpoints is
    refused), and a block's GPU-only commands say so."""
    import yaml

    for block in _blocks("bash"):
        seen = {}
        for comment, command in _commands(block):
            if not command.startswith(("hf-dlm train", "accelerate launch")):
                continue
            words = shlex.split(command, comments=True)
            if not (words[:2] == ["hf-dlm", "train"] or (words[:2] == ["accelerate", "launch"] and "--config" in words)):
                continue
            config = words[words.index("--config") + 1] if "--config" in words else words[2]
            sets = dict(w.split("=", 1) for w in words if w.startswith("training.output_dir="))
            output_dir = sets.get("training.output_dir") or yaml.safe_load((ROOT / config).read_text())["training"]["output_dir"]
            assert output_dir not in seen, f"{command!r} writes into {output_dir}, as {seen.get(output_dir)!r} did"
            seen[output_dir] = command
            if "fsdp2.yaml" in command or "1.7b" in command:
                assert "GPU" in comment, f"{command!r} needs GPUs and does not say so"


def test_first_training_command_runs_as_written(tmp_path):
    block = next(b for b in _blocks("bash") if "hf-dlm train examples/configs/tiny_cpu.yaml" in b)
    command = next(c for _, c in _commands(block) if c.startswith("hf-dlm train"))
    words = shlex.split(command.replace("max_steps=50", "max_steps=2"))  # the command, 2 steps instead of 50
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    out = subprocess.run([sys.executable, "-m", "hf_dlm.cli", *words[1:]], capture_output=True, text=True,
                         timeout=600, cwd=tmp_path, env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "outputs" / "tiny_cpu").exists()


def test_convert_with_a_mask_id_beyond_the_vocabulary_is_one_line(tmp_path, capsys):
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_dlm.cli import main as cli_main

    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(tmp_path / "llama")
    capsys.readouterr()  # the save's progress bar is not the command's output
    for mask_id in ("128002", "64"):  # the README's Llama-3 id, and the first id past this vocabulary (0..63)
        assert cli_main(["convert", "--from", "llama", str(tmp_path / "llama"), str(tmp_path / "dlm"),
                         "--mask-token-id", mask_id]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and mask_id in err and "mask" in err, err
    assert not (tmp_path / "dlm").exists() or not any((tmp_path / "dlm").iterdir())
