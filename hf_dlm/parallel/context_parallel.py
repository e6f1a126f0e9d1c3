"""Context parallel for bidirectional (and causal) attention: each rank holds 1/cp of the sequence.

`apply_context_parallel(model, cp_mesh)` makes the model take the whole batch on every CP rank (so the
objective's noise, drawn from each sample's global index, is identical on every rank by construction)
and run only this rank's contiguous sequence chunk: a forward pre-hook slices `input_ids`, `labels`,
`label_weights` and the global `position_ids`, and builds this chunk's rows of the attention mask from
the whole sequence's padding and packed-document boundaries (so a document cut by a chunk edge still
sees all of itself). The returned loss is this chunk's share: its supervised rows over the *global*
normaliser, so the CP ranks' losses sum to the single-process loss and their gradients sum to its
gradients (FSDP2's reduce-scatter over `dp_shard_cp` does that sum).

Two attention paths:
- "all_gather" (any device, any mask, differentiable on CPU through gloo): keys and values are
  all-gathered along the sequence, queries stay local. Memory for K/V grows with the full length, but
  K/V are (num_key_value_heads x head_dim) per token, a fraction of the activations.
- "ring" (CUDA, SDPA, no mask): PyTorch's ring attention (`torch.distributed.tensor.experimental`),
  which rotates K/V shards and overlaps the exchange with compute.

No load balancing: causal ring attention reorders the sequence (chunks i and 2cp-1-i per rank) because
with a causal mask the ranks holding late chunks do most of the work. Under bidirectional attention
every query attends to every key, so every chunk costs the same and contiguous chunks are already
balanced. (Causal models work here too, through the all-gather path and an explicit mask, unbalanced.)
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn

from ..modeling.masks import block_ids, dense_mask, document_ids_from_position_ids, make_mask_mod
from ..utils.masking import additive_mask

CP_ATTENTION = "hf_dlm_context_parallel"
CP_BACKENDS = ("all_gather", "ring")
_SEQUENCE_INPUTS = ("input_ids", "labels", "label_weights", "position_ids", "inputs_embeds")


class _AllGatherSequence(torch.autograd.Function):
    """All-gather along dim 2 of (B, heads, L / cp, hd); backward sums the gradients of every rank's copy
    and keeps this rank's slice (an all-reduce, which gloo has, instead of a reduce-scatter, which it lacks)."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group, ctx.rank, ctx.size = group, dist.get_rank(group), dist.get_world_size(group)
        pieces = [torch.empty_like(tensor) for _ in range(ctx.size)]
        dist.all_gather(pieces, tensor.contiguous(), group=group)
        return torch.cat(pieces, dim=2)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        if dist.get_backend(ctx.group) == "nccl":
            out = torch.empty_like(grad.chunk(ctx.size, dim=2)[ctx.rank]).contiguous()
            dist.reduce_scatter(out, [c.contiguous() for c in grad.chunk(ctx.size, dim=2)], group=ctx.group)
            return out, None
        dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(ctx.size, dim=2)[ctx.rank].contiguous(), None


def context_parallel_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The attention interface registered as `CP_ATTENTION`: query (B, nh, L/cp, hd) of this chunk, key / value
    (B, nkv, L/cp, hd); attention_mask (B, 1, L/cp, L) bool or None. -> (B, L/cp, nh, hd), weights or None."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from ..modeling.modeling_dlm import eager_attention_forward, sdpa_backend_context

    cp = module._context_parallel
    if cp["backend"] == "ring" and attention_mask is None:
        with sdpa_backend_context(module.config.sdpa_backends, query.device):
            return _ring_attention(module, query, key, value, cp["mesh"], scaling, dropout)
    key = _AllGatherSequence.apply(key, cp["group"])
    value = _AllGatherSequence.apply(value, cp["group"])
    base = cp["implementation"]
    if base == "eager" and attention_mask is not None:
        attention_mask = additive_mask(attention_mask, query.dtype)
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(base, eager_attention_forward)
    with sdpa_backend_context(module.config.sdpa_backends, query.device) if base == "sdpa" else nullcontext():
        return attention(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


def _ring_attention(module, query, key, value, mesh, scaling, dropout):
    """PyTorch's ring SDPA over `mesh` on DTensors sharded along the sequence (dim 2)."""
    from torch.distributed.tensor import DTensor, Shard
    from transformers.models.llama.modeling_llama import repeat_kv

    groups = module.num_key_value_groups
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)  # the ring kernels take equal head counts
    q, k, v = (DTensor.from_local(t.contiguous(), mesh, [Shard(2)], run_check=False) for t in (query, key, value))
    output = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=False,
                                                              scale=scaling)
    return output.to_local().transpose(1, 2).contiguous(), None


def _enable_ring_dispatch() -> None:
    """Route DTensor SDPA to ring attention, without load balancing (see the module docstring)."""
    try:  # torch >= 2.12 moved the module; the old path stays as a shim there
        from torch.distributed.tensor.experimental._context_parallel._attention import (
            _cp_options, _enable_cp_dtensor_dispatcher)
    except ImportError:
        from torch.distributed.tensor.experimental._attention import _cp_options, _enable_cp_dtensor_dispatcher

    _cp_options.enable_load_balance = False
    _enable_cp_dtensor_dispatcher()


