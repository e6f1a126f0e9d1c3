"""Pipeline parallelism on CPU (gloo): PP=2 with each schedule, alone and composed with FSDP2=2 (a 2-D mesh
pp x dp_shard), gives the single-process loss and gradients of one gradient-accumulation window; the
splitter and the planning terms against hand-computed cases."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hf_dlm.parallel.pipeline import (DLMPipeline, DLMPipelineModel, DLMPipelineStageModule, PipelinePlan, check_pipeline_model,
                                      pipeline_schedule_terms, split_layers)
from hf_dlm.diffusion.objective import MaskedDiffusionObjective
from tests.utils import MASK_ID, VOCAB, tiny_model

LAYERS, MICRO_BATCHES, ROWS, LENGTH = 4, 4, 2, 12
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


def _model():
    return tiny_model("sdpa", num_hidden_layers=LAYERS).train()


def _micro_batches():
    """The corrupted micro-batches of one optimizer step (noise keyed by sample index) and their global
    number of supervised items (the loss normaliser of every micro-batch)."""
    objective = MaskedDiffusionObjective(mask_token_id=MASK_ID, normalization="token")
    generator = torch.Generator().manual_seed(3)
    batches = []
    for index in range(MICRO_BATCHES):
        ids = torch.randint(0, VOCAB - 1, (ROWS, LENGTH), generator=generator)
        inputs = objective.corrupt(ids, torch.arange(index * ROWS, (index + 1) * ROWS))
        batches.append({k: inputs[k] for k in ("input_ids", "labels", "label_weights")})
    items = sum((b["labels"] != -100).sum() for b in batches)
    return batches, items


def _reference():
    model = _model()
    batches, items = _micro_batches()
    total = 0.0
    for batch in batches:
        loss = model(**batch, num_items_in_batch=items).loss
        loss.backward()
        total += loss.detach()
    return total, {name: p.grad.clone() for name, p in model.named_parameters()}


def _pp_dp_mesh(rank, world_size, init_file):
    """A worker's gloo group and its (pp=2, dp_shard=2) mesh -> (mesh, dp rank, dp size)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp_shard"))
    return mesh, mesh["dp_shard"].get_local_rank(), mesh["dp_shard"].size()


def _dp_share(batches, items, dp_rank, dp_size):
    """A data-parallel rank's half of every micro-batch and its share of the normaliser (FSDP averages gradients)."""
    rows = slice(dp_rank * ROWS // dp_size, (dp_rank + 1) * ROWS // dp_size)
    return [{k: v[rows] for k, v in b.items()} for b in batches], items / dp_size


def _worker(rank, world_size, init_file, out_dir):
    mesh, dp_rank, dp_size = _pp_dp_mesh(rank, world_size, init_file)
    batches, items = _micro_batches()
    results = {}
    for schedule in SCHEDULES:
        for fsdp in (False, True):
            pipeline = DLMPipeline(_model(), pp_mesh=mesh["pp"], schedule=schedule,
                                   dp_mesh=mesh["dp_shard"] if fsdp else None)
            # FSDP: each data-parallel rank runs its half of every micro-batch; else every replica the whole batch
            inputs, normaliser = _dp_share(batches, items, dp_rank, dp_size) if fsdp else (batches, items)
            loss = pipeline.step(inputs, normaliser)
            if loss is not None and fsdp:
                loss = loss / dp_size  # this rank's share (the normaliser was divided by dp_size)
                dist.all_reduce(loss, group=mesh["dp_shard"].get_group())
            grads = {name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                     for name, p in pipeline.model.named_parameters()}
            norm = pipeline.clip_grad_norm_(float("inf"))
            results[(schedule, fsdp)] = (loss, grads, norm, [list(r) for r in pipeline.layer_ranges])
    # a window shorter than the pipeline (the end of an epoch): 1F1B needs m >= p, so it runs through GPipe
    pipeline = DLMPipeline(_model(), pp_mesh=mesh["pp"], schedule="1f1b")
    results["short window"] = (pipeline.step(batches[:1], items), type(pipeline._schedule).__name__)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def pipeline_results():
    with tempfile.TemporaryDirectory() as folder:
        # fork: the children reuse this interpreter's imports (spawning 4 fresh ones costs most of the test)
        mp.start_processes(_worker, args=(4, os.path.join(folder, "init"), folder), nprocs=4, start_method="fork")
        return [torch.load(os.path.join(folder, f"rank{r}.pt")) for r in range(4)]


@pytest.mark.parametrize("fsdp", [False, True], ids=["pp2", "pp2xfsdp2"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pipeline_matches_single_process(pipeline_results, schedule, fsdp):
    ref_loss, ref_grads = _reference()
    ranks = [r[(schedule, fsdp)] for r in pipeline_results]
    # ranks 0, 1: pp rank 0 (dp 0, 1); ranks 2, 3: pp rank 1, which holds the last stage and the loss
    assert ranks[0][0] is None and ranks[2][0] is not None
    for loss, _, _, _ in ranks[2:]:
        torch.testing.assert_close(loss, ref_loss.reshape(()), rtol=0, atol=1e-5)
    grads = {}
    for _, rank_grads, _, _ in ranks:
        grads.update(rank_grads)
    assert grads.keys() == ref_grads.keys()  # every parameter once, under its save_pretrained name
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=0, atol=1e-5, msg=f"{schedule} gradient of {name}")
    total_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in ref_grads.values()]))
    for _, _, norm, _ in ranks:  # the clipping norm spans every stage and shard
        torch.testing.assert_close(norm, total_norm, rtol=1e-5, atol=0)
    if schedule == "interleaved_1f1b":  # 4 stages of one layer: pp rank 0 holds stages 0 and 2
        assert ranks[0][3] == [[0], [2]] and ranks[2][3] == [[1], [3]]
    else:
        assert ranks[0][3] == [[0, 1]] and ranks[2][3] == [[2, 3]]


MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, router_aux_loss_coef=0.5,
           router_z_loss_coef=0.1, mlp_only_layers=[0])  # layer 0 dense, layers 1-3 MoE: stages of unequal MoE counts


def _moe_reference(dp_size):
    """Loss and gradients of the unsplit MoE model over the window, as DLMTrainer forms them: the cross-entropy
    over the global normaliser plus each micro-batch's router loss / micro-batches; with data parallelism
    the router losses are per data-parallel shard of the rows, averaged over the shards."""
    model = tiny_model("sdpa", num_hidden_layers=LAYERS, **MOE).train()
    batches, items = _micro_batches()
    cross_entropy, routers = 0.0, torch.zeros(2)
    for batch in batches:
        for shard in range(dp_size):
            rows = slice(shard * ROWS // dp_size, (shard + 1) * ROWS // dp_size)
            out = model(**{k: v[rows] for k, v in batch.items()}, num_items_in_batch=items)
            (out.loss - out.router_loss + out.router_loss / (MICRO_BATCHES * dp_size)).backward()
            cross_entropy += (out.loss - out.router_loss).detach()
            routers += torch.stack([out.aux_loss, out.router_z_loss]).detach() / dp_size
    return cross_entropy, routers, {name: p.grad.clone() for name, p in model.named_parameters()}


def _moe_worker(rank, world_size, init_file, out_dir):
    mesh, dp_rank, dp_size = _pp_dp_mesh(rank, world_size, init_file)
    batches, items = _micro_batches()
    results = {}
    for schedule, fsdp in (("1f1b", False), ("interleaved_1f1b", False), ("1f1b", True)):
        pipeline = DLMPipeline(tiny_model("sdpa", num_hidden_layers=LAYERS, **MOE).train(), pp_mesh=mesh["pp"],
                               schedule=schedule, dp_mesh=mesh["dp_shard"] if fsdp else None)
        inputs, normaliser = _dp_share(batches, items, dp_rank, dp_size) if fsdp else (batches, items)
        loss = pipeline.step(inputs, normaliser)
        routers = pipeline.router_totals()
        if fsdp:
            routers = routers / dp_size
            dist.all_reduce(routers, group=mesh["dp_shard"].get_group())
            if loss is not None:
                loss = loss / dp_size
                dist.all_reduce(loss, group=mesh["dp_shard"].get_group())
        grads = {name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                 for name, p in pipeline.model.named_parameters()}
        results[(schedule, fsdp)] = (loss, routers, grads)
    torch.save(results, os.path.join(out_dir, f"moe_rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def test_moe_pipeline_matches_single_process():
    """Router losses never cross stages: each stage ties its own into the backward. Gradients, the loss and the
    logged router losses equal the unsplit model's, with PP=2, interleaved (4 stages) and PP=2 x FSDP2=2."""
    with tempfile.TemporaryDirectory() as folder:
        mp.start_processes(_moe_worker, args=(4, os.path.join(folder, "init"), folder), nprocs=4, start_method="fork")
        ranks = [torch.load(os.path.join(folder, f"moe_rank{r}.pt")) for r in range(4)]
    for (schedule, fsdp) in ranks[0]:
        ref_loss, ref_routers, ref_grads = _moe_reference(2 if fsdp else 1)
        assert ref_routers[0] > 0 and ref_routers[1] > 0
        torch.testing.assert_close(ranks[2][(schedule, fsdp)][0], ref_loss.reshape(()), rtol=0, atol=1e-5)
        grads = {}
        for rank in ranks:
            _, routers, rank_grads = rank[(schedule, fsdp)]
            torch.testing.assert_close(routers, ref_routers, rtol=0, atol=1e-5)  # the same on every rank
            grads.update(rank_grads)
        assert grads.keys() == ref_grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref_grads[name], rtol=0, atol=1e-5, msg=f"{schedule} {fsdp}: {name}")


def test_short_window_runs_through_gpipe(pipeline_results):
    model = _model()
    batches, items = _micro_batches()
    expected = model(**batches[0], num_items_in_batch=items).loss
    loss, schedule = pipeline_results[2]["short window"]
    assert schedule == "ScheduleGPipe" and pipeline_results[0]["short window"][0] is None
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-6)


def test_split_layers_and_plan():
    assert [list(r) for r in split_layers(5, 2)] == [[0, 1, 2], [3, 4]]
    assert [list(r) for r in split_layers(6, 3, [1, 5])] == [[0], [1, 2, 3, 4], [5]]
    for bad in ([3, 1], [0, 2], [2]):
        with pytest.raises(ValueError, match="split_points"):
            split_layers(6, 3, bad)
    with pytest.raises(ValueError, match="at least one layer"):
        split_layers(2, 3)
    model = _model()
    plan = PipelinePlan.from_model(model)
    assert plan == PipelinePlan(("embed_tokens",), "layers", ("norm",), ("lm_head",))
    last = DLMPipelineStageModule(model, range(2, 4), False, True, plan)
    owned = ("model.layers.2.", "model.layers.3.", "model.norm", "lm_head")
    assert sorted(last.state_dict()) == sorted(k for k in model.state_dict() if k.startswith(owned))
    with pytest.raises(NotImplementedError, match="tie_word_embeddings"):
        check_pipeline_model(tiny_model(tie_word_embeddings=True))


def test_stages_chained_equal_the_model():
    """Three stages run one after another give the model's own loss (the stage forward, no schedule)."""
    model = _model()
    batches, items = _micro_batches()
    plan = PipelinePlan.from_model(model)
    stages = [DLMPipelineStageModule(model, r, i == 0, i == 2, plan) for i, r in enumerate(split_layers(LAYERS, 3))]
    stages[-1].loss_normaliser = items
    hidden = batches[0]["input_ids"]
    for stage in stages:
        hidden = stage(hidden, labels=batches[0]["labels"], label_weights=batches[0]["label_weights"])
    expected = model(**batches[0], num_items_in_batch=items).loss
    torch.testing.assert_close(hidden, expected.reshape(1), rtol=0, atol=1e-6)


def test_activation_checkpointing_on_the_stages_changes_no_gradient():
    """What the Trainer calls for gradient_checkpointing (either transformers name) on a rank's stages."""
    batches, items = _micro_batches()
    grads = []
    for checkpointing in (False, True):
        model = _model()
        plan = PipelinePlan.from_model(model)
        stages = [DLMPipelineStageModule(model, r, i == 0, i == 1, plan) for i, r in enumerate(split_layers(LAYERS, 2))]
        held = DLMPipelineModel(model.config, stages)
        if checkpointing:
            held.activation_checkpointing_enable(every_n_layers=2)
            assert [layer.gradient_checkpointing for layer in held.model.layers.values()] == [True, False, True, False]
            held.gradient_checkpointing_enable({"use_reentrant": False})
        stages[-1].loss_normaliser = items
        hidden = batches[0]["input_ids"]
        for stage in stages:
            hidden = stage(hidden, labels=batches[0]["labels"], label_weights=batches[0]["label_weights"])
        hidden.sum().backward()
        grads.append({name: p.grad for name, p in held.named_parameters()})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == len(list(_model().parameters()))
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=0, atol=1e-6, msg=name)


