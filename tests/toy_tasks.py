"""A tiny verifiable task for the post-training tests: answer with the prompt's digits reversed.

Word-level tokenizer over digits and five special tokens (vocab 15), a chat template whose prompt
(with the generation prompt) is a prefix of the whole conversation, and a partial-credit reward.
"""

from __future__ import annotations

import random

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL = ["<pad>", "<|endoftext|>", "<|mask|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}<|user|>{{ m['content'] }}"
                 "{% else %}<|assistant|>{{ m['content'] }}<|endoftext|>{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def digit_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {token: i for i, token in enumerate(SPECIAL + [str(d) for d in range(10)])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Digits(individual_digits=True)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<|endoftext|>",
                                        mask_token="<|mask|>", additional_special_tokens=SPECIAL[3:])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def reverse_rows(n: int, seed: int, min_digits: int = 2, max_digits: int = 3) -> list[dict]:
    """Conversational prompt-completion rows; prompts of mixed lengths."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(min_digits, max_digits)))
        rows.append({"prompt": [{"role": "user", "content": digits}],
                     "completion": [{"role": "assistant", "content": digits[::-1]}],
                     "answer": digits[::-1]})
    return rows


def reversal_reward(completions, answer, **kwargs) -> list[float]:
    """Fraction of the answer's digits in the right place, minus a penalty for extra digits (trl reward signature)."""
    rewards = []
    for completion, target in zip(completions, answer):
        text = completion[0]["content"] if isinstance(completion, list) else completion
        digits = "".join(ch for ch in text if ch.isdigit())
        hits = sum(a == b for a, b in zip(digits, target))
        rewards.append((hits - 0.5 * max(len(digits) - len(target), 0)) / len(target))
    return rewards


@pytest.fixture
def one_thread():
    """Tiny models run fastest on one thread, and the CI machine is shared: run a test on one, then restore."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
