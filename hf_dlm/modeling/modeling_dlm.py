"""The DLM model family: a Llama / Qwen3 decoder stack whose attention is bidirectional, causal or
block-causal, with a masked-only training head."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.activations import ACT2FN
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutput
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv
from transformers.utils import ModelOutput

from .configuration_dlm import DLMConfig
from .fused_projections import fuse_projections, has_fused_projections, unfuse_projections
from ..generation.sampler import DLMGenerationMixin
from .loss import masked_lm_loss
from .masks import build_attention_mask
from .moe import DLMExperts, DLMSparseMoeBlock


class DLMRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)

    def extra_repr(self):
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class DLMRotaryEmbedding(nn.Module):
    """RoPE through transformers' rope utilities (default, linear, dynamic, yarn, llama3, ...). With
    `rope_parameters["partial_rotary_factor"]` < 1 (LLaDA-MoE, LLaDA2) only the first
    `int(head_dim * factor)` channels of each head rotate; cos / sin then have that width."""

    def __init__(self, config: DLMConfig):
        super().__init__()
        self.config = config
        self.max_seq_len_cached = config.max_position_embeddings
        self.original_max_seq_len = config.max_position_embeddings
        self.rope_type = config.rope_parameters["rope_type"]
        rope_init_fn: Callable = self.compute_default_rope_parameters
        if self.rope_type != "default":
            rope_init_fn = ROPE_INIT_FUNCTIONS[self.rope_type]
        inv_freq, self.attention_scaling = rope_init_fn(config)
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)
        self.original_inv_freq = nn.Buffer(inv_freq.clone(), persistent=False)

    @staticmethod
    def compute_default_rope_parameters(config: DLMConfig, **kwargs) -> tuple[torch.Tensor, float]:
        base, dim = config.rope_parameters["rope_theta"], rotary_dim(config)
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0

    @torch.no_grad()
    @dynamic_rope_update
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)  # (B, L, d/2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def rotary_dim(config) -> int:
    """Channels of a head that rotate: head_dim, or int(head_dim * partial_rotary_factor)."""
    return int(config.head_dim * config.rope_parameters.get("partial_rotary_factor", 1.0))


def apply_partial_rotary_pos_emb(query, key, cos, sin):
    """RoPE on the first cos.shape[-1] channels of query / key (B, h, L, hd); the rest pass through
    (transformers' GLM / Phi convention, as LLaDA-MoE and LLaDA2 apply it)."""
    width = cos.shape[-1]
    if width == query.shape[-1]:
        return apply_rotary_pos_emb(query, key, cos, sin)
    query_rot, key_rot = apply_rotary_pos_emb(query[..., :width], key[..., :width], cos, sin)
    return torch.cat([query_rot, query[..., width:]], dim=-1), torch.cat([key_rot, key[..., width:]], dim=-1)


class DLMMLP(nn.Module):
    def __init__(self, config: DLMConfig, intermediate_size: int | None = None):
        super().__init__()
        intermediate_size = intermediate_size or config.intermediate_size
        self.gate_proj = nn.Linear(config.hidden_size, intermediate_size, bias=config.mlp_bias)
        self.up_proj = nn.Linear(config.hidden_size, intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = getattr(self, "gate_up_proj", None)  # decoding (fused_projections.py)
        if fused is not None:
            gate, up = fused(x).split(fused.split_sizes, -1)
            return self.down_proj(self.act_fn(gate) * up)
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """The reference attention. query (B, nh, Q, hd), key / value (B, nkv, K, hd), additive mask (B, 1, Q, K)."""
    key, value = repeat_kv(key, module.num_key_value_groups), repeat_kv(value, module.num_key_value_groups)
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        weights = weights + attention_mask
    weights = nn.functional.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


def sdpa_backend_context(backends: list[str], device: torch.device):
    """Prefer SDPA backends in the configured order on CUDA (cuDNN first by default: fastest measured)."""
    if device.type != "cuda" or not backends:
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    names = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
             "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
    return sdpa_kernel([names[b] for b in backends], set_priority=True)


class DLMAttention(nn.Module):
    def __init__(self, config: DLMConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        # sdpa and flash read this when no mask is passed; block mode always passes one
        self.is_causal = config.attention_mode == "causal"
        qkv_bias = config.attention_bias or config.qkv_bias
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(
            config.num_attention_heads * self.head_dim, config.hidden_size, bias=config.attention_bias
        )
        if config.qk_norm:
            self.q_norm = DLMRMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = DLMRMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask=None, kv_cache=None, **kwargs):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        fused = getattr(self, "qkv_proj", None)  # decoding (fused_projections.py)
        if fused is not None:
            query, key, value = fused(hidden_states).split(fused.split_sizes, -1)
        else:
            query, key, value = self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)
        query = query.view(hidden_shape)  # (B, L, nh, hd)
        key = key.view(hidden_shape)  # (B, L, nkv, hd)
        value = value.view(hidden_shape).transpose(1, 2)  # (B, nkv, L, hd)
        if self.config.qk_norm:
            query, key = self.q_norm(query), self.k_norm(key)
        cos, sin = position_embeddings
        query, key = apply_partial_rotary_pos_emb(query.transpose(1, 2), key.transpose(1, 2), cos, sin)
        if kv_cache is not None:  # sampler cache (generation_cache.DLMKVCache): splice in the cached keys
            key, value = kv_cache.update(self.layer_idx, key, value)
            if getattr(kv_cache, "attends", False):  # the engine's ragged rows (generation/slot_cache.py)
                output = kv_cache.attention(self, query, key, value)
                return self.o_proj(output.reshape(*input_shape, -1).contiguous()), None

        implementation = self.config._attn_implementation or "eager"
        if type(attention_mask).__name__ == "BlockMask":  # structured mask on CUDA (masks.document_attention_implementation)
            implementation = "flex_attention"
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)
        context = sdpa_backend_context(self.config.sdpa_backends, query.device) if implementation == "sdpa" else nullcontext()
        with context:
            output, weights = attention(
                self, query, key, value, attention_mask,
                dropout=self.attention_dropout if self.training else 0.0, scaling=self.scaling, **kwargs,
            )
        return self.o_proj(output.reshape(*input_shape, -1).contiguous()), weights


class DLMDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: DLMConfig, layer_idx: int):
        super().__init__()
        self.self_attn = DLMAttention(config, layer_idx)
        if config.is_moe_layer(layer_idx):
            gated_size = config.shared_expert_intermediate_size
            shared_size = config.n_shared_experts * config.moe_intermediate_size
            self.mlp = DLMSparseMoeBlock(config, shared_expert=DLMMLP(config, gated_size) if gated_size else None,
                                         shared_experts=DLMMLP(config, shared_size) if shared_size else None)
        else:
            self.mlp = DLMMLP(config)
        self.input_layernorm = DLMRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = DLMRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, **kwargs) -> torch.Tensor:
        residual = hidden_states
        hidden_states, _ = self.self_attn(
            self.input_layernorm(hidden_states), position_embeddings, attention_mask, **kwargs
        )
        hidden_states = residual + hidden_states
        # a packed input of independent rows (the engine's ragged cache): expert choice routes within each row
        groups = getattr(kwargs.get("kv_cache"), "token_groups", None)
        if groups is not None and isinstance(self.mlp, DLMSparseMoeBlock):
            return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states), token_groups=groups)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


def decoder_layer_inputs(config, rotary_emb, hidden_states, attention_mask=None, position_ids=None, two_stream=False):
    """The attention mask and RoPE (cos, sin) the decoder layers take with `hidden_states` (B, L, H), or
    (B, 2L, H) for two-stream block-diffusion input; attention_mask / position_ids (B, L) as in
    `DLMModel.forward`. Shared by `DLMModel.forward` and the pipeline stages (`hf_dlm.parallel.pipeline`)."""
    batch_size, total_len = hidden_states.shape[:2]
    seq_len = total_len // 2 if two_stream else total_len
    packed = position_ids is not None
    if position_ids is None:
        if attention_mask is not None and attention_mask.dim() == 2:
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        else:
            position_ids = torch.arange(seq_len, device=hidden_states.device).expand(batch_size, -1)
    key_padding, rope_positions = attention_mask, position_ids
    if two_stream:
        rope_positions = torch.cat([position_ids, position_ids], dim=1)
        if attention_mask is not None and attention_mask.dim() == 2:
            key_padding = torch.cat([attention_mask, attention_mask], dim=1)
    mask = build_attention_mask(
        config._attn_implementation or "eager", config.attention_mode, config.block_size, batch_size, total_len,
        total_len, hidden_states.device, hidden_states.dtype, attention_mask=key_padding, position_ids=position_ids,
        packed=packed, two_stream=two_stream, structured_kernel=True,
    )
    return mask, rotary_emb(hidden_states, rope_positions)


