"""Checkpoint conversion into hf-dlm (and out to Megatron).

Sources: AR checkpoints of the Llama / Mistral / Qwen2 / Qwen3 families (adapted into DLMs), published
DLMs (LLaDA, Dream) and Megatron / MegaDLMs runs. Weights are read straight from the checkpoint files
(safetensors or torch, sharded or not) through an explicit key map per family; no source modeling code
runs, so LLaDA / Dream convert without `trust_remote_code`.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .adapt import DEFAULT_MASK_TOKEN, add_mask_token, init_mask_row
from .configs import AR_FAMILIES, FAMILY_CONFIGS
from .key_maps import FAMILY_MAPS, rename_state_dict
from .moe import fuse_experts

SOURCES = (*AR_FAMILIES, "llada", "dream", "megadlms", "megatron", "dlm")
TARGETS = ("dlm", "megatron", "qwen3_moe")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")


@dataclass
class ConversionOptions:
    """How an AR / DLM checkpoint becomes an hf-dlm model."""

    attention_mode: str | None = field(default=None, metadata={
        "choices": ("bidirectional", "causal", "block"),
        "help": "attention of the converted model; default: bidirectional (megatron / dlm sources keep their own)"})
    label_alignment: str | None = field(default=None, metadata={
        "choices": ("same", "shift"),
        "help": "label alignment; default: shift for adapted AR weights and Dream, same for LLaDA"})
    block_size: int | None = field(default=None, metadata={"help": "block length for --attention-mode block"})
    mask_token_id: int | None = field(default=None, metadata={
        "help": "use this existing token id as [MASK] instead of adding a token"})
    mask_token: str = field(default=DEFAULT_MASK_TOKEN, metadata={"help": "text of the mask token added to the tokenizer"})
    dtype: str | None = field(default=None, metadata={
        "choices": ("float32", "bfloat16", "float16"), "help": "dtype of the saved weights; default: the source's"})
    base_model: str | None = field(default=None, metadata={"help": "Hub id of the source, recorded in the model card"})
    trust_pickle: bool = field(default=False, metadata={"help": "allow full unpickling of Megatron checkpoints"})


def read_config_json(folder: str | os.PathLike) -> dict:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing (the source folder needs its config.json)")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from error


def load_state_dict(folder: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of a transformers-style checkpoint folder (safetensors or torch, sharded or not)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder)
    for index_name, single_name in (("model.safetensors.index.json", "model.safetensors"),
                                    ("pytorch_model.bin.index.json", "pytorch_model.bin")):
        index, single = folder / index_name, folder / single_name
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        elif single.is_file():
            files = [single_name]
        else:
            continue
        state_dict = {}
        for name in tqdm(files, desc=f"reading {folder.name}", unit="file", disable=len(files) < 2):
            path = folder / name
            if not path.is_file():
                raise FileNotFoundError(f"{path}: listed in {index_name} but missing")
            try:
                if name.endswith(".safetensors"):
                    state_dict.update(load_file(path))
                else:
                    state_dict.update(torch.load(path, map_location="cpu", weights_only=True))
            except (SafetensorError, OSError, RuntimeError, EOFError, ValueError) as error:
                raise ValueError(f"{path}: cannot be read ({type(error).__name__}: {error}); the file is "
                                 "truncated or corrupt") from None
        return state_dict
    raise FileNotFoundError(f"{folder}: no model.safetensors(.index.json) or pytorch_model.bin(.index.json)")


def build_dlm(config_options: dict, state_dict: dict[str, torch.Tensor], dtype: torch.dtype | None, source: str):
    """A `DLMForDiffusionLM` holding exactly `state_dict` (no random initialisation of big matrices)."""
    from accelerate import init_empty_weights

    from ..modeling import DLMConfig, DLMForDiffusionLM

    config = DLMConfig(**config_options)
    with init_empty_weights(include_buffers=False):  # parameters on meta, RoPE buffers real
        model = DLMForDiffusionLM(config)
    if dtype is not None:
        state_dict = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state_dict.items()}
    result = model.load_state_dict(state_dict, strict=False, assign=True)
    missing = [k for k in result.missing_keys if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or result.unexpected_keys:
        raise KeyError(f"{source}: missing tensors {missing[:8]}, unexpected tensors {result.unexpected_keys[:8]}")
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    for name, tensor in model.state_dict().items():
        if tensor.is_meta:
            raise RuntimeError(f"{source}: {name} was never loaded")
    return model.eval()


# config.json `model_type` -> source family ("attn_mask_type" marks MegaDLMs' Qwen3-style DiffLM)
_MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe", "llada": "llada",
                "dream": "dream", "dlm": "dlm"}


def detect_family(source: str | os.PathLike) -> str:
    """The source family of a checkpoint folder: Megatron by its files, otherwise config.json's model_type."""
    from .megatron import is_megatron_checkpoint

    source = Path(source)
    if not source.exists():
        raise FileNotFoundError(f"{source}: no such checkpoint folder")
    if not (source / "config.json").is_file() and is_megatron_checkpoint(source):
        return "megatron"
    config = read_config_json(source)
    if "attn_mask_type" in config:
        return "megadlms"
    model_type = str(config.get("model_type", "")).lower()
    if model_type not in _MODEL_TYPES:
        raise ValueError(f"{source / 'config.json'}: model_type {config.get('model_type')!r} is not a family hf-dlm "
                         f"converts; supported: {sorted(set(_MODEL_TYPES.values()) | {'megadlms', 'megatron'})}")
    return _MODEL_TYPES[model_type]


