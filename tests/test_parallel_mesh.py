"""Named device meshes on CPU (4 gloo processes, one launch): tensor parallel with sequence-parallel norms
and the vocabulary-parallel head, context parallel (all-gather KV) with packed documents and padding cut by
chunk edges, FSDP2 x TP and FSDP2 x CP, all reproduce the single-process loss and gradients; the diffusion
noise is identical on every rank of a TP / CP group."""

import pytest
import torch
import torch.distributed as dist

from hf_dlm.parallel.mesh import ParallelDims
from hf_dlm.parallel.parallelize import parallelize_dlm, parallelize_from_dims
from hf_dlm.diffusion.objective import MaskedDiffusionObjective
from tests.utils import MASK_ID, VOCAB, tiny_model
from tests.utils import finish, spawn_workers

WORLD, BATCH, LENGTH, STEPS = 4, 4, 16, 2
# name -> (ParallelDims options, tied embeddings, activation checkpointing)
LAYOUTS = {
    "tp": (dict(dp_replicate=2, dp_shard=1, tp=2), False, False),
    "cp": (dict(dp_replicate=2, dp_shard=1, cp=2), False, False),
    "fsdp x tp": (dict(dp_shard=2, tp=2), True, False),
    "fsdp x cp": (dict(dp_shard=2, cp=2), False, True),
    "cp x tp": (dict(dp_shard=1, cp=2, tp=2), True, False),
}


def _batches():
    """Step 0: packed documents (lengths 5, 7, 4: boundaries inside both CP chunks); step 1: right padding."""
    generator = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, VOCAB - 1, (BATCH, LENGTH), generator=generator) for _ in range(STEPS)]
    positions = torch.cat([torch.arange(n) for n in (5, 7, 4)]).expand(BATCH, -1)
    padding = torch.ones(BATCH, LENGTH, dtype=torch.long)
    padding[1, 11:] = 0
    padding[3, 6:] = 0
    return [dict(input_ids=ids[0], position_ids=positions), dict(input_ids=ids[1], attention_mask=padding)]


def _train(model, rows=slice(None), record=None):
    """STEPS of AdamW (lr 1e-2) on `rows`; returns each step's loss (this rank's share) and step 1's gradients."""
    objective = MaskedDiffusionObjective(mask_token_id=MASK_ID, normalization="batch")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], None
    for step, batch in enumerate(_batches()):
        sample_index = torch.arange(step * BATCH, (step + 1) * BATCH)[rows]
        attention_mask = batch["attention_mask"][rows] if "attention_mask" in batch else None
        inputs = objective.corrupt(batch["input_ids"][rows], sample_index, attention_mask)
        if record is not None:
            record.append(torch.stack([inputs["input_ids"], inputs["masked"].long()]))
        kwargs = {k: v for k, v in inputs.items() if k not in ("t", "masked") and v is not None}
        if "position_ids" in batch:
            kwargs["position_ids"] = batch["position_ids"][rows]
        loss = model(**kwargs).loss
        loss.backward()
        if grads is None:
            grads = {name: _full(p.grad) for name, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses), grads


def _full(tensor):
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor.detach().clone()


def _worker(rank, init_file, out_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    results = {}
    for name, (options, tied, checkpointing) in LAYOUTS.items():
        dims = ParallelDims(world_size=WORLD, **options)
        dims.build_mesh("cpu")
        mesh = dims.meshes
        model = tiny_model("sdpa", tie_word_embeddings=tied).train()
        if dims.dp_replicate > 1:  # the replicate groups repeat the work: TP or CP alone, on their own meshes
            parallelize_dlm(model, tp_mesh=mesh["tp"] if dims.tp > 1 else None,
                            dp_mesh=mesh["dp_shard_cp"] if dims.cp > 1 else None,
                            cp_mesh=mesh["cp"] if dims.cp > 1 else None)
        else:
            parallelize_from_dims(model, dims, activation_checkpointing=checkpointing)
        # data parallel over dp_shard only (the dp_replicate groups of the "tp" / "cp" layouts repeat the work)
        dp_rank, dp = mesh["dp_shard"].get_local_rank(), dims.dp_shard
        rows = slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)
        record = []
        losses, grads = _train(model, rows, record)
        dist.all_reduce(losses, group=mesh["cp"].get_group())  # CP ranks hold shares of one loss
        if dp > 1:
            dist.all_reduce(losses, op=dist.ReduceOp.AVG, group=mesh["dp_shard"].get_group())
        noise = torch.stack(record)
        gathered = [torch.empty_like(noise) for _ in range(WORLD)]
        dist.all_gather(gathered, noise)
        dp_ranks = [None] * WORLD
        dist.all_gather_object(dp_ranks, dp_rank)
        results[name] = (losses, grads, gathered, dp_ranks)
    finish(results, out_file)


@pytest.fixture(scope="module")
def mesh_results():
    return spawn_workers(_worker, WORLD)


@pytest.fixture(scope="module")
def references():
    return {tied: _train(tiny_model("sdpa", tie_word_embeddings=tied).train()) for tied in (False, True)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process(mesh_results, references, layout):
    losses, grads, _, _ = mesh_results[layout]
    ref_losses, ref_grads = references[LAYOUTS[layout][1]]
    torch.testing.assert_close(losses, ref_losses, rtol=0, atol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=0, atol=1e-5, msg=f"{layout}: gradient of {name}")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_noise_identical_on_tensor_and_context_parallel_ranks(mesh_results, layout):
    """Every rank that reads the same rows (same data-parallel rank) draws the same masks and noisy ids."""
    _, _, noise, dp_ranks = mesh_results[layout]
    for rank in range(WORLD):
        peer = dp_ranks.index(dp_ranks[rank])
        torch.testing.assert_close(noise[rank], noise[peer], rtol=0, atol=0)
    assert len(set(dp_ranks)) == (2 if LAYOUTS[layout][0].get("dp_shard", 1) == 2 else 1)
