"""Explicit key maps, one per source family (litgpt / torchtitan style).

Each map sends a source key template to the hf-dlm key template (`{}` is the layer index) or to None
for keys that are known and carry nothing (non-persistent RoPE buffers saved by old code). A key that
no map names is an error: silently dropping a tensor is how conversions go wrong.

hf-dlm names follow transformers' Llama / Qwen3 modules (`model.layers.N.self_attn.q_proj`, ...).
"""

from __future__ import annotations

import re

import torch

_LAYER = re.compile(r"\.(\d+)\.")

# transformers' decoder names, shared by Llama / Mistral / Qwen2 / Qwen3 / Dream and hf-dlm itself
_ATTENTION = {
    "model.layers.{}.self_attn.q_proj.weight": "model.layers.{}.self_attn.q_proj.weight",
    "model.layers.{}.self_attn.k_proj.weight": "model.layers.{}.self_attn.k_proj.weight",
    "model.layers.{}.self_attn.v_proj.weight": "model.layers.{}.self_attn.v_proj.weight",
    "model.layers.{}.self_attn.o_proj.weight": "model.layers.{}.self_attn.o_proj.weight",
}
_QKV_BIAS = {
    "model.layers.{}.self_attn.q_proj.bias": "model.layers.{}.self_attn.q_proj.bias",
    "model.layers.{}.self_attn.k_proj.bias": "model.layers.{}.self_attn.k_proj.bias",
    "model.layers.{}.self_attn.v_proj.bias": "model.layers.{}.self_attn.v_proj.bias",
}
_O_BIAS = {"model.layers.{}.self_attn.o_proj.bias": "model.layers.{}.self_attn.o_proj.bias"}
_QK_NORM = {
    "model.layers.{}.self_attn.q_norm.weight": "model.layers.{}.self_attn.q_norm.weight",
    "model.layers.{}.self_attn.k_norm.weight": "model.layers.{}.self_attn.k_norm.weight",
}
_MLP = {
    "model.layers.{}.mlp.gate_proj.weight": "model.layers.{}.mlp.gate_proj.weight",
    "model.layers.{}.mlp.up_proj.weight": "model.layers.{}.mlp.up_proj.weight",
    "model.layers.{}.mlp.down_proj.weight": "model.layers.{}.mlp.down_proj.weight",
}
_MLP_BIAS = {
    "model.layers.{}.mlp.gate_proj.bias": "model.layers.{}.mlp.gate_proj.bias",
    "model.layers.{}.mlp.up_proj.bias": "model.layers.{}.mlp.up_proj.bias",
    "model.layers.{}.mlp.down_proj.bias": "model.layers.{}.mlp.down_proj.bias",
}
_NORMS_AND_EMBEDDINGS = {
    "model.embed_tokens.weight": "model.embed_tokens.weight",
    "model.layers.{}.input_layernorm.weight": "model.layers.{}.input_layernorm.weight",
    "model.layers.{}.post_attention_layernorm.weight": "model.layers.{}.post_attention_layernorm.weight",
    "model.norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
    "model.layers.{}.self_attn.rotary_emb.inv_freq": None,  # non-persistent buffer of old checkpoints
    "model.rotary_emb.inv_freq": None,
}

# Llama: `attention_bias` puts a bias on q / k / v / o, `mlp_bias` on the three MLP projections
LLAMA_MAP = {**_NORMS_AND_EMBEDDINGS, **_ATTENTION, **_QKV_BIAS, **_O_BIAS, **_MLP, **_MLP_BIAS}
# Mistral: no biases at all
MISTRAL_MAP = {**_NORMS_AND_EMBEDDINGS, **_ATTENTION, **_MLP}
# Qwen2: bias on q / k / v only
QWEN2_MAP = {**_NORMS_AND_EMBEDDINGS, **_ATTENTION, **_QKV_BIAS, **_MLP}
# Qwen3: per-head RMSNorm on q and k; `attention_bias` on q / k / v / o
QWEN3_MAP = {**_NORMS_AND_EMBEDDINGS, **_ATTENTION, **_QKV_BIAS, **_O_BIAS, **_QK_NORM, **_MLP}
# Dream (Dream-org/Dream-v0-*-7B, `modeling_dream.py`): the Qwen2 layout, bias on q / k / v
DREAM_MAP = dict(QWEN2_MAP)
# MegaDLMs' HF-side DiffLM: the Qwen3 names without biases
MEGADLMS_MAP = {**_NORMS_AND_EMBEDDINGS, **_ATTENTION, **_QK_NORM, **_MLP}
# MoE layers (transformers 5's Qwen3-MoE modules): the router and the grouped experts (`moe.fuse_experts`
# groups a checkpoint's per-expert keys first); an optional Qwen2-MoE-style gated shared expert
_MOE = {
    "model.layers.{}.mlp.gate.weight": "model.layers.{}.mlp.gate.weight",
    "model.layers.{}.mlp.experts.gate_up_proj": "model.layers.{}.mlp.experts.gate_up_proj",
    "model.layers.{}.mlp.experts.down_proj": "model.layers.{}.mlp.experts.down_proj",
}
_SHARED_EXPERT = {
    "model.layers.{}.mlp.shared_expert.gate_proj.weight": "model.layers.{}.mlp.shared_expert.gate_proj.weight",
    "model.layers.{}.mlp.shared_expert.up_proj.weight": "model.layers.{}.mlp.shared_expert.up_proj.weight",
    "model.layers.{}.mlp.shared_expert.down_proj.weight": "model.layers.{}.mlp.shared_expert.down_proj.weight",
    "model.layers.{}.mlp.shared_expert_gate.weight": "model.layers.{}.mlp.shared_expert_gate.weight",
}
# Qwen3-MoE: the Qwen3 layout, MoE blocks in the layers `decoder_sparse_step` / `mlp_only_layers` select
QWEN3_MOE_MAP = {**QWEN3_MAP, **_MOE}
# hf-dlm to itself (every optional tensor)
DLM_MAP = {**LLAMA_MAP, **_QK_NORM, **_MOE, **_SHARED_EXPERT}