def _load_tokenizer(folder: Path):
    if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def load_as_dlm(family: str, source: str | os.PathLike, options: ConversionOptions | None = None):
    """(DLM model, tokenizer or None, tokenizer folder to copy verbatim or None, conversion record)."""
    options = options or ConversionOptions()
    if family not in SOURCES:
        raise ValueError(f"unknown source family {family!r}; choose from {SOURCES}")
    source = Path(source)
    tokenizer, copy_tokenizer_from = None, None
    if family == "megatron":
        from .megatron import config_from_megatron, load_megatron_checkpoint, megatron_to_dlm

        args, raw = load_megatron_checkpoint(source, trust_pickle=options.trust_pickle)
        config_options = config_from_megatron(args, raw)
        from ..modeling import DLMConfig

        state_dict = megatron_to_dlm(raw, DLMConfig(**config_options), source=str(source))
    else:
        source_config = read_config_json(source)
        raw = load_state_dict(source)
        if family == "dlm":
            config_options = {k: v for k, v in source_config.items()
                              if k not in ("model_type", "transformers_version", "architectures", "auto_map", "dtype")}
        else:
            config_options = FAMILY_CONFIGS[family](source_config)
        if family in ("qwen3_moe", "dlm"):  # one key per expert on the Hub -> grouped expert weights
            raw = fuse_experts(raw, source=str(source))
        state_dict = rename_state_dict(raw, FAMILY_MAPS[family], source=f"{source} ({family})")
        if family in AR_FAMILIES:
            config_options.setdefault("attention_mode", "bidirectional")
            config_options.setdefault("label_alignment", "shift")  # the AR head already predicts the next token
        if family in ("llada", "dream", "megadlms", "dlm"):
            copy_tokenizer_from = source  # they ship their mask token; copy files verbatim (Dream's are remote code)
        else:
            tokenizer = _load_tokenizer(source)

    for name in ("attention_mode", "label_alignment", "block_size"):
        if getattr(options, name) is not None:
            config_options[name] = getattr(options, name)
    record = {"source_family": family, "attention_mode": config_options.get("attention_mode", "bidirectional"),
              "label_alignment": config_options.get("label_alignment", "same")}
    config_options["vocab_size"] = state_dict["model.embed_tokens.weight"].shape[0]
    source_dtype = state_dict["model.embed_tokens.weight"].dtype
    tied = bool(config_options.get("tie_word_embeddings", False))
    if tied:
        state_dict.pop("lm_head.weight", None)

    if options.mask_token_id is not None:
        if not 0 <= options.mask_token_id < config_options["vocab_size"]:
            from ..utils.errors import FieldError

            raise FieldError("mask_token_id", f"--mask-token-id {options.mask_token_id} is not a token of {source} "
                             f"(vocabulary 0..{config_options['vocab_size'] - 1}); pass an id inside it, or leave "
                             f"it out to add a mask token", options.mask_token_id)
        config_options["mask_token_id"] = options.mask_token_id
        record["mask_token"] = f"existing id {options.mask_token_id}"
    elif config_options.get("mask_token_id") is None:
        if tokenizer is not None:
            mask_id, trained_rows, added = add_mask_token(tokenizer, options.mask_token)
        else:  # no tokenizer: a new id after the last row
            mask_id, trained_rows, added = config_options["vocab_size"], config_options["vocab_size"], True
        config_options["mask_token_id"] = mask_id
        if added:
            state_dict = init_mask_row(state_dict, mask_id, trained_rows, tied)
            config_options["vocab_size"] = state_dict["model.embed_tokens.weight"].shape[0]
            record["mask_token"] = f"added id {mask_id}, embedding row = mean of the {trained_rows} trained rows"
        else:
            record["mask_token"] = f"the tokenizer's own mask token, id {mask_id}"
    if tokenizer is not None and tokenizer.pad_token is None and tokenizer.eos_token is not None:
        # AR tokenizers often have no pad token; batched generation and SFT pad (left / right, always with
        # an attention mask, so the id is never attended to): the EOS token, as transformers users do
        tokenizer.pad_token = tokenizer.eos_token
        record["pad_token"] = f"none in the source: the EOS token {tokenizer.eos_token!r} (id {tokenizer.pad_token_id})"
        config_options["pad_token_id"] = tokenizer.pad_token_id
    if tokenizer is not None:
        for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
            if config_options.get(name) is None and getattr(tokenizer, name, None) is not None:
                config_options[name] = getattr(tokenizer, name)

    dtype = DTYPES[options.dtype] if options.dtype else source_dtype
    model = build_dlm(config_options, state_dict, dtype, str(source))
    record["mask_token_id"] = model.config.mask_token_id
    return model, tokenizer, copy_tokenizer_from, record


