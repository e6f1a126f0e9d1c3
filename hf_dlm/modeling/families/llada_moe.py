"""inclusionAI's mixture-of-experts DLMs.

LLaDA-MoE (LLaDA-MoE-7B-A1B-Base / -Instruct, `model_type: "lladamoe"`, OLMoE-like, bidirectional, no shift):
- router: softmax in fp32 whatever `moe_router_score_function` says; the optional `mlp.expert_bias` is added to
  the probabilities, which then both choose and weight the experts; the k weights are not renormalised
  (the published block hard-codes `norm_topk_prob = False`) and `routed_scaling_factor` is not applied;
- one ungated shared expert per MoE layer, `model.layers.N.shared_expert.*` (width
  `shared_expert_intermediate_size`); dense layers where `moe_layer_freq[i] == 0` (`dense_intermediate_size`);
- per-head QK RMSNorm (`qk_layernorm`), partial rotary (`partial_rotary_factor`), q / k / v / o bias with
  `attention_bias`.

LLaDA2.x (LLaDA2.0-mini / -flash, `"llada2_moe"`, BailingMoeV2-like, block diffusion):
- fused `attention.query_key_value` (query heads, then key, then value heads), `attention.dense`,
  `query_layernorm` / `key_layernorm`, `model.word_embeddings`;
- `LLaDA2MoeGate`: fp32 sigmoid scores, `expert_bias` for the choice only, group-limited top-k (a group scores
  the sum of its top two), weights = chosen scores renormalised (k > 1) times `routed_scaling_factor`;
- `num_shared_experts` ungated shared experts of `moe_intermediate_size` each; the first `first_k_dense_replace`
  layers dense; partial rotary 0.5;
- its generate decodes blocks of 32 under the block-causal mask `tril(ones(nb, nb)).repeat_interleave(32)`:
  hf-dlm's `attention_mode="block"`, `block_size=32`; [MASK] 156895.
"""

from __future__ import annotations

from transformers.core_model_loading import WeightConverter

from ..modeling_dlm import DLMForDiffusionLM, DLMModel
from .llada import llada_generation_defaults
from .base import FamilyConfig, FamilyModelMixin, SplitFusedQKV, check_field, grouped_experts, renamings

_COMMON = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
           "hidden_act", "max_position_embeddings", "initializer_range", "rms_norm_eps", "use_cache",
           "tie_word_embeddings", "pad_token_id", "bos_token_id", "eos_token_id", "num_experts",
           "num_experts_per_tok", "router_aux_loss_coef", "moe_router_enable_expert_bias", "mask_token_id")


class LLaDAMoEConfig(FamilyConfig):
    model_type = "lladamoe"
    renames = {"dense_intermediate_size": "intermediate_size", "expert_intermediate_size": "moe_intermediate_size",
               "qk_layernorm": "qk_norm"}
    published_fields = (*_COMMON, "attention_bias", "attention_dropout")
    default_mask_token_id = 156895
    rms_norm_eps: float = 1e-5

    def read_published(self, kwargs, published):
        check_field(kwargs.get("clip_qkv") is None, "LLaDA-MoE", "clip_qkv", kwargs.get("clip_qkv"), "is not supported")
        # values the published router reads differently from their names: kept as written, not applied
        for key in ("norm_topk_prob", "routed_scaling_factor", "moe_router_score_function"):
            published[key] = kwargs.pop(key) if key in kwargs else getattr(self, key, None)
        self.norm_topk_prob, self.routed_scaling_factor, self.moe_router = False, 1.0, "softmax"
        freq = kwargs.pop("moe_layer_freq", None)
        if freq is not None:
            published["moe_layer_freq"] = list(freq)
            self.mlp_only_layers = [i for i, moe in enumerate(freq) if not moe]
        shared = self.shared_expert_intermediate_size  # LLaDA-MoE's shared expert is ungated
        if shared and shared > 0:
            expert = kwargs.get("expert_intermediate_size") or self.moe_intermediate_size
            check_field(shared % expert == 0, "LLaDA-MoE", "shared_expert_intermediate_size", shared,
                        f"must be a multiple of expert_intermediate_size ({expert})")
            self.n_shared_experts = shared // expert
        self.shared_expert_intermediate_size = 0
        return kwargs

    def write_published(self, output):
        published = self.published_values or {}
        output["shared_expert_intermediate_size"] = output.pop("n_shared_experts", 0) * output["moe_intermediate_size"]
        for key in ("norm_topk_prob", "routed_scaling_factor", "moe_router", "mlp_only_layers"):
            output.pop(key, None)
        if "moe_layer_freq" not in published:
            output["moe_layer_freq"] = [int(i not in self.mlp_only_layers) for i in range(self.num_hidden_layers)]


