import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForMaskedLM, AutoTokenizer

from hf_dlm import DLMForDiffusionLM
from hf_dlm.cli import main as cli_main
from hf_dlm.data.corpus import (SPECIAL_TOKENS, UNK_TOKEN, cached_prose_corpus, prose_paragraphs, split_documents,
                                stdlib_documents, train_bpe_tokenizer, train_word_tokenizer)
from hf_dlm.data.simple_english import NOUNS, TRANSITIVE, GIVING, MOTION, STAYING, simple_stories, stories_corpus
from hf_dlm.training.quickstart import QuickstartConfig, choose_threads, run_quickstart

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


def test_prose_paragraphs_keep_running_text_only():
    doc = ("The for statement\n*****************\n\nThe for statement is used to iterate over the elements of\n"
           "a sequence (such as a string, tuple or list) or other iterable object.\n\n   for_stmt ::= \"for\" "
           "target_list \"in\" expression_list\n\n>>> for x in range(3): print(x) and a long doctest line here\n\n"
           "Short one.")
    assert prose_paragraphs(doc) == ["The for statement is used to iterate over the elements of a sequence (such as "
                                     "a string, tuple or list) or other iterable object."]


def test_prose_corpus_is_cached_with_a_chat_template(tmp_path, monkeypatch):
    first = cached_prose_corpus(300, str(tmp_path), max_files=30)
    assert not first["cached"] and first["train_ids"] and first["heldout_ids"] and "the" in first["words"]
    assert not any("\n" in first["tokenizer"].decode(ids) for ids in first["train_ids"])  # prose on one line
    import hf_dlm.data.corpus as corpus

    monkeypatch.setattr(corpus, "stdlib_documents", lambda **_: pytest.fail("the cache was not used"))
    again = cached_prose_corpus(300, str(tmp_path), max_files=30)
    assert again["cached"] and again["train_ids"] == first["train_ids"] and again["words"] == first["words"]
    chat = again["tokenizer"].apply_chat_template([{"role": "user", "content": "What is a list?"}],
                                                  add_generation_prompt=True, tokenize=False)
    assert chat == "User: What is a list?\nAssistant:"


def test_word_tokenizer_keeps_the_commonest_words_and_decodes_to_words():
    tokenizer = train_word_tokenizer(["The the THE dog dog cat"], vocab_size=len(SPECIAL_TOKENS) + 3)
    assert len(tokenizer) == 6 and set(tokenizer.get_vocab()) == {*SPECIAL_TOKENS.values(), UNK_TOKEN, "the", "dog"}
    ids = tokenizer("The cat", add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids) == ["the", UNK_TOKEN]

    tokenizer = train_word_tokenizer(["The dog's ball fell. The dog ran, and the cat sat."], vocab_size=64)
    ids = tokenizer("The cat's hat ran.", add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids) == ["the", "cat", "'", "s", UNK_TOKEN, "ran", "."]
    # tokens joined by spaces, then "." / "," / "'s" re-attached
    assert tokenizer.decode(ids) == "the cat's <|unk|> ran."
    assert tokenizer.decode(tokenizer("The dog ran, and the cat sat.")["input_ids"]) == "the dog ran, and the cat sat."
    ids = tokenizer("(the dog).", add_special_tokens=False)["input_ids"]  # one mark per token, not runs
    assert tokenizer.convert_ids_to_tokens(ids) == [UNK_TOKEN, "the", "dog", UNK_TOKEN, "."]


def _present_forms(verbs) -> tuple[set, set]:
    past = {forms[2] for forms in verbs}
    return {f[0] for f in verbs} - past, {f[1] for f in verbs} - past


def test_stories_are_deterministic_new_held_out_text_with_agreement():
    stories = simple_stories(300, seed=0)
    assert stories == simple_stories(300, seed=0) and not set(stories) & set(simple_stories(100, seed=1))
    words = [w for story in stories for w in re.findall(r"[a-z]+", story.lower())]
    assert len(set(words)) < 400  # the whole grammar fits the quickstart's 1024-word vocabulary
    # a / an by the next word; a plural noun never takes a singular present verb, nor a singular one a plural verb
    assert not [(a, b) for a, b in zip(words, words[1:]) if (a == "a") == (b[0] in "aeiou") and a in ("a", "an")]
    singular_verbs, plural_verbs = _present_forms([v[0] for v in TRANSITIVE] + GIVING + MOTION + STAYING)
    singular_nouns = {pair[0] for nouns in NOUNS.values() for pair in nouns}
    plural_nouns = {pair[1] for nouns in NOUNS.values() for pair in nouns}
    pairs = set(zip(words, words[1:]))
    assert {(n, v) for n in plural_nouns | {"they"} for v in singular_verbs | {"is", "was"}}.isdisjoint(pairs)
    assert {(n, v) for n in singular_nouns | {"he", "she"} for v in plural_verbs | {"are", "were"}}.isdisjoint(pairs)
    assert pairs & {(n, v) for n in plural_nouns for v in plural_verbs}  # present tense occurs at all
    assert all(sentence.endswith(".") for story in stories for sentence in re.split(r"(?<=\.) ", story))


