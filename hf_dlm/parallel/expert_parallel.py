"""Expert parallelism, and the expert-bias update of the MoE routers under data / expert parallelism.

Expert parallelism: each rank of a 1-D mesh holds E / size of every MoE layer's experts and the
tokens travel to them and back by all-to-all (GShard / torchtitan's `ExpertParallel` layout).

The MoE block (`hf_dlm.modeling.moe.DLMSparseMoeBlock`) already hands its experts the assignments sorted
by expert (`tokens`, `counts`); under expert parallelism a forward pre-hook on `experts` sends each rank
the rows of its experts and regroups what arrives by local expert, and a forward hook undoes both. The
model code does not change, and the hooks rerun correctly under activation checkpointing.

Gradients: each rank's loss reaches a remote expert through the all-to-all's backward, so an expert's
gradient is the sum over the ranks that sent it tokens. Replicated parameters are averaged over those
ranks (FSDP2 / DDP), so expert gradients are divided by the group size to match: both then carry the
gradient of the mean of the ranks' losses, as a single process running every rank's micro-batch would.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from transformers import TrainerCallback

from ..modeling.moe import DLMExperts, DLMSparseMoeBlock, update_expert_bias


def _all_to_all(tokens: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    """Autograd-aware variable-size all-to-all of rows (its backward is the reverse all-to-all). The functional
    collective, as torchtitan uses: `torch.distributed.nn.functional.all_to_all_single` is deprecated."""
    return all_to_all_single_autograd(tokens.contiguous(), output_splits, input_splits, group)


def _dispatch(module: DLMExperts, args):
    """(tokens (T, H) sorted by global expert, counts (E,)) -> this rank's (tokens, counts (E_local,))."""
    tokens, counts = args
    group, size = module.ep_group, module.ep_size
    local_experts = counts.numel() // size
    # received_counts[r, j]: rows rank r sends to this rank's local expert j
    received_counts = torch.empty_like(counts)
    dist.all_to_all_single(received_counts, counts, group=group)
    received_counts = received_counts.view(size, local_experts)
    input_splits = counts.view(size, local_experts).sum(1).tolist()
    output_splits = received_counts.sum(1).tolist()
    received = _all_to_all(tokens, output_splits, input_splits, group)  # rows ordered (source rank, local expert)
    # regroup by local expert (stable: within an expert, rows stay in source-rank order)
    expert_of_row = torch.arange(local_experts, device=counts.device).repeat(size)
    expert_of_row = expert_of_row.repeat_interleave(received_counts.reshape(-1))
    order = expert_of_row.argsort(stable=True)
    module._ep_state = (order, input_splits, output_splits)
    return received.index_select(0, order), received_counts.sum(0)


def _combine(module: DLMExperts, args, output: torch.Tensor) -> torch.Tensor:
    """This rank's expert outputs -> the outputs of the rows it dispatched, in their original order."""
    order, input_splits, output_splits = module._ep_state
    module._ep_state = None
    unsorted = torch.empty_like(output).index_copy(0, order, output)  # back to (source rank, local expert)
    return _all_to_all(unsorted, input_splits, output_splits, module.ep_group)


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The grouped expert weights of every MoE layer (FSDP2 leaves them to expert parallelism)."""
    return [p for m in model.modules() if isinstance(m, DLMExperts) for p in (m.gate_up_proj, m.down_proj)]


def apply_expert_parallel(model: nn.Module, ep_mesh) -> nn.Module:
    """Shard every MoE layer's experts over the 1-D `ep_mesh` and dispatch tokens by all-to-all, in place.

    The grouped weights become DTensors `Shard(0)` on `ep_mesh` (so `torch.distributed.checkpoint` and
    `full_tensor()` see whole experts); every rank must hold the same full weights when this is called.
    Each rank routes its own tokens: the ranks of `ep_mesh` are data-parallel ranks (torchtitan lets EP
    borrow them from `dp_shard`). Returns `model`.
    """
    from torch.distributed.tensor import Shard, distribute_tensor

    if ep_mesh.ndim != 1:
        raise ValueError(f"apply_expert_parallel: ep_mesh must be 1-D, got a {ep_mesh.ndim}-D mesh")
    size = ep_mesh.size()
    num_experts = model.config.num_experts
    if not num_experts:
        raise ValueError("apply_expert_parallel: the model has no experts (config.num_experts = 0)")
    if num_experts % size:
        raise ValueError(f"apply_expert_parallel: num_experts ({num_experts}) must divide by the mesh size ({size})")
    group = ep_mesh.get_group()
    for module in model.modules():
        if not isinstance(module, DLMExperts) or getattr(module, "ep_group", None) is not None:
            continue
        for name in ("gate_up_proj", "down_proj"):
            weight = getattr(module, name)
            sharded = nn.Parameter(distribute_tensor(weight.data, ep_mesh, [Shard(0)]),
                                   requires_grad=weight.requires_grad)
            # remote ranks' tokens add their gradients here: divide by the group, as replicas are averaged
            sharded.register_hook(lambda grad, size=size: grad / size)
            setattr(module, name, sharded)
        module.ep_group, module.ep_size, module._ep_state = group, size, None
        module.register_forward_pre_hook(_dispatch)
        module.register_forward_hook(_combine)
    return model


class ExpertBiasUpdateCallback(TrainerCallback):
    """After every optimizer step, DeepSeek-V3's auxiliary-loss-free bias update of the MoE routers that have
    `moe_router_bias_update_rate > 0` (`hf_dlm.modeling.moe.update_expert_bias`), with each expert's load summed
    over `group`: the ranks that route different tokens (None: every process)."""

    def __init__(self, group=None):
        self.group = group

    def on_optimizer_step(self, args, state, control, model=None, **kwargs):
        update_expert_bias(model, self.group)


def expert_bias_callback(model: nn.Module, parallel=None) -> ExpertBiasUpdateCallback | None:
    """The callback a trainer adds for `model`, or None when no MoE layer updates its expert bias. `parallel`: the
    trainer's mesh layout (`trainer_parallel.ParallelTraining`), whose `dp_cp` ranks route different tokens and
    hold the same layers (pipeline stages stay apart); without one, every process."""
    if not any(isinstance(m, DLMSparseMoeBlock) and m.expert_bias is not None and m.bias_update_rate > 0
               for m in model.modules()):
        return None
    group = parallel.dims.meshes["dp_cp"].get_group() if parallel is not None else None
    return ExpertBiasUpdateCallback(group)


__all__ = ["apply_expert_parallel", "expert_parameters", "ExpertBiasUpdateCallback", "expert_bias_callback"]