def _prepare_output(destination: Path, overwrite: bool) -> None:
    if destination.exists() and any(destination.iterdir()) and not overwrite:
        raise FileExistsError(f"{destination}: exists and is not empty; pass --overwrite to replace its files")
    destination.mkdir(parents=True, exist_ok=True)


def convert_checkpoint(
    family: str,
    source: str | os.PathLike,
    destination: str | os.PathLike,
    options: ConversionOptions | None = None,
    to: str = "dlm",
    overwrite: bool = False,
) -> Path:
    """Convert `source` (a `family` checkpoint; None: read from its files, see `detect_family`) into
    `destination`, as an hf-dlm folder (`to="dlm"`), a Megatron checkpoint (`to="megatron"`) or, for an MoE
    model, a Qwen3-MoE folder (`to="qwen3_moe"`). A family that contradicts the checkpoint's config.json is
    an error."""
    from ..hub.model_card import write_info, write_model_card

    if to not in TARGETS:  # before minutes of loading
        raise ValueError(f"unknown target {to!r}; choose from {TARGETS}")
    options = options or ConversionOptions()
    destination = Path(destination)
    if destination.exists() and any(destination.iterdir()) and not overwrite:  # before minutes of loading
        _prepare_output(destination, overwrite)
    if family is None:
        family = detect_family(source)
    elif family not in ("megatron", "dlm") or (Path(source) / "config.json").is_file():
        detected = detect_family(source)
        if detected != family and {detected, family} != {"qwen3", "megadlms"}:
            raise ValueError(f"{source}: --from {family}, but the checkpoint is a {detected!r} checkpoint "
                             f"(config.json model_type); pass --from {detected} or leave --from out")
    model, tokenizer, copy_tokenizer_from, record = load_as_dlm(family, source, options)
    _prepare_output(destination, overwrite)
    if to == "megatron":
        from .megatron import save_megatron_checkpoint

        save_megatron_checkpoint(model, destination)
        return destination
    if to == "qwen3_moe":
        from .moe import save_qwen3_moe

        save_qwen3_moe(model, destination)
        return destination
    model.save_pretrained(destination)
    if tokenizer is not None:
        tokenizer.save_pretrained(destination)
    elif copy_tokenizer_from is not None:
        for name in os.listdir(copy_tokenizer_from):
            if name in _TOKENIZER_FILES or name.startswith("tokenization_"):
                shutil.copy2(Path(copy_tokenizer_from) / name, destination / name)
    write_info(destination, base_model=options.base_model, conversion=record)
    write_model_card(destination, model.config)
    return destination


__all__ = ["SOURCES", "ConversionOptions", "load_state_dict", "read_config_json", "build_dlm", "load_as_dlm",
           "convert_checkpoint", "detect_family"]
