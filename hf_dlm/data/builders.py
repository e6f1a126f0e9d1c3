"""The `data:` section of a YAML training config (`hf_dlm.training.runner`): one builder per `data.kind`,
each returning {"train", "eval", "tokenizer"} and filling the model's vocabulary / special ids it implies.
`register_data_builder` adds a kind."""

from __future__ import annotations

from typing import Callable

import torch

from ..utils.errors import ConfigError


def _corpus_data(options: dict, model_options: dict) -> dict:
    """Python's own documentation, a byte-level BPE tokenizer trained on it, packed windows."""
    from .corpus import split_documents, stdlib_documents, train_bpe_tokenizer
    from .memory_dataset import TokenWindowDataset, pack_documents

    train_docs, heldout_docs = split_documents(stdlib_documents(max_files=options.get("max_files")))
    tokenizer = train_bpe_tokenizer(train_docs, options.get("vocab_size", 384))
    seq_len = options.get("seq_len", 128)

    def windows(docs):
        encoded = tokenizer(docs, add_special_tokens=False)["input_ids"]
        return pack_documents(encoded, seq_len, tokenizer.eos_token_id)

    train_ids, train_positions = windows(train_docs)
    eval_ids, eval_positions = windows(heldout_docs)
    eval_windows = options.get("eval_windows", 32)
    _take_corpus_ids(tokenizer, model_options)
    packed = options.get("packed_positions", True)  # evaluation attends like training
    return {"train": TokenWindowDataset(train_ids, train_positions if packed else None),
            "eval": TokenWindowDataset(eval_ids[:eval_windows], eval_positions[:eval_windows] if packed else None)
            if eval_windows else None,
            "tokenizer": tokenizer}


def _take_corpus_ids(tokenizer, model_options: dict) -> None:
    """The corpus tokenizer is trained here, so its ids are the model's. An id the config sets explicitly must
    agree (never replaced silently); a larger vocab_size is kept (spare rows), a smaller one is refused."""
    ids = {"mask_token_id": tokenizer.mask_token_id, "eos_token_id": tokenizer.eos_token_id,
           "pad_token_id": tokenizer.pad_token_id}
    for name, value in ids.items():
        given = model_options.get(name)
        if given is not None and given != value:
            raise ConfigError(f"model.config.{name} = {given!r}, but the corpus tokenizer's {name} is {value}: "
                              f"remove model.config.{name} (or set it to {value})", field=f"model.config.{name}",
                              value=given)
    vocab = model_options.get("vocab_size")
    if vocab is not None and vocab < len(tokenizer):
        raise ConfigError(f"model.config.vocab_size = {vocab!r} is smaller than the corpus tokenizer's {len(tokenizer)} "
                          "tokens: remove it (or raise it)", field="model.config.vocab_size", value=vocab)
    model_options.update(ids, vocab_size=max(vocab or 0, len(tokenizer)))


def _random_data(options: dict, model_options: dict) -> dict:
    """Uniform random token ids (throughput runs; nothing to learn). Needs the model's vocab_size."""
    from .memory_dataset import TokenWindowDataset

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

    from .streams import PackedDataset, build_pretraining_dataset

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

    from .sft_data import SFTDataConfig, SFTDataset

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
        raise error.with_prefix(path) from None


__all__ = ["DATA_BUILDERS", "register_data_builder", "build_data"]
