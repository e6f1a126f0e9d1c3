"""Tensor parallel with sequence parallel (Megatron-SP) and a vocabulary-parallel masked-only head.

Layout per decoder layer (torchtitan's Llama plan, DTensor `parallelize_module`): the residual stream
between layers is split along the sequence (Shard(1)); the norms run on their sequence shard
(`SequenceParallel`); attention and the MLP all-gather their input, run q/k/v and gate/up column-wise
and o/down row-wise, and reduce-scatter their output back to sequence shards. The per-head q/k norms see
this rank's heads: they are declared sharded on the head dimension, so DTensor sums their weight
gradients over the group. Embeddings are vocabulary-parallel (row-wise); the last layer all-gathers
its output, so the final norm and the masked-only head see the whole sequence (the head needs every
supervised row on every rank anyway, as Megatron's output layer does).

The head: the supervised rows' logits exist only as vocabulary shards (V / tp columns per rank); the
cross-entropy's log-sum-exp and target logit are all-reduced over the group, so no rank ever holds
full-vocabulary logits (`vocab_parallel_weighted_cross_entropy`). Why hand-written: DTensor's
`loss_parallel` takes full (B, L, V) logits, and its gradient path recomputes them; this head keeps the
masked-only, chunked, gradients-in-forward design of `hf_dlm.modeling.loss` under vocabulary sharding.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..modeling.loss import _compute_dtype


def apply_tensor_parallel(model: nn.Module, tp_mesh, sequence_parallel: bool = True) -> None:
    """Shard `model` (a `DLMForDiffusionLM`) over the 1-D `tp_mesh` in place. Attention and KV heads must
    divide by its size. `sequence_parallel=False` keeps the residual stream replicated (the plain Megatron
    layout from `config.base_model_tp_plan`)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleInputOutput,
                                                   PrepareModuleOutput,
                                                   RowwiseParallel, SequenceParallel, parallelize_module)

    config = model.config
    size = tp_mesh.size()
    if config.num_attention_heads % size or config.num_key_value_heads % size:
        raise ValueError(
            f"tensor parallel size {size} must divide num_attention_heads ({config.num_attention_heads}) "
            f"and num_key_value_heads ({config.num_key_value_heads})"
        )
    if any(getattr(layer.mlp, "experts", None) is not None for layer in model.model.layers):
        raise NotImplementedError("tensor parallel of mixture-of-experts layers is not supported; "
                                  "use expert parallel (ep) for the experts")
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    # the head first: its weight becomes a vocabulary-sharded DTensor; logits (return_logits / no labels)
    # are all-gathered to full vocabulary
    parallelize_module(model.lm_head, tp_mesh, ColwiseParallel(input_layouts=Replicate(),
                                                               output_layouts=Replicate()))
    seq = Shard(1) if sequence_parallel else Replicate()
    parallelize_module(model.model, tp_mesh, {
        "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
    })
    if tied:  # both are Shard(0) of the same (V, H) matrix: one parameter again
        model.lm_head.weight = model.model.embed_tokens.weight
    model.lm_head.vocab_parallel_loss = vocab_parallel_weighted_cross_entropy  # read by modeling.loss.masked_lm_loss

    layers = model.model.layers
    for index, layer in enumerate(layers):
        plan = {
            "self_attn": PrepareModuleInput(input_layouts=(seq, None, None), desired_input_layouts=(Replicate(), None, None)),
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(output_layouts=seq),
            "mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=seq),
        }
        if sequence_parallel:
            plan["input_layernorm"] = SequenceParallel()
            plan["post_attention_layernorm"] = SequenceParallel()
        if config.qk_norm:  # (B, L, heads / tp, head_dim): sharded on the heads
            plan["self_attn.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
            plan["self_attn.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        # the first layer takes its sequence shard of the replicated embeddings (a slice, no communication);
        # the last all-gathers its output, so the final norm and the head see the whole sequence
        first, last = index == 0, index == len(layers) - 1
        if sequence_parallel and first and last:
            plan[""] = PrepareModuleInputOutput(
                input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_input=True,
                use_local_output=True)
        elif sequence_parallel and first:
            plan[""] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                          use_local_output=True)
        elif sequence_parallel and last:
            plan[""] = PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate(),
                                           use_local_output=True)
        parallelize_module(layer, tp_mesh, _expand_root(plan, layer, tp_mesh))
    model._tp_mesh = tp_mesh


def _expand_root(plan: dict, layer: nn.Module, tp_mesh) -> dict:
    """parallelize_module's dict plans name children only: a style for the layer itself is applied here."""
    root = plan.pop("", None)
    if root is not None:
        from torch.distributed.tensor.parallel import parallelize_module

        parallelize_module(layer, tp_mesh, root)
    return plan


