"""The families published under transformers' Qwen tensor names (which are hf-dlm's own, so no key mapping
except the MoE experts): Dream, SDAR, SDAR-MoE and Fast-dLLM v2.

- Dream (Dream-org/Dream-v0-Base/Instruct-7B, `model_type: "Dream"`): Qwen2 (q / k / v bias), bidirectional;
  its generate reads the logits at i-1 for token i (`label_alignment="shift"`); [MASK] from config.json.
- SDAR (JetLM/SDAR-*, `"sdar"`): Qwen3 (per-head QK RMSNorm) run block-causally: a token sees its own block
  and earlier ones (`block_size`, 4 in the released configs); no shift; [MASK] 151669 (its generate default).
- SDAR-MoE (`"sdar_moe"`): the same over Qwen3-MoE layers (softmax top-k router, one key per expert).
- Fast-dLLM v2 (Efficient-Large-Model/Fast_dLLM_v2_*, `"Fast_dLLM_Qwen"`): Qwen2.5 (q / k / v bias) with
  block-causal attention of `bd_size` (32) tokens, whatever `attention_mask` says; its generate shifts the
  logits by one (the token shift); [MASK] 151665 (its generate default).
"""

from __future__ import annotations

from ..modeling_dlm import DLMForDiffusionLM, DLMModel
from .base import FamilyConfig, FamilyModelMixin, check_field, grouped_experts
from .llada_moe import block_threshold_defaults

_QWEN_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "hidden_act", "max_position_embeddings", "initializer_range", "rms_norm_eps",
                "use_cache", "tie_word_embeddings", "attention_dropout", "pad_token_id", "bos_token_id", "eos_token_id")


def _refuse_sliding_window(family: str, kwargs: dict) -> None:
    window = kwargs.get("use_sliding_window") and kwargs.get("sliding_window")
    check_field(not window, family, "use_sliding_window", kwargs.get("use_sliding_window"),
                "is not supported (hf-dlm attends to the whole sequence or block)")


class DreamConfig(FamilyConfig):
    model_type = "Dream"
    published_fields = (*_QWEN_FIELDS, "mask_token_id")
    qkv_bias: bool = True
    label_alignment: str = "shift"
    rms_norm_eps: float = 1e-6

    def read_published(self, kwargs, published):
        _refuse_sliding_window("Dream", kwargs)
        return kwargs


class SDARConfig(FamilyConfig):
    model_type = "sdar"
    published_fields = (*_QWEN_FIELDS, "head_dim", "attention_bias", "block_size")
    default_mask_token_id = 151669
    qk_norm: bool = True
    attention_mode: str = "block"
    block_size: int | None = 4

    def read_published(self, kwargs, published):
        _refuse_sliding_window("SDAR", kwargs)
        return kwargs


class SDARMoeConfig(SDARConfig):
    model_type = "sdar_moe"
    published_fields = (*SDARConfig.published_fields, "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                        "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef")


class FastDLLMQwenConfig(FamilyConfig):
    model_type = "Fast_dLLM_Qwen"
    renames = {"bd_size": "block_size"}
    published_fields = _QWEN_FIELDS
    default_mask_token_id = 151665
    qkv_bias: bool = True
    attention_mode: str = "block"
    block_size: int | None = 32
    label_alignment: str = "shift"

    def read_published(self, kwargs, published):
        _refuse_sliding_window("Fast_dLLM_Qwen", kwargs)
        return kwargs


class DreamBaseModel(FamilyModelMixin, DLMModel):
    config_class = DreamConfig


class DreamModel(FamilyModelMixin, DLMForDiffusionLM):
    """Named as Dream's published class (which carries the LM head), so a saved config's `architectures` matches."""

    config_class = DreamConfig
    # Dream's README call: 512 tokens, 512 steps, entropy ordering (alg="entropy", alg_temp 0), temperature 0.2,
    # top_p 0.95, and its `_sample`'s timestep schedule for how many tokens each step commits (eps 1e-3)
    generation_defaults = staticmethod(lambda config: {"max_new_tokens": 512, "steps": 512, "remasking": "entropy",
                                                        "do_sample": True, "temperature": 0.2, "top_p": 0.95,
                                                        "schedule": "dream", "schedule_eps": 1e-3})


class SDARModel(FamilyModelMixin, DLMModel):
    config_class = SDARConfig


class SDARForCausalLM(FamilyModelMixin, DLMForDiffusionLM):
    config_class = SDARConfig
    generation_defaults = block_threshold_defaults(0.85)


class SDARMoeModel(FamilyModelMixin, DLMModel):
    config_class = SDARMoeConfig


class SDARMoeForCausalLM(FamilyModelMixin, DLMForDiffusionLM):
    config_class = SDARMoeConfig
    generation_defaults = block_threshold_defaults(0.85)


class Fast_dLLM_QwenModel(FamilyModelMixin, DLMModel):  # noqa: N801 (the published name)
    config_class = FastDLLMQwenConfig


class Fast_dLLM_QwenForCausalLM(FamilyModelMixin, DLMForDiffusionLM):  # noqa: N801
    config_class = FastDLLMQwenConfig
    # Fast-dLLM v2's batch_sample as its evaluation runs it: blocks of bd_size aligned to the positions (the prompt's
    # partial block first), decoded in sub-blocks of 8 with threshold 0.95 (at least the most confident mask), each
    # block's first token alone from the previous position's logits, the token shift (label_alignment), earlier
    # blocks from the exact block cache, greedy
    generation_defaults = staticmethod(lambda config: {
        "block_length": config.block_size, "sub_block_length": 8, "threshold": 0.95, "first_token_alone": True,
        "align_blocks": True, "cache": "prefix", "remasking": "low_confidence", "do_sample": False})


def sdar_moe_keys():
    return grouped_experts()
