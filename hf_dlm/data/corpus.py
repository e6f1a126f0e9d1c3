"""An English corpus that ships with Python itself, and the byte-level BPE and word-level tokenizers.

Sources: the language reference topics of `pydoc_data.topics` (the text behind `help("if")`) and the
docstrings of the standard library's source files, read with `ast` (nothing is imported or run).
The result depends only on the Python version, so it needs no network.
`prose_paragraphs` keeps the running text of a document (no code, tables or reST markup, lines joined)
and `cached_prose_corpus` builds `hf-dlm quickstart --corpus python-docs`'s word-level tokenizer and token
ids once per Python version.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import sys
import sysconfig
import warnings

SPECIAL_TOKENS = {"pad_token": "<|pad|>", "eos_token": "<|endoftext|>", "mask_token": "<|mask|>"}
UNK_TOKEN = "<|unk|>"  # the word-level tokenizer's stand-in for a word outside its vocabulary
# a plain "Role: text" chat template, so `apply_chat_template` works on the quickstart model (its corpus is
# prose, so the roles are words it has seen)
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] | capitalize }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
_CORPUS_FORMAT = 2  # bump when prose_paragraphs or the tokenizer recipe changes: invalidates the cache


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


def train_word_tokenizer(texts: list[str], vocab_size: int = 1024):
    """Word-level tokenizer (`tokenizers` WordLevel) wrapped as a `PreTrainedTokenizerFast`: lower-cased
    words, numbers and single punctuation marks, the `vocab_size` commonest of `texts` (special tokens
    included), `UNK_TOKEN` for the rest. Decoding joins tokens with spaces, then transformers' clean-up
    re-attaches ".", ",", "?", "!" and "'s" / "n't" ("it ' s" -> "it's")."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel(unk_token=UNK_TOKEN))
    tokenizer.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(),
        pre_tokenizers.Split(Regex(r"[a-z]+|[0-9]+|[^a-z0-9]"), behavior="isolated"),
    ])
    trainer = trainers.WordLevelTrainer(vocab_size=vocab_size, special_tokens=[*SPECIAL_TOKENS.values(), UNK_TOKEN],
                                        show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token=UNK_TOKEN, clean_up_tokenization_spaces=True,
                                   **SPECIAL_TOKENS)


def prose_paragraphs(doc: str, min_chars: int = 80, min_letter_share: float = 0.93) -> list[str]:
    """The running-text paragraphs of one document, each on one line.

    Docstrings and reference topics mix prose with indented code, doctests, tables and reST underlines;
    a small model trained on all of it samples mostly newlines and punctuation. Kept: blank-line
    separated paragraphs with no indented line and no doctest, at least `min_letter_share` letters,
    spaces and ",.'" and `min_chars` long; their lines are joined with single spaces.
    """
    kept = []
    for paragraph in re.split(r"\n\s*\n", doc):
        lines = paragraph.split("\n")
        if any(line[:1].isspace() for line in lines) or ">>>" in paragraph:
            continue
        text = " ".join(line.strip() for line in lines)
        if len(text) < min_chars:
            continue
        if sum(ch.isalpha() or ch in " ,.'" for ch in text) / len(text) >= min_letter_share:
            kept.append(text)
    return kept


def default_cache_dir() -> str:
    """`$HF_DLM_CACHE`, else `$XDG_CACHE_HOME/hf_dlm`, else `~/.cache/hf_dlm`."""
    if os.environ.get("HF_DLM_CACHE"):
        return os.environ["HF_DLM_CACHE"]
    return os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "hf_dlm")


def cached_prose_corpus(vocab_size: int, cache_dir: str | None = None, max_files: int | None = None) -> dict:
    """The quickstart's python-docs corpus: prose of the standard library split by document, a word-level
    tokenizer trained on the train part, and both parts' token ids (one list per paragraph).

    Reading the standard library takes ~30 s on a busy 2-core machine and training the tokenizer a few
    more, so the result is kept under `cache_dir` (default `default_cache_dir()`), keyed by Python version,
    vocabulary size, file limit and corpus format; a cache that cannot be read is rebuilt.
    Returns {"tokenizer", "train_ids", "heldout_ids", "words" (the set of train words), "cached", "source"
    (what the corpus is, in words)}.
    """
    from transformers import AutoTokenizer

    key = f"py{sys.version_info[0]}.{sys.version_info[1]}-w{vocab_size}-f{max_files}-c{_CORPUS_FORMAT}"
    directory = os.path.join(cache_dir or default_cache_dir(), "prose_corpus", key)
    ids_path = os.path.join(directory, "ids.json")
    try:
        with open(ids_path) as f:
            data = json.load(f)
        tokenizer = AutoTokenizer.from_pretrained(directory)
        return {"tokenizer": tokenizer, "train_ids": data["train"], "heldout_ids": data["heldout"],
                "words": set(data["words"]), "cached": True, "source": "prose of Python's documentation (cached)"}
    except (OSError, ValueError, KeyError):
        pass  # not built yet (or unreadable): build it
    train_docs, heldout_docs = split_documents(stdlib_documents(max_files=max_files))
    train = [p for doc in train_docs for p in prose_paragraphs(doc)]
    heldout = [p for doc in heldout_docs for p in prose_paragraphs(doc)]
    tokenizer = train_word_tokenizer(train, vocab_size)
    tokenizer.chat_template = CHAT_TEMPLATE
    encode = lambda texts: tokenizer(texts, add_special_tokens=False)["input_ids"]  # noqa: E731
    data = {"train": encode(train), "heldout": encode(heldout),
            "words": sorted({w for p in train for w in corpus_words(p)})}
    os.makedirs(directory, exist_ok=True)
    tokenizer.save_pretrained(directory)
    staged = ids_path + ".tmp"
    with open(staged, "w") as f:
        json.dump(data, f)
    os.replace(staged, ids_path)  # written last and atomically: a half-written cache is never read
    return {"tokenizer": tokenizer, "train_ids": data["train"], "heldout_ids": data["heldout"],
            "words": set(data["words"]), "cached": False,
            "source": "prose of Python's documentation (built and cached)"}


def corpus_words(text: str) -> list[str]:
    """Lower-cased alphabetic words of a text (what "made of corpus words" counts)."""
    return re.findall(r"[a-z]+", text.lower())