def apply_context_parallel(model: nn.Module, cp_mesh, backend: str = "all_gather") -> None:
    """Make `model` (a `DLMForDiffusionLM`) context-parallel over the 1-D `cp_mesh` in place (see the module
    docstring). backend: "all_gather" or "ring" (CUDA + sdpa; batches that need a mask, i.e. padding or
    packed documents, still take the all-gather path)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    config = model.config
    implementation = config._attn_implementation or "eager"
    if backend not in CP_BACKENDS:
        raise ValueError(f"context parallel backend must be one of {CP_BACKENDS}, got {backend!r}")
    check_context_parallel_supported(config, implementation)
    if backend == "ring":
        if implementation != "sdpa" or cp_mesh.device_type != "cuda":
            raise ValueError("context parallel backend 'ring' needs attn_implementation='sdpa' on CUDA; "
                             f"got {implementation!r} on {cp_mesh.device_type!r} (use 'all_gather')")
        _enable_ring_dispatch()
    ALL_ATTENTION_FUNCTIONS[CP_ATTENTION] = context_parallel_attention
    state = {"mesh": cp_mesh, "group": cp_mesh.get_group(), "implementation": implementation, "backend": backend}
    for module in model.modules():
        if hasattr(module, "num_key_value_groups"):
            module._context_parallel = state
    config._attn_implementation = CP_ATTENTION
    model._cp_mesh = cp_mesh
    model.register_forward_pre_hook(_shard_inputs_hook, with_kwargs=True)


def check_context_parallel_supported(config, implementation: str) -> None:
    """Refuse what context parallel cannot run, with the reason."""
    if getattr(config, "attention_mode", "bidirectional") == "block":
        raise NotImplementedError(
            "context parallel with attention_mode='block' is not supported: block-diffusion training runs the "
            "two streams x_t and x_0 in one sequence, and both would need the same chunking")
    if implementation not in ("eager", "sdpa", CP_ATTENTION):
        raise NotImplementedError(f"context parallel takes attn_implementation 'sdpa' or 'eager', got {implementation!r}"
                                  " (flex and flash masks are built for a local sequence)")


def _shard_inputs_hook(model, args, kwargs):
    if args:
        raise TypeError("a context-parallel model takes keyword arguments only (input_ids=..., labels=...)")
    if kwargs.get("kv_cache") is not None or kwargs.get("clean_input_ids") is not None:
        raise NotImplementedError("context parallel runs training and scoring forwards, not cached generation")
    return (), shard_for_context_parallel(model, kwargs)


def shard_for_context_parallel(model, kwargs: dict) -> dict:
    """Whole-sequence model inputs -> this CP rank's chunk (see the module docstring)."""
    mesh = model._cp_mesh
    rank, size = mesh.get_local_rank(), mesh.size()
    kwargs = dict(kwargs)
    reference = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else kwargs["inputs_embeds"]
    batch, length = reference.shape[:2]
    device = reference.device
    if length % size:
        raise ValueError(f"context parallel size {size} must divide the sequence length {length}; pad the batch "
                         "(e.g. DLMDataCollator(pad_to_multiple_of=...))")
    chunk = length // size
    attention_mask = kwargs.get("attention_mask")
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError("a context-parallel model takes a 2D attention_mask (B, L)")
    padded = attention_mask is not None and not bool(attention_mask.all())
    position_ids = kwargs.get("position_ids")
    packed = position_ids is not None and bool((position_ids[:, 1:] == 0).any())
    if position_ids is None:  # as DLMModel: positions count real tokens
        position_ids = ((attention_mask.long().cumsum(-1) - 1).clamp(min=0) if attention_mask is not None
                        else torch.arange(length, device=device).expand(batch, -1))
    labels = kwargs.get("labels")
    if labels is not None and kwargs.get("num_items_in_batch") is None:
        kwargs["num_items_in_batch"] = (labels != -100).sum().clamp(min=1)  # global, before slicing
    mode = getattr(model.config, "attention_mode", "bidirectional")
    mask = None
    if padded or packed or mode != "bidirectional":
        mask_mod = make_mask_mod(mode, key_padding=None if attention_mask is None else attention_mask.bool(),
                                 document_ids=document_ids_from_position_ids(position_ids) if packed else None,
                                 blocks=block_ids(position_ids, model.config.block_size) if mode == "block" else None,
                                 query_offset=rank * chunk)
        mask = dense_mask(mask_mod, batch, chunk, length, device)  # (B, 1, L/cp, L): this chunk's rows
    kwargs["position_ids"] = position_ids
    for name in _SEQUENCE_INPUTS:
        if kwargs.get(name) is not None:
            kwargs[name] = kwargs[name][:, rank * chunk:(rank + 1) * chunk]
    kwargs["attention_mask"] = mask
    return kwargs
