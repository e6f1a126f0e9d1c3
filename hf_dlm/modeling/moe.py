"""Mixture-of-experts feed-forward block: a top-k token-choice router, SwiGLU experts stored as grouped
weights, dropless dispatch, and the router's auxiliary losses.

Weights follow transformers 5's Qwen3-MoE modules (`mlp.gate.weight` (E, H), `mlp.experts.gate_up_proj`
(E, 2I, H) with the gate half first, `mlp.experts.down_proj` (E, H, I)), so checkpoints map key by key.
The block sorts the (token, expert) assignments by expert and hands the experts one contiguous run of
rows per expert (`tokens`, `counts`): that is the input a grouped GEMM takes, and the seam where expert
parallelism (`hf_dlm.parallel.expert_parallel`) inserts its all-to-all dispatch as module hooks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN


def _grouped_mm_function():
    """`torch.nn.functional.grouped_mm` (torch >= 2.10) or the older private `torch._grouped_mm`, or None."""
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def router_aux_losses(router_logits: torch.Tensor, top_experts: torch.Tensor, num_experts: int,
                      token_mask: torch.Tensor | None = None):
    """(load-balancing loss, z-loss) of one MoE layer. router_logits (N, E), top_experts (N, k), token_mask
    (N,) with 0 for padding (left out of both losses, as transformers' `attention_mask` argument does).

    Load balancing (Switch Transformer eq. 4, in transformers' top-k form): `E * sum_e f_e * P_e`, f_e the
    number of top-k assignments to expert e over the number of tokens (sums to k), P_e the mean router
    probability of e; it is k for a uniform router. z-loss (ST-MoE eq. 5): mean over tokens of
    logsumexp(logits)^2.
    """
    logits = router_logits.float()
    weights = torch.ones_like(logits[:, 0]) if token_mask is None else token_mask.reshape(-1).to(logits.dtype)
    num_tokens = weights.sum().clamp(min=1)
    top_k = top_experts.shape[-1]
    assigned = torch.bincount(top_experts.reshape(-1), weights=weights.repeat_interleave(top_k),
                              minlength=num_experts)  # (E,)
    fraction = assigned / num_tokens
    mean_probability = (logits.softmax(dim=-1) * weights[:, None]).sum(0) / num_tokens  # (E,)
    balance = num_experts * (fraction * mean_probability).sum()
    z_loss = (torch.logsumexp(logits, dim=-1).square() * weights).sum() / num_tokens
    return balance, z_loss


class DLMExperts(nn.Module):
    """E SwiGLU experts as two grouped weights. forward(tokens (T, H) grouped by expert, counts (E,)) ->
    (T, H): rows counts[0] go through expert 0, the next counts[1] through expert 1, and so on."""

    def __init__(self, config):
        super().__init__()
        self.num_experts = config.num_experts
        self.intermediate_size = config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_experts, 2 * self.intermediate_size, config.hidden_size))
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, config.hidden_size, self.intermediate_size))
        self.act_fn = ACT2FN[config.hidden_act]
        self.implementation = config.moe_implementation

    def _local_weights(self):
        # under expert parallelism the weights are DTensors sharded on dim 0: compute with this rank's experts
        gate_up, down = self.gate_up_proj, self.down_proj
        if hasattr(gate_up, "to_local"):
            gate_up, down = gate_up.to_local(), down.to_local()
        return gate_up, down

    def use_grouped_mm(self, tokens: torch.Tensor, dtype: torch.dtype) -> bool:
        if self.implementation == "loop":
            return False
        if self.implementation == "grouped_mm":
            if _grouped_mm_function() is None:
                raise RuntimeError(f"moe_implementation='grouped_mm' needs torch >= 2.9 (torch {torch.__version__})")
            return True
        # auto: the CUDA kernels take bf16 (SM80+); CPU and fp32 take the loop
        return tokens.is_cuda and dtype == torch.bfloat16 and _grouped_mm_function() is not None

    def forward(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        # compute dtype: autocast's, else the tokens' (bf16 under FSDP2 mixed precision, which leaves
        # expert-parallel weights in their stored dtype)
        device_type = tokens.device.type
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else tokens.dtype
        gate_up, down = (w.to(dtype) for w in self._local_weights())  # (E_local, 2I, H), (E_local, H, I)
        tokens = tokens.to(dtype)
        if self.use_grouped_mm(tokens, dtype):
            # grouped_mm is not autocast-aware (hence the casts); offs[e] is where expert e's rows end
            grouped_mm = _grouped_mm_function()
            offsets = counts.cumsum(0).to(torch.int32)
            gate, up = grouped_mm(tokens, gate_up.transpose(-2, -1), offs=offsets).chunk(2, dim=-1)  # (T, I) each
            return grouped_mm(self.act_fn(gate) * up, down.transpose(-2, -1), offs=offsets)  # (T, H)
        outputs = []
        for expert, rows in enumerate(tokens.split(counts.tolist())):
            gate, up = F.linear(rows, gate_up[expert]).chunk(2, dim=-1)
            outputs.append(F.linear(self.act_fn(gate) * up, down[expert]))
        return torch.cat(outputs) if outputs else tokens.new_zeros(0, tokens.shape[-1])


class DLMSparseMoeBlock(nn.Module):
    """Top-k token-choice MoE (Qwen3-MoE semantics), dropless, plus an optional gated shared expert
    (Qwen2-MoE). forward(hidden_states (B, L, H)) -> (B, L, H); the forward leaves this layer's
    (load-balancing, z) losses in `router_losses`, where the model collects them, computed over the tokens
    that `token_mask` (B, L), set by the model for the duration of its forward, marks real."""

    def __init__(self, config, shared_expert: nn.Module | None = None):
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)  # the router
        self.experts = DLMExperts(config)
        self.shared_expert = shared_expert
        if shared_expert is not None:
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)
        self.router_losses = self.token_mask = None

    def route(self, hidden_states: torch.Tensor):
        """(N, H) -> router logits (N, E), top-k weights (N, k) fp32, top-k expert ids (N, k)."""
        router_logits = self.gate(hidden_states)
        probabilities = F.softmax(router_logits, dim=-1, dtype=torch.float32)
        top_weights, top_experts = probabilities.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_weights = top_weights / top_weights.sum(dim=-1, keepdim=True)
        return router_logits, top_weights, top_experts

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        hidden_states = hidden_states.reshape(-1, shape[-1])  # (N, H)
        router_logits, top_weights, top_experts = self.route(hidden_states)
        self.router_losses = None
        if hidden_states.shape[0] > 0:
            self.router_losses = router_aux_losses(router_logits, top_experts, self.num_experts, self.token_mask)

        # dispatch: the N * k assignments sorted by expert (stable, so a token's rows keep their order)
        flat_experts = top_experts.reshape(-1)  # (N * k,)
        order = flat_experts.argsort(stable=True)
        counts = torch.bincount(flat_experts, minlength=self.num_experts)  # (E,)
        source_rows = order // self.top_k  # the token of each sorted assignment
        expert_output = self.experts(hidden_states.index_select(0, source_rows), counts)  # (N * k, H)
        expert_output = expert_output * top_weights.reshape(-1)[order, None].to(expert_output.dtype)
        output = torch.zeros_like(hidden_states, dtype=expert_output.dtype).index_add_(0, source_rows, expert_output)
        if self.shared_expert is not None:
            shared = self.shared_expert(hidden_states)
            output = output + torch.sigmoid(self.shared_expert_gate(hidden_states)) * shared
        return output.reshape(shape)


def active_parameter_count(model: nn.Module) -> int:
    """Parameters one token runs through: all, less the (E - k) / E share of every MoE layer's experts (the
    N of the 6N FLOPs-per-token count)."""
    total = sum(p.numel() for p in model.parameters())
    for module in model.modules():
        if isinstance(module, DLMSparseMoeBlock):
            experts = module.experts.gate_up_proj.numel() + module.experts.down_proj.numel()
            total -= experts * (module.num_experts - module.top_k) // module.num_experts
    return total


__all__ = ["DLMExperts", "DLMSparseMoeBlock", "router_aux_losses", "active_parameter_count"]
