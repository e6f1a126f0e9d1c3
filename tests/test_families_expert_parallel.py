"""Expert parallelism on the MoE families (LLaDA-MoE's biased softmax router with a shared expert, LLaDA2's
group-limited sigmoid router with expert bias and dense first layer under block diffusion, SDAR-MoE's Qwen3-MoE
router): 2 gloo processes, each holding half of the experts and training on half of every batch, give the
single process's losses and gradients (fp32, 1e-5) over two AdamW steps. One launch covers the three."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import hf_dlm  # noqa: F401
from hf_dlm.diffusion.objective import MaskedDiffusionObjective
from hf_dlm.modeling.families import (
    LLaDA2MoeConfig, LLaDA2MoeModelLM, LLaDAMoEConfig, LLaDAMoEModelLM, SDARMoeConfig, SDARMoeForCausalLM,
)

V, MASK, BATCH, LENGTH, STEPS, WORLD = 64, 63, 4, 12, 2, 2
SHAPE = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
             num_experts=4, num_experts_per_tok=2, mask_token_id=MASK)
FAMILIES = {
    "lladamoe": lambda: LLaDAMoEModelLM(LLaDAMoEConfig(
        **SHAPE, dense_intermediate_size=64, expert_intermediate_size=16, shared_expert_intermediate_size=16,
        moe_layer_freq=[0, 1], qk_layernorm=True, partial_rotary_factor=0.5, moe_router_enable_expert_bias=True)),
    "llada2_moe": lambda: LLaDA2MoeModelLM(LLaDA2MoeConfig(
        **SHAPE, num_key_value_heads=2, intermediate_size=64, moe_intermediate_size=16, n_group=2, topk_group=1,
        num_shared_experts=1, first_k_dense_replace=1, partial_rotary_factor=0.5, use_bias=False, block_size=4)),
    "sdar_moe": lambda: SDARMoeForCausalLM(SDARMoeConfig(
        **SHAPE, intermediate_size=64, moe_intermediate_size=16, norm_topk_prob=True, block_size=4)),
}


def _model(name):
    torch.manual_seed(0)
    model = FAMILIES[name]()
    model.config._attn_implementation = "sdpa"
    with torch.no_grad():  # weights of O(1) effect, so hidden states (and routes) differ from token to token
        for param_name, param in model.named_parameters():
            if "norm" not in param_name:
                param.normal_(0, 0.3)
        for module in model.modules():
            if getattr(module, "expert_bias", None) is not None:
                module.expert_bias.normal_(0, 0.05)
    return model.train()


def _train(model, ranks, sync=None):
    objective = MaskedDiffusionObjective.from_model_config(model.config, normalization="batch")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    generator = torch.Generator().manual_seed(1)
    losses, grads = [], None
    for step in range(STEPS):
        batch = torch.randint(0, V - 1, (BATCH, LENGTH), generator=generator)
        total = 0
        for rank in ranks:
            rows = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
            loss, _ = objective(model, batch[rows], torch.arange(step * BATCH, (step + 1) * BATCH)[rows])
            (loss / len(ranks)).backward()
            total = total + loss.detach() / len(ranks)
        if sync is not None:
            sync(model)
        if grads is None:
            grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone())
                     for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return torch.stack(losses), grads


def _average_replicas(model):
    for parameter in model.parameters():
        if not hasattr(parameter, "full_tensor"):
            dist.all_reduce(parameter.grad, op=dist.ReduceOp.AVG)


def _worker(rank, init_file, out_file):
    from torch.distributed.device_mesh import init_device_mesh

    from hf_dlm.parallel.parallelize import parallelize_dlm

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    mesh = init_device_mesh("cpu", (WORLD,))
    results = {}
    for name in FAMILIES:
        model = parallelize_dlm(_model(name), ep_mesh=mesh)
        experts = next(m for m in model.modules() if hasattr(m, "gate_up_proj")).gate_up_proj
        losses, grads = _train(model, [rank], _average_replicas)
        dist.all_reduce(losses, op=dist.ReduceOp.AVG)
        results[name] = (losses, grads, experts.to_local().shape[0])
    if rank == 0:
        torch.save(results, out_file)
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def distributed_results():
    with tempfile.TemporaryDirectory() as folder:
        out_file = os.path.join(folder, "results.pt")
        mp.spawn(_worker, args=(os.path.join(folder, "init"), out_file), nprocs=WORLD, join=True)
        return torch.load(out_file)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_expert_parallel_family_equals_one_process(distributed_results, name):
    losses, grads, local_experts = distributed_results[name]
    ref_losses, ref_grads = _train(_model(name), range(WORLD))
    assert local_experts == SHAPE["num_experts"] // WORLD
    torch.testing.assert_close(losses, ref_losses, rtol=0, atol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for key, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[key], rtol=0, atol=1e-5, msg=f"{name}: gradient of {key}")
    expert_grad = next(g for k, g in ref_grads.items() if k.endswith("experts.gate_up_proj"))
    assert (expert_grad.flatten(1).abs().sum(1) > 0).all(), name  # every expert got tokens: the test has teeth
