"""Mixture-of-experts feed-forward block: routers (token choice, expert choice), SwiGLU experts stored as
grouped weights, dropless dispatch, and the routers' auxiliary losses.

Weights follow transformers 5's Qwen3-MoE modules (`mlp.gate.weight` (E, H), `mlp.experts.gate_up_proj`
(E, 2I, H) with the gate half first, `mlp.experts.down_proj` (E, H, I)), so checkpoints map key by key.
Every router ends in the same dispatch: the (token, expert, weight) assignments sorted by expert, handed
to the experts as one contiguous run of rows per expert (`tokens`, `counts`): the input a grouped GEMM
takes, and the seam where expert parallelism (`hf_dlm.parallel.expert_parallel`) inserts its all-to-all
as module hooks. Shapes stay static (no host synchronisation), so a compiled block has no graph break.
"""

from __future__ import annotations

from fractions import Fraction

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN


def _grouped_mm_function():
    """`torch.nn.functional.grouped_mm` (torch >= 2.10) or the older private `torch._grouped_mm`, or None."""
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def count_per_expert(experts: torch.Tensor, num_experts: int, weights: torch.Tensor | None = None) -> torch.Tensor:
    """(E,) number of entries of `experts` naming each expert (`weights` (same shape): their sum instead).
    A scatter-add rather than `bincount`, whose output size depends on the data (a graph break)."""
    experts = experts.reshape(-1)
    values = torch.ones_like(experts) if weights is None else weights.reshape(-1)
    return torch.zeros(num_experts, dtype=values.dtype, device=experts.device).scatter_add_(0, experts, values)


