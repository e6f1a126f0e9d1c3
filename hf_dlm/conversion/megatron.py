"""hf-dlm <-> Megatron-core / MegaDLMs GPT layout (the state dict of megatron.core GPTModel, as MegaDLMs saves it).

Megatron names (Transformer Engine layer spec; the local spec's `input_layernorm` / `pre_mlp_layernorm`
are read too):
  embedding.word_embeddings.weight                      <- model.embed_tokens.weight
  decoder.layers.N.self_attention.linear_qkv.layer_norm_weight <- input_layernorm (TE fused norm)
  decoder.layers.N.self_attention.linear_qkv.{weight,bias}     <- q / k / v fused per query group:
      for each of the `num_query_groups` groups: [q heads of the group, k head, v head]
  decoder.layers.N.self_attention.{q,k}_layernorm.weight      <- q_norm / k_norm (per head)
  decoder.layers.N.self_attention.linear_proj.{weight,bias}   <- o_proj
  decoder.layers.N.mlp.linear_fc1.layer_norm_weight            <- post_attention_layernorm
  decoder.layers.N.mlp.linear_fc1.{weight,bias}                <- cat(gate_proj, up_proj) (SwiGLU: silu(first) * second)
  decoder.layers.N.mlp.linear_fc2.{weight,bias}                <- down_proj
  decoder.final_layernorm.weight                               <- model.norm
  output_layer.weight                                          <- lm_head (absent when tied)
RoPE: Megatron's default (`rotary_interleaved=False`) rotates halves like transformers, so q / k need
no permutation. Checkpoint files: the legacy single-rank layout
`latest_checkpointed_iteration.txt` + `<iteration>/mp_rank_00/model_optim_rng.pt` ({"args", "model", ...}).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .key_maps import key_template

_EXACT_CONFIG = "hf_dlm_config"  # args field holding the full DLMConfig as JSON, for exact round trips


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """q (nh*hd, ...), k / v (ng*hd, ...) -> (ng * (nh/ng + 2) * hd, ...), grouped [q of group, k, v]."""
    rest = q.shape[1:]
    grouped = [t.reshape(groups, -1, *rest) for t in (q, k, v)]  # (ng, rows per group, ...)
    return torch.cat(grouped, dim=1).reshape(-1, *rest)


def _split_qkv(qkv: torch.Tensor, heads: int, groups: int, head_dim: int):
    rest = qkv.shape[1:]
    grouped = qkv.reshape(groups, (heads // groups + 2) * head_dim, *rest)
    q, k, v = grouped.split([heads // groups * head_dim, head_dim, head_dim], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def dlm_to_megatron(state_dict: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """hf-dlm state dict -> Megatron GPT state dict."""
    if getattr(config, "num_experts", 0):  # the dense map below would silently drop the experts
        raise NotImplementedError("Megatron export of MoE models (num_experts > 0) is not built; "
                                  "export with --to qwen3_moe or keep the hf-dlm folder")
    groups = config.num_key_value_heads
    out = {"embedding.word_embeddings.weight": state_dict["model.embed_tokens.weight"],
           "decoder.final_layernorm.weight": state_dict["model.norm.weight"]}
    if not config.tie_word_embeddings:
        out["output_layer.weight"] = state_dict["lm_head.weight"]
    for i in tqdm(range(config.num_hidden_layers), desc="to megatron", unit="layer", disable=config.num_hidden_layers < 8):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        attn = src + "self_attn."
        out[dst + "self_attention.linear_qkv.layer_norm_weight"] = state_dict[src + "input_layernorm.weight"]
        for kind in ("weight", "bias"):
            if attn + f"q_proj.{kind}" in state_dict:
                out[dst + f"self_attention.linear_qkv.{kind}"] = _fuse_qkv(
                    *(state_dict[attn + f"{p}_proj.{kind}"] for p in "qkv"), groups
                )
            if attn + f"o_proj.{kind}" in state_dict:
                out[dst + f"self_attention.linear_proj.{kind}"] = state_dict[attn + f"o_proj.{kind}"]
            if src + f"mlp.gate_proj.{kind}" in state_dict:
                out[dst + f"mlp.linear_fc1.{kind}"] = torch.cat(
                    [state_dict[src + f"mlp.gate_proj.{kind}"], state_dict[src + f"mlp.up_proj.{kind}"]], 0
                )
            if src + f"mlp.down_proj.{kind}" in state_dict:
                out[dst + f"mlp.linear_fc2.{kind}"] = state_dict[src + f"mlp.down_proj.{kind}"]
        if config.qk_norm:
            out[dst + "self_attention.q_layernorm.weight"] = state_dict[attn + "q_norm.weight"]
            out[dst + "self_attention.k_layernorm.weight"] = state_dict[attn + "k_norm.weight"]
        out[dst + "mlp.linear_fc1.layer_norm_weight"] = state_dict[src + "post_attention_layernorm.weight"]
    return out


# Megatron key template -> hf-dlm key template, for everything that is not fused
_PLAIN = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
    "decoder.layers.{}.self_attention.linear_qkv.layer_norm_weight": "model.layers.{}.input_layernorm.weight",
    "decoder.layers.{}.input_layernorm.weight": "model.layers.{}.input_layernorm.weight",
    "decoder.layers.{}.self_attention.q_layernorm.weight": "model.layers.{}.self_attn.q_norm.weight",
    "decoder.layers.{}.self_attention.k_layernorm.weight": "model.layers.{}.self_attn.k_norm.weight",
    "decoder.layers.{}.self_attention.linear_proj.weight": "model.layers.{}.self_attn.o_proj.weight",
    "decoder.layers.{}.self_attention.linear_proj.bias": "model.layers.{}.self_attn.o_proj.bias",
    "decoder.layers.{}.mlp.linear_fc1.layer_norm_weight": "model.layers.{}.post_attention_layernorm.weight",
    "decoder.layers.{}.pre_mlp_layernorm.weight": "model.layers.{}.post_attention_layernorm.weight",
    "decoder.layers.{}.mlp.linear_fc2.weight": "model.layers.{}.mlp.down_proj.weight",
    "decoder.layers.{}.mlp.linear_fc2.bias": "model.layers.{}.mlp.down_proj.bias",
}


def megatron_to_dlm(state_dict: dict[str, torch.Tensor], config, source: str = "megatron checkpoint") -> dict:
    """Megatron GPT state dict -> hf-dlm state dict (TE `_extra_state` entries carry no weights)."""
    out, unknown = {}, []
    for key, tensor in state_dict.items():
        if key.endswith("._extra_state") or key.endswith("rotary_pos_emb.inv_freq"):
            continue
        template, layer = key_template(key)
        prefix, kind = f"model.layers.{layer}.", template.rsplit(".", 1)[1]
        if template in _PLAIN:
            out[_PLAIN[template].format(layer)] = tensor
        elif template in ("decoder.layers.{}.self_attention.linear_qkv.weight",
                          "decoder.layers.{}.self_attention.linear_qkv.bias"):
            q, k, v = _split_qkv(tensor, config.num_attention_heads, config.num_key_value_heads, config.head_dim)
            out.update({prefix + f"self_attn.{p}_proj.{kind}": t for p, t in zip("qkv", (q, k, v))})
        elif template in ("decoder.layers.{}.mlp.linear_fc1.weight", "decoder.layers.{}.mlp.linear_fc1.bias"):
            gate, up = tensor.chunk(2, dim=0)
            out[prefix + f"mlp.gate_proj.{kind}"], out[prefix + f"mlp.up_proj.{kind}"] = gate, up
        else:
            unknown.append(key)
    if unknown:
        raise KeyError(f"{source}: no conversion rule for key(s) {', '.join(unknown[:8])}")
    return out


def megatron_args(config) -> argparse.Namespace:
    """Megatron-LM argument names for `config` (what `--use-checkpoint-args` reads), plus the exact DLMConfig."""
    if config.attention_bias != config.mlp_bias:
        # Megatron has one switch for every linear's bias (add_bias_linear) and one for q/k/v only
        raise ValueError(
            f"Megatron cannot hold attention_bias={config.attention_bias} with mlp_bias={config.mlp_bias}: its "
            "add_bias_linear gives all linears a bias or none (qkv_bias alone maps to add_qkv_bias)"
        )
    rope = config.rope_parameters
    return argparse.Namespace(
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        ffn_hidden_size=config.intermediate_size,
        num_attention_heads=config.num_attention_heads,
        kv_channels=config.head_dim,
        group_query_attention=config.num_key_value_heads != config.num_attention_heads,
        num_query_groups=config.num_key_value_heads,
        padded_vocab_size=config.vocab_size,
        max_position_embeddings=config.max_position_embeddings,
        seq_length=config.max_position_embeddings,
        normalization="RMSNorm",
        norm_epsilon=config.rms_norm_eps,
        swiglu=config.hidden_act == "silu",
        position_embedding_type="rope",
        use_rotary_position_embeddings=True,
        rotary_base=rope["rope_theta"],
        rotary_percent=1.0,
        rotary_interleaved=False,
        use_rope_scaling=rope.get("rope_type") == "llama3",
        rope_scaling_factor=rope.get("factor", 1.0),
        untie_embeddings_and_output_weights=not config.tie_word_embeddings,
        add_qkv_bias=config.qkv_bias or config.attention_bias,
        add_bias_linear=config.attention_bias and config.mlp_bias,
        qk_layernorm=config.qk_norm,
        mask_token_id=config.mask_token_id,
        attn_mask_type="causal" if config.attention_mode == "causal" else "bidirectional",
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        **{_EXACT_CONFIG: config.to_json_string(use_diff=False)},
    )


def config_from_megatron(args: argparse.Namespace, state_dict: dict[str, torch.Tensor]) -> dict:
    """DLMConfig keyword arguments from Megatron args (exact when hf-dlm wrote them); biases and QK-norm
    are read off the state dict, which is what the weights actually have."""
    if getattr(args, _EXACT_CONFIG, None):
        options = json.loads(getattr(args, _EXACT_CONFIG))
        for key in ("model_type", "transformers_version", "architectures", "dtype", "torch_dtype", "auto_map"):
            options.pop(key, None)
        return options
    if getattr(args, "normalization", "RMSNorm") != "RMSNorm" or not getattr(args, "swiglu", True):
        raise ValueError("megatron args: only RMSNorm + SwiGLU GPT models convert to the DLM architecture")
    if getattr(args, "position_embedding_type", "rope") != "rope" or getattr(args, "rotary_interleaved", False):
        raise ValueError("megatron args: only non-interleaved RoPE converts to the DLM architecture")
    heads = args.num_attention_heads
    groups = args.num_query_groups if getattr(args, "group_query_attention", False) else heads
    rope = {"rope_type": "default", "rope_theta": float(getattr(args, "rotary_base", 10000))}
    if getattr(args, "use_rope_scaling", False):
        rope = {"rope_type": "llama3", "rope_theta": rope["rope_theta"], "factor": float(args.rope_scaling_factor),
                "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    keys = set(state_dict)
    has = lambda suffix: any(k.endswith(suffix) for k in keys)  # noqa: E731
    options = dict(
        num_hidden_layers=args.num_layers,
        hidden_size=args.hidden_size,
        intermediate_size=args.ffn_hidden_size,
        num_attention_heads=heads,
        num_key_value_heads=groups,
        head_dim=getattr(args, "kv_channels", None) or args.hidden_size // heads,
        vocab_size=state_dict["embedding.word_embeddings.weight"].shape[0],
        max_position_embeddings=getattr(args, "max_position_embeddings", None) or args.seq_length,
        rms_norm_eps=getattr(args, "norm_epsilon", 1e-5),
        rope_parameters=rope,
        tie_word_embeddings="output_layer.weight" not in keys,
        qk_norm=has("self_attention.q_layernorm.weight"),
        attention_bias=has("linear_proj.bias"),
        qkv_bias=has("linear_qkv.bias") and not has("linear_proj.bias"),
        mlp_bias=has("linear_fc2.bias"),
        attention_mode="causal" if getattr(args, "attn_mask_type", "bidirectional") == "causal" else "bidirectional",
    )
    if getattr(args, "mask_token_id", None) is not None:
        options["mask_token_id"] = args.mask_token_id
    return options


def save_megatron_checkpoint(model, folder: str | os.PathLike, iteration: str = "release") -> Path:
    """Write `model` in the legacy single-rank Megatron layout under `folder`."""
    folder = Path(folder)
    args = megatron_args(model.config)  # refuses what Megatron cannot hold before anything is written
    state_dict = {k: v.detach().contiguous().clone() for k, v in dlm_to_megatron(model.state_dict(), model.config).items()}
    checkpoint = {"args": args, "checkpoint_version": 3.0, "iteration": 0, "model": state_dict}
    rank_dir = folder / iteration / "mp_rank_00"
    rank_dir.mkdir(parents=True, exist_ok=True)
    torch.save(checkpoint, rank_dir / "model_optim_rng.pt")
    (folder / "latest_checkpointed_iteration.txt").write_text(iteration)
    return rank_dir / "model_optim_rng.pt"


def find_megatron_file(path: str | os.PathLike) -> Path:
    """The `model_optim_rng.pt` of a checkpoint folder, an iteration folder or the file itself."""
    path = Path(path)
    if path.is_file():
        return path
    tracker = path / "latest_checkpointed_iteration.txt"
    if tracker.is_file():
        iteration = tracker.read_text().strip()
        path = path / (iteration if iteration == "release" else f"iter_{int(iteration):07d}")
    ranks = sorted(path.glob("mp_rank_*"))
    if not ranks:
        if (path / ".metadata").is_file() or (path.parent / ".metadata").is_file():
            raise ValueError(
                f"{path}: a torch_dist (distributed) Megatron checkpoint; convert it to the legacy 'torch' format "
                "first (Megatron-LM: --ckpt-convert-format torch)"
            )
        raise FileNotFoundError(f"{path}: no mp_rank_* folder (expected a Megatron checkpoint)")
    if len(ranks) > 1:
        raise ValueError(f"{path}: {len(ranks)} model-parallel ranks; merge them to one rank first (tools/checkpoint)")
    return ranks[0] / "model_optim_rng.pt"


def is_megatron_checkpoint(path: str | os.PathLike) -> bool:
    path = Path(path)
    return (path / "latest_checkpointed_iteration.txt").is_file() or any(path.glob("mp_rank_*")) or path.suffix == ".pt"


def load_megatron_checkpoint(path: str | os.PathLike, trust_pickle: bool = False):
    """(args, model state dict) of a Megatron checkpoint. Loads with `weights_only=True` (argparse
    Namespace allowed); checkpoints whose args hold other objects need `trust_pickle=True`."""
    file = find_megatron_file(path)
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):
            checkpoint = torch.load(file, map_location="cpu", weights_only=not trust_pickle)
    except pickle.UnpicklingError as error:
        raise ValueError(
            f"{file}: its args hold objects that a weights-only load refuses ({str(error).splitlines()[0]}); "
            "pass --trust-pickle if you trust this file"
        ) from error
    if "model" not in checkpoint:
        raise KeyError(f"{file}: no 'model' entry (keys: {sorted(checkpoint)})")
    args = checkpoint.get("args")
    if args is None:
        raise KeyError(f"{file}: no 'args' entry; the architecture cannot be read")
    return args, checkpoint["model"]


__all__ = ["dlm_to_megatron", "megatron_to_dlm", "megatron_args", "config_from_megatron", "save_megatron_checkpoint",
           "load_megatron_checkpoint", "find_megatron_file", "is_megatron_checkpoint"]
