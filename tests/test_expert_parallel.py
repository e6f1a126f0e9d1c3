"""Expert parallelism on CPU: 2 gloo processes, each holding half of the experts and training on half of
every batch, reproduce a single process that runs both halves (loss and gradients within 1e-5, fp32),
alone, under FSDP2 and under FSDP2 with activation checkpointing; and under FSDP2 for the sigmoid router
(expert bias updated after every step from the loads of both ranks) and for expert choice. One launch covers
all layouts."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hf_dlm.diffusion.objective import MaskedDiffusionObjective
from hf_dlm.modeling.moe import update_expert_bias
from hf_dlm.parallel.parallelize import parallelize_dlm
from tests.utils import MASK_ID, VOCAB, tiny_model

BATCH, LENGTH, STEPS, WORLD = 4, 12, 2, 2
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, router_aux_loss_coef=0.1,
           router_z_loss_coef=0.01, shared_expert_intermediate_size=8)
ROUTERS = {  # router -> its options over MOE
    "softmax": {},
    "sigmoid": dict(moe_router="sigmoid", moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.05,
                    routed_scaling_factor=2.0, norm_topk_prob=True,
                    shared_expert_intermediate_size=0, n_shared_experts=1),
    "expert_choice": dict(moe_router="expert_choice", expert_choice_level="batch", expert_capacity_factor=1.5),
}
LAYOUTS = ("ep", "ep+fsdp", "ep+fsdp+checkpointing", "sigmoid ep+fsdp", "expert_choice ep+fsdp")


def _router(layout):
    return layout.split()[0] if " " in layout else "softmax"


def _model(router="softmax"):
    model = tiny_model("sdpa", **{**MOE, **ROUTERS[router]}).train()
    with torch.no_grad():  # a router far from uniform, so tokens really travel to both ranks unevenly
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 1.0)
    return model


def _batches():
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB - 1, (BATCH, LENGTH), generator=generator) for _ in range(STEPS)]


def _rows(rank):
    return slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)


def _full(tensor):
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor.detach().clone()


def _train(model, ranks, sync_grads=None):
    """STEPS of AdamW (lr 1e-2), each followed by the expert-bias update (loads summed over the processes);
    each step's loss is the mean over `ranks` of their rows' losses (the single process runs every rank's
    rows). Returns the losses, the first step's gradients and the final expert biases."""
    objective = MaskedDiffusionObjective(mask_token_id=MASK_ID, normalization="batch")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    losses, grads = [], None
    for step, batch in enumerate(_batches()):
        total = 0
        for rank in ranks:
            sample_index = torch.arange(step * BATCH, (step + 1) * BATCH)[_rows(rank)]
            loss, _ = objective(model, batch[_rows(rank)], sample_index)
            (loss / len(ranks)).backward()
            total = total + loss.detach() / len(ranks)
        if sync_grads is not None:
            sync_grads(model)
        if grads is None:
            grads = {name: _full(p.grad) for name, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
        update_expert_bias(model)
        losses.append(total)
    biases = [layer.mlp.expert_bias.clone() for layer in model.model.layers if layer.mlp.expert_bias is not None]
    return losses, grads, biases


def _average_replicated_grads(model):
    """Without FSDP the non-expert parameters are plain replicas: average their gradients (as DDP would)."""
    for parameter in model.parameters():
        if not hasattr(parameter, "full_tensor"):
            dist.all_reduce(parameter.grad, op=dist.ReduceOp.AVG)


def _worker(rank, init_file, out_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD,))
    results = {}
    for layout in LAYOUTS:
        fsdp = "fsdp" in layout
        model = parallelize_dlm(_model(_router(layout)), ep_mesh=mesh, dp_mesh=mesh if fsdp else None,
                                activation_checkpointing="checkpointing" in layout)
        local = model.model.layers[0].mlp.experts.gate_up_proj.to_local().shape[0]
        losses, grads, biases = _train(model, [rank], None if fsdp else _average_replicated_grads)
        for loss in losses:
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        results[layout] = (losses, grads, local, biases)
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


@pytest.fixture(scope="module")
def references():
    return {router: _train(_model(router), range(WORLD)) for router in ROUTERS}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_expert_parallel_matches_single_process(distributed_results, references, layout):
    losses, grads, local_experts, biases = distributed_results[layout]
    ref_losses, ref_grads, ref_biases = references[_router(layout)]
    assert local_experts == MOE["num_experts"] // WORLD  # each rank really holds half of the experts
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), rtol=0, atol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=0, atol=1e-5, msg=f"{layout} gradient of {name}")
    expert_grad = ref_grads["model.layers.0.mlp.experts.gate_up_proj"]
    assert (expert_grad.flatten(1).abs().sum(1) > 0).all()  # every expert received tokens: the test has teeth
    assert ref_grads["model.layers.0.mlp.gate.weight"].abs().sum() > 0
    assert len(biases) == len(ref_biases) == (2 if _router(layout) == "sigmoid" else 0)
    for bias, ref_bias in zip(biases, ref_biases):
        torch.testing.assert_close(bias, ref_bias, rtol=0, atol=1e-7)
    if biases:
        assert torch.stack(biases).abs().sum() > 0  # the updates moved some bias


def test_expert_parallel_rejects_indivisible_experts():
    from hf_dlm.parallel.expert_parallel import apply_expert_parallel

    class ThreeRanks:
        ndim = 1

        def size(self):
            return 3

    with pytest.raises(ValueError, match="num_experts \\(4\\) must divide"):
        apply_expert_parallel(_model(), ThreeRanks())
    with pytest.raises(ValueError, match="no experts"):
        apply_expert_parallel(tiny_model(), ThreeRanks())