def test_schedule_terms_by_hand():
    # GPipe / 1F1B: bubble (p - 1) / (m + p - 1); p = 4, m = 8 -> 3 / 11
    gpipe = pipeline_schedule_terms(32, 4, 8, "gpipe")
    one = pipeline_schedule_terms(32, 4, 8, "1f1b")
    assert gpipe["bubble_fraction"] == one["bubble_fraction"] == 3 / 11
    # 8 layers per rank; GPipe holds all 8 micro-batches' activations, 1F1B at most p = 4 on rank 0
    assert gpipe["layers_per_rank"] == 8 and gpipe["in_flight_layers"] == 64 and one["in_flight_layers"] == 32
    # interleaved, v = 2: bubble 3 / (16 + 3); 8 stages of 4 layers; rank 0 warms up (v-1) * 4 + 2 * 3 = 10
    # chunks, the 11th forward before its first backward
    inter = pipeline_schedule_terms(32, 4, 8, "interleaved_1f1b")
    assert inter["bubble_fraction"] == 3 / 19 and inter["num_stages"] == 8
    assert inter["layers_per_rank"] == 8 and inter["in_flight_layers"] == 11 * 4
    sized = pipeline_schedule_terms(32, 4, 8, "1f1b", layer_state_bytes=100.0, layer_activation_bytes=10.0)
    assert sized["memory_bytes"] == 8 * 100 + 32 * 10
    with pytest.raises(ValueError, match="schedule must be one of"):
        pipeline_schedule_terms(32, 4, 8, "zb")
