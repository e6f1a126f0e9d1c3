"""`hf-dlm generate` on a tiny saved checkpoint with its own BPE tokenizer."""

import pytest
import torch

from hf_dlm.cli import main
from hf_dlm.data.corpus import train_bpe_tokenizer

from tests.utils import tiny_model

TEXTS = ["the quick brown fox jumps over the lazy dog", "a diffusion model fills in masked tokens"] * 20
CHAT_TEMPLATE = ("{% for m in messages %}<|user|>{{ m['content'] }}{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
OPTIONS = ["--max-new-tokens", "8", "--block-length", "4", "--steps", "8", "--temperature", "0", "--device", "cpu"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_dlm")
    tokenizer = train_bpe_tokenizer(TEXTS, vocab_size=300)
    model = tiny_model(vocab_size=len(tokenizer), mask_token_id=tokenizer.mask_token_id,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, model, tokenizer


def expected_text(model, tokenizer, input_ids):
    out = model.generate(input_ids, max_new_tokens=8, block_length=4, steps=8, temperature=0.0)
    return tokenizer.decode(out[0, input_ids.shape[1] :], skip_special_tokens=True)


def test_generate_streams_the_completion_to_the_terminal(checkpoint, capsys):
    path, model, tokenizer = checkpoint
    assert main(["generate", "--model", str(path), "--prompt", "the quick brown", *OPTIONS]) == 0
    printed = capsys.readouterr().out
    expected = expected_text(model, tokenizer, tokenizer("the quick brown", return_tensors="pt")["input_ids"])
    assert expected.strip() and printed.strip() == expected.strip() and printed.endswith("\n")


def test_chat_needs_a_template_and_uses_it(checkpoint, capsys, tmp_path):
    path, model, tokenizer = checkpoint
    assert main(["generate", "--model", str(path), "--prompt", "hi", "--chat", *OPTIONS]) == 2
    assert "chat template" in capsys.readouterr().err
    tokenizer.chat_template = CHAT_TEMPLATE
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    assert main(["generate", "--model", str(tmp_path), "--prompt", "hi", "--chat", *OPTIONS]) == 0
    prompt = tokenizer("<|user|>hi<|assistant|>", return_tensors="pt")["input_ids"]
    assert capsys.readouterr().out.strip() == expected_text(model, tokenizer, prompt).strip()


def test_bad_options_give_a_clear_error(checkpoint, capsys):
    path, _, _ = checkpoint
    args = ["generate", "--model", str(path), "--prompt", "x", "--device", "cpu", "--max-new-tokens", "10",
            "--block-length", "4"]
    assert main(args) == 2
    assert "multiple of block_length" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "--model", str(path), "--prompt", "x", "--cache", "full"])
    assert torch.is_grad_enabled()
