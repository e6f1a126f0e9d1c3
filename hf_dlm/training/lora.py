"""peft LoRA on DLM models: default target modules and a one-call wrapper.

`register_peft_defaults()` adds the DLM family to peft's table of default LoRA targets, so a plain
`LoraConfig(r=16)` (no `target_modules`) works on a DLM as it does on Llama; the trainers of this package
call it. LoRA layers wrap `nn.Linear`s in place, so DLMTrainer, DLMSFTTrainer, DiffuGRPOTrainer and
`generate` run unchanged; adapters save / load / merge through peft's own API.
"""

from __future__ import annotations

from ..utils.import_utils import require

# every projection of the decoder (attention and SwiGLU MLP); the tied lm_head / embeddings stay frozen
DLM_LORA_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def register_peft_defaults() -> None:
    """peft picks default LoRA targets by `config.model_type`; add the DLM family ("dlm")."""
    require("peft", "LoRA on DLM models")
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as targets

    targets.setdefault("dlm", list(DLM_LORA_TARGET_MODULES))


def dlm_lora_config(r: int = 16, lora_alpha: int = 32, lora_dropout: float = 0.0, target_modules=None, **kwargs):
    """A `peft.LoraConfig` for DLM models. No `task_type`: peft's task wrappers (CAUSAL_LM, ...) reshape causal
    inputs; the plain `PeftModel` calls the DLM's own forward and `generate`."""
    require("peft", "LoRA on DLM models")
    from peft import LoraConfig

    register_peft_defaults()
    return LoraConfig(r=r, lora_alpha=lora_alpha, lora_dropout=lora_dropout,
                      target_modules=list(target_modules or DLM_LORA_TARGET_MODULES), **kwargs)


def get_dlm_peft_model(model, peft_config=None, **config_kwargs):
    """`peft.get_peft_model` with the DLM defaults (`dlm_lora_config(**config_kwargs)` when no config is given)."""
    from peft import get_peft_model

    register_peft_defaults()
    return get_peft_model(model, peft_config or dlm_lora_config(**config_kwargs))


__all__ = ["DLM_LORA_TARGET_MODULES", "register_peft_defaults", "dlm_lora_config", "get_dlm_peft_model"]
