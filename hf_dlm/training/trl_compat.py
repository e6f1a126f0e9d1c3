"""What hf-dlm's trl subclasses share: loading a DLM by name, and building trl trainers without the causal
fused LM head that trl 1.16 patches onto every model (hidden state i scores token i + 1)."""

from __future__ import annotations

import contextlib
import importlib
from unittest import mock

from ..utils.import_utils import is_peft_available


def load_dlm(model, model_init_kwargs: dict | None, owner: str):
    """A model instance or a Hub id / folder -> a DLM model. trl's own loader resolves names to
    `AutoModelForCausalLM`; a DLM registers `AutoModelForMaskedLM`."""
    if isinstance(model, str):
        from transformers import AutoModelForMaskedLM

        model = AutoModelForMaskedLM.from_pretrained(model, **(model_init_kwargs or {}))
    config = getattr(model, "config", None)
    if getattr(config, "mask_token_id", None) is None or not hasattr(model, "generate"):
        raise ValueError(f"{owner} trains masked-diffusion LMs: the model needs `config.mask_token_id` and the DLM "
                         f"`generate`; got {type(model).__name__}")
    if getattr(config, "attention_mode", None) == "causal":
        raise ValueError(f"{owner}: the model has attention_mode='causal' (an AR model); the diffusion objective "
                         "needs a bidirectional or block model")
    if is_peft_available():
        from .lora import register_peft_defaults

        register_peft_defaults()
    return model


@contextlib.contextmanager
def without_causal_lm_head(*trl_modules: str):
    """Builds a trl trainer without `add_fused_lm_head`: the DLM keeps its own forward, and the DLM's guard against
    that patch (modeling_dlm.DLMForDiffusionLM.__setattr__) is never tripped by our own subclasses."""
    with contextlib.ExitStack() as stack:
        for name in trl_modules:
            module = importlib.import_module(name)
            stack.enter_context(mock.patch.object(module, "add_fused_lm_head", lambda *args, **kwargs: None))
        yield


def ensure_mask_token(tokenizer, model) -> int:
    """Make a (chat) tokenizer carry the model's mask token, so `tokenizer.mask_token_id`, the saved tokenizer and
    `model.config.mask_token_id` agree. A tokenizer without one takes the model's token; one whose mask token has
    another id is an error. Returns the id."""
    mask_id = model.config.mask_token_id
    if tokenizer.mask_token is None:
        if mask_id >= len(tokenizer):
            raise ValueError(f"model.config.mask_token_id ({mask_id}) is outside the tokenizer's vocabulary "
                             f"({len(tokenizer)} tokens); add the mask token to the tokenizer first")
        tokenizer.mask_token = tokenizer.convert_ids_to_tokens(mask_id)
    elif tokenizer.mask_token_id != mask_id:
        raise ValueError(f"the tokenizer's mask token {tokenizer.mask_token!r} has id {tokenizer.mask_token_id} but "
                         f"model.config.mask_token_id is {mask_id}")
    return mask_id