# LLaDA (GSAI-ML/LLaDA-8B-*, `modeling_llada.py`, OLMo-derived names, block_type "llama"):
# `ff_proj` is the SiLU-gated branch, `up_proj` the linear branch, `ff_out` the down projection;
# `attn_norm` / `ff_norm` the two RMSNorms; `transformer.ff_out` the untied output head.
LLADA_MAP = {
    "model.transformer.wte.weight": "model.embed_tokens.weight",
    "model.transformer.blocks.{}.attn_norm.weight": "model.layers.{}.input_layernorm.weight",
    "model.transformer.blocks.{}.q_proj.weight": "model.layers.{}.self_attn.q_proj.weight",
    "model.transformer.blocks.{}.k_proj.weight": "model.layers.{}.self_attn.k_proj.weight",
    "model.transformer.blocks.{}.v_proj.weight": "model.layers.{}.self_attn.v_proj.weight",
    "model.transformer.blocks.{}.q_proj.bias": "model.layers.{}.self_attn.q_proj.bias",
    "model.transformer.blocks.{}.k_proj.bias": "model.layers.{}.self_attn.k_proj.bias",
    "model.transformer.blocks.{}.v_proj.bias": "model.layers.{}.self_attn.v_proj.bias",
    "model.transformer.blocks.{}.attn_out.weight": "model.layers.{}.self_attn.o_proj.weight",
    "model.transformer.blocks.{}.ff_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
    "model.transformer.blocks.{}.ff_proj.weight": "model.layers.{}.mlp.gate_proj.weight",
    "model.transformer.blocks.{}.up_proj.weight": "model.layers.{}.mlp.up_proj.weight",
    "model.transformer.blocks.{}.ff_out.weight": "model.layers.{}.mlp.down_proj.weight",
    "model.transformer.ln_f.weight": "model.norm.weight",
    "model.transformer.ff_out.weight": "lm_head.weight",
}

FAMILY_MAPS = {
    "llama": LLAMA_MAP,
    "mistral": MISTRAL_MAP,
    "qwen2": QWEN2_MAP,
    "qwen3": QWEN3_MAP,
    "qwen3_moe": QWEN3_MOE_MAP,
    "dream": DREAM_MAP,
    "llada": LLADA_MAP,
    "megadlms": MEGADLMS_MAP,
    "dlm": DLM_MAP,
}


def key_template(key: str) -> tuple[str, int | None]:
    """`model.layers.3.mlp.up_proj.weight` -> (`model.layers.{}.mlp.up_proj.weight`, 3)."""
    match = _LAYER.search(key)
    if match is None:
        return key, None
    return key[: match.start()] + ".{}." + key[match.end() :], int(match.group(1))


def rename_state_dict(
    state_dict: dict[str, torch.Tensor], weight_map: dict[str, str | None], source: str = "checkpoint"
) -> dict[str, torch.Tensor]:
    """Rename every key of `state_dict` through `weight_map`; a key the map does not know is an error
    naming the key and the `source` it came from."""
    renamed = {}
    unknown = []
    for key, tensor in state_dict.items():
        template, layer = key_template(key)
        if template not in weight_map:
            unknown.append(key)
            continue
        target = weight_map[template]
        if target is not None:
            renamed[target.format(layer) if layer is not None else target] = tensor
    if unknown:
        shown = ", ".join(unknown[:8]) + (f" (+{len(unknown) - 8} more)" if len(unknown) > 8 else "")
        raise KeyError(f"{source}: no conversion rule for key(s) {shown}")
    return renamed


__all__ = ["FAMILY_MAPS", "LLAMA_MAP", "MISTRAL_MAP", "QWEN2_MAP", "QWEN3_MAP", "QWEN3_MOE_MAP", "DREAM_MAP", "LLADA_MAP",
           "MEGADLMS_MAP", "DLM_MAP", "key_template", "rename_state_dict"]
