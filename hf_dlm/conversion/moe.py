"""Qwen3-MoE checkpoints <-> hf-dlm MoE models.

Hub checkpoints of Qwen3-MoE (and what transformers 5 writes) store one key per expert and projection,
`model.layers.N.mlp.experts.J.{gate,up,down}_proj.weight`; hf-dlm (like transformers 5 in memory) keeps
grouped weights `mlp.experts.gate_up_proj` (E, 2I, H), gate rows first, and `mlp.experts.down_proj`
(E, H, I). `fuse_experts` / `split_experts` move between the two; every other key goes through the
explicit `QWEN3_MOE_MAP` of `key_maps`.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import torch

from .key_maps import QWEN3_MOE_MAP, rename_state_dict

_EXPERT_KEY = re.compile(r"^(?P<prefix>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def fuse_experts(state_dict: dict[str, torch.Tensor], source: str = "checkpoint") -> dict[str, torch.Tensor]:
    """Per-expert `...experts.J.{gate,up,down}_proj.weight` -> grouped `...experts.gate_up_proj` /
    `...experts.down_proj`. Keys already grouped pass through; a missing expert or projection is an error."""
    fused, grouped = {}, {}
    for key, tensor in state_dict.items():
        match = _EXPERT_KEY.match(key)
        if match is None:
            fused[key] = tensor
        else:
            grouped.setdefault(match["prefix"], {})[(int(match["expert"]), match["proj"])] = tensor
    for prefix, parts in grouped.items():
        count = 1 + max(expert for expert, _ in parts)
        missing = [f"{prefix}.{e}.{p}.weight" for e in range(count) for p in ("gate_proj", "up_proj", "down_proj")
                   if (e, p) not in parts]
        if missing:
            raise KeyError(f"{source}: incomplete experts, missing {missing[:4]}")
        fused[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([parts[e, "gate_proj"], parts[e, "up_proj"]], dim=0) for e in range(count)])  # (E, 2I, H)
        fused[f"{prefix}.down_proj"] = torch.stack([parts[e, "down_proj"] for e in range(count)])  # (E, H, I)
    return fused


def split_experts(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of `fuse_experts`: grouped expert weights -> one key per expert and projection."""
    split = {}
    for key, tensor in state_dict.items():
        if key.endswith(".mlp.experts.gate_up_proj"):
            prefix = key[: -len(".gate_up_proj")]
            for expert, weight in enumerate(tensor):
                gate, up = weight.chunk(2, dim=0)
                split[f"{prefix}.{expert}.gate_proj.weight"] = gate.contiguous()
                split[f"{prefix}.{expert}.up_proj.weight"] = up.contiguous()
        elif key.endswith(".mlp.experts.down_proj"):
            prefix = key[: -len(".down_proj")]
            for expert, weight in enumerate(tensor):
                split[f"{prefix}.{expert}.down_proj.weight"] = weight.contiguous()
        else:
            split[key] = tensor
    return split


def qwen3_moe_config_from_dlm(config) -> dict:
    """A `Qwen3MoeConfig` dict for a DLM config; a DLM feature Qwen3-MoE lacks is an error naming the field."""
    unsupported = {"qkv_bias": config.qkv_bias, "mlp_bias": config.mlp_bias,
                   "shared_expert_intermediate_size": config.shared_expert_intermediate_size,
                   "qk_norm": not config.qk_norm, "num_experts": not config.num_experts}
    bad = [name for name, value in unsupported.items() if value]
    if bad:
        raise ValueError(f"Qwen3-MoE export: DLMConfig field(s) {bad} have values Qwen3-MoE cannot represent")
    if config.attention_mode != "causal":
        warnings.warn(f"Qwen3-MoE export: the DLM's attention_mode is {config.attention_mode!r}; Qwen3-MoE is "
                      "causal, so the exported model computes a different function", stacklevel=2)
    fields = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
              "tie_word_embeddings", "attention_bias", "attention_dropout", "initializer_range", "rope_parameters",
              "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
              "mlp_only_layers", "router_aux_loss_coef", "pad_token_id", "bos_token_id", "eos_token_id")
    options = {name: getattr(config, name) for name in fields}
    return {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "use_sliding_window": False,
            **options}


@torch.no_grad()
def save_qwen3_moe(model, destination: str | Path) -> Path:
    """Write a DLM MoE model as a Qwen3-MoE checkpoint folder (config.json + model.safetensors, Hub key layout)
    that `transformers.AutoModelForCausalLM.from_pretrained` loads."""
    from safetensors.torch import save_file

    destination = Path(destination)
    destination.mkdir(parents=True, exist_ok=True)
    inverse = {target: source for source, target in QWEN3_MOE_MAP.items() if target is not None}
    state_dict = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state_dict.pop("lm_head.weight", None)
    state_dict = split_experts(rename_state_dict(state_dict, inverse, source="hf-dlm model"))
    save_file(state_dict, destination / "model.safetensors", metadata={"format": "pt"})
    config = qwen3_moe_config_from_dlm(model.config)
    (destination / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return destination


__all__ = ["fuse_experts", "split_experts", "qwen3_moe_config_from_dlm", "save_qwen3_moe"]