class LLaDA2MoeConfig(FamilyConfig):
    model_type = "llada2_moe"
    renames = {"num_shared_experts": "n_shared_experts", "use_qkv_bias": "qkv_bias", "use_qk_norm": "qk_norm"}
    published_fields = (*_COMMON, "intermediate_size", "moe_intermediate_size", "head_dim", "n_group", "topk_group",
                        "routed_scaling_factor", "norm_topk_prob", "attention_dropout")
    default_mask_token_id = 156895
    moe_router: str = "sigmoid"
    moe_router_enable_expert_bias: bool = True  # `mlp.gate.expert_bias` exists in every LLaDA2 layer
    norm_topk_prob: bool = True
    qk_norm: bool = True
    attention_mode: str = "block"
    block_size: int | None = 32
    rms_norm_eps: float = 1e-5

    def read_published(self, kwargs, published):
        score = kwargs.pop("score_function", "sigmoid")
        published["score_function"] = score
        check_field(score == "sigmoid", "LLaDA2", "score_function", score, "is not supported (only 'sigmoid')")
        # `use_bias` puts a bias on `attention.dense` alone; hf-dlm has one only with the q / k / v biases. The
        # released configs write use_bias false; an absent one is read as equal to use_qkv_bias (the published
        # class defaults to True, which no released checkpoint uses)
        qkv_bias = kwargs.get("use_qkv_bias", False)
        use_bias = kwargs.pop("use_bias", bool(qkv_bias))
        published["use_bias"] = use_bias
        check_field(bool(use_bias) == bool(qkv_bias), "LLaDA2", "use_bias", use_bias,
                    f"must equal use_qkv_bias ({qkv_bias}): an output-projection bias alone is not supported")
        self.attention_bias = bool(use_bias)
        dense = kwargs.pop("first_k_dense_replace", 0)
        published["first_k_dense_replace"] = dense
        self.mlp_only_layers = list(range(dense))
        check_field(self.num_experts_per_tok > 1, "LLaDA2", "num_experts_per_tok", self.num_experts_per_tok,
                    "= 1 is not supported (the published gate then skips the renormalisation)")
        return kwargs

    def write_published(self, output):
        for key in ("attention_bias", "moe_router", "mlp_only_layers"):
            output.pop(key, None)
        output["first_k_dense_replace"] = len(self.mlp_only_layers)
        output["use_bias"] = self.attention_bias


class LLaDAMoEModel(FamilyModelMixin, DLMModel):
    config_class = LLaDAMoEConfig


class LLaDAMoEModelLM(FamilyModelMixin, DLMForDiffusionLM):
    config_class = LLaDAMoEConfig
    generation_defaults = llada_generation_defaults  # LLaDA-MoE ships LLaDA's sampler


class LLaDA2MoeModel(FamilyModelMixin, DLMModel):
    config_class = LLaDA2MoeConfig


def block_threshold_defaults(threshold: float):
    """Block diffusion as LLaDA2's `generate` (threshold 0.95) and SDAR's `low_confidence_dynamic` (0.85) run it:
    blocks of the model's block size aligned to the positions (the prompt's partial block is decoded first), each
    step commits the block's masks above the threshold (at least the most confident one), earlier blocks from the
    exact block cache, greedy."""
    return lambda config: {"block_length": config.block_size, "threshold": threshold, "cache": "prefix",
                           "remasking": "low_confidence", "align_blocks": True, "do_sample": False}


class LLaDA2MoeModelLM(FamilyModelMixin, DLMForDiffusionLM):
    config_class = LLaDA2MoeConfig
    generation_defaults = block_threshold_defaults(0.95)


class LLaDA21MoeConfig(LLaDA2MoeConfig):
    """LLaDA2.1 as some copies publish it (`model_type: "llada21_moe"`): LLaDA2's architecture and keys."""

    model_type = "llada21_moe"


class LLaDA21MoeModel(FamilyModelMixin, DLMModel):
    config_class = LLaDA21MoeConfig


class LLaDA21MoeModelLM(LLaDA2MoeModelLM):
    config_class = LLaDA21MoeConfig


# those copies keep LLaDA2's class name: saved configs then name the same `architectures`
LLaDA21MoeModelLM.__name__ = "LLaDA2MoeModelLM"


def lladamoe_keys():
    return [*renamings([(r"\.shared_expert\.", ".mlp.shared_experts.")]), *grouped_experts()]


def llada2_keys():
    # the converter names the published key itself (no renaming acts on it): transformers 5.17 re-prefixes a
    # reversed converter's output only when its pattern appears in the final key
    fused = [WeightConverter(f"attention.query_key_value.{kind}",
                             [f"self_attn.q_proj.{kind}", f"self_attn.k_proj.{kind}", f"self_attn.v_proj.{kind}"],
                             operations=[SplitFusedQKV(dim=0)]) for kind in ("weight", "bias")]
    return [
        *renamings([
            (r"^model\.word_embeddings\.", "model.embed_tokens."),
            (r"\.attention\.dense\.", ".self_attn.o_proj."),
            (r"\.attention\.query_layernorm\.", ".self_attn.q_norm."),
            (r"\.attention\.key_layernorm\.", ".self_attn.k_norm."),
            (r"\.mlp\.gate\.expert_bias", ".mlp.expert_bias"),
        ]),
        *fused,
        *grouped_experts(),
    ]
