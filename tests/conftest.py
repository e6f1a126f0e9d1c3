"""Fixtures only; the helpers they use live in tests/utils.py (no test imports conftest as a module)."""

import os

import pytest
import torch

from tests.utils import SFT_CHAT_TEMPLATE, tiny_model

if "PYTEST_XDIST_WORKER_COUNT" in os.environ:  # `pytest -n N`: the workers share the cores, not each take all
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


@pytest.fixture
def make_model():
    return tiny_model


@pytest.fixture(scope="session", autouse=True)
def _corpus_cache(tmp_path_factory):
    """The quickstart corpus cache of this test session, not the user's (~/.cache/hf_dlm)."""
    import os

    previous = os.environ.get("HF_DLM_CACHE")
    os.environ["HF_DLM_CACHE"] = str(tmp_path_factory.mktemp("hf_dlm_cache"))
    yield
    if previous is None:
        os.environ.pop("HF_DLM_CACHE", None)
    else:
        os.environ["HF_DLM_CACHE"] = previous


@pytest.fixture
def one_thread():
    """Tiny models run fastest on one thread, and the CI machine is shared: run a test on one, then restore."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """(folder, documents): a byte-level BPE tokenizer trained on 30 stdlib documents, with a chat template."""
    from hf_dlm.data.corpus import stdlib_documents, train_bpe_tokenizer

    docs = stdlib_documents(max_files=30)
    tokenizer = train_bpe_tokenizer(docs, vocab_size=300)
    tokenizer.chat_template = SFT_CHAT_TEMPLATE
    path = tmp_path_factory.mktemp("tok")
    tokenizer.save_pretrained(path)
    return path, docs
