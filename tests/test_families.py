"""Published families load natively: a tiny folder in each family's published layout (config.json keys and
safetensors tensor names as on the Hub) loads with `AutoModelForMaskedLM.from_pretrained` after `import hf_dlm`
and gives the reference architecture's logits in fp32 (transformers' Llama for LLaDA, Qwen2 for Dream and
Fast-dLLM v2, Qwen3 / Qwen3-MoE for SDAR / SDAR-MoE run with the family's block-causal mask, DeepSeek-V3's MoE
for LLaDA2's gate; LLaDA-MoE and LLaDA2's attention from their published equations, written out here);
`save_pretrained` writes the same keys and config fields back and the reloaded model gives the same logits."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForMaskedLM

import hf_dlm  # noqa: F401  (registers the families)
from hf_dlm.modeling.families import FAMILIES
from hf_dlm.modeling.families.base import BOOKKEEPING_KEYS

V, H, I, L, NH = 128, 32, 64, 2, 4
IDS = torch.randint(0, 120, (2, 12), generator=torch.Generator().manual_seed(0))


def randomize(model, seed=0):
    """Every tensor random (norms near 1, biases non-zero), so a misplaced tensor shows in the logits."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            scale = 0.1 if "bias" in name else 0.2
            param.copy_(1 + 0.1 * torch.randn_like(param) if "norm" in name else scale * torch.randn_like(param))
    return model.eval()


def additive(allowed):
    """(L, L) bool -> the (2, 1, L, L) additive 4D mask transformers passes to eager attention untouched."""
    return torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf")).expand(2, 1, *allowed.shape)


def full_mask(length=12):
    return additive(torch.ones(length, length, dtype=torch.bool))


def block_causal_mask(block, length=12):
    """The block-causal mask SDAR / LLaDA2 / Fast-dLLM v2 build: tril(ones(nb, nb)).repeat_interleave(block)."""
    blocks = -(-length // block)
    allowed = torch.tril(torch.ones(blocks, blocks)).repeat_interleave(block, 0).repeat_interleave(block, 1)
    return additive(allowed[:length, :length].bool())


def write_folder(folder, config, state_dict):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in state_dict.items()}, folder / "model.safetensors")
    return folder


# ---- dense families against transformers' own modules ----

def llada_case():
    from transformers import LlamaConfig, LlamaForCausalLM

    ref = randomize(LlamaForCausalLM(LlamaConfig(
        vocab_size=V, hidden_size=H, intermediate_size=I, num_hidden_layers=L, num_attention_heads=NH,
        num_key_value_heads=NH, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
        attn_implementation="eager")))
    names = {"self_attn.q_proj": "q_proj", "self_attn.k_proj": "k_proj", "self_attn.v_proj": "v_proj",
             "self_attn.o_proj": "attn_out", "mlp.gate_proj": "ff_proj", "mlp.up_proj": "up_proj",
             "mlp.down_proj": "ff_out", "input_layernorm": "attn_norm", "post_attention_layernorm": "ff_norm"}
    sd = {"model.transformer.wte.weight": ref.model.embed_tokens.weight,
          "model.transformer.ln_f.weight": ref.model.norm.weight,
          "model.transformer.ff_out.weight": ref.lm_head.weight}
    for i, layer in enumerate(ref.model.layers):
        for ours, theirs in names.items():
            sd[f"model.transformer.blocks.{i}.{theirs}.weight"] = layer.get_submodule(ours).weight
    config = {"model_type": "llada", "architectures": ["LLaDAModelLM"], "d_model": H, "n_heads": NH, "n_kv_heads": NH,
              "n_layers": L, "mlp_ratio": 4, "mlp_hidden_size": I, "vocab_size": 126, "embedding_size": V,
              "max_sequence_length": 64, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "mask_token_id": 125,
              "eos_token_id": 124, "pad_token_id": 124, "weight_tying": False, "include_bias": False,
              "include_qkv_bias": False, "activation_type": "silu", "block_type": "llama", "layer_norm_type": "rms",
              "alibi": False, "rope": True, "block_group_size": 1, "init_std": 0.02, "use_cache": False,
              "auto_map": {"AutoConfig": "configuration_llada.LLaDAConfig", "AutoModel": "modeling_llada.LLaDAModelLM"}}
    return config, sd, lambda ids: ref(input_ids=ids, attention_mask=full_mask()).logits


