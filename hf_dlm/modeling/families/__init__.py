"""Published DLM families loaded natively: `import hf_dlm` registers each family's `model_type` with
`AutoConfig`, `AutoModel` and `AutoModelForMaskedLM`, and its checkpoint key mapping with transformers'
weight conversion, so `AutoModelForMaskedLM.from_pretrained(folder)` reads a published checkpoint as it is:
no conversion step, no `trust_remote_code` (a registered model_type wins over the folder's `auto_map`), and
`save_pretrained` writes the published config keys and tensor names back.

Every family is a `DLMForDiffusionLM` (one architecture core: attention backends, FSDP2 / TP / EP / PP / CP,
float8, LoRA targets, the masked loss head, the decoding core); only names and options differ.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .base import FamilyConfig
from .llada import LLADA_KEYS, LLaDAConfig, LLaDAModel, LLaDAModelLM
from .llada_moe import (
    LLaDA2MoeConfig, LLaDA2MoeModel, LLaDA2MoeModelLM, LLaDA21MoeConfig, LLaDA21MoeModel, LLaDA21MoeModelLM,
    LLaDAMoEConfig, LLaDAMoEModel, LLaDAMoEModelLM, llada2_keys, lladamoe_keys,
)
from .qwen_families import (
    DreamBaseModel, DreamConfig, DreamModel, Fast_dLLM_QwenForCausalLM, Fast_dLLM_QwenModel, FastDLLMQwenConfig,
    SDARConfig, SDARForCausalLM, SDARModel, SDARMoeConfig, SDARMoeForCausalLM, SDARMoeModel, sdar_moe_keys,
)


@dataclass(frozen=True)
class Family:
    config_class: type[FamilyConfig]
    base_class: type
    lm_class: type
    key_mapping: Callable[[], list] | None = None  # transformers WeightTransforms, published -> hf-dlm names


FAMILIES: dict[str, Family] = {
    family.config_class.model_type: family
    for family in (
        Family(LLaDAConfig, LLaDAModel, LLaDAModelLM, lambda: list(LLADA_KEYS)),
        Family(DreamConfig, DreamBaseModel, DreamModel),
        Family(SDARConfig, SDARModel, SDARForCausalLM),
        Family(FastDLLMQwenConfig, Fast_dLLM_QwenModel, Fast_dLLM_QwenForCausalLM),
        Family(LLaDAMoEConfig, LLaDAMoEModel, LLaDAMoEModelLM, lladamoe_keys),
        Family(LLaDA2MoeConfig, LLaDA2MoeModel, LLaDA2MoeModelLM, llada2_keys),
        Family(LLaDA21MoeConfig, LLaDA21MoeModel, LLaDA21MoeModelLM, llada2_keys),
        Family(SDARMoeConfig, SDARMoeModel, SDARMoeForCausalLM, sdar_moe_keys),
    )
}


def register_families() -> None:
    """Register every family with the Auto classes and transformers' checkpoint conversion mapping."""
    from transformers import AutoConfig, AutoModel, AutoModelForMaskedLM
    from transformers.conversion_mapping import register_checkpoint_conversion_mapping

    for model_type, family in FAMILIES.items():
        AutoConfig.register(model_type, family.config_class, exist_ok=True)
        AutoModel.register(family.config_class, family.base_class, exist_ok=True)
        AutoModelForMaskedLM.register(family.config_class, family.lm_class, exist_ok=True)
        if family.key_mapping is not None:
            register_checkpoint_conversion_mapping(model_type, family.key_mapping(), overwrite=True)


__all__ = ["FAMILIES", "Family", "register_families", "LLaDAConfig", "LLaDAModelLM", "DreamConfig", "DreamModel",
           "SDARConfig", "SDARForCausalLM", "SDARMoeConfig", "SDARMoeForCausalLM", "FastDLLMQwenConfig",
           "Fast_dLLM_QwenForCausalLM", "LLaDAMoEConfig", "LLaDAMoEModelLM", "LLaDA2MoeConfig", "LLaDA2MoeModelLM",
           "LLaDA21MoeConfig", "LLaDA21MoeModelLM"]
