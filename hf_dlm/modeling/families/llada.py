"""LLaDA (GSAI-ML/LLaDA-8B-Base / -Instruct, LLaDA-1.5; `model_type: "llada"`): OLMo-derived config keys and
tensor names over the Llama computation, bidirectional, no logit shift, [MASK] 126336.

Published tensors (`modeling_llada.py`, block_type "llama"): `model.transformer.wte`, per block `attn_norm`,
`q_proj` / `k_proj` / `v_proj` (optional bias), `attn_out`, `ff_norm`, `ff_proj` (the SiLU-gated branch),
`up_proj` (the linear branch), `ff_out` (down projection), then `ln_f` and the untied head `transformer.ff_out`.
The published attention ignores padding (`attn_mask=None`); hf-dlm masks padded keys, which equals it on
unpadded input.
"""

from __future__ import annotations

from ..modeling_dlm import DLMForDiffusionLM, DLMModel
from .base import FamilyConfig, FamilyModelMixin, check_field, renamings

# the only variant the released checkpoints use; anything else is refused by name
_REQUIRED = {"block_type": "llama", "layer_norm_type": "rms", "activation_type": "silu"}
_UNSUPPORTED_FLAGS = ("alibi", "attention_layer_norm", "scale_logits", "input_emb_norm", "include_bias", "yarn",
                      "clip_qkv")


class LLaDAConfig(FamilyConfig):
    model_type = "llada"
    renames = {
        "d_model": "hidden_size", "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads",
        "n_layers": "num_hidden_layers", "mlp_hidden_size": "intermediate_size",
        "max_sequence_length": "max_position_embeddings", "weight_tying": "tie_word_embeddings",
        "include_qkv_bias": "qkv_bias", "init_std": "initializer_range",
    }
    published_fields = ("rms_norm_eps", "mask_token_id", "pad_token_id", "eos_token_id", "bos_token_id",
                        "attention_dropout", "use_cache")
    default_mask_token_id = 126336
    rms_norm_eps: float = 1e-5

    def read_published(self, kwargs, published):
        for field, value in _REQUIRED.items():
            check_field(kwargs.get(field, value) == value, "LLaDA", field, kwargs.get(field), f"is not supported (only {value!r})")
        for field in _UNSUPPORTED_FLAGS:
            check_field(not kwargs.get(field), "LLaDA", field, kwargs.get(field), "is not supported by the DLM architecture")
        check_field(kwargs.get("rope", True), "LLaDA", "rope", kwargs.get("rope"), "is not supported (the DLM uses RoPE)")
        check_field(kwargs.get("block_group_size", 1) == 1, "LLaDA", "block_group_size", kwargs.get("block_group_size"),
                    "!= 1 is not supported")
        if kwargs.get("multi_query_attention") and kwargs.get("n_kv_heads") is None:
            kwargs["n_kv_heads"] = 1
        if kwargs.get("mlp_hidden_size") is None and kwargs.get("mlp_ratio") and kwargs.get("d_model"):
            kwargs["mlp_hidden_size"] = kwargs["mlp_ratio"] * kwargs["d_model"]
        if kwargs.get("embedding_size"):  # LLaDA's vocab_size is the tokenizer's; the embedding has embedding_size rows
            published["vocab_size"] = self.vocab_size
            self.vocab_size = kwargs.pop("embedding_size")
        return {key: value for key, value in kwargs.items() if value is not None or key not in self.renames}

    def write_published(self, output):
        published = self.published_values or {}
        if "vocab_size" in published:
            output["embedding_size"], output["vocab_size"] = output["vocab_size"], published["vocab_size"]


class LLaDAModel(FamilyModelMixin, DLMModel):
    config_class = LLaDAConfig


def llada_generation_defaults(config) -> dict:
    """LLaDA's `generate.py` as its example runs it: 128 tokens in semi-autoregressive blocks of 32, one token per
    step, low-confidence remasking, greedy."""
    return {"max_new_tokens": 128, "steps": 128, "block_length": 32, "remasking": "low_confidence", "do_sample": False}


class LLaDAModelLM(FamilyModelMixin, DLMForDiffusionLM):
    config_class = LLaDAConfig
    generation_defaults = llada_generation_defaults


# published name -> hf-dlm name, in order (the head's `transformer.ff_out` before the blocks' `ff_out`)
LLADA_KEYS = renamings([
    (r"^model\.transformer\.ff_out\.", "lm_head."),
    (r"^model\.transformer\.wte\.", "model.embed_tokens."),
    (r"^model\.transformer\.ln_f\.", "model.norm."),
    (r"^model\.transformer\.blocks\.", "model.layers."),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ff_norm\.", ".post_attention_layernorm."),
    (r"\.q_proj\.", ".self_attn.q_proj."),
    (r"\.k_proj\.", ".self_attn.k_proj."),
    (r"\.v_proj\.", ".self_attn.v_proj."),
    (r"\.attn_out\.", ".self_attn.o_proj."),
    (r"\.ff_proj\.", ".mlp.gate_proj."),
    (r"\.up_proj\.", ".mlp.up_proj."),
    (r"\.ff_out\.", ".mlp.down_proj."),
])