def _qwen_config(**extra):
    return {"vocab_size": V, "hidden_size": H, "intermediate_size": I, "num_hidden_layers": L,
            "num_attention_heads": NH, "num_key_value_heads": 2, "hidden_act": "silu", "max_position_embeddings": 64,
            "rms_norm_eps": 1e-6, "initializer_range": 0.02, "use_cache": True, "attention_dropout": 0.0, **extra}


def dream_case():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    ref = randomize(Qwen2ForCausalLM(Qwen2Config(**_qwen_config(rope_theta=1e6, tie_word_embeddings=False),
                                                 attn_implementation="eager")), seed=1)
    config = {"model_type": "Dream", "architectures": ["DreamModel"],
              **_qwen_config(rope_theta=1000000.0, rope_scaling=None, tie_word_embeddings=False),
              "mask_token_id": 126, "pad_token_id": 125, "bos_token_id": 124, "eos_token_id": 125,
              "use_sliding_window": False, "sliding_window": None, "max_window_layers": 2,
              "auto_map": {"AutoConfig": "configuration_dream.DreamConfig", "AutoModel": "modeling_dream.DreamModel"}}
    return config, dict(ref.state_dict()), lambda ids: ref(input_ids=ids, attention_mask=full_mask()).logits


def sdar_case():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    ref = randomize(Qwen3ForCausalLM(Qwen3Config(**_qwen_config(head_dim=16, rope_theta=1e4, tie_word_embeddings=False),
                                                 attn_implementation="eager")), seed=2)
    config = {"model_type": "sdar", "architectures": ["SDARForCausalLM"],
              **_qwen_config(head_dim=16, rope_theta=10000.0, rope_scaling=None, tie_word_embeddings=False),
              "attention_bias": False, "block_size": 4, "use_sliding_window": False, "sliding_window": 4096,
              "max_window_layers": 2, "bos_token_id": 124, "eos_token_id": 125, "mask_token_id": 126,
              "auto_map": {"AutoConfig": "configuration_sdar.SDARConfig", "AutoModel": "modeling_sdar.SDARModel"}}
    return config, dict(ref.state_dict()), lambda ids: ref(input_ids=ids, attention_mask=block_causal_mask(4)).logits


def fast_dllm_case():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    ref = randomize(Qwen2ForCausalLM(Qwen2Config(**_qwen_config(rope_theta=1e6, tie_word_embeddings=True),
                                                 attn_implementation="eager")), seed=3)
    sd = {k: v for k, v in ref.state_dict().items() if k != "lm_head.weight"}  # tied, as the 1.5B checkpoint
    config = {"model_type": "Fast_dLLM_Qwen", "architectures": ["Fast_dLLM_QwenForCausalLM"],
              **_qwen_config(rope_theta=1000000.0, rope_scaling=None, tie_word_embeddings=True), "bd_size": 8,
              "bos_token_id": 124, "eos_token_id": 125, "use_sliding_window": False, "sliding_window": None,
              "max_window_layers": 2, "layer_types": ["full_attention"] * L, "mask_token_id": 126,
              "auto_map": {"AutoConfig": "configuration.Fast_dLLM_QwenConfig",
                           "AutoModelForCausalLM": "modeling.Fast_dLLM_QwenForCausalLM"}}
    return config, sd, lambda ids: ref(input_ids=ids, attention_mask=block_causal_mask(8)).logits


