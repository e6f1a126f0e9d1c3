"""Shared pieces of the post-training tests: the toy 'reverse the digits' task lives in
`hf_dlm.training.post_training` (tokenizer of 15 tokens, rows, partial-credit reward); this adds the
one-thread fixture."""

from __future__ import annotations

import pytest
import torch

from hf_dlm.training.post_training import toy_reward as reversal_reward  # noqa: F401
from hf_dlm.training.post_training import toy_rows as reverse_rows  # noqa: F401
from hf_dlm.training.post_training import toy_tokenizer as digit_tokenizer  # noqa: F401


@pytest.fixture
def one_thread():
    """Tiny models run fastest on one thread, and the CI machine is shared: run a test on one, then restore."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