def router_token_mask(attention_mask, two_stream: bool = False):
    """The real tokens (B, L), or (B, 2L) for two-stream input, over which the MoE blocks average their router
    losses; None when the mask is not a 2-D padding mask (every token counts)."""
    if attention_mask is None or attention_mask.dim() != 2:
        return None
    return torch.cat([attention_mask, attention_mask], dim=1) if two_stream else attention_mask


class DLMPreTrainedModel(PreTrainedModel):
    config_class = DLMConfig
    config: DLMConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DLMDecoderLayer"]
    _supports_sdpa = True
    _supports_flex_attn = True
    # flash-attn kernels take padding and packing but no block masks; block mode rejects them at forward
    _supports_flash_attn = True
    # the samplers keep their own caches (prefix / dual / block), not transformers' Cache classes
    _supports_cache_class = False
    _can_compile_fullgraph = False  # the masked-only head gathers a data-dependent number of rows
    _supports_attention_backend = True
    # weights: transformers' default `_init_weights` covers every module here (normal(0, initializer_range)
    # linears and embeddings, unit RMSNorm weights, RoPE buffers), as for Llama / Qwen3, except the grouped
    # expert weights (same normal init, below). A depth-scaled init of o_proj / down_proj was tried and slowed
    # the quickstart's learning (ELBO 4.47 -> 4.64 at 400 steps).

    def _init_weights(self, module):
        super()._init_weights(module)
        from transformers import initialization as init

        if isinstance(module, DLMExperts):
            init.normal_(module.gate_up_proj, mean=0.0, std=self.config.initializer_range)
            init.normal_(module.down_proj, mean=0.0, std=self.config.initializer_range)
        elif isinstance(module, DLMSparseMoeBlock) and module.expert_bias is not None:
            init.zeros_(module.expert_bias)
            init.zeros_(module.tokens_per_expert)  # non-persistent: a load leaves it uninitialised

    @property
    def is_gradient_checkpointing(self) -> bool:
        """What transformers' property reports (any layer checkpointing), without the FutureWarning transformers
        >= 5.24 attaches to the old name: trl (rollout unwrapping) and peft still read it on every step."""
        return any(getattr(module, "gradient_checkpointing", False) for module in self.modules())

    def fuse_projections(self):
        """In place, for decoding: q / k / v and gate / up as one linear layer each (`fused_projections.py`:
        faster small-batch decoding steps); `unfuse_projections()` undoes it. Returns the model."""
        return fuse_projections(self)

    def unfuse_projections(self):
        return unfuse_projections(self)

    def save_pretrained(self, save_directory, *args, **kwargs):
        """transformers' save, plus self-contained remote code, `auto_map` and a model card
        (`hf_dlm.hub.publish`, reached through the `utils.publishing` hook: hub/ sits above modeling), so the
        folder loads with `trust_remote_code=True` without hf-dlm."""
        from ..utils.publishing import publisher

        if has_fused_projections(self):
            raise ValueError(f"save_pretrained({str(save_directory)!r}): the model's projections are fused for "
                             "decoding (fuse_projections), which changes its weight names; call "
                             "model.unfuse_projections() before saving")

        return publisher().save_with_remote_code(self, super().save_pretrained, save_directory, *args, **kwargs)

    def push_to_hub(self, repo_id: str, **kwargs):
        """transformers' arguments plus `tokenizer`, `base_model`, `training_details`: one commit holding the
        weights, the generated remote code and a full model card (`hf_dlm.hub.publish.push_to_hub`)."""
        from ..utils.publishing import publisher

        return publisher().push_to_hub(self, repo_id, **kwargs)