def test_stories_corpus_has_no_unknown_tokens_and_a_chat_prompt_in_vocabulary():
    corpus = stories_corpus(1024, train_stories=200, heldout_stories=20)
    tokenizer = corpus["tokenizer"]
    assert len(tokenizer) < 1024 and corpus["train_ids"] and corpus["heldout_ids"]
    assert not set(map(tuple, corpus["heldout_ids"])) & set(map(tuple, corpus["train_ids"]))  # other stories
    assert tokenizer.unk_token_id not in {i for ids in corpus["heldout_ids"] for i in ids}
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "The old man walked to the market."}],
                                         add_generation_prompt=True)
    ids = chat if isinstance(chat, list) else chat["input_ids"]
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == "user : the old man walked to the market. assistant :"


def test_threads_are_the_idle_cores():
    assert choose_threads(cpus=2, load=0.0) == 2  # idle: every core
    assert choose_threads(cpus=2, load=1.0) == 1  # one busy process: one thread, not two fighting it
    assert choose_threads(cpus=2, load=9.0) == 1
    assert choose_threads(cpus=8, load=2.2) == 6


def _tiny(tmp_path, **overrides):
    options = dict(output_dir=str(tmp_path / "qs"), max_seconds=600, max_steps=25, vocab_size=320, seq_len=64,
                   batch_size=8, hidden_size=48, num_layers=2, num_heads=4, eval_windows=8, mc_num=2,
                   learning_rate=3e-3, warmup_steps=5, max_new_tokens=8, corpus_max_files=60,
                   cache_dir=str(tmp_path / "cache"), threads=1)
    return QuickstartConfig(**{**options, **overrides})


def test_quickstart_trains_saves_a_loadable_checkpoint_and_samples(tmp_path):
    cfg = _tiny(tmp_path)
    lines = []
    result = run_quickstart(cfg, log=lines.append)
    assert result["steps"] == 25  # max_steps first: the 600 s are not reached
    # --max-seconds bounds the whole command: training gets what the corpus and model set-up used and what
    # the evaluation, save and sample are estimated to need leave (before, training alone took max_seconds)
    budget = result["budget"]
    assert budget["setup_seconds"] > 0 and budget["finish_seconds"] > 3.0
    assert budget["setup_seconds"] + budget["train_seconds"] + budget["finish_seconds"] == pytest.approx(cfg.max_seconds)
    assert result["heldout_elbo_after"] < result["heldout_elbo_before"]
    assert result["undertrained"] == (result["relative_drop"] < 0.3)
    assert any("held-out ELBO" in line for line in lines) and result["threads"] == 1
    model = AutoModelForMaskedLM.from_pretrained(tmp_path / "qs")
    assert isinstance(model, DLMForDiffusionLM) and model.config.mask_token_id is not None
    assert isinstance(result["sample"], str) and 0 <= result["sample_corpus_word_share"] <= 1
    # the sample decodes to the tokenizer's words, space-separated, punctuation re-attached
    vocabulary = set(AutoTokenizer.from_pretrained(tmp_path / "qs").get_vocab())
    assert result["sample"] and set(re.findall(r"[a-z]+", result["sample"])) <= vocabulary
    assert not re.search(r"\s[.,]", result["sample"])
    assert result["corpus"] == "stories" and result["heldout_unknown_share"] == 0.0

    # examples/usage.py runs against the checkpoint the quickstart wrote
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "usage.py"), str(tmp_path / "qs"),
                          "--max-new-tokens", "8"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "tokens masked" in out.stdout and "->" in out.stdout
    # the NELBO per token: near the held-out bound, not rescaled by the masked count (which gave ~60)
    nelbo = float(re.search(r"NELBO ([0-9.]+) nats per token", out.stdout).group(1))
    assert nelbo < 1.5 * math.log(cfg.vocab_size)


def test_too_short_a_run_says_so_and_exits_non_zero(tmp_path, capsys):
    args = ["quickstart", "--output-dir", str(tmp_path / "qs"), "--max-steps", "2", "--vocab-size", "320",
            "--hidden-size", "32", "--num-layers", "1", "--eval-windows", "4", "--mc-num", "1", "--max-new-tokens",
            "4", "--corpus-max-files", "60", "--cache-dir", str(tmp_path / "cache"), "--threads", "1"]
    assert cli_main(args) == 1
    assert "too little training to learn" in capsys.readouterr().out
    assert cli_main(args + ["--allow-undertrained"]) == 0
    assert cli_main(args + ["--corpus", "python-docs", "--allow-undertrained"]) == 0
    assert "corpus: prose of Python's documentation" in capsys.readouterr().out
    assert cli_main(args + ["--corpus", "novels"]) == 2
    assert "--corpus must be 'stories' or 'python-docs', got 'novels'" in capsys.readouterr().err


def test_cli_lists_commands_and_rejects_unknown(capsys):
    assert cli_main([]) == 2
    assert "quickstart" in capsys.readouterr().out
    try:
        cli_main(["nope"])
    except SystemExit as exit_:
        assert exit_.code == 2
    assert "unknown command 'nope'" in capsys.readouterr().err
