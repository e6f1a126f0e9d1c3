"""Training configuration: field validation with the field's name, YAML configs, the collator, `hf-dlm train`."""

import os

import pytest
import torch

from hf_dlm.data.collator import DLMDataCollator
from hf_dlm.training.runner import ConfigError, build_trainer, load_config
from hf_dlm.training.trainer import STAGING_DIR
from hf_dlm.training.training_args import DLMTrainingArguments

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "examples", "configs", "tiny_cpu.yaml")


@pytest.mark.parametrize("field,value", [("objective_preset", "bert"), ("schedule", "square"), ("weighting", "1/t2"),
                                         ("t_sampling", "sobol"), ("normalization", "rows"), ("eps", 1.0),
                                         ("random_length_prob", 1.5), ("peak_flops", 0.0), ("t_buckets", -1),
                                         ("eval_mc_num", 0), ("fp8_recipe", "mxfp8-ish"),
                                         ("fp8_fast_accum", True), ("average_tokens_across_devices", False),
                                         ("low_precision_residual", True)])
def test_bad_argument_values_name_the_field(tmp_path, field, value):
    with pytest.raises(ValueError, match=f"DLMTrainingArguments.{field} must be"):
        DLMTrainingArguments(output_dir=str(tmp_path), **{field: value})


def test_every_field_has_help_and_the_objective_follows_the_arguments(tmp_path):
    import dataclasses

    from tests.utils import tiny_config

    for f in dataclasses.fields(DLMTrainingArguments):
        assert f.metadata.get("help"), f"{f.name} has no help text"
    args = DLMTrainingArguments(output_dir=str(tmp_path), objective_preset="megadlms", eps=0.01, seed=7,
                                fp8_recipe="rowwise", compile_blocks=True)
    objective = args.build_objective(tiny_config(label_alignment="shift"))
    assert (objective.weighting, objective.at_least_one_masked, objective.eps, objective.seed) == ("measured", True, 0.01, 7)
    assert objective.label_alignment == "shift" and objective.mask_token_id == 98
    assert args.remove_unused_columns is False and args.accelerator_config.dispatch_batches is False


def _write(tmp_path, text):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("text,message", [
    ("training:\n  learning_rat: 0.1\n", "training.learning_rat is not a DLMTrainingArguments field"),
    ("training:\n  schedule: square\n", "DLMTrainingArguments.schedule must be"),
    ("training:\n  learning_rate: fast\n", "training.learning_rate = 'fast': expected a number"),
    ("trainig:\n  max_steps: 1\n", "unknown section"),
    ("model:\n  config: {hiden_size: 8}\ndata: {kind: random}\n", "model.config.hiden_size is not a DLMConfig field"),
    ("model:\n  config: {vocab_size: 9}\ndata: {kind: megatron}\n", "data.kind must be one of"),
    ("model:\n  config: {vocab_size: 9}\ndata: {kind: random, seqlen: 3}\n", "data.seqlen is not an option"),
    ("model:\n  flash: true\ndata: {kind: random}\n", "model.flash is not a model option"),
])
def test_bad_config_entries_name_the_file_and_field(tmp_path, text, message):
    path = _write(tmp_path, text + "" if "training" in text else text + f"training: {{output_dir: {tmp_path}}}\n")
    with pytest.raises(ConfigError) as error:
        build_trainer(load_config(path), path)
    assert message in str(error.value) and path in str(error.value)


def test_set_overrides_and_the_cli_reports_config_errors(tmp_path, capsys):
    from hf_dlm.cli import main

    config = load_config(TINY, ["training.max_steps=3", "data.seq_len=32", "training.eval_strategy=no",
                                "training.use_cpu=True"])
    assert config["training"]["max_steps"] == 3 and config["data"]["seq_len"] == 32
    # YAML 1.2 booleans: `no` stays the string TrainingArguments expects (PyYAML's 1.1 default makes it False)
    assert config["training"]["eval_strategy"] == "no" and config["training"]["use_cpu"] is True
    with pytest.raises(ConfigError, match="training.x=\\[1': the value is not valid YAML"):
        load_config(TINY, ["training.x=[1"])
    path = _write(tmp_path, "training:\n  max_step: 3\n")
    assert main(["train", path]) == 2
    assert "training.max_step is not a DLMTrainingArguments field" in capsys.readouterr().err  # errors go to stderr


