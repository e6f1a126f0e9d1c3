"""Source-family config (a `config.json` dict) -> `DLMConfig` keyword arguments.

Every architecture field the DLM family has is carried (RoPE parameters with their scaling, RMSNorm
epsilon, tied embeddings, biases, QK-norm, head_dim, special token ids). A source feature hf-dlm
cannot reproduce exactly is an error naming the field, never a silent approximation.
"""

from __future__ import annotations

import warnings

_COMMON_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
    "tie_word_embeddings", "attention_dropout", "initializer_range", "pad_token_id", "bos_token_id",
    "eos_token_id",
)


def rope_parameters_of(source: dict) -> dict:
    """transformers 5 `rope_parameters`, or the older `rope_theta` + `rope_scaling` pair (Dream, 4.x dumps)."""
    if source.get("rope_parameters"):
        return dict(source["rope_parameters"])
    rope = {"rope_type": "default", "rope_theta": float(source.get("rope_theta", 10000.0))}
    scaling = source.get("rope_scaling")
    if scaling:
        scaling = dict(scaling)
        scaling["rope_type"] = scaling.pop("rope_type", scaling.pop("type", "default"))
        rope.update(scaling)
    return rope


def _common(source: dict) -> dict:
    options = {name: source[name] for name in _COMMON_FIELDS if source.get(name) is not None}
    options["rope_parameters"] = rope_parameters_of(source)
    return options


def _check_no_sliding_window(source: dict, family: str) -> None:
    uses_window = source.get("use_sliding_window", family == "mistral") and source.get("sliding_window")
    if uses_window or "sliding_attention" in (source.get("layer_types") or ()):
        warnings.warn(
            f"{family} config: sliding-window attention (sliding_window={source.get('sliding_window')}) is dropped; "
            "the DLM attends to the whole sequence, which equals the source only up to the window length",
            stacklevel=3,
        )


def llama_config(source: dict) -> dict:
    options = _common(source)
    options.update(attention_bias=bool(source.get("attention_bias", False)), mlp_bias=bool(source.get("mlp_bias", False)))
    return options


def mistral_config(source: dict) -> dict:
    _check_no_sliding_window(source, "mistral")
    return _common(source)


def qwen2_config(source: dict) -> dict:
    _check_no_sliding_window(source, "qwen2")
    return {**_common(source), "qkv_bias": True}


def qwen3_config(source: dict) -> dict:
    _check_no_sliding_window(source, "qwen3")
    return {**_common(source), "qk_norm": True, "attention_bias": bool(source.get("attention_bias", False))}


def qwen3_moe_config(source: dict) -> dict:
    """Qwen3-MoE: the Qwen3 layout with top-k MoE blocks (`num_experts` is `num_local_experts` in newer dumps)."""
    options = qwen3_config(source)
    options["num_experts"] = source.get("num_experts", source.get("num_local_experts"))
    for name in ("num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
                 "mlp_only_layers", "router_aux_loss_coef"):
        if source.get(name) is not None:
            options[name] = source[name]
    return options


def dream_config(source: dict) -> dict:
    """Dream: Qwen2 layout (q / k / v bias), bidirectional, logits shifted by one (Dream's sampler reads
    the logits at i-1 for token i)."""
    _check_no_sliding_window(source, "dream")
    options = {**_common(source), "qkv_bias": True, "attention_mode": "bidirectional", "label_alignment": "shift"}
    if source.get("mask_token_id") is not None:
        options["mask_token_id"] = source["mask_token_id"]
    return options


def megadlms_config(source: dict) -> dict:
    """MegaDLMs' HF-side model (`tools/weights_conversion/hf_configs/*/modeling_dlm.py`): the Qwen3 layout
    (per-head QK-norm, no biases) with `attn_mask_type` choosing bidirectional or causal attention."""
    _check_no_sliding_window(source, "megadlms")
    mode = source.get("attn_mask_type", "bidirectional")
    if mode not in ("bidirectional", "causal"):
        raise ValueError(f"MegaDLMs config field attn_mask_type={mode!r} is not supported (bidirectional / causal)")
    options = {**_common(source), "qk_norm": True, "attention_mode": mode, "label_alignment": "same"}
    if source.get("mask_token_id") is not None:
        options["mask_token_id"] = source["mask_token_id"]
    return options


def llada_config(source: dict) -> dict:
    """LLaDA (OLMo-derived `LLaDAConfig`): only the `block_type="llama"`, RMSNorm, SiLU, RoPE variant that
    the released checkpoints use; anything else is rejected by name."""
    required = {"block_type": "llama", "layer_norm_type": "rms", "activation_type": "silu"}
    for field, value in required.items():
        if source.get(field, value) != value:
            raise ValueError(f"LLaDA config field {field}={source.get(field)!r} is not supported (only {value!r})")
    for field in ("alibi", "attention_layer_norm", "scale_logits", "input_emb_norm", "include_bias", "yarn"):
        if source.get(field):
            raise ValueError(f"LLaDA config field {field}=true is not supported by the DLM architecture")
    if not source.get("rope", True):
        raise ValueError("LLaDA config field rope=false is not supported (the DLM uses RoPE)")
    if source.get("block_group_size", 1) != 1:
        raise ValueError("LLaDA config field block_group_size != 1 is not supported")
    d_model, n_heads = source["d_model"], source["n_heads"]
    n_kv_heads = source.get("n_kv_heads") or (1 if source.get("multi_query_attention") else n_heads)
    hidden = source.get("mlp_hidden_size") or source["mlp_ratio"] * d_model
    options = {
        "vocab_size": source.get("embedding_size") or source["vocab_size"],
        "hidden_size": d_model,
        "intermediate_size": hidden,
        "num_hidden_layers": source["n_layers"],
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": d_model // n_heads,
        "hidden_act": "silu",
        "max_position_embeddings": source.get("max_sequence_length", 4096),
        "rms_norm_eps": source.get("rms_norm_eps", 1e-5),
        "tie_word_embeddings": bool(source.get("weight_tying", False)),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(source.get("rope_theta", 10000.0))},
        "qkv_bias": bool(source.get("include_qkv_bias", False)),
        "attention_mode": "bidirectional",
        "label_alignment": "same",
    }
    for name in ("mask_token_id", "pad_token_id", "eos_token_id", "bos_token_id"):
        if source.get(name) is not None:
            options[name] = source[name]
    return options


FAMILY_CONFIGS = {
    "llama": llama_config,
    "mistral": mistral_config,
    "qwen2": qwen2_config,
    "qwen3": qwen3_config,
    "qwen3_moe": qwen3_moe_config,
    "dream": dream_config,
    "llada": llada_config,
    "megadlms": megadlms_config,
}
AR_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")

__all__ = ["FAMILY_CONFIGS", "AR_FAMILIES", "rope_parameters_of"]