def vocab_parallel_weighted_cross_entropy(hidden: torch.Tensor, weight, labels: torch.Tensor, scale: torch.Tensor,
                                          chunk_size: int = 4096, suppressed_token_id: int | None = None) -> torch.Tensor:
    """`sum_i scale_i * CE_i` of `hidden @ weight.T` where `weight` (V, H) is a DTensor sharded on the
    vocabulary (Shard(0)) over a 1-D tensor-parallel mesh. hidden (N, H) replicated over that mesh, labels
    and scale (N,). Returns the fp32 scalar, identical on every rank; gradients reach `hidden` (summed over
    the group) and the weight shard. suppressed_token_id: a token whose logit is -inf (MDLM's SUBS)."""
    mesh = weight.device_mesh
    vocab = weight.shape[0]
    local_weight = weight.to_local()
    rank, size = mesh.get_local_rank(), mesh.size()
    shard = math.ceil(vocab / size)  # torch.chunk's split, as DTensor's Shard(0)
    vocab_start = min(rank * shard, vocab)
    return _VocabParallelLinearCrossEntropy.apply(hidden, local_weight, labels, scale, vocab_start,
                                                  mesh.get_group(), chunk_size, suppressed_token_id)


class _VocabParallelLinearCrossEntropy(torch.autograd.Function):
    """Per chunk of rows: local logits (n, V/tp); max, sum of exponentials and target logit all-reduced;
    the logit gradient softmax - one-hot is then local, and so are the weight-shard gradient and this
    shard's share of the hidden gradient (all-reduced once at the end)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, scale, vocab_start, group, chunk_size, suppressed_token_id=None):
        dtype = _compute_dtype(hidden, weight)
        needs_hidden, needs_weight = ctx.needs_input_grad[:2]
        with torch.autocast(hidden.device.type, enabled=False):
            h_all, w = hidden.to(dtype), weight.to(dtype)
            local_vocab = w.shape[0]
            ce = torch.empty(h_all.shape[0], dtype=torch.float32, device=hidden.device)
            grad_hidden = torch.zeros_like(h_all, dtype=torch.float32) if needs_hidden else None
            grad_weight = torch.zeros_like(w, dtype=torch.float32) if needs_weight else None
            scale32 = scale.float()
            for start in range(0, h_all.shape[0], chunk_size):
                rows = slice(start, start + chunk_size)
                h, y = h_all[rows], labels[rows]
                logits = F.linear(h, w).float()  # (n, V / tp)
                if suppressed_token_id is not None and 0 <= suppressed_token_id - vocab_start < local_vocab:
                    logits[:, suppressed_token_id - vocab_start] = float("-inf")
                row_max = logits.max(-1).values if local_vocab else torch.full_like(ce[rows], -torch.inf)
                dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
                exp = torch.exp(logits - row_max[:, None])
                sum_exp = exp.sum(-1)
                local_label = y - vocab_start
                here = (local_label >= 0) & (local_label < local_vocab)
                target = torch.where(here, logits.gather(1, local_label.clamp(0, max(local_vocab - 1, 0))[:, None]
                                                         ).squeeze(1) if local_vocab else 0.0, 0.0)
                reduced = torch.stack([sum_exp, target])
                dist.all_reduce(reduced, group=group)
                lse = row_max + torch.log(reduced[0])
                ce[rows] = lse - reduced[1]
                probs = exp / reduced[0][:, None]
                is_label = torch.arange(local_vocab, device=h.device)[None, :] == local_label[:, None]
                grad_logits = (torch.where(is_label, probs - 1.0, probs) * scale32[rows, None]).to(dtype)
                if needs_hidden:
                    grad_hidden[rows] = grad_logits @ w
                if needs_weight:
                    grad_weight.addmm_(grad_logits.t().float(), h.float())
            if needs_hidden:
                dist.all_reduce(grad_hidden, group=group)  # each shard's share of d loss / d hidden
        ctx.save_for_backward(grad_hidden, grad_weight, ce)
        ctx.dtypes = (hidden.dtype, weight.dtype, scale.dtype)
        return (ce * scale32).sum()

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, grad_weight, ce = ctx.saved_tensors
        hidden_dtype, weight_dtype, scale_dtype = ctx.dtypes
        return (
            (grad_hidden * grad_output).to(hidden_dtype) if grad_hidden is not None else None,
            (grad_weight * grad_output).to(weight_dtype) if grad_weight is not None else None,
            None,
            (ce * grad_output).to(scale_dtype) if ctx.needs_input_grad[3] else None,
            None, None, None, None,
        )