def sdar_moe_case():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    extra = dict(head_dim=16, rope_theta=1e4, tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2,
                 moe_intermediate_size=16, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[0])
    ref = randomize(Qwen3MoeForCausalLM(Qwen3MoeConfig(**_qwen_config(**extra), attn_implementation="eager")), seed=4)
    sd = {}
    for key, value in ref.state_dict().items():  # the Hub layout: one key per expert
        if key.endswith("experts.gate_up_proj"):
            for e in range(4):
                gate, up = value[e].chunk(2, dim=0)
                sd[key.replace("gate_up_proj", f"{e}.gate_proj.weight")] = gate
                sd[key.replace("gate_up_proj", f"{e}.up_proj.weight")] = up
        elif key.endswith("experts.down_proj"):
            for e in range(4):
                sd[key.replace("down_proj", f"{e}.down_proj.weight")] = value[e]
        else:
            sd[key] = value
    config = {"model_type": "sdar_moe", "architectures": ["SDARMoeForCausalLM"],
              **_qwen_config(**{**extra, "rope_theta": 10000.0}), "rope_scaling": None, "attention_bias": False,
              "block_size": 4, "router_aux_loss_coef": 0.001, "output_router_logits": False, "eos_token_id": 125,
              "mask_token_id": 126}
    return config, sd, lambda ids: ref(input_ids=ids, attention_mask=block_causal_mask(4)).logits


# ---- MoE families: attention from the published equations, MoE from them or DeepSeek-V3 ----

