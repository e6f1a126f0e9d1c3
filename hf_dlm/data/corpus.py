"""An English corpus that ships with Python itself, and a byte-level BPE tokenizer trained on it.

Sources: the language reference topics of `pydoc_data.topics` (the text behind `help("if")`) and the
docstrings of the standard library's source files, read with `ast` (nothing is imported or run).
The result depends only on the Python version, so the quickstart needs no network.
"""

from __future__ import annotations

import ast
import hashlib
import os
import sysconfig
import warnings

SPECIAL_TOKENS = {"pad_token": "<|pad|>", "eos_token": "<|endoftext|>", "mask_token": "<|mask|>"}


def stdlib_documents(max_files: int | None = None, min_chars: int = 200) -> list[str]:
    """Documentation paragraphs of the running Python, in a fixed order."""
    from pydoc_data.topics import topics

    docs = [topics[name] for name in sorted(topics)]
    stdlib = sysconfig.get_paths()["stdlib"]
    files = []
    for root, dirs, names in os.walk(stdlib):
        dirs[:] = sorted(d for d in dirs if d not in ("test", "tests", "site-packages", "idlelib", "__pycache__"))
        files += [os.path.join(root, n) for n in sorted(names) if n.endswith(".py")]
    for path in files[:max_files]:
        try:
            with open(path, encoding="utf-8") as f:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    tree = ast.parse(f.read())
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    docs.append(doc)
    return [d.strip() for d in docs if len(d.strip()) >= min_chars]


def split_documents(docs: list[str], heldout_fraction: float = 0.02) -> tuple[list[str], list[str]]:
    """Deterministic train / held-out split by a hash of each document."""
    train, heldout = [], []
    for doc in docs:
        bucket = int(hashlib.sha1(doc.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
        (heldout if bucket < heldout_fraction else train).append(doc)
    return train, heldout


def train_bpe_tokenizer(texts: list[str], vocab_size: int = 2048):
    """Byte-level BPE (`tokenizers`) wrapped as a `PreTrainedTokenizerFast` with pad, EOS and mask tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, **SPECIAL_TOKENS)
