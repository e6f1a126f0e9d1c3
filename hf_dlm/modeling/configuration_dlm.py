"""Configuration of the DLM model family (Llama / Qwen3 architecture, diffusion knobs on top)."""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig
from transformers.modeling_rope_utils import RopeParameters

from ..utils.errors import FieldError

MOE_IMPLEMENTATIONS = ("auto", "grouped_mm", "loop")
MOE_ROUTERS = ("softmax", "sigmoid", "expert_choice")
EXPERT_CHOICE_LEVELS = ("batch", "sequence")
ATTENTION_MODES = ("bidirectional", "causal", "block")
LABEL_ALIGNMENTS = ("same", "shift")
SDPA_BACKENDS = ("cudnn", "flash", "efficient", "math")


@strict
class DLMConfig(PreTrainedConfig):
    r"""
    Configuration of a diffusion language model of the Llama / Qwen3 family.

    Architecture fields follow `Qwen3Config` / `LlamaConfig` (same names, same meaning), so AR
    checkpoints convert key by key. The diffusion fields:

    - `mask_token_id`: id of the `[MASK]` token the forward process writes.
    - `attention_mode`: `"bidirectional"` (a masked-diffusion LM), `"causal"` (an AR LM, as MegaDLMs
      also trains) or `"block"` (block diffusion: a token sees its own block and earlier blocks).
    - `block_size`: block length of `"block"` mode.
    - `label_alignment`: `"same"` (the logits at position i predict token i: LLaDA, MDLM, MegaDLMs) or
      `"shift"` (the logits at i-1 predict token i: Dream, adapted AR checkpoints).
    - `qk_norm`: per-head RMSNorm on queries and keys (Qwen3); `qkv_bias`: bias on q/k/v only
      (Qwen2 / Dream); `attention_bias`: bias on q/k/v/o (Llama's flag).
    - `sdpa_backends`: priority order of PyTorch SDPA backends on CUDA. cuDNN first: on an H200 its
      non-causal fwd+bwd ran at 564 TFLOP/s against 299 for flash (head dim 128, seq 4096).
    - `loss_chunk_size`: number of supervised positions whose full-vocabulary logits exist at once
      in the training forward.

    Mixture of experts (names and meaning of transformers' `Qwen3MoeConfig` / `Qwen2MoeConfig`; the
    default `num_experts=0` is a dense model):

    - `num_experts`, `num_experts_per_tok` (top-k token-choice routing), `moe_intermediate_size` (each
      expert's SwiGLU width; default `intermediate_size`), `norm_topk_prob` (renormalise the k weights).
    - `decoder_sparse_step`, `mlp_only_layers`: layer i is MoE when `(i + 1) % decoder_sparse_step == 0`
      and i is not in `mlp_only_layers`; other layers keep the dense MLP of `intermediate_size`.
    - Dense first layers (DeepSeek-V3 / LLaDA2 `first_k_dense_replace = n`): `mlp_only_layers = [0, ..., n-1]`.
    - Shared experts, a dense SwiGLU every token runs besides its routed experts (one kind at a time):
      `shared_expert_intermediate_size` (its width; scaled by a sigmoid gate, Qwen2-MoE) or `n_shared_experts`
      (DeepSeek-V3 name, LLaDA2's `num_shared_experts`: width `n_shared_experts * moe_intermediate_size`, no gate;
      MegaDLMs' shared experts). 0 = none.
    - `router_aux_loss_coef`: weight of the load-balancing loss `E * sum_e f_e * P_e` (Switch Transformer
      eq. 4, transformers' `load_balancing_loss_func`: f_e = top-k assignments to e / tokens, P_e = mean
      router probability), averaged over MoE layers; `router_z_loss_coef`: weight of the router z-loss
      `mean_tokens(logsumexp(router_logits)^2)` (ST-MoE eq. 5).
    - `moe_router`: how tokens and experts meet.
      - `"softmax"` (token choice, Qwen3-MoE): each token takes its top-k experts by softmax probability.
      - `"sigmoid"` (token choice, DeepSeek-V3 / LLaDA2 `BailingMoeV2Gate`): sigmoid scores in fp32, top-k by
        score (plus the expert bias, if any, for the choice only); weights are the chosen scores,
        renormalised with `norm_topk_prob`. Its balance loss reads the scores normalised per token.
      - `"expert_choice"` (MegaDLMs' `ExpertChoiceRouter`, OpenMoE 2): each expert takes its top-capacity tokens.
    - Token-choice options (DeepSeek-V3 names):
      - `n_group`, `topk_group`: group-limited routing: the E experts form `n_group` groups of consecutive
        experts, a group scores the sum of its two best scores, and a token picks its k experts within its
        `topk_group` best groups (1, 1: no limit).
      - `routed_scaling_factor`: the routed experts' weights are multiplied by it (LLaDA2: 2.5).
      - `moe_router_enable_expert_bias` (LLaDA / Megatron name; DeepSeek-V3's `e_score_correction_bias`): a
        per-expert bias buffer `mlp.expert_bias`, kept in fp32. With `"sigmoid"` it is added to the scores for
        the choice only; with `"softmax"` it is added to the probabilities used for choice and weights, as
        LLaDA-MoE's router does (which also leaves its top-k weights unnormalised: `norm_topk_prob=False`).
      - `moe_router_bias_update_rate` (Megatron's name): DeepSeek-V3's auxiliary-loss-free balancing. After
        every optimizer step, `bias_e += rate * sign(mean load - load_e)` over the tokens each expert took
        (`hf_dlm.modeling.moe.update_expert_bias`; DLMTrainer calls it). 0 (default) keeps the bias fixed, as
        a loaded checkpoint's routing policy; DeepSeek-V3 trained with 0.001.
    - Expert choice:
      - `expert_choice_level`: `"sequence"` (MegaDLMs' default: each expert picks within each row, so rows
        stay independent) or `"batch"` (each expert picks among all tokens of the micro-batch: a token's
        output then depends on the other rows, and at inference on what is batched with it).
      - `expert_capacity_factor`: capacity = `max(1, floor(factor * tokens * k / num_experts))` tokens per
        expert (tokens: the row's length, or the micro-batch's tokens at batch level; at most all of
        them); 1.0 is MegaDLMs' capacity (a token gets k experts on average; some get none).
      - `expert_choice_pre_softmax`: False (MegaDLMs' default) ranks tokens by router logit and weights a
        token's experts by the softmax over the logits of the experts that chose it; True ranks by the
        softmax probability over experts and weights by that probability.
      - load balancing (`router_aux_loss_coef`): MegaDLMs' expert-choice loss
        `sum_t (sum_e softmax_tokens(logits)[t, e]) * n_t / (E * k)`, n_t the experts that chose token t
        (1.0 for a uniform router). Padding is never chosen before real tokens and gets no output.
    - `moe_implementation`: `"grouped_mm"` (one `torch.nn.functional.grouped_mm` per projection), `"loop"`
      (one matmul per expert) or `"auto"` (grouped_mm on CUDA where PyTorch has it, else the loop).

    ```python
    >>> from hf_dlm import DLMConfig, DLMForDiffusionLM
    >>> config = DLMConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    ...                    num_attention_heads=4, mask_token_id=999)
    >>> model = DLMForDiffusionLM(config)
    ```
    """

    model_type = "dlm"
    keys_to_ignore_at_inference = ["past_key_values"]

    base_model_tp_plan = {
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
        "layers.*.self_attn.k_norm": "replicated_with_grad_allreduce",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
    }
    base_model_pp_plan = {
        "embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
        "norm": (["hidden_states"], ["hidden_states"]),
    }

    vocab_size: int = 32000
    hidden_size: int = 2048
    intermediate_size: int = 5632
    num_hidden_layers: int = 22
    num_attention_heads: int = 16
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    use_cache: bool = False
    tie_word_embeddings: bool = False
    rope_parameters: RopeParameters | dict | None = None
    attention_bias: bool = False
    qkv_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    attention_dropout: float | int = 0.0
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    mask_token_id: int | None = None
    attention_mode: str = "bidirectional"
    block_size: int | None = None
    label_alignment: str = "same"
    sdpa_backends: list[str] | None = None
    loss_chunk_size: int = 4096
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: int | None = None
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] | None = None
    shared_expert_intermediate_size: int = 0
    n_shared_experts: int = 0
    router_aux_loss_coef: float = 0.01
    router_z_loss_coef: float = 0.0
    moe_implementation: str = "auto"
    moe_router: str = "softmax"
    expert_choice_level: str = "sequence"
    expert_capacity_factor: float = 1.0
    expert_choice_pre_softmax: bool = False
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    moe_router_enable_expert_bias: bool = False
    moe_router_bias_update_rate: float = 0.0

    def __post_init__(self, **kwargs):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"DLMConfig.hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                    f"({self.num_attention_heads}), or set head_dim explicitly"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.sdpa_backends is None:
            self.sdpa_backends = list(SDPA_BACKENDS)
        if self.moe_intermediate_size is None:
            self.moe_intermediate_size = self.intermediate_size
        if self.mlp_only_layers is None:
            self.mlp_only_layers = []
        super().__post_init__(**kwargs)

    def validate_architecture(self):
        """Checks run by `strict` after init and on every `validate()`."""
        super().validate_architecture()
        if self.attention_mode not in ATTENTION_MODES:
            raise ValueError(f"DLMConfig.attention_mode must be one of {ATTENTION_MODES}, got {self.attention_mode!r}")
        if self.label_alignment not in LABEL_ALIGNMENTS:
            raise ValueError(
                f"DLMConfig.label_alignment must be one of {LABEL_ALIGNMENTS}, got {self.label_alignment!r}"
            )
        if self.attention_mode == "block" and (self.block_size is None or self.block_size < 1):
            raise ValueError("DLMConfig.block_size must be a positive integer when attention_mode is 'block'")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"DLMConfig.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        unknown = [b for b in self.sdpa_backends or () if b not in SDPA_BACKENDS]
        if unknown:
            raise ValueError(f"DLMConfig.sdpa_backends has unknown entries {unknown}; choose from {SDPA_BACKENDS}")
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"DLMConfig.mask_token_id ({self.mask_token_id}) must lie in [0, vocab_size={self.vocab_size})"
            )
        if self.loss_chunk_size < 1:
            raise ValueError("DLMConfig.loss_chunk_size must be a positive integer")
        if self.num_experts < 0 or (self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts):
            raise ValueError(
                f"DLMConfig.num_experts_per_tok ({self.num_experts_per_tok}) must lie in [1, num_experts="
                f"{self.num_experts}] (num_experts=0: a dense model)"
            )
        if self.decoder_sparse_step < 1:
            raise ValueError(f"DLMConfig.decoder_sparse_step must be a positive integer, got {self.decoder_sparse_step}")
        if self.moe_implementation not in MOE_IMPLEMENTATIONS:
            raise ValueError(
                f"DLMConfig.moe_implementation must be one of {MOE_IMPLEMENTATIONS}, got {self.moe_implementation!r}"
            )
        self._validate_routing()

    def _validate_routing(self):
        def check(ok: bool, field: str, message: str):
            if not ok:
                raise FieldError(field, f"DLMConfig.{field} {message}", getattr(self, field))

        check(self.moe_router in MOE_ROUTERS, "moe_router", f"must be one of {MOE_ROUTERS}, got {self.moe_router!r}")
        check(self.expert_choice_level in EXPERT_CHOICE_LEVELS, "expert_choice_level",
              f"must be one of {EXPERT_CHOICE_LEVELS}, got {self.expert_choice_level!r}")
        check(self.expert_capacity_factor > 0, "expert_capacity_factor",
              f"must be positive, got {self.expert_capacity_factor}")
        check(self.n_shared_experts >= 0, "n_shared_experts", f"must be >= 0, got {self.n_shared_experts}")
        check(not (self.n_shared_experts and self.shared_expert_intermediate_size), "n_shared_experts",
              "and shared_expert_intermediate_size both ask for a shared expert; set one (ungated or gated)")
        check(self.routed_scaling_factor > 0, "routed_scaling_factor", f"must be positive, got {self.routed_scaling_factor}")
        experts, group = self.num_experts, self.n_group
        check(group >= 1 and experts % group == 0 and (group == 1 or experts // group >= 2), "n_group",
              f"({group}) must divide num_experts ({experts}) into groups of at least 2 experts")
        check(1 <= self.topk_group <= group, "topk_group", f"({self.topk_group}) must lie in [1, n_group={group}]")
        if group > 1:
            check(self.moe_router != "expert_choice", "n_group", "> 1 (group-limited routing) needs token choice")
            check(self.num_experts_per_tok <= self.topk_group * (experts // group), "topk_group",
                  f"({self.topk_group}) groups of {experts // group} experts cannot hold "
                  f"num_experts_per_tok={self.num_experts_per_tok} experts")
        if self.moe_router_enable_expert_bias:
            check(self.moe_router != "expert_choice", "moe_router_enable_expert_bias",
                  "needs token choice (moe_router 'softmax' or 'sigmoid')")
        check(self.moe_router_bias_update_rate >= 0, "moe_router_bias_update_rate",
              f"must be >= 0, got {self.moe_router_bias_update_rate}")
        check(not self.moe_router_bias_update_rate or self.moe_router_enable_expert_bias,
              "moe_router_bias_update_rate", "> 0 needs moe_router_enable_expert_bias=True")

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether decoder layer `layer_idx` holds a sparse MoE block (Qwen3-MoE's rule)."""
        return (self.num_experts > 0 and layer_idx not in self.mlp_only_layers
                and (layer_idx + 1) % self.decoder_sparse_step == 0)


__all__ = ["DLMConfig"]