@dataclass
class DLMModelOutput(BaseModelOutput):
    """aux_loss / router_z_loss: the MoE layers' load-balancing and z-losses, averaged over those layers
    (unweighted; None for a dense model)."""

    aux_loss: torch.Tensor | None = None
    router_z_loss: torch.Tensor | None = None


class DLMModel(DLMPreTrainedModel):
    def __init__(self, config: DLMConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([DLMDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = DLMRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = DLMRotaryEmbedding(config)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        clean_input_ids: torch.LongTensor | None = None,
        output_hidden_states: bool | None = None,
        kv_cache=None,
        **kwargs,
    ) -> BaseModelOutput:
        """
        input_ids (B, L); attention_mask (B, L) with 0 for padding; position_ids (B, L): passing them
        marks packed documents (a restart at 0 starts a new document, and attention never crosses one);
        without them positions count real tokens, so left padding does not shift a row's positions.
        clean_input_ids (B, L): block-diffusion training only; the clean sequence x_0 joins the noisy
        input as a second stream (BD3LM layout) and only the noisy stream's states are returned.
        kv_cache: a `generation_cache.DLMKVCache` (samplers only); the input is then the cache's query
        window, and the cache supplies positions, key padding and the other keys.
        """
        if kv_cache is not None:
            return self._forward_with_cache(input_ids, inputs_embeds, kv_cache, **kwargs)
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("DLMModel.forward takes exactly one of input_ids and inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        seq_len = inputs_embeds.shape[1]
        two_stream = clean_input_ids is not None
        if two_stream:
            if self.config.attention_mode != "block":
                raise ValueError("clean_input_ids (two-stream training input) needs attention_mode='block'")
            inputs_embeds = torch.cat([inputs_embeds, self.embed_tokens(clean_input_ids)], dim=1)
        hidden_states = inputs_embeds
        mask, position_embeddings = decoder_layer_inputs(
            self.config, self.rotary_emb, hidden_states, attention_mask, position_ids, two_stream
        )
        all_hidden_states = () if output_hidden_states else None
        self._set_router_token_mask(router_token_mask(attention_mask, two_stream))
        for layer in self.layers:
            if output_hidden_states:
                all_hidden_states += (hidden_states[:, :seq_len],)
            hidden_states = layer(hidden_states, attention_mask=mask, position_embeddings=position_embeddings, **kwargs)
        hidden_states = self.norm(hidden_states[:, :seq_len])
        if output_hidden_states:
            all_hidden_states += (hidden_states,)
        self._set_router_token_mask(None)
        aux_loss, router_z_loss = self._collect_router_losses()
        return DLMModelOutput(last_hidden_state=hidden_states, hidden_states=all_hidden_states,
                              aux_loss=aux_loss, router_z_loss=router_z_loss)

    def _set_router_token_mask(self, token_mask):
        """Padding (B, L) for the MoE blocks' router losses during one forward (None: every token is real)."""
        for layer in self.layers:
            if isinstance(layer.mlp, DLMSparseMoeBlock):
                layer.mlp.token_mask = token_mask

    def _collect_router_losses(self):
        """The MoE layers' (load-balancing, z) losses of the forward just run, each a mean over the layers.
        The blocks keep them as an attribute (a list handed down through the layers' kwargs would be copied
        by FSDP2's and checkpointing's input handling); reading clears them."""
        losses = []
        for layer in self.layers:
            if isinstance(layer.mlp, DLMSparseMoeBlock) and layer.mlp.router_losses is not None:
                losses.append(layer.mlp.router_losses)
                layer.mlp.router_losses = None
        if not losses:
            return None, None
        return torch.stack([balance for balance, _ in losses]).mean(), torch.stack([z for _, z in losses]).mean()

    def _forward_with_cache(self, input_ids, inputs_embeds, kv_cache, **kwargs) -> BaseModelOutput:
        """Queries are canvas slots [start, start + Q) of the cache; keys are the cache's slots [0, key_end)
        with the query slots recomputed."""
        query_len = (input_ids if inputs_embeds is None else inputs_embeds).shape[1]
        positions, key_end = kv_cache.position_ids, kv_cache.key_end
        hidden_states = self.forward_window(
            input_ids, inputs_embeds, positions[:, kv_cache.start : kv_cache.start + query_len],
            kv_cache.attention_mask[:, :key_end], positions[:, :key_end], kv_cache, **kwargs,
        )
        return BaseModelOutput(last_hidden_state=hidden_states)

    def forward_window(self, input_ids, inputs_embeds, position_ids, key_padding, key_position_ids, kv_cache,
                       run_layer=None, **kwargs) -> torch.Tensor:
        """The samplers' forward: queries (b, Q) at `position_ids` against keys (b, K) described by
        `key_padding` (1 = real; None: no padding) and `key_position_ids`, whose keys / values `kv_cache` supplies (its
        `update(layer_idx, key, value)` returns all keys). Queries sit at the end of the keys, or, for
        bidirectional dual caching, anywhere: only the padded-query self-clause reads the offset.
        run_layer(index, layer, hidden_states, mask, position_embeddings) -> hidden_states, if given, runs each
        decoder layer (the samplers' compiled layer step, with its own cache per layer); the mask is then built
        without host syncs (the step around the compiled layers is captured as a CUDA graph).
        -> final-normed hidden states (b, Q, H)."""
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        batch_size, query_len = inputs_embeds.shape[:2]
        mask = build_attention_mask(
            self.config._attn_implementation or "eager", self.config.attention_mode, self.config.block_size,
            batch_size, query_len, key_position_ids.shape[1], inputs_embeds.device, inputs_embeds.dtype,
            attention_mask=key_padding, position_ids=key_position_ids, capturable=run_layer is not None,
        )
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for index, layer in enumerate(self.layers):
            if run_layer is not None:
                hidden_states = run_layer(index, layer, hidden_states, mask, position_embeddings)
            else:
                hidden_states = layer(hidden_states, attention_mask=mask, position_embeddings=position_embeddings,
                                      kv_cache=kv_cache, **kwargs)
        return self.norm(hidden_states)


@dataclass
class DiffusionLMOutput(ModelOutput):
    """loss: the weighted masked cross-entropy, plus `router_loss` for an MoE model; num_loss_tokens:
    supervised positions in this batch; logits: (B, L, V), left out of a training forward unless
    `return_logits=True`; aux_loss / router_z_loss: the MoE routers' unweighted losses (`DLMModelOutput`);
    router_loss: `router_aux_loss_coef * aux_loss + router_z_loss_coef * router_z_loss`."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    num_loss_tokens: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None
    router_z_loss: torch.Tensor | None = None
    router_loss: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None


class DLMForDiffusionLM(DLMGenerationMixin, DLMPreTrainedModel):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}
    # run the masked head's chunks through torch.compile (set by `parallelize_dlm(compile=True)`)
    compile_loss_head: bool = False
    # training: the head's gradients computed chunk by chunk in forward (`loss.weighted_linear_cross_entropy`)
    loss_grad_in_forward: bool = True

    def __init__(self, config: DLMConfig):
        super().__init__(config)
        self.model = DLMModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def __setattr__(self, name, value):
        # trl's SFTTrainer / GRPOTrainer replace `forward` with a fused *causal* LM head (hidden state i scores
        # token i + 1): on a diffusion LM that silently trains next-token prediction. Refuse it loudly.
        function = getattr(value, "__func__", value)
        if name == "forward" and "fused_lm_head" in getattr(getattr(function, "__code__", None), "co_varnames", ()):
            raise TypeError(
                "trl tried to patch a DLM's forward with its causal fused LM head (next-token prediction), "
                "which is the wrong objective for a diffusion LM. Use hf_dlm.DLMSFTTrainer / hf_dlm.DiffuGRPOTrainer instead of "
                "trl's SFTTrainer / GRPOTrainer.")
        super().__setattr__(name, value)

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        label_weights: torch.Tensor | None = None,
        num_items_in_batch: torch.Tensor | int | None = None,
        clean_input_ids: torch.LongTensor | None = None,
        suppressed_token_id: int | None = None,
        return_logits: bool | None = None,
        output_hidden_states: bool | None = None,
        kv_cache=None,
        logits_to_keep: int = 0,
        **kwargs,
    ) -> DiffusionLMOutput:
        """
        labels (B, L): the target predicted from each position's logits, -100 where no loss (build them
        with `hf_dlm.MaskedDiffusionObjective`, which also applies `label_alignment`); label_weights
        (B, L): per-position loss weights (the diffusion ELBO weight); num_items_in_batch: the loss
        normaliser (default: the number of supervised positions). With labels, only the supervised
        positions' logits are computed, in chunks of `config.loss_chunk_size`. suppressed_token_id: a token
        removed from the loss's softmax (MDLM's SUBS: the objective's `subs=True` passes the mask token).
        logits_to_keep: as in transformers' LMs, only the last `logits_to_keep` positions' logits (0: all).
        """
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            clean_input_ids=clean_input_ids,
            output_hidden_states=output_hidden_states,
            **({"kv_cache": kv_cache} if kv_cache is not None else {}),
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state
        loss = num_loss_tokens = logits = None
        if labels is not None:
            loss, num_loss_tokens = masked_lm_loss(
                hidden_states, self.lm_head, labels, label_weights, num_items_in_batch, self.config.loss_chunk_size,
                compiled=self.compile_loss_head, grad_in_forward=self.loss_grad_in_forward,
                suppressed_token_id=suppressed_token_id,
            )
        aux_loss, router_z_loss = getattr(outputs, "aux_loss", None), getattr(outputs, "router_z_loss", None)
        router_loss = None
        if aux_loss is not None:
            router_loss = self.config.router_aux_loss_coef * aux_loss + self.config.router_z_loss_coef * router_z_loss
            if loss is not None:
                loss = loss + router_loss
        if labels is None or return_logits:
            logits = self.lm_head(hidden_states[:, -logits_to_keep:] if logits_to_keep else hidden_states)
        return DiffusionLMOutput(
            loss=loss, logits=logits, num_loss_tokens=num_loss_tokens, hidden_states=outputs.hidden_states,
            aux_loss=aux_loss, router_z_loss=router_z_loss, router_loss=router_loss,
        )

    def denoising_logits(self, input_ids, attention_mask=None, position_ids=None) -> torch.Tensor:
        """Logits aligned with token positions, whatever `label_alignment`: entry i predicts token i.
        With shifted alignment the logits at i-1 predict token i; position 0 repeats its own row."""
        logits = self(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
        if self.config.label_alignment == "shift":
            logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
        return logits


__all__ = ["DLMPreTrainedModel", "DLMModel", "DLMForDiffusionLM", "DiffusionLMOutput", "DLMModelOutput"]