def test_the_example_script_trains_and_reports_bad_configs_under_its_own_name(tmp_path):
    import json
    import subprocess
    import sys

    script = os.path.join(ROOT, "examples", "pretrain.py")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, script, "--config", TINY, "--json", "--set", "training.max_steps=2",
                          "--set", f"training.output_dir={tmp_path / 'run'}", "--set", "training.eval_strategy=no"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    metrics = json.loads(out.stdout.strip().splitlines()[-1])
    assert metrics["global_step"] == 2 and (tmp_path / "run" / "final" / "config.json").exists()
    bad = _write(tmp_path, "training:\n  max_step: 3\n")
    out = subprocess.run([sys.executable, script, "--config", bad], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 2 and "pretrain.py: " in out.stderr and "training.max_step" in out.stderr


def test_hf_dlm_train_runs_the_tiny_config_and_saves_a_loadable_model(tmp_path):
    from transformers import AutoModelForMaskedLM

    from hf_dlm.training.runner import run_pretraining

    metrics = run_pretraining(TINY, [f"training.output_dir={tmp_path}", "training.max_steps=4", "training.save_steps=2",
                                     "training.eval_steps=4", "training.logging_steps=2", "data.max_files=40"])
    assert metrics["eval_nll_per_token"] > 0 and metrics["train_loss"] > 0
    assert sorted(os.listdir(tmp_path / "checkpoint-4")) and not os.path.exists(tmp_path / STAGING_DIR)
    model = AutoModelForMaskedLM.from_pretrained(tmp_path / "final")
    assert model.config.hidden_size == 64 and model.config.mask_token_id is not None


def test_accelerate_config_files_parse():
    from accelerate.commands.config.config_args import ClusterConfig

    kinds = {}
    for name in ("single_gpu", "ddp", "fsdp2", "ddp_cpu"):
        config = ClusterConfig.from_yaml_file(os.path.join(ROOT, "examples", "accelerate", f"{name}.yaml"))
        kinds[name] = str(config.distributed_type)
    fsdp = ClusterConfig.from_yaml_file(os.path.join(ROOT, "examples", "accelerate", "fsdp2.yaml"))
    assert fsdp.fsdp_config["fsdp_version"] == 2 and "FSDP" in kinds["fsdp2"] and "MULTI_GPU" in kinds["ddp"]


def test_collator_pads_and_passes_position_ids_only_for_packed_rows():
    collator = DLMDataCollator(pad_token_id=0, pad_to_multiple_of=4)
    batch = collator([{"input_ids": [5, 6, 7], "sample_index": 3, "prompt_mask": [True, False, False]},
                      {"input_ids": torch.tensor([8, 9, 10, 11, 12]), "sample_index": 9}])
    assert batch["input_ids"].tolist() == [[5, 6, 7, 0, 0, 0, 0, 0], [8, 9, 10, 11, 12, 0, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0, 0]]
    assert batch["prompt_mask"][0].tolist() == [True] + [False] * 7 and batch["sample_index"].tolist() == [3, 9]
    assert "position_ids" not in batch
    plain = collator([{"input_ids": [1, 2], "position_ids": [0, 1], "sample_index": 0},
                      {"input_ids": [1, 2, 3], "position_ids": [0, 1, 2], "sample_index": 1}])
    assert "position_ids" not in plain  # arange rows, padding aside: not packed
    packed = DLMDataCollator()([{"input_ids": [1, 2, 3, 4], "position_ids": [0, 1, 0, 1], "sample_index": 0}])
    assert packed["position_ids"].tolist() == [[0, 1, 0, 1]] and "attention_mask" not in packed
    with pytest.raises(KeyError, match="sample 0 of the batch has no 'sample_index'"):
        collator([{"input_ids": [1, 2]}])


def test_gpu_config_is_the_qwen3_1_7b_shape():
    from hf_dlm.modeling import DLMConfig, DLMForDiffusionLM
    from hf_dlm.training.runner import build_training_args, check_model_section

    config = load_config(os.path.join(ROOT, "examples", "configs", "qwen3_1.7b_shape.yaml"), ["training.use_cpu=true"])
    model_section = dict(config["model"])
    options = model_section.pop("config")
    check_model_section(model_section, options)
    with torch.device("meta"):
        model = DLMForDiffusionLM(DLMConfig(**options))
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(1.72e9, rel=1e-3)  # tied, as measured
    args = build_training_args(config["training"])
    assert args.bf16 and args.compile_blocks and args.per_device_train_batch_size == 4
    assert config["data"]["seq_len"] == 4096
