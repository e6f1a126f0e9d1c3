"""Conversion into hf-dlm: AR families against transformers' own models, LLaDA / Dream key maps on
synthetic checkpoints with the real key names, Megatron round trip, asserted verification."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from hf_dlm import DLMForDiffusionLM
from hf_dlm.cli import main as cli_main
from hf_dlm.conversion.convert import ConversionOptions, convert_checkpoint, load_as_dlm
from hf_dlm.conversion.megatron import dlm_to_megatron, load_megatron_checkpoint
from tests.utils import AR_SHAPE as SHAPE
from tests.utils import ar_families, randomize, save_ar_checkpoint, tiny_model

FAMILIES = ar_families()

def bidirectional_mask(batch, length):
    """An all-visible additive 4D mask: transformers passes a 4D mask through untouched, so the eager
    AR model attends everywhere: the source run as a bidirectional baseline."""
    return torch.zeros(batch, 1, length, length)


def assert_matches_source_bidirectionally(dlm, source):
    """The converted model's logits equal the transformers source run with an all-visible mask (fp32, 1e-5)."""
    ids = torch.randint(0, 99, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = source(input_ids=ids, attention_mask=bidirectional_mask(2, 10)).logits
        torch.testing.assert_close(dlm(input_ids=ids).logits, expected, atol=1e-5, rtol=0)


@pytest.fixture(scope="module", params=list(FAMILIES))
def ar_checkpoint(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    return request.param, save_ar_checkpoint(request.param, folder), folder


def test_ar_family_matches_source_causal_and_bidirectional(ar_checkpoint, tmp_path):
    family, source, folder = ar_checkpoint
    ids = torch.randint(0, 98, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref_causal = source(input_ids=ids).logits
        ref_bidirectional = source(input_ids=ids, attention_mask=bidirectional_mask(2, 12)).logits
    assert (ref_causal - ref_bidirectional).abs().max() > 1e-3  # the two modes really differ

    convert_checkpoint(family, folder, tmp_path / "dlm", ConversionOptions(mask_token_id=98))
    dlm = DLMForDiffusionLM.from_pretrained(tmp_path / "dlm", attn_implementation="eager").eval()
    assert dlm.config.attention_mode == "bidirectional" and dlm.config.label_alignment == "shift"
    assert dlm.config.rope_parameters == source.config.rope_parameters
    assert dlm.config.rms_norm_eps == source.config.rms_norm_eps
    assert dlm.config.tie_word_embeddings == source.config.tie_word_embeddings
    with torch.no_grad():
        torch.testing.assert_close(dlm(input_ids=ids).logits, ref_bidirectional, atol=1e-5, rtol=0)

    causal = load_as_dlm(family, folder, ConversionOptions(mask_token_id=98, attention_mode="causal"))[0]
    causal.config._attn_implementation = "eager"
    with torch.no_grad():
        torch.testing.assert_close(causal(input_ids=ids).logits, ref_causal, atol=1e-5, rtol=0)


def _word_tokenizer(size):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(size)}
    backend = Tokenizer(WordLevel(vocab, unk_token="w0"))
    backend.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0", eos_token="w1")


@pytest.mark.parametrize("tokenizer_size,tied", [(90, False), (99, False), (99, True)])
def test_adaptation_adds_mask_token_with_mean_embedding(tmp_path, tokenizer_size, tied):
    from transformers import AutoTokenizer

    config = Qwen3Config(**SHAPE, head_dim=16, tie_word_embeddings=tied)
    config._attn_implementation = "eager"
    source = randomize(Qwen3ForCausalLM(config))
    source.save_pretrained(tmp_path / "src")
    _word_tokenizer(tokenizer_size).save_pretrained(tmp_path / "src")

    convert_checkpoint("qwen3", tmp_path / "src", tmp_path / "dst")
    dlm = DLMForDiffusionLM.from_pretrained(tmp_path / "dst", attn_implementation="eager").eval()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "dst")
    mask_id = tokenizer.mask_token_id
    assert mask_id == tokenizer_size == dlm.config.mask_token_id
    assert dlm.config.vocab_size == max(99, tokenizer_size + 1)
    old_embed = source.model.embed_tokens.weight
    new_embed = dlm.model.embed_tokens.weight
    torch.testing.assert_close(new_embed[mask_id], old_embed[:tokenizer_size].mean(0))
    torch.testing.assert_close(dlm.lm_head.weight[mask_id], source.lm_head.weight[:tokenizer_size].mean(0))
    assert (dlm.lm_head.weight.data_ptr() == new_embed.data_ptr()) == tied
    torch.testing.assert_close(new_embed[:tokenizer_size], old_embed[:tokenizer_size], atol=0, rtol=0)
    # the adapted model still is its source, run causally, on the old vocabulary
    causal = load_as_dlm("qwen3", tmp_path / "src", ConversionOptions(attention_mode="causal"))[0]
    causal.config._attn_implementation = "eager"
    ids = torch.randint(0, tokenizer_size, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(causal(input_ids=ids).logits[..., :tokenizer_size],
                                   source(input_ids=ids).logits[..., :tokenizer_size], atol=1e-5, rtol=0)
    # verify leaves the rewritten [MASK] row out and finds the rest identical
    assert cli_main(["verify", str(tmp_path / "src"), str(tmp_path / "dst")]) == 0
    info = json.loads((tmp_path / "dst" / "hf_dlm_info.json").read_text())
    assert info["conversion"]["source_family"] == "qwen3" and "mean" in info["conversion"]["mask_token"]


def test_tokenizer_mask_token_is_reused_untouched(tmp_path):
    source = save_ar_checkpoint("llama", tmp_path / "src")
    tokenizer = _word_tokenizer(90)
    tokenizer.add_special_tokens({"mask_token": "w7"})
    tokenizer.save_pretrained(tmp_path / "src")
    dlm = load_as_dlm("llama", tmp_path / "src")[0]
    assert (dlm.config.mask_token_id, dlm.config.vocab_size) == (7, 99)
    assert torch.equal(dlm.model.embed_tokens.weight, source.model.embed_tokens.weight)


def test_adaptation_without_tokenizer_appends_a_mask_row(tmp_path):
    source = save_ar_checkpoint("mistral", tmp_path / "src")
    assert cli_main(["convert", "--from", "mistral", str(tmp_path / "src"), str(tmp_path / "dst"),
                     "--attention-mode", "block", "--block-size", "4", "--label-alignment", "same"]) == 0
    dlm = DLMForDiffusionLM.from_pretrained(tmp_path / "dst")
    assert (dlm.config.mask_token_id, dlm.config.vocab_size) == (99, 100)
    assert (dlm.config.attention_mode, dlm.config.block_size, dlm.config.label_alignment) == ("block", 4, "same")
    torch.testing.assert_close(dlm.model.embed_tokens.weight[99], source.model.embed_tokens.weight.mean(0))
    assert torch.equal(dlm.model.embed_tokens.weight[:99], source.model.embed_tokens.weight)


# ---- LLaDA: OLMo-derived names of GSAI-ML/LLaDA-8B modeling_llada.py ----

LLADA_CONFIG = {"model_type": "llada", "architectures": ["LLaDAModelLM"], "d_model": 32, "n_heads": 4, "n_kv_heads": 2,
                "n_layers": 2, "mlp_hidden_size": 48, "vocab_size": 96, "embedding_size": 100, "max_sequence_length": 64,
                "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "weight_tying": False, "include_bias": False,
                "include_qkv_bias": False, "block_type": "llama", "layer_norm_type": "rms", "activation_type": "silu",
                "rope": True, "alibi": False, "attention_layer_norm": False, "scale_logits": False,
                "mask_token_id": 99, "eos_token_id": 1, "pad_token_id": 1, "block_group_size": 1}


def llada_state_dict(seed=0):
    torch.manual_seed(seed)
    d, hd, kv, ffn, rows = 32, 8, 2, 48, 100
    sd = {"model.transformer.wte.weight": torch.randn(rows, d) * 0.5,
          "model.transformer.ln_f.weight": 1 + 0.1 * torch.randn(d),
          "model.transformer.ff_out.weight": torch.randn(rows, d) * 0.2}
    for i in range(2):
        p = f"model.transformer.blocks.{i}."
        sd.update({p + "attn_norm.weight": 1 + 0.1 * torch.randn(d), p + "ff_norm.weight": 1 + 0.1 * torch.randn(d),
                   p + "q_proj.weight": torch.randn(d, d) * 0.2, p + "k_proj.weight": torch.randn(kv * hd, d) * 0.2,
                   p + "v_proj.weight": torch.randn(kv * hd, d) * 0.2, p + "attn_out.weight": torch.randn(d, d) * 0.2,
                   p + "ff_proj.weight": torch.randn(ffn, d) * 0.2, p + "up_proj.weight": torch.randn(ffn, d) * 0.2,
                   p + "ff_out.weight": torch.randn(d, ffn) * 0.2})
    return sd


def llada_reference_logits(sd, ids, heads=4, kv=2, theta=500000.0, eps=1e-5):
    """LLaDA's forward written out from its modeling file: RMSNorm, half-rotation RoPE, non-causal
    attention with repeated kv heads, act(ff_proj(x)) * up_proj(x) -> ff_out, untied head."""
    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rope(t):  # (B, h, L, hd)
        hd = t.shape[-1]
        inv = 1.0 / theta ** (torch.arange(0, hd, 2).float() / hd)
        freqs = torch.arange(t.shape[2]).float()[:, None] * inv
        pos = torch.cat([freqs, freqs], -1)
        x1, x2 = t[..., : hd // 2], t[..., hd // 2 :]
        return t * pos.cos() + torch.cat([-x2, x1], -1) * pos.sin()

    x = sd["model.transformer.wte.weight"][ids]
    B, L, d = x.shape
    for i in range(2):
        p = f"model.transformer.blocks.{i}."
        h = rms(x, sd[p + "attn_norm.weight"])
        q = (h @ sd[p + "q_proj.weight"].T).view(B, L, heads, -1).transpose(1, 2)
        k = (h @ sd[p + "k_proj.weight"].T).view(B, L, kv, -1).transpose(1, 2)
        v = (h @ sd[p + "v_proj.weight"].T).view(B, L, kv, -1).transpose(1, 2)
        q, k = rope(q), rope(k)
        k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
        att = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=False)
        x = x + att.transpose(1, 2).reshape(B, L, d) @ sd[p + "attn_out.weight"].T
        h = rms(x, sd[p + "ff_norm.weight"])
        x = x + (torch.nn.functional.silu(h @ sd[p + "ff_proj.weight"].T) * (h @ sd[p + "up_proj.weight"].T)) @ sd[p + "ff_out.weight"].T
    return rms(x, sd["model.transformer.ln_f.weight"]) @ sd["model.transformer.ff_out.weight"].T


def test_llada_key_map_on_synthetic_checkpoint(tmp_path):
    sd = llada_state_dict()
    (tmp_path / "llada").mkdir()
    save_file(sd, tmp_path / "llada" / "model.safetensors")
    (tmp_path / "llada" / "config.json").write_text(json.dumps(LLADA_CONFIG))
    convert_checkpoint("llada", tmp_path / "llada", tmp_path / "dlm")
    dlm = DLMForDiffusionLM.from_pretrained(tmp_path / "dlm", attn_implementation="eager").eval()
    assert (dlm.config.mask_token_id, dlm.config.vocab_size, dlm.config.label_alignment) == (99, 100, "same")
    assert dlm.config.attention_mode == "bidirectional" and not dlm.config.tie_word_embeddings
    ids = torch.randint(0, 100, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(dlm(input_ids=ids).logits, llada_reference_logits(sd, ids), atol=1e-5, rtol=1e-5)


def test_llada_rejects_unsupported_variant(tmp_path):
    (tmp_path / "llada").mkdir()
    save_file(llada_state_dict(), tmp_path / "llada" / "model.safetensors")
    (tmp_path / "llada" / "config.json").write_text(json.dumps({**LLADA_CONFIG, "scale_logits": True}))
    with pytest.raises(ValueError, match="scale_logits"):
        convert_checkpoint("llada", tmp_path / "llada", tmp_path / "dlm")
    assert not (tmp_path / "dlm").exists()


def test_dream_key_map_on_synthetic_checkpoint(tmp_path):
    """Dream = the Qwen2 layout (q / k / v bias) run bidirectionally with shifted logits; the reference is
    transformers' Qwen2 holding the same tensors, run with an all-visible mask."""
    qwen2 = randomize(Qwen2ForCausalLM(Qwen2Config(**SHAPE, tie_word_embeddings=False)), seed=3)
    qwen2.config._attn_implementation = "eager"
    sd = {k: v.contiguous() for k, v in qwen2.state_dict().items()}
    assert "model.layers.0.self_attn.q_proj.bias" in sd and "model.layers.0.self_attn.o_proj.bias" not in sd
    (tmp_path / "dream").mkdir()
    save_file(sd, tmp_path / "dream" / "model.safetensors")
    dream_config = {"model_type": "Dream", "architectures": ["DreamModel"], **SHAPE, "hidden_act": "silu",
                    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_scaling": None, "tie_word_embeddings": False,
                    "mask_token_id": 97, "pad_token_id": 96, "use_sliding_window": False,
                    "auto_map": {"AutoConfig": "configuration_dream.DreamConfig", "AutoModel": "modeling_dream.DreamModel"}}
    (tmp_path / "dream" / "config.json").write_text(json.dumps(dream_config))
    qwen2.config.rope_parameters = {"rope_type": "default", "rope_theta": 1000000.0}
    qwen2.model.rotary_emb = type(qwen2.model.rotary_emb)(qwen2.config)
    convert_checkpoint("dream", tmp_path / "dream", tmp_path / "dlm")
    dlm = DLMForDiffusionLM.from_pretrained(tmp_path / "dlm", attn_implementation="eager").eval()
    assert (dlm.config.mask_token_id, dlm.config.label_alignment, dlm.config.qkv_bias) == (97, "shift", True)
    assert_matches_source_bidirectionally(dlm, qwen2)


def test_megadlms_hf_folder(tmp_path):
    """MegaDLMs' HF-side DiffLM: Qwen3 names, `attn_mask_type`; the reference is transformers' Qwen3."""
    qwen3 = randomize(Qwen3ForCausalLM(Qwen3Config(**SHAPE, head_dim=16)), seed=5)
    qwen3.config._attn_implementation = "eager"
    (tmp_path / "mega_hf").mkdir()
    save_file({k: v.contiguous() for k, v in qwen3.state_dict().items()}, tmp_path / "mega_hf" / "model.safetensors")
    config = {"architectures": ["DLMForCausalLM"], **SHAPE, "head_dim": 16, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "rope_scaling": None, "attn_mask_type": "bidirectional", "mask_token_id": 97, "tie_word_embeddings": False}
    (tmp_path / "mega_hf" / "config.json").write_text(json.dumps(config))
    model = load_as_dlm("megadlms", tmp_path / "mega_hf")[0]
    model.config._attn_implementation = "eager"
    assert (model.config.mask_token_id, model.config.attention_mode, model.config.qk_norm) == (97, "bidirectional", True)
    assert_matches_source_bidirectionally(model, qwen3)


def test_unknown_source_key_is_an_error_naming_it(tmp_path):
    sd = llada_state_dict()
    sd["model.transformer.blocks.0.mystery.weight"] = torch.zeros(2)
    (tmp_path / "llada").mkdir()
    save_file(sd, tmp_path / "llada" / "model.safetensors")
    (tmp_path / "llada" / "config.json").write_text(json.dumps(LLADA_CONFIG))
    with pytest.raises(KeyError, match="mystery"):
        load_as_dlm("llada", tmp_path / "llada")


# ---- Megatron / MegaDLMs ----

@pytest.mark.parametrize("overrides", [dict(qk_norm=True), dict(qk_norm=False, attention_bias=True, mlp_bias=True,
                                                                   tie_word_embeddings=True, num_key_value_heads=1)])
def test_megatron_round_trip_is_bit_identical(tmp_path, overrides):
    model = randomize(tiny_model(**overrides))
    model.save_pretrained(tmp_path / "dlm")
    assert cli_main(["convert", "--to", "megatron", str(tmp_path / "dlm"), str(tmp_path / "mega")]) == 0
    assert cli_main(["convert", "--from", "megatron", str(tmp_path / "mega"), str(tmp_path / "back")]) == 0
    back = DLMForDiffusionLM.from_pretrained(tmp_path / "back")
    original, restored = model.state_dict(), back.state_dict()
    assert original.keys() == restored.keys()
    for key in original:
        assert torch.equal(original[key], restored[key]), key
    ignore = {"architectures": None, "auto_map": None}  # written by save_pretrained, not part of the architecture
    assert back.config.to_diff_dict() | ignore == model.config.to_diff_dict() | ignore


def test_megatron_layout_groups_qkv_per_query_group():
    model = randomize(tiny_model(qkv_bias=True))  # 4 heads, 2 groups, head_dim 8
    sd, config = model.state_dict(), model.config
    mega = dlm_to_megatron(sd, config)
    hd, per_group = 8, 2
    attn = "model.layers.1.self_attn."
    fused = mega["decoder.layers.1.self_attention.linear_qkv.weight"]
    assert fused.shape == ((4 + 2 * 2) * hd, 32)
    for g in range(2):
        block = fused[g * (per_group + 2) * hd : (g + 1) * (per_group + 2) * hd]
        assert torch.equal(block[: per_group * hd], sd[attn + "q_proj.weight"][g * per_group * hd : (g + 1) * per_group * hd])
        assert torch.equal(block[per_group * hd : (per_group + 1) * hd], sd[attn + "k_proj.weight"][g * hd : (g + 1) * hd])
        assert torch.equal(block[(per_group + 1) * hd :], sd[attn + "v_proj.weight"][g * hd : (g + 1) * hd])
    assert mega["decoder.layers.1.self_attention.linear_qkv.bias"].shape == ((4 + 2 * 2) * hd,)
    fc1 = mega["decoder.layers.1.mlp.linear_fc1.weight"]
    assert torch.equal(fc1, torch.cat([sd["model.layers.1.mlp.gate_proj.weight"], sd["model.layers.1.mlp.up_proj.weight"]]))
    assert torch.equal(mega["decoder.layers.1.self_attention.linear_qkv.layer_norm_weight"], sd["model.layers.1.input_layernorm.weight"])
    assert torch.equal(mega["decoder.layers.1.mlp.linear_fc1.layer_norm_weight"], sd["model.layers.1.post_attention_layernorm.weight"])
    assert torch.equal(mega["decoder.layers.1.self_attention.q_layernorm.weight"], sd[attn + "q_norm.weight"])


def test_foreign_megatron_args_are_read(tmp_path):
    """A checkpoint whose args are Megatron-LM's own (no hf-dlm config inside) converts from its args."""
    model = randomize(tiny_model(qk_norm=True))
    from hf_dlm.conversion.megatron import save_megatron_checkpoint

    path = save_megatron_checkpoint(model, tmp_path / "mega")
    checkpoint = torch.load(path, weights_only=False)
    delattr(checkpoint["args"], "hf_dlm_config")
    # Megatron's local (non-TE) layer spec names the norms apart; TE adds `_extra_state` entries
    renamed = {"decoder.layers.0.self_attention.linear_qkv._extra_state": None}  # first, where dtype was once read
    for key, tensor in checkpoint["model"].items():
        key = key.replace("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight")
        renamed[key.replace("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight")] = tensor
    torch.save({**checkpoint, "model": renamed}, path)
    args, _ = load_megatron_checkpoint(tmp_path / "mega")
    assert args.num_query_groups == 2 and args.qk_layernorm
    back = load_as_dlm("megatron", tmp_path / "mega")[0]
    back.config._attn_implementation = model.config._attn_implementation
    ids = torch.randint(0, 99, (1, 8))
    with torch.no_grad():
        # a wrong mapping (a swapped or missing tensor) moves logits by O(1); a few fp32 ulps are allowed
        # because the converted tensors sit at other alignments, where CPU GEMMs take other SIMD paths
        torch.testing.assert_close(back(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-6, rtol=0)


def test_unknown_target_is_refused_before_loading(tmp_path):
    with pytest.raises(ValueError, match="unknown target"):
        convert_checkpoint("llama", tmp_path / "no-such-source", tmp_path / "out", to="gguf")
    assert not (tmp_path / "out").exists()


def test_megatron_refuses_bias_layouts_it_cannot_hold(tmp_path):
    from hf_dlm.conversion.megatron import megatron_args, save_megatron_checkpoint

    with pytest.raises(ValueError, match="add_bias_linear"):
        save_megatron_checkpoint(tiny_model(attention_bias=True), tmp_path / "mega")
    assert not (tmp_path / "mega").exists()  # refused before anything is written
    both = megatron_args(tiny_model(attention_bias=True, mlp_bias=True).config)
    assert both.add_bias_linear and both.add_qkv_bias
    qkv_only = megatron_args(tiny_model(qkv_bias=True).config)
    assert qkv_only.add_qkv_bias and not qkv_only.add_bias_linear


# ---- verify ----

def test_verify_loader_overrides_the_attention_mode(tmp_path):
    from hf_dlm.conversion.megatron import save_megatron_checkpoint
    from hf_dlm.conversion.verify import load_for_verify

    model = randomize(tiny_model())  # bidirectional
    model.save_pretrained(tmp_path / "dlm")
    save_megatron_checkpoint(model, tmp_path / "mega")
    ids = torch.randint(0, 98, (1, 8))
    changed = ids.clone()
    changed[0, -1] = (changed[0, -1] + 1) % 98
    for folder in ("dlm", "mega"):
        causal, is_dlm = load_for_verify(tmp_path / folder, torch.float32, attention_mode="causal")
        assert is_dlm and causal.config.attention_mode == "causal"
        with torch.no_grad():  # the first position no longer sees the last token
            torch.testing.assert_close(causal(input_ids=ids).logits[0, 0], causal(input_ids=changed).logits[0, 0])
        as_saved = load_for_verify(tmp_path / folder, torch.float32)[0]
        with torch.no_grad():
            assert not torch.equal(as_saved(input_ids=ids).logits[0, 0], as_saved(input_ids=changed).logits[0, 0])


def test_verify_passes_then_fails_on_corrupted_weight(tmp_path, capsys):
    folder = tmp_path / "llama"
    save_ar_checkpoint("llama", folder, max_shard_size="20KB")  # sharded: read through the index
    assert (folder / "model.safetensors.index.json").is_file()
    convert_checkpoint("llama", folder, tmp_path / "dlm", ConversionOptions(mask_token_id=98))
    assert cli_main(["verify", str(folder), str(tmp_path / "dlm")]) == 0
    assert "PASS" in capsys.readouterr().out
    weights = load_file(tmp_path / "dlm" / "model.safetensors")
    weights["model.layers.1.mlp.down_proj.weight"][0, 0] += 0.5
    save_file(weights, tmp_path / "dlm" / "model.safetensors", metadata={"format": "pt"})
    assert cli_main(["verify", str(folder), str(tmp_path / "dlm")]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "max abs" in out and "mean rel" in out
