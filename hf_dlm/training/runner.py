"""Pretraining from one YAML file: `accelerate launch examples/pretrain.py --config CONFIG.yaml` or
`hf-dlm train CONFIG.yaml`.

The file has three sections:

    model:     name_or_path (from_pretrained) or config (DLMConfig fields); attn_implementation; dtype
    data:      kind (one of `hf_dlm.data.builders.DATA_BUILDERS`) and that builder's options
    training:  DLMTrainingArguments fields

`--set section.key=value` overrides one entry (value parsed as YAML). Unknown sections or fields are
errors that name the file and the field.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re

import torch

from ..data.builders import DATA_BUILDERS, build_data, register_data_builder  # noqa: F401  (the YAML's data.kind)
from ..utils.errors import ConfigError
from ..utils.import_utils import require

SECTIONS = ("model", "data", "training")
MODEL_KEYS = ("name_or_path", "config", "attn_implementation", "dtype")


@functools.lru_cache(maxsize=1)
def _yaml_loader():
    """A safe loader with YAML 1.2 booleans. PyYAML follows YAML 1.1, where `no`, `off`, `yes` and `on`
    are booleans too, so `eval_strategy: no` (or `--set training.save_strategy=no`) would reach
    TrainingArguments as False."""
    import yaml

    bool_tag = "tag:yaml.org,2002:bool"

    class Yaml12Loader(yaml.SafeLoader):
        yaml_implicit_resolvers = {first: [(tag, regexp) for tag, regexp in resolvers if tag != bool_tag]
                                   for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}

    Yaml12Loader.add_implicit_resolver(bool_tag, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
    return Yaml12Loader


def load_config(path: str, overrides: list[str] | None = None) -> dict:
    require("yaml", "reading training configs")
    import yaml

    loader = _yaml_loader()
    try:
        with open(path) as f:
            config = yaml.load(f, Loader=loader)
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML: {error}") from None
    except OSError as error:
        raise ConfigError(f"{path}: cannot read the config ({error.strerror or error})") from None
    if config is None:  # an empty file would otherwise train a default-sized model
        raise ConfigError(f"{path}: the config is empty; it needs the sections {list(SECTIONS)} "
                          "(see examples/configs/tiny_cpu.yaml)")
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: the top level must be a mapping with sections {SECTIONS}")
    for item in overrides or []:
        key, sep, value = item.partition("=")
        section, dot, name = key.partition(".")
        if not sep or not dot:
            raise ConfigError(f"--set {item!r}: expected section.key=value")
        try:
            config.setdefault(section, {})[name] = yaml.load(value, Loader=loader)
        except yaml.YAMLError as error:
            raise ConfigError(f"--set {item!r}: the value is not valid YAML: {error}") from None
    unknown = sorted(set(config) - set(SECTIONS))
    if unknown:
        raise ConfigError(f"{path}: unknown section(s) {unknown}; expected {list(SECTIONS)}")
    for section in SECTIONS:
        if not isinstance(config.get(section, {}), dict):
            raise ConfigError(f"{path}: section {section!r} must be a mapping")
    return config


# -- model and arguments --------------------------------------------------------------------------------
def check_model_section(model: dict, model_options: dict, path: str = "config") -> None:
    """Names the first unknown model option or DLMConfig field (DLMConfig itself accepts any keyword)."""
    from ..modeling import DLMConfig

    unknown = sorted(set(model) - set(MODEL_KEYS))
    if unknown:
        raise ConfigError(f"{path}: model.{unknown[0]} is not a model option (options: {list(MODEL_KEYS)})")
    known = {f.name for f in dataclasses.fields(DLMConfig)}
    typo = sorted(set(model_options) - known)
    if typo:
        raise ConfigError(f"{path}: model.config.{typo[0]} is not a DLMConfig field")


def build_model(model: dict, model_options: dict, path: str = "config"):
    from ..modeling import DLMConfig, DLMForDiffusionLM

    check_model_section(model, model_options, path)
    dtype = getattr(torch, model.get("dtype", "float32"), None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"{path}: model.dtype {model.get('dtype')!r} is not a torch dtype")
    attn = model.get("attn_implementation", "sdpa")
    if model.get("name_or_path"):
        from transformers import AutoModelForMaskedLM

        from ..utils.paths import check_model_location

        check_model_location(model["name_or_path"], f"{path}: model.name_or_path")
        return AutoModelForMaskedLM.from_pretrained(model["name_or_path"], attn_implementation=attn, dtype=dtype,
                                                    **model_options)
    try:
        config = DLMConfig(**model_options)
    except (TypeError, ValueError) as error:
        raise ConfigError(f"{path}: model.config: {error}") from None
    config._attn_implementation = attn
    return DLMForDiffusionLM(config).to(dtype)


def build_training_args(training: dict, path: str = "config"):
    from .training_args import DLMTrainingArguments

    fields = {f.name: f for f in dataclasses.fields(DLMTrainingArguments) if f.init}
    options = {}
    for name, value in training.items():
        if name not in fields:
            raise ConfigError(f"{path}: training.{name} is not a DLMTrainingArguments field")
        if isinstance(value, str) and "float" in str(fields[name].type):
            try:
                value = float(value)  # YAML reads 3e-4 (no dot) as a string
            except ValueError:
                raise ConfigError(f"{path}: training.{name} must be a number, got {value!r}") from None
        options[name] = value
    options.setdefault("output_dir", "outputs/pretrain")
    try:
        return DLMTrainingArguments(**options)
    except (TypeError, ValueError) as error:
        raise ConfigError(f"{path}: training: {error}") from None


def _check_model_fits_data(model_config, data: dict, tokenizer, path: str) -> None:
    """Mistakes that would otherwise fail mid-run (an IndexError in the embedding) or extrapolate silently."""
    length = data.get("seq_len", data.get("max_length"))
    limit = getattr(model_config, "max_position_embeddings", None)
    if length is not None and limit is not None and length > limit:
        name = "seq_len" if "seq_len" in data else "max_length"
        raise ConfigError(f"{path}: data.{name} ({length}) exceeds the model's max_position_embeddings ({limit})")
    if tokenizer is not None and len(tokenizer) > model_config.vocab_size:
        raise ConfigError(f"{path}: the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is "
                          f"{model_config.vocab_size}: token ids past it would fail mid-run; use a model with a "
                          "vocabulary at least as large (model.config.vocab_size, or resize the checkpoint)")
    mask_id = getattr(tokenizer, "mask_token_id", None)
    if mask_id is not None and model_config.mask_token_id is not None and mask_id != model_config.mask_token_id:
        raise ConfigError(f"{path}: the tokenizer's mask token id ({mask_id}) differs from the model's "
                          f"mask_token_id ({model_config.mask_token_id})")


def build_trainer(config: dict, path: str = "config"):
    """(trainer, tokenizer) from a loaded config."""
    from transformers import set_seed

    from .trainer import DLMTrainer

    args = build_training_args(config.get("training", {}), path)
    model_section = dict(config.get("model", {}))
    model_options = dict(model_section.pop("config", None) or {})
    check_model_section(model_section, model_options, path)
    # the data's tokenizer fills the ids a model built from its config lacks; a checkpoint keeps its own
    # (a vocabulary taken from the tokenizer would silently resize it), and is checked against it below
    data_model_options = dict(model_options)
    data = build_data(config.get("data", {"kind": "corpus"}), data_model_options, path)
    if not model_section.get("name_or_path"):
        model_options = data_model_options
    # a model built from its config draws its initial weights now, before the Trainer seeds: seed first,
    # so the same YAML twice gives the same run, and every process of a run starts from the same weights
    # (FSDP2 and pipeline stages shard what each process built), as Trainer(model_init=...) does
    set_seed(args.seed)
    model = build_model(model_section, model_options, path)
    _check_model_fits_data(model.config, config.get("data", {}), data["tokenizer"], path)
    trainer = DLMTrainer(model=model, args=args, train_dataset=data["train"], eval_dataset=data["eval"],
                         processing_class=data["tokenizer"])
    return trainer, data["tokenizer"]


def run_pretraining(path: str, overrides: list[str] | None = None) -> dict:
    """Train, evaluate (if there is an eval set) and save the final model; returns the metrics."""
    config = load_config(path, overrides)
    trainer, _ = build_trainer(config, path)
    resume = trainer.args.resume_from_checkpoint
    if isinstance(resume, str) and resume.lower() in ("true", "last"):
        resume = True
    result = trainer.train(resume_from_checkpoint=resume or None)
    metrics = dict(result.metrics, global_step=result.global_step)
    if trainer.eval_dataset is not None:
        metrics.update(trainer.evaluate())
    trainer.save_model(os.path.join(trainer.args.output_dir, "final"))
    trainer.accelerator.wait_for_everyone()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()  # a live gloo/NCCL group aborts the interpreter at exit
    return metrics