def router_z_loss(router_logits: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """ST-MoE eq. 5: mean over tokens of logsumexp(logits)^2; weights (N,) 0 for padding."""
    lse = torch.logsumexp(router_logits.float(), dim=-1)
    return (lse.square() * weights).sum() / weights.sum().clamp(min=1)


def router_aux_losses(router_logits: torch.Tensor, top_experts: torch.Tensor, num_experts: int,
                      token_mask: torch.Tensor | None = None, probabilities: torch.Tensor | None = None):
    """(load-balancing loss, z-loss) of one token-choice MoE layer. router_logits (N, E), top_experts (N, k),
    token_mask (N,) with 0 for padding (left out of both losses, as transformers' `attention_mask` argument does).

    Load balancing (Switch Transformer eq. 4, in transformers' top-k form): `E * sum_e f_e * P_e`, f_e the
    number of top-k assignments to expert e over the number of tokens (sums to k), P_e the mean router
    probability of e (`probabilities` (N, E), default the softmax of the logits); it is k for a uniform router.
    """
    logits = router_logits.float()
    weights = torch.ones_like(logits[:, 0]) if token_mask is None else token_mask.reshape(-1).to(logits.dtype)
    num_tokens = weights.sum().clamp(min=1)
    top_k = top_experts.shape[-1]
    fraction = count_per_expert(top_experts, num_experts, weights[:, None].expand(-1, top_k)) / num_tokens
    probabilities = logits.softmax(dim=-1) if probabilities is None else probabilities
    mean_probability = (probabilities * weights[:, None]).sum(0) / num_tokens  # (E,)
    return num_experts * (fraction * mean_probability).sum(), router_z_loss(logits, weights)


def group_limited_mask(scores: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """(N, E) bool: the experts of each token's `topk_group` best groups of E / n_group consecutive experts, a
    group scored by the sum of its two best scores (DeepSeek-V3's `noaux_tc`, LLaDA2's `group_limited_topk`)."""
    num_tokens, num_experts = scores.shape
    grouped = scores.view(num_tokens, n_group, num_experts // n_group)
    groups = grouped.topk(2, dim=-1).values.sum(dim=-1).topk(topk_group, dim=-1).indices  # (N, topk_group)
    keep = torch.zeros(num_tokens, n_group, dtype=torch.bool, device=scores.device).scatter_(1, groups, True)
    return keep[:, :, None].expand_as(grouped).reshape(num_tokens, num_experts)


def expert_capacity(tokens, num_experts: int, top_k: int, capacity_factor: float):
    """Tokens each expert takes under expert choice: floor(factor * tokens * k / E), at least 1 and at most
    `tokens` (MegaDLMs: `max(tokens * k // E, 1)`, factor 1); `tokens` an int or a tensor of group lengths
    (elementwise, 0 for an empty group). Integer arithmetic, so compiled code with a symbolic `tokens` needs no
    float guard."""
    factor = Fraction(capacity_factor).limit_denominator(1 << 16)
    scaled = tokens * top_k * factor.numerator // (num_experts * factor.denominator)
    if isinstance(tokens, torch.Tensor):
        return scaled.clamp(min=1).minimum(tokens)
    return max(1, min(tokens, scaled))


def expert_choice_routing(router_logits: torch.Tensor, rows: int, top_k: int, capacity_factor: float = 1.0,
                          pre_softmax: bool = False, token_mask: torch.Tensor | None = None, groups=None):
    """MegaDLMs' expert choice (`expert_choice_softmax_with_capacity`). router_logits (N, E), N = rows x L: the
    experts choose within each of `rows` groups of consecutive tokens (rows=1: the whole micro-batch).
    groups: (index (G, Q) token ids, valid (G, Q) bool) instead of `rows`: ragged groups, each of its own
    length and capacity (the serving engine's packed rows, each routed as if it were decoded alone).

    Each expert takes the C = `expert_capacity(L, ...)` tokens of each group with the highest score: the
    router logit, or with `pre_softmax` the softmax probability over experts. A token's weights: without
    `pre_softmax` the softmax over the logits of the experts that chose it (zero when none did); with it
    the chosen probabilities. Padding (token_mask 0) ranks below every real token and gets zero weight.
    -> tokens (E, G * C) token ids per expert, weights (E, G * C) fp32 (0 for the slots beyond a ragged
    group's capacity, which repeat one of its tokens), chosen (N, E) bool (real tokens only).
    """
    num_tokens, num_experts = router_logits.shape
    logits = router_logits.float()
    real = None if token_mask is None else token_mask.reshape(-1, 1).bool()  # (N, 1)
    scores = logits.softmax(dim=-1) if pre_softmax else logits
    if real is not None:
        scores = scores.masked_fill(~real, float("-inf"))
    if groups is None:
        index, valid = torch.arange(num_tokens, device=logits.device).view(rows, num_tokens // rows), None
    else:
        index, valid = groups
    capacity = expert_capacity(index.shape[1], num_experts, top_k, capacity_factor)
    grouped = scores[index]  # (G, Q, E)
    if valid is not None:
        grouped = grouped.masked_fill(~valid.unsqueeze(-1), float("-inf"))
    values, position = grouped.topk(capacity, dim=1)  # (G, C, E)
    tokens = index.gather(1, position.flatten(1)).view_as(position)
    taken = None
    if valid is not None:  # a group's own capacity, real slots only
        own = expert_capacity(valid.sum(1), num_experts, top_k, capacity_factor)  # (G,)
        rank = torch.arange(capacity, device=index.device).view(1, -1, 1)
        taken = (rank < own.view(-1, 1, 1)) & valid.gather(1, position.flatten(1)).view_as(position)
        taken = taken.reshape(-1, num_experts)
    tokens, values = tokens.reshape(-1, num_experts), values.reshape(-1, num_experts)  # (G * C, E)
    if taken is None:
        chosen = torch.zeros_like(logits, dtype=torch.bool).scatter_(0, tokens, True)  # (N, E)
    else:  # a slot past its group's capacity may repeat a chosen token: count, do not overwrite
        chosen = torch.zeros_like(logits, dtype=torch.long).scatter_add_(0, tokens, taken.long()) > 0
    if real is not None:
        chosen = chosen & real
    if pre_softmax:
        weights = values
    else:  # softmax over the chosen experts' logits (a finite fill: a row with none stays NaN-free)
        weights = logits.masked_fill(~chosen, torch.finfo(logits.dtype).min).softmax(dim=-1).gather(0, tokens)
    if taken is not None:
        weights = weights.masked_fill(~taken, 0.0)
    if real is not None:
        weights = weights.masked_fill(~real.reshape(-1)[tokens], 0.0)
    return tokens.T, weights.T, chosen


def expert_choice_aux_losses(router_logits: torch.Tensor, chosen: torch.Tensor, top_k: int,
                             token_mask: torch.Tensor | None = None):
    """(load-balancing loss, z-loss) of one expert-choice layer. The balance loss is MegaDLMs'
    `ec_load_balancing_loss_func`: P = softmax of the logits over the tokens (each expert's distribution over
    tokens), n_t = experts that chose token t (no gradient); loss = sum_t (sum_e P[t, e]) n_t / (E k), 1.0 for
    a uniform router. It pushes each token towards being chosen by k experts. Padding is left out."""
    logits = router_logits.float()
    num_experts = logits.shape[-1]
    weights = torch.ones_like(logits[:, 0]) if token_mask is None else token_mask.reshape(-1).to(logits.dtype)
    over_tokens = logits.masked_fill(weights[:, None] == 0, torch.finfo(logits.dtype).min).softmax(dim=0)
    experts_per_token = chosen.sum(dim=-1).to(logits.dtype)
    balance = (over_tokens.sum(dim=-1) * experts_per_token).sum() / (num_experts * top_k)
    return balance, router_z_loss(logits, weights)


class _GatherRows(torch.autograd.Function):
    """rows = x.index_select(0, index) where `index` takes every row of x exactly `repeats` times (a permutation
    of `repeats` copies), so the backward is a gather too: grad_x = sum over copies of grad[inverse]. Autograd's
    own backward of index_select is an atomic scatter-add (`index_add_`), the slowest kernel of the MoE
    dispatch in bf16; this is Megatron's permute / unpermute pair written as one function."""

    @staticmethod
    def forward(ctx, x, index, inverse, repeats):
        ctx.save_for_backward(inverse)
        ctx.repeats = repeats
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        grad = grad.index_select(0, inverse)
        if ctx.repeats > 1:
            grad = grad.view(-1, ctx.repeats, grad.shape[-1]).sum(dim=1)
        return grad, None, None, None


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
        return self._loop(tokens, counts, gate_up, down)

    # eager under torch.compile: the loop reads the counts on the host (a graph break anyway), and tracing it
    # would guard on each expert's row count (0, 1 and more specialise), recompiling as the routing changes
    @torch.compiler.disable
    def _loop(self, tokens, counts, gate_up, down):
        outputs = []
        for expert, rows in enumerate(tokens.split(counts.tolist())):
            gate, up = F.linear(rows, gate_up[expert]).chunk(2, dim=-1)
            outputs.append(F.linear(self.act_fn(gate) * up, down[expert]))
        return torch.cat(outputs) if outputs else tokens.new_zeros(0, tokens.shape[-1])


class DLMSparseMoeBlock(nn.Module):
    """Dropless MoE with the router of `config.moe_router` (see `DLMConfig`), plus an optional shared expert every
    token runs: `shared_expert`, scaled by a sigmoid gate (Qwen2-MoE), or `shared_experts`, ungated (DeepSeek-V3,
    LLaDA2, MegaDLMs). forward(hidden_states (B, L, H)) -> (B, L, H); the forward leaves this layer's
    (load-balancing, z) losses in `router_losses`, where the model collects them, computed over the tokens
    that `token_mask` (B, L), set by the model for the duration of its forward, marks real.

    With `moe_router_enable_expert_bias` the block holds `expert_bias` (E,), fp32 whatever the model's dtype,
    and, while training with `moe_router_bias_update_rate > 0`, counts each expert's tokens in
    `tokens_per_expert` for `update_expert_bias`."""

    def __init__(self, config, shared_expert: nn.Module | None = None, shared_experts: nn.Module | None = None):
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.router = config.moe_router
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.routed_scaling_factor = config.routed_scaling_factor
        self.bias_update_rate = config.moe_router_bias_update_rate
        if config.moe_router_enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(config.num_experts, dtype=torch.float32))
            self.register_buffer("tokens_per_expert", torch.zeros(config.num_experts, dtype=torch.long),
                                 persistent=False)
        else:
            self.expert_bias = self.tokens_per_expert = None
        self.expert_choice_level = config.expert_choice_level
        self.capacity_factor = config.expert_capacity_factor
        self.pre_softmax = config.expert_choice_pre_softmax
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)  # the router
        self.experts = DLMExperts(config)
        self.shared_expert = shared_expert
        if shared_expert is not None:
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)
        self.shared_experts = shared_experts
        self.router_losses = self.token_mask = None

    @property
    def mean_experts_per_token(self) -> float:
        """Experts a token runs through on average: k, or under expert choice k times the capacity factor."""
        if self.router == "expert_choice":
            return min(self.num_experts, self.top_k * self.capacity_factor)
        return self.top_k

    def _apply(self, fn, recurse=True):
        # `.to(torch.bfloat16)` / `.half()` leave the expert bias in fp32: update steps of ~1e-3 on a bias near 1
        # vanish in bf16 (transformers keeps DeepSeek-V3's bias in fp32 on loading for the same reason)
        bias = self._buffers.get("expert_bias")
        super()._apply(fn, recurse)
        if bias is not None and self.expert_bias.dtype != torch.float32:
            moved = self.expert_bias
            self.expert_bias = moved.float() if bias.is_meta or moved.is_meta else bias.to(moved.device)
        return self

    def route(self, hidden_states: torch.Tensor):
        """Token choice. (N, H) -> router logits (N, E), top-k weights (N, k) fp32, top-k expert ids (N, k).

        "softmax": probabilities in fp32 (logits in the compute dtype, as Qwen3-MoE); an expert bias is added to
        the probabilities and enters selection and weights (LLaDA-MoE). "sigmoid": logits and scores in fp32,
        the bias steers the selection only (DeepSeek-V3, LLaDA2). Then, for both: group-limited selection when
        `n_group > 1`, weights renormalised over the k with `norm_topk_prob`, times `routed_scaling_factor`."""
        if self.router == "sigmoid":
            with torch.autocast(hidden_states.device.type, enabled=False):
                router_logits = F.linear(hidden_states.float(), self.gate.weight.float())
            scores = router_logits.sigmoid()
            choice = scores if self.expert_bias is None else scores + self.expert_bias
        else:
            router_logits = self.gate(hidden_states)
            scores = F.softmax(router_logits, dim=-1, dtype=torch.float32)
            if self.expert_bias is not None:
                scores = scores + self.expert_bias
            choice = scores
        if self.n_group > 1:
            choice = choice.masked_fill(~group_limited_mask(choice, self.n_group, self.topk_group), float("-inf"))
        top_experts = choice.topk(self.top_k, dim=-1).indices
        top_weights = scores.gather(-1, top_experts)
        if self.norm_topk_prob:
            top_weights = top_weights / (top_weights.sum(dim=-1, keepdim=True) + 1e-20)
        return router_logits, top_weights * self.routed_scaling_factor, top_experts

    def _token_choice(self, hidden_states, token_mask):
        """-> (assignment order sorted by expert (N * k,), its inverse, the (N, k) weights), counts (E,), losses."""
        router_logits, top_weights, top_experts = self.route(hidden_states)
        flat_experts = top_experts.reshape(-1)  # (N * k,)
        order = flat_experts.argsort(stable=True)  # stable: a token's rows keep their order
        counts = count_per_expert(flat_experts, self.num_experts)
        probabilities = None
        if self.router == "sigmoid":  # DeepSeek-V3's balance loss reads the scores normalised per token
            probabilities = router_logits.sigmoid()
            probabilities = probabilities / probabilities.sum(dim=-1, keepdim=True)
        losses = router_aux_losses(router_logits, top_experts, self.num_experts, token_mask, probabilities)
        if self.training and self.bias_update_rate > 0:  # the real tokens each expert took, for update_expert_bias
            with torch.no_grad():
                real = torch.ones_like(top_experts)
                if token_mask is not None:
                    real = real * token_mask.reshape(-1, 1).long()
                self.tokens_per_expert += count_per_expert(top_experts, self.num_experts, real)
        return (order, order.argsort(), top_weights), counts, losses

    def _expert_choice(self, hidden_states, token_mask, rows, token_groups=None):
        router_logits = self.gate(hidden_states)
        tokens, weights, chosen = expert_choice_routing(router_logits, rows, self.top_k, self.capacity_factor,
                                                        self.pre_softmax, token_mask, token_groups)  # (E, G * C)
        counts = torch.full((self.num_experts,), tokens.shape[1], dtype=torch.long, device=tokens.device)
        losses = expert_choice_aux_losses(router_logits, chosen, self.top_k, token_mask)
        return tokens.reshape(-1), weights.reshape(-1), counts, losses

    def forward(self, hidden_states: torch.Tensor, token_groups=None) -> torch.Tensor:
        """token_groups: (index (G, Q), valid (G, Q)) of a packed input whose rows are independent sequences (the
        serving engine's `kv_cache.token_groups`): expert choice then picks within each of them, whatever
        `expert_choice_level` (each row routed as if it were alone); token choice is per token anyway."""
        shape = hidden_states.shape
        hidden_states = hidden_states.reshape(-1, shape[-1])  # (N, H)
        token_mask = None if self.token_mask is None else self.token_mask.reshape(-1)
        self.router_losses = None
        if hidden_states.shape[0] == 0:
            return hidden_states.reshape(shape)
        # dispatch: the assignments' tokens, one contiguous run per expert; combine: weighted sum per token
        if self.router == "expert_choice":  # a token is taken by 0..E experts: combine with a scatter-add
            rows = shape[0] if self.expert_choice_level == "sequence" and len(shape) == 3 else 1
            token_rows, row_weights, counts, losses = self._expert_choice(hidden_states, token_mask, rows, token_groups)
            expert_output = self.experts(hidden_states.index_select(0, token_rows), counts)
            expert_output = expert_output * row_weights[:, None].to(expert_output.dtype)
            output = torch.zeros_like(hidden_states, dtype=expert_output.dtype).index_add_(0, token_rows, expert_output)
        else:  # exactly k assignments per token: dispatch and combine are row permutations, gathers both ways
            (order, inverse, top_weights), counts, losses = self._token_choice(hidden_states, token_mask)
            k = self.top_k
            expert_input = _GatherRows.apply(hidden_states, order // k, inverse, k)  # (N * k, H) by expert
            expert_output = self.experts(expert_input, counts)
            unsorted = _GatherRows.apply(expert_output, inverse, order, 1).view(-1, k, expert_output.shape[-1])
            output = (unsorted * top_weights[:, :, None].to(unsorted.dtype)).sum(dim=1)  # (N, H)
        self.router_losses = losses
        if self.shared_expert is not None:
            shared = self.shared_expert(hidden_states)
            output = output + torch.sigmoid(self.shared_expert_gate(hidden_states)) * shared
        if self.shared_experts is not None:
            output = output + self.shared_experts(hidden_states)
        return output.reshape(shape)


@torch.no_grad()
def update_expert_bias(model: nn.Module, group=None) -> None:
    """DeepSeek-V3's auxiliary-loss-free load balancing, once per optimizer step, outside autograd: every MoE
    layer with `moe_router_bias_update_rate` r > 0 moves its expert bias by `r * sign(mean_e load - load_e)`
    (overloaded experts down, underloaded up), load = the tokens each expert took since the last update, then
    clears the counts. Under data / expert parallelism the counts are summed over `group` first (default: every
    process), so every rank applies the same update; with pipeline stages pass the stage's data-parallel group.
    Activation checkpointing counts a layer's tokens twice, which leaves every sign unchanged."""
    blocks = [module for module in model.modules()
              if isinstance(module, DLMSparseMoeBlock) and module.expert_bias is not None and module.bias_update_rate > 0]
    if not blocks:
        return
    loads = torch.stack([block.tokens_per_expert for block in blocks])  # (layers, E), one collective for all
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(loads, group=group)
    loads = loads.double()
    for block, load in zip(blocks, loads):
        step = block.bias_update_rate * torch.sign(load.mean() - load)
        block.expert_bias.add_(step.to(block.expert_bias.dtype))
        block.tokens_per_expert.zero_()


def active_parameter_count(model: nn.Module) -> int:
    """Parameters one token runs through: all, less the idle share of every MoE layer's experts (all but k of
    E under token choice; under expert choice a token runs k x capacity factor experts on average): the N of
    the 6N FLOPs-per-token count."""
    total = sum(p.numel() for p in model.parameters())
    for module in model.modules():
        if isinstance(module, DLMSparseMoeBlock):
            experts = module.experts.gate_up_proj.numel() + module.experts.down_proj.numel()
            total -= round(experts * (module.num_experts - module.mean_experts_per_token) / module.num_experts)
    return total


__all__ = ["DLMExperts", "DLMSparseMoeBlock", "router_aux_losses", "expert_choice_routing",
           "expert_choice_aux_losses", "expert_capacity", "group_limited_mask", "count_per_expert",
           "update_expert_bias", "active_parameter_count"]
