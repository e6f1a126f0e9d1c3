import pytest
import torch

import hf_dlm  # noqa: F401  (registers the Auto classes)
from hf_dlm import DLMConfig, DLMForDiffusionLM

VOCAB = 99
MASK_ID = 98


def tiny_config(**overrides) -> DLMConfig:
    options = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, mask_token_id=MASK_ID, qk_norm=True,
                   max_position_embeddings=256)
    options.update(overrides)
    return DLMConfig(**options)


def tiny_model(attn_implementation: str = "eager", seed: int = 0, **overrides) -> DLMForDiffusionLM:
    torch.manual_seed(seed)
    config = tiny_config(**overrides)
    config._attn_implementation = attn_implementation
    return DLMForDiffusionLM(config).eval()


def set_attn(model, implementation: str):
    model.config._attn_implementation = implementation
    return model


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