def _rms(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _partial_rope(t, theta, rotary):
    """RoPE (rotate_half convention) on the first `rotary` channels of t (B, h, L, hd), positions 0..L-1."""
    inv = 1.0 / theta ** (torch.arange(0, rotary, 2).float() / rotary)
    freqs = torch.arange(t.shape[2]).float()[:, None] * inv
    cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()
    rot, rest = t[..., :rotary], t[..., rotary:]
    x1, x2 = rot[..., : rotary // 2], rot[..., rotary // 2:]
    return torch.cat([rot * cos + torch.cat([-x2, x1], -1) * sin, rest], -1)


def _attention(h, q, k, v, heads, kv_heads, q_norm, k_norm, eps, theta, rotary, mask):
    """q / k / v (B, L, heads * hd): per-head RMSNorm on q and k, partial RoPE, grouped attention under `mask`."""
    B, T, _ = h.shape
    q, k, v = (x.view(B, T, n, -1).transpose(1, 2) for x, n in ((q, heads), (k, kv_heads), (v, kv_heads)))
    q, k = _partial_rope(_rms(q, q_norm, eps), theta, rotary), _partial_rope(_rms(k, k_norm, eps), theta, rotary)
    k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5 + mask
    return (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, -1)


def _swiglu(x, sd, prefix):
    return (torch.nn.functional.silu(x @ sd[prefix + "gate_proj.weight"].T) * (x @ sd[prefix + "up_proj.weight"].T)) \
        @ sd[prefix + "down_proj.weight"].T


def _random_sd(shapes, seed):
    torch.manual_seed(seed)
    return {k: (1 + 0.1 * torch.randn(s)) if "norm" in k else (0.3 if "expert_bias" in k else 0.2) * torch.randn(s)
            for k, s in shapes.items()}


def lladamoe_case():
    """Layer 0 dense, layer 1 MoE (4 experts, top-2, expert bias, one shared expert); q / k / v / o biases,
    per-head QK norm, half the channels rotate."""
    hd, E, EI = H // NH, 4, 16
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,), "lm_head.weight": (V, H)}
    for i in range(L):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                       p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
        for name in "qkvo":
            shapes[p + f"self_attn.{name}_proj.weight"] = (H, H)
            shapes[p + f"self_attn.{name}_proj.bias"] = (H,)
        if i == 0:
            shapes.update({p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H), p + "mlp.down_proj.weight": (H, I)})
        else:
            shapes.update({p + "mlp.gate.weight": (E, H), p + "mlp.expert_bias": (E,)})
            for e in range(E):
                shapes.update({p + f"mlp.experts.{e}.gate_proj.weight": (EI, H), p + f"mlp.experts.{e}.up_proj.weight": (EI, H),
                               p + f"mlp.experts.{e}.down_proj.weight": (H, EI)})
            shapes.update({p + "shared_expert.gate_proj.weight": (EI, H), p + "shared_expert.up_proj.weight": (EI, H),
                           p + "shared_expert.down_proj.weight": (H, EI)})
    sd = _random_sd(shapes, seed=5)

    def reference(ids):
        x = sd["model.embed_tokens.weight"][ids]
        for i in range(L):
            p = f"model.layers.{i}."
            h = _rms(x, sd[p + "input_layernorm.weight"], 1e-5)
            q, k, v = (h @ sd[p + f"self_attn.{n}_proj.weight"].T + sd[p + f"self_attn.{n}_proj.bias"] for n in "qkv")
            att = _attention(h, q, k, v, NH, NH, sd[p + "self_attn.q_norm.weight"], sd[p + "self_attn.k_norm.weight"],
                             1e-5, 10000.0, hd // 2, full_mask()[:1])
            x = x + att @ sd[p + "self_attn.o_proj.weight"].T + sd[p + "self_attn.o_proj.bias"]
            h = _rms(x, sd[p + "post_attention_layernorm.weight"], 1e-5)
            if i == 0:
                x = x + _swiglu(h, sd, p + "mlp.")
                continue
            # softmax probabilities + expert bias choose and weight the experts; no renormalisation
            probs = (h @ sd[p + "mlp.gate.weight"].T).softmax(-1) + sd[p + "mlp.expert_bias"]
            weights, experts = probs.topk(2, dim=-1)
            moe = sum(weights[..., j:j + 1] * torch.stack([_swiglu(h, sd, p + f"mlp.experts.{e}.") for e in range(E)], -2)
                      .gather(-2, experts[..., j:j + 1, None].expand(*experts.shape[:2], 1, H)).squeeze(-2)
                      for j in range(2))
            x = x + moe + _swiglu(h, sd, p + "shared_expert.")
        return _rms(x, sd["model.norm.weight"], 1e-5) @ sd["lm_head.weight"].T

    config = {"model_type": "lladamoe", "architectures": ["LLaDAMoEModelLM"], "vocab_size": V, "hidden_size": H,
              "dense_intermediate_size": I, "expert_intermediate_size": EI, "shared_expert_intermediate_size": EI,
              "num_hidden_layers": L, "num_attention_heads": NH, "num_key_value_heads": NH, "hidden_act": "silu",
              "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
              "rope_scaling": None, "attention_bias": True, "clip_qkv": None, "num_experts": E, "num_experts_per_tok": 2,
              "norm_topk_prob": None, "qk_layernorm": True, "moe_layer_freq": [0, 1],
              "moe_router_enable_expert_bias": True, "moe_router_score_function": "sigmoid",
              "routed_scaling_factor": 1, "router_num_group": None, "router_topk_group": None, "tie_word_embeddings": False,
              "pad_token_id": 124, "eos_token_id": 125, "mask_token_id": 126}
    return config, sd, reference


def llada2_case():
    """Layer 0 dense (first_k_dense_replace=1), layer 1 MoE: 8 experts in 4 groups, top-2 groups, k=3, expert
    bias, routed_scaling_factor 2.5, one shared expert; fused query_key_value with GQA, QK norm, partial RoPE 0.5."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    hd, KV, E, EI = 8, 2, 8, 16
    shapes = {"model.word_embeddings.weight": (V, H), "model.norm.weight": (H,), "lm_head.weight": (V, H)}
    for i in range(L):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                       p + "attention.query_key_value.weight": ((NH + 2 * KV) * hd, H),
                       p + "attention.dense.weight": (H, NH * hd),
                       p + "attention.query_layernorm.weight": (hd,), p + "attention.key_layernorm.weight": (hd,)})
        if i == 0:
            shapes.update({p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H), p + "mlp.down_proj.weight": (H, I)})
        else:
            shapes.update({p + "mlp.gate.weight": (E, H), p + "mlp.gate.expert_bias": (E,),
                           p + "mlp.shared_experts.gate_proj.weight": (EI, H), p + "mlp.shared_experts.up_proj.weight": (EI, H),
                           p + "mlp.shared_experts.down_proj.weight": (H, EI)})
            for e in range(E):
                shapes.update({p + f"mlp.experts.{e}.gate_proj.weight": (EI, H), p + f"mlp.experts.{e}.up_proj.weight": (EI, H),
                               p + f"mlp.experts.{e}.down_proj.weight": (H, EI)})
    sd = _random_sd(shapes, seed=6)
    moe = DeepseekV3MoE(DeepseekV3Config(hidden_size=H, n_routed_experts=E, num_experts_per_tok=3, n_group=4, topk_group=2,
                                         routed_scaling_factor=2.5, norm_topk_prob=True, moe_intermediate_size=EI,
                                         n_shared_experts=1, hidden_act="silu"))
    p = "model.layers.1.mlp."
    with torch.no_grad():
        moe.gate.weight.copy_(sd[p + "gate.weight"])
        moe.gate.e_score_correction_bias.copy_(sd[p + "gate.expert_bias"])
        moe.experts.gate_up_proj.copy_(torch.stack([torch.cat([sd[p + f"experts.{e}.gate_proj.weight"],
                                                                sd[p + f"experts.{e}.up_proj.weight"]]) for e in range(E)]))
        moe.experts.down_proj.copy_(torch.stack([sd[p + f"experts.{e}.down_proj.weight"] for e in range(E)]))
        moe.shared_experts.load_state_dict({k.removeprefix(p + "shared_experts."): v for k, v in sd.items()
                                            if k.startswith(p + "shared_experts.")})

    def reference(ids, block=32):  # LLaDA2's generate: blocks of 32
        x = sd["model.word_embeddings.weight"][ids]
        for i in range(L):
            p = f"model.layers.{i}."
            h = _rms(x, sd[p + "input_layernorm.weight"], 1e-6)
            q, k, v = (h @ sd[p + "attention.query_key_value.weight"].T).split([NH * hd, KV * hd, KV * hd], -1)
            att = _attention(h, q, k, v, NH, KV, sd[p + "attention.query_layernorm.weight"],
                             sd[p + "attention.key_layernorm.weight"], 1e-6, 600000.0, hd // 2, block_causal_mask(block)[:1])
            x = x + att @ sd[p + "attention.dense.weight"].T
            h = _rms(x, sd[p + "post_attention_layernorm.weight"], 1e-6)
            x = x + (_swiglu(h, sd, p + "mlp.") if i == 0 else moe(h))
        return _rms(x, sd["model.norm.weight"], 1e-6) @ sd["lm_head.weight"].T

    config = {"model_type": "llada2_moe", "architectures": ["LLaDA2MoeModelLM"], "vocab_size": V, "hidden_size": H,
              "intermediate_size": I, "moe_intermediate_size": EI, "num_hidden_layers": L, "num_attention_heads": NH,
              "num_key_value_heads": KV, "head_dim": hd, "hidden_act": "silu", "use_qkv_bias": False, "use_bias": False,
              "use_qk_norm": True, "rms_norm_eps": 1e-6, "norm_head": False, "tie_word_embeddings": False,
              "max_position_embeddings": 64, "rope_theta": 600000, "partial_rotary_factor": 0.5, "rope_scaling": None,
              "num_experts": E, "num_shared_experts": 1, "num_experts_per_tok": 3, "n_group": 4, "topk_group": 2,
              "routed_scaling_factor": 2.5, "first_k_dense_replace": 1, "norm_topk_prob": True,
              "score_function": "sigmoid", "output_router_logits": False, "pad_token_id": 124, "mask_token_id": 126,
              "auto_map": {"AutoConfig": "configuration_llada2_moe.LLaDA2MoeConfig",
                           "AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM"}}
    return config, sd, reference


def llada21_case():
    config, sd, reference = llada2_case()
    return {**config, "model_type": "llada21_moe"}, sd, reference


CASES = {"llada": llada_case, "Dream": dream_case, "sdar": sdar_case, "Fast_dLLM_Qwen": fast_dllm_case,
         "sdar_moe": sdar_moe_case, "lladamoe": lladamoe_case, "llada2_moe": llada2_case, "llada21_moe": llada21_case}
LAYOUTS = {"llada": ("bidirectional", "same"), "Dream": ("bidirectional", "shift"), "sdar": ("block", "same"),
           "Fast_dLLM_Qwen": ("block", "shift"), "sdar_moe": ("block", "same"), "lladamoe": ("bidirectional", "same"),
           "llada2_moe": ("block", "same"), "llada21_moe": ("block", "same")}


@pytest.fixture(scope="module", params=list(CASES))
def family_case(request, tmp_path_factory):
    config, sd, reference = CASES[request.param]()
    folder = write_folder(tmp_path_factory.mktemp(request.param) / "published", config, sd)
    return request.param, config, sd, reference, folder


def test_every_family_is_covered():
    assert set(CASES) == set(FAMILIES)


def test_published_folder_loads_natively_with_the_reference_logits(family_case):
    name, config, _, reference, folder = family_case
    assert AutoConfig.from_pretrained(folder).model_type == name  # the registered type wins over auto_map
    model = AutoModelForMaskedLM.from_pretrained(folder, attn_implementation="eager").eval()
    assert type(model) is FAMILIES[name].lm_class and model.dtype == torch.float32
    assert (model.config.attention_mode, model.config.label_alignment) == LAYOUTS[name]
    with torch.no_grad():
        expected = reference(IDS)
        torch.testing.assert_close(model(input_ids=IDS).logits, expected, atol=1e-5, rtol=0)


def test_save_round_trip_keeps_the_published_layout(family_case, tmp_path):
    name, config, sd, _, folder = family_case
    model = AutoModelForMaskedLM.from_pretrained(folder, attn_implementation="eager").eval()
    model.save_pretrained(tmp_path / "saved")
    saved_sd = load_file(tmp_path / "saved" / "model.safetensors")
    assert set(saved_sd) == set(sd)
    for key, tensor in sd.items():
        assert torch.equal(saved_sd[key], tensor.contiguous()), key
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    for key, value in config.items():
        if key not in BOOKKEEPING_KEYS:
            assert key in saved and saved[key] == value, (key, saved.get(key), value)
    assert saved["model_type"] == name and saved["architectures"] == config["architectures"]
    assert not (tmp_path / "saved" / "modeling_dlm.py").exists()  # the family's own layout, no hf-dlm remote code
    reloaded = AutoModelForMaskedLM.from_pretrained(tmp_path / "saved", attn_implementation="eager").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=IDS).logits, model(input_ids=IDS).logits, atol=0, rtol=0)


# ---- training and LoRA on every family ----

def _training_args(output_dir, **overrides):
    from hf_dlm import DLMTrainingArguments

    options = dict(output_dir=str(output_dir), use_cpu=True, report_to="none", disable_tqdm=True, seed=0,
                   per_device_train_batch_size=4, per_device_eval_batch_size=8, learning_rate=1e-2,
                   lr_scheduler_type="constant", logging_steps=1, save_strategy="no", max_steps=8,
                   dataloader_num_workers=0)
    return DLMTrainingArguments(**{**options, **overrides})


def _pattern_windows(n=16, length=16):
    """Windows of one repeated 4-token pattern at shifting phases: learnable within a few steps."""
    from hf_dlm.data.memory_dataset import TokenWindowDataset

    pattern = torch.tensor([3, 17, 42, 99])
    rows = torch.stack([pattern.roll(i % 4).repeat(length // 4) for i in range(n)])
    return TokenWindowDataset(rows)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_dlm_trainer_steps_lower_the_loss(family_case, tmp_path, lora):
    """A few DLMTrainer steps (the family's objective: two-stream block diffusion for the block families, the
    shift where the family shifts) lower the held-out diffusion loss; with LoRA (hf-dlm's default targets) only
    the adapters move."""
    from hf_dlm import DLMTrainer
    from hf_dlm.training.lora import register_peft_defaults

    name, _, _, _, folder = family_case
    model = AutoModelForMaskedLM.from_pretrained(folder, attn_implementation="eager").train()
    if lora:
        import peft

        register_peft_defaults()
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8))  # peft's default targets for the type
        frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
        assert any("self_attn.q_proj.lora_A" in n for n, _ in model.named_parameters())
    trainer = DLMTrainer(model=model, args=_training_args(tmp_path, learning_rate=3e-2 if lora else 1e-2),
                         train_dataset=_pattern_windows(), eval_dataset=_pattern_windows(8))
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    after = trainer.evaluate()["eval_loss"]
    assert after < 0.8 * before, (name, before, after)
    if lora:
        assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)
        assert all(p.abs().sum() > 0 for n, p in model.named_parameters() if "lora_B" in n)


def test_auto_model_loads_the_base_model(family_case):
    """AutoModel (the family's base model) reads the same published folder: the LM's final hidden states."""
    from transformers import AutoModel

    name, _, _, _, folder = family_case
    lm = AutoModelForMaskedLM.from_pretrained(folder, attn_implementation="eager").eval()
    base = AutoModel.from_pretrained(folder, attn_implementation="eager").eval()
    assert type(base) is FAMILIES[name].base_class
    with torch.no_grad():
        torch.testing.assert_close(base(input_ids=IDS).last_hidden_state, lm.model(input_ids=IDS).last_hidden_state,
                                   atol=0, rtol=0)


# config.json of the released checkpoints as published (LLaDA-8B-Instruct, LLaDA2.0-mini, Dream-v0-Instruct-7B)
FULL_CONFIGS = {
    "llada": {"activation_type": "silu", "alibi": False, "alibi_bias_max": 8.0, "architectures": ["LLaDAModelLM"],
              "attention_dropout": 0.0, "attention_layer_norm": False, "attention_layer_norm_with_affine": True,
              "bias_for_layer_norm": False, "block_group_size": 1, "block_type": "llama", "d_model": 4096,
              "embedding_dropout": 0.0, "embedding_size": 126464, "eos_token_id": 126081, "flash_attention": False,
              "include_bias": False, "include_qkv_bias": False, "init_cutoff_factor": None, "init_device": "meta",
              "init_fn": "mitchell", "init_std": 0.02, "input_emb_norm": False, "layer_norm_type": "rms",
              "layer_norm_with_affine": True, "mask_token_id": 126336, "max_sequence_length": 4096,
              "mlp_hidden_size": 12288, "mlp_ratio": 4, "model_type": "llada", "multi_query_attention": None,
              "n_heads": 32, "n_kv_heads": 32, "n_layers": 32, "pad_token_id": 126081, "precision": "amp_bf16",
              "residual_dropout": 0.0, "rms_norm_eps": 1e-05, "rope": True, "rope_full_precision": True,
              "rope_theta": 500000.0, "scale_logits": False, "use_cache": False, "vocab_size": 126464,
              "weight_tying": False},
    "llada2_moe": {"architectures": ["LLaDA2MoeModelLM"], "first_k_dense_replace": 1, "head_dim": 128,
                   "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 5120,
                   "max_position_embeddings": 32768, "model_type": "llada2_moe", "moe_intermediate_size": 512,
                   "moe_router_enable_expert_bias": True, "n_group": 8, "use_qk_norm": True, "use_qkv_bias": False,
                   "use_bias": False, "norm_topk_prob": True, "num_attention_heads": 16, "num_experts": 256,
                   "num_experts_per_tok": 8, "num_hidden_layers": 20, "num_key_value_heads": 4, "num_shared_experts": 1,
                   "output_router_logits": False, "pad_token_id": 156892, "partial_rotary_factor": 0.5,
                   "rms_norm_eps": 1e-06, "rope_theta": 600000, "routed_scaling_factor": 2.5, "score_function": "sigmoid",
                   "tie_word_embeddings": False, "topk_group": 4, "vocab_size": 157184, "router_dtype": "fp32",
                   "rope_scaling": None, "use_sliding_window": False, "embedding_dropout": 0.0, "norm_head": False},
    "Dream": {"architectures": ["DreamModel"], "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151643,
              "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 18944,
              "mask_token_id": 151666, "max_position_embeddings": 131072, "max_window_layers": 28, "model_type": "Dream",
              "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4, "pad_token_id": 151643,
              "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "sliding_window": 131072,
              "tie_word_embeddings": False, "use_cache": True, "use_sliding_window": False, "vocab_size": 152064},
}


@pytest.mark.parametrize("name", list(FULL_CONFIGS))
def test_released_configs_read_and_write_back(name, tmp_path):
    """The released config.json files (every key, as published) read into the DLM fields and write back as read."""
    published = FULL_CONFIGS[name]
    (tmp_path / "config.json").write_text(json.dumps(published))
    config = AutoConfig.from_pretrained(tmp_path)
    expected = {"llada": (4096, 126464, 12288, 126336), "llada2_moe": (2048, 157184, 5120, 156895),
                "Dream": (3584, 152064, 18944, 151666)}[name]
    assert (config.hidden_size, config.vocab_size, config.intermediate_size, config.mask_token_id) == expected
    config.save_pretrained(tmp_path / "out")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert {k: written.get(k, "missing") for k in published} == published
