"""Pretraining from one YAML file: `accelerate launch examples/pretrain.py --config CONFIG.yaml` or
`hf-dlm train CONFIG.yaml`.

The file has three sections:

    model:     name_or_path (from_pretrained) or config (DLMConfig fields); attn_implementation; dtype
    data:      kind (one of DATA_BUILDERS) and that builder's options
    training:  DLMTrainingArguments fields

`--set section.key=value` overrides one entry (value parsed as YAML). Unknown sections or fields are
errors that name the file and the field.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from typing import Callable

import torch

from ..utils.import_utils import require

SECTIONS = ("model", "data", "training")
MODEL_KEYS = ("name_or_path", "config", "attn_implementation", "dtype")


class ConfigError(ValueError):
    pass


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


# -- data ---------------------------------------------------------------------------------------------
def _corpus_data(options: dict, model_options: dict) -> dict:
    """Python's own documentation, a byte-level BPE tokenizer trained on it, packed windows."""
    from ..data.corpus import split_documents, stdlib_documents, train_bpe_tokenizer
    from ..data.memory_dataset import TokenWindowDataset, pack_documents

    train_docs, heldout_docs = split_documents(stdlib_documents(max_files=options.get("max_files")))
    tokenizer = train_bpe_tokenizer(train_docs, options.get("vocab_size", 384))
    seq_len = options.get("seq_len", 128)

    def windows(docs):
        encoded = tokenizer(docs, add_special_tokens=False)["input_ids"]
        return pack_documents(encoded, seq_len, tokenizer.eos_token_id)

    train_ids, train_positions = windows(train_docs)
    eval_ids, eval_positions = windows(heldout_docs)
    eval_windows = options.get("eval_windows", 32)
    model_options.update(vocab_size=len(tokenizer), mask_token_id=tokenizer.mask_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    packed = options.get("packed_positions", True)  # evaluation attends like training
    return {"train": TokenWindowDataset(train_ids, train_positions if packed else None),
            "eval": TokenWindowDataset(eval_ids[:eval_windows], eval_positions[:eval_windows] if packed else None)
            if eval_windows else None,
            "tokenizer": tokenizer}


def _random_data(options: dict, model_options: dict) -> dict:
    """Uniform random token ids (throughput runs; nothing to learn). Needs the model's vocab_size."""
    from ..data.memory_dataset import TokenWindowDataset

    vocab = model_options.get("vocab_size")
    if vocab is None:
        raise ConfigError("data.kind 'random' needs model.config.vocab_size")
    generator = torch.Generator().manual_seed(options.get("seed", 0))
    shape = (options.get("num_samples", 1024), options.get("seq_len", 128))
    ids = torch.randint(0, vocab - 1, shape, generator=generator)
    mask_id = model_options.get("mask_token_id")
    if mask_id is not None:
        ids = ids + (ids >= mask_id).long()  # every id but the mask token
    eval_windows = options.get("eval_windows", 0)
    return {"train": TokenWindowDataset(ids), "eval": TokenWindowDataset(ids[:eval_windows]) if eval_windows else None,
            "tokenizer": None}


def _tokenizer_ids(options: dict, model_options: dict, kind: str):
    """Load `data.tokenizer` and take vocab / mask / eos / pad ids from it where the model section is silent."""
    if not options.get("tokenizer"):
        raise ConfigError(f"data.kind {kind!r} needs data.tokenizer (a name or path with a mask token)")
    from transformers import AutoTokenizer

    from ..utils.paths import check_model_location

    try:
        tokenizer = AutoTokenizer.from_pretrained(check_model_location(options["tokenizer"], "data.tokenizer"))
    except OSError as error:
        raise ConfigError(str(error)) from None
    if tokenizer.mask_token_id is None and model_options.get("mask_token_id") is None:
        raise ConfigError(f"data.tokenizer {options['tokenizer']!r} has no mask token; add one "
                          "(hf-dlm convert adds it for AR checkpoints) or set model.config.mask_token_id")
    for field, value in (("vocab_size", len(tokenizer)), ("mask_token_id", tokenizer.mask_token_id),
                         ("eos_token_id", tokenizer.eos_token_id), ("pad_token_id", tokenizer.pad_token_id)):
        if model_options.get(field) is None and value is not None:
            model_options[field] = value
    return tokenizer


def _indexed_data(options: dict, model_options: dict) -> dict:
    """Megatron indexed files (`hf-dlm preprocess`): packed windows, blended by weight, shuffled per epoch,
    endless (stop with training.max_steps). accelerate shards the stream over ranks; its position is saved
    in every checkpoint."""
    from torch.utils.data import Subset

    from ..data.streams import PackedDataset, build_pretraining_dataset

    prefixes = options.get("prefixes")
    if isinstance(prefixes, str):
        prefixes = [prefixes]
    if not prefixes:
        raise ConfigError("data.prefixes must list at least one indexed-file prefix (OUT of OUT.bin / OUT.idx)")
    tokenizer = _tokenizer_ids(options, model_options, "indexed")
    seq_len = options.get("seq_len", 2048)
    try:
        train = build_pretraining_dataset(prefixes, seq_len, weights=options.get("weights"),
                                          seed=options.get("seed", 0), num_epochs=None)
        eval_set = None
        if options.get("eval_prefix"):
            packed = PackedDataset(options["eval_prefix"], seq_len)  # windows with their documents' positions
            eval_set = Subset(packed, range(min(len(packed), options.get("eval_windows", 32))))
    except (OSError, ValueError) as error:
        raise ConfigError(f"data: {error}") from None
    return {"train": train, "eval": eval_set, "tokenizer": tokenizer}


def _sft_data(options: dict, model_options: dict) -> dict:
    """Chat JSONL (one {"messages": [...]} per line) through the tokenizer's chat template; prompt tokens
    are never noised; `padding_policy` 'eos' (LLaDA: train on EOS padding) or 'exclude'."""
    import json

    from ..data.sft_data import SFTDataConfig, SFTDataset

    tokenizer = _tokenizer_ids(options, model_options, "sft")
    rows = []
    for key in ("train_file", "eval_file"):
        path, loaded = options.get(key), []
        if path:
            try:
                with open(path, encoding="utf-8") as f:
                    for number, line in enumerate(f, 1):
                        if line.strip():
                            try:
                                loaded.append(json.loads(line))
                            except json.JSONDecodeError as error:
                                raise ConfigError(f"{path}:{number}: malformed JSON ({error.msg})") from None
            except OSError as error:
                raise ConfigError(f"data.{key}: {error}") from None
        rows.append(loaded)
    if not rows[0]:
        raise ConfigError("data.train_file must name a JSONL file with at least one conversation")
    try:
        padding = {key: options[key] for key in ("padding_policy", "padding") if key in options}  # padding: deprecated
        config = SFTDataConfig(max_length=options.get("max_length", 1024), **padding)
        train = SFTDataset(rows[0], tokenizer, config)
        return {"train": train, "eval": SFTDataset(rows[1], tokenizer, config) if rows[1] else None,
                "tokenizer": tokenizer}
    except ValueError as error:
        raise ConfigError(f"data: {error}") from None


DATA_BUILDERS: dict[str, Callable[[dict, dict], dict]] = {
    "corpus": _corpus_data, "random": _random_data, "indexed": _indexed_data, "sft": _sft_data}
_DATA_OPTIONS = {"corpus": {"seq_len", "vocab_size", "eval_windows", "max_files", "packed_positions"},
                 "random": {"seq_len", "num_samples", "eval_windows", "seed"},
                 "indexed": {"prefixes", "weights", "tokenizer", "seq_len", "seed", "eval_prefix", "eval_windows"},
                 "sft": {"train_file", "eval_file", "tokenizer", "max_length", "padding_policy", "padding"}}


def register_data_builder(kind: str, builder: Callable[[dict, dict], dict], options: set[str] | None = None) -> None:
    """Add a `data.kind`: builder(data_options, model_options) -> {"train", "eval", "tokenizer"}; it may
    update model_options (vocab_size, mask_token_id, ...). `options`: the accepted keys (None: any)."""
    DATA_BUILDERS[kind] = builder
    if options is not None:
        _DATA_OPTIONS[kind] = set(options)


def build_data(data: dict, model_options: dict, path: str = "config") -> dict:
    data = dict(data)
    kind = data.pop("kind", None)
    if kind not in DATA_BUILDERS:
        raise ConfigError(f"{path}: data.kind must be one of {sorted(DATA_BUILDERS)}, got {kind!r}")
    allowed = _DATA_OPTIONS.get(kind)
    if allowed is not None and set(data) - allowed:
        raise ConfigError(f"{path}: data.{sorted(set(data) - allowed)[0]} is not an option of data.kind {kind!r} "
                          f"(options: {sorted(allowed)})")
    for name, low in (("seq_len", 2), ("max_length", 2), ("num_samples", 1), ("vocab_size", 2), ("eval_windows", 0)):
        value = data.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < low):
            raise ConfigError(f"{path}: data.{name} must be an integer >= {low}, got {value!r}")
    try:
        return DATA_BUILDERS[kind](data, model_options)
    except ConfigError as error:
        raise ConfigError(f"{path}: {error}") from None


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
