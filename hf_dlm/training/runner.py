"""Pretraining from one YAML file: `accelerate launch examples/pretrain.py --config CONFIG.yaml` or
`hf-dlm train CONFIG.yaml`.

The file has three sections:

    model:     name_or_path (from_pretrained) or config (DLMConfig fields); attn_implementation; dtype
    data:      kind (one of `hf_dlm.data.builders.DATA_BUILDERS`) and that builder's options
    training:  DLMTrainingArguments fields

`--set section.key=value` overrides one entry at any depth (`model.config.hidden_size=48`; the value parsed
as YAML). Unknown sections or fields, and values of the wrong type for their DLMConfig / DLMTrainingArguments
field, are errors that name the file, the field, the value and what is expected, raised before any data is
built.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re

import torch

from ..data.builders import DATA_BUILDERS, build_data, register_data_builder  # noqa: F401  (the YAML's data.kind)
from ..utils.checkpoint_files import CheckpointFileError, check_checkpoint_files
from ..utils.errors import ConfigError
from ..utils.import_utils import require
from ..utils.typecheck import conforms, expected, field_types

SECTIONS = ("model", "data", "training")
MODEL_KEYS = ("name_or_path", "config", "attn_implementation", "dtype")
DEFAULT_OUTPUT_DIR = "outputs/pretrain"
DATA_IDS = ("vocab_size", "mask_token_id", "eos_token_id", "pad_token_id")  # what a data builder may fill in


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
        _apply_override(config, item, loader)
    unknown = sorted(set(config) - set(SECTIONS))
    if unknown:
        raise ConfigError(f"{path}: unknown section(s) {unknown}; expected {list(SECTIONS)}")
    for section in SECTIONS:
        if not isinstance(config.get(section, {}), dict):
            raise ConfigError(f"{path}: section {section!r} must be a mapping")
    return config


def _apply_override(config: dict, item: str, loader) -> None:
    """`--set a.b.c=value`: the value (parsed as YAML) at any depth (`model.config.rope_parameters.rope_theta`);
    missing mappings on the way are created, a non-mapping on the way is an error naming it."""
    import yaml

    key, sep, text = item.partition("=")
    keys = key.strip().split(".")
    if not sep or len(keys) < 2 or not all(keys):
        raise ConfigError(f"--set {item!r}: expected section.key=value (keys at any depth: model.config.hidden_size=48)",
                          field=key or None)
    try:
        value = yaml.load(text, Loader=loader)
    except yaml.YAMLError as error:
        raise ConfigError(f"--set {item!r}: the value is not valid YAML: {' '.join(str(error).split())}",
                          field=key) from None
    node = config
    for depth, name in enumerate(keys[:-1]):
        if node.get(name) is None:
            node[name] = {}
        if not isinstance(node[name], dict):
            where = ".".join(keys[: depth + 1])
            raise ConfigError(f"--set {item!r}: {where} is {node[name]!r}, not a mapping", field=where,
                              value=node[name])
        node = node[name]
    node[keys[-1]] = value


def _check_field(path: str, field: str, value, annotation) -> None:
    """One line naming section.field, the value and the expected type, before any data is built."""
    if not conforms(value, annotation):
        raise ConfigError(f"{path}: {field} = {value!r}: expected {expected(annotation)}", field=field, value=value)


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
        raise ConfigError(f"{path}: model.config.{typo[0]} is not a DLMConfig field", field=f"model.config.{typo[0]}")
    types = field_types(DLMConfig)
    for name, value in model_options.items():
        _check_field(path, f"model.config.{name}", value, types.get(name, object))
    for name in ("name_or_path", "attn_implementation", "dtype"):
        if model.get(name) is not None:
            _check_field(path, f"model.{name}", model[name], str)


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
    except Exception as raised:  # noqa: BLE001 (unwrapped; anything else is re-raised)
        raise _model_config_error(raised, path) from None
    config._attn_implementation = attn
    return DLMForDiffusionLM(config).to(dtype)


def _check_model_config_early(model_options: dict, path: str) -> None:
    """DLMConfig's own checks (divisibility, modes, routing) on the section as written, before the data is
    built; the token ids the data may still fill in (vocabulary, mask / eos / pad) are checked after it."""
    from ..modeling import DLMConfig

    trial = {name: value for name, value in model_options.items() if name not in DATA_IDS}
    try:
        DLMConfig(**trial)
    except Exception as raised:  # noqa: BLE001 (unwrapped below; anything else is re-raised)
        raise _model_config_error(raised, path) from None


def _model_config_error(raised: Exception, path: str) -> Exception:
    """DLMConfig's own error as one ConfigError line. huggingface_hub's strict dataclasses wrap a validator's
    ValueError in StrictDataclassClassValidationError (not a ValueError); the original is its cause."""
    from ..utils.errors import FieldError

    error = raised
    while not isinstance(error, (TypeError, ValueError)) and error.__cause__ is not None:
        error = error.__cause__
    if isinstance(error, FieldError):
        return ConfigError(f"{path}: model.config.{error.field}: {error}", field=f"model.config.{error.field}",
                           value=error.value)
    if isinstance(error, (TypeError, ValueError)):
        return ConfigError(f"{path}: model.config: {error}")
    return raised


def build_training_args(training: dict, path: str = "config"):
    from .training_args import DLMTrainingArguments

    fields = {f.name: f for f in dataclasses.fields(DLMTrainingArguments) if f.init}
    options = {}
    for name, value in training.items():
        if name not in fields:
            raise ConfigError(f"{path}: training.{name} is not a DLMTrainingArguments field", field=f"training.{name}")
        annotation = field_types(DLMTrainingArguments).get(name)
        if isinstance(value, str) and conforms(1.0, annotation) and not conforms(value, annotation):
            try:
                value = float(value)  # YAML reads 3e-4 (no dot) as a string
            except ValueError:
                pass
        if name == "resume_from_checkpoint" and isinstance(value, bool):
            value = "true" if value else None  # `resume_from_checkpoint: true`: the last checkpoint
        _check_field(path, f"training.{name}", value, object if annotation is None else annotation)
        options[name] = value
    options.setdefault("output_dir", DEFAULT_OUTPUT_DIR)
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
    if not model_section.get("name_or_path"):
        _check_model_config_early(model_options, path)
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


def check_resume(training: dict, path: str = "config") -> str | None:
    """The checkpoint to resume from (None: a fresh run), decided on every rank from the files alone, so a
    refusal is the same one line on every rank of a launch and comes before any collective: an output_dir that
    already holds checkpoints without resume_from_checkpoint, a resume with nothing to resume, or a checkpoint
    file that cannot be read (named, with the previous checkpoint to fall back to)."""
    from transformers.trainer_utils import get_last_checkpoint

    output_dir = training.get("output_dir", DEFAULT_OUTPUT_DIR)
    resume = training.get("resume_from_checkpoint")
    if isinstance(resume, str) and resume.lower() in ("true", "last"):
        resume = True
    last = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
    if not resume:
        if last is not None and not training.get("overwrite_output_dir"):
            raise ConfigError(f"{path}: training.output_dir {output_dir!r} already holds {os.path.basename(last)}: "
                              "--set training.resume_from_checkpoint=true to continue it, or another output_dir "
                              "(or training.overwrite_output_dir=true) for a new run", field="training.output_dir",
                              value=output_dir)
        return None
    checkpoint = last if resume is True else resume
    if checkpoint is None or not os.path.isdir(checkpoint):
        where = f"{output_dir!r} holds no checkpoint" if resume is True else f"{resume!r} is not a checkpoint folder"
        raise ConfigError(f"{path}: training.resume_from_checkpoint: {where}", field="training.resume_from_checkpoint",
                          value=resume)
    try:
        check_checkpoint_files(checkpoint, "--set training.resume_from_checkpoint")
    except CheckpointFileError as error:
        raise ConfigError(str(error), field="training.resume_from_checkpoint", value=error.field) from None
    return checkpoint


def run_pretraining(path: str, overrides: list[str] | None = None) -> dict:
    """Train, evaluate (if there is an eval set) and save the final model; returns the metrics."""
    config = load_config(path, overrides)
    resume = check_resume(config.get("training", {}), path)  # before any data is built or collective is run
    trainer, _ = build_trainer(config, path)
    result = trainer.train(resume_from_checkpoint=resume)
    metrics = dict(result.metrics, global_step=result.global_step)
    if trainer.eval_dataset is not None:
        metrics.update(trainer.evaluate())
    trainer.save_model(os.path.join(trainer.args.output_dir, "final"))
    trainer.accelerator.wait_for_everyone()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()  # a live gloo/NCCL group aborts the interpreter at exit
    return metrics
