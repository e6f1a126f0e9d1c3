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
    """LLaDA (OLMo-derived `LLaDAConfig`): read through the native family's config
    (`hf_dlm.modeling.families.LLaDAConfig`), which refuses by name every variant the DLM architecture cannot
    run (only the released `block_type="llama"`, RMSNorm, SiLU, RoPE layout loads)."""
    from ..modeling.families import LLaDAConfig

    config = LLaDAConfig(**{k: v for k, v in source.items() if k not in ("model_type", "architectures", "auto_map")})
    names = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
             "tie_word_embeddings", "rope_parameters", "qkv_bias", "attention_mode", "label_alignment")
    options = {name: getattr(config, name) for name in names}
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
