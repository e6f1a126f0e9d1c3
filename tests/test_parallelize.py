"""parallelize_dlm on CPU: FSDP2 and tensor parallel over 2 gloo processes reproduce the single-process loss
and gradients; activation checkpointing and per-block compile change no numbers, names or attention."""

import pytest
import torch
import torch.distributed as dist

from hf_dlm.diffusion.objective import MaskedDiffusionObjective
from hf_dlm.parallel.parallelize import parallelize_dlm
from tests.utils import MASK_ID, VOCAB, tiny_model
from tests.utils import finish, spawn_workers

BATCH, LENGTH, STEPS = 4, 12, 2
FLOAT8_MIN = 32  # q/o and the MLP of tiny_model (hidden 32, ffn 64) go to float8, k/v (32 -> 16) stay


def _batches():
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB - 1, (BATCH, LENGTH), generator=generator) for _ in range(STEPS)]


def _objective():
    return MaskedDiffusionObjective(mask_token_id=MASK_ID, normalization="batch")


def _train(model, rows=slice(None), after_step=None):
    """STEPS of AdamW on `rows` of each batch (`after_step(model)` after each optimizer step); returns the
    losses and the first step's gradients."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], None
    for step, batch in enumerate(_batches()):
        sample_index = torch.arange(step * BATCH, (step + 1) * BATCH)[rows]
        loss, _ = _objective()(model, batch[rows], sample_index)
        loss.backward()
        if grads is None:
            grads = {name: _full(p.grad) for name, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
        if after_step is not None:
            after_step(model)
        losses.append(loss.detach())
    return losses, grads


def _full(tensor):
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor.detach().clone()


def _worker(rank, init_file, out_file, world_size):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    results = {}
    # FSDP2: each rank trains on its half of every batch (data parallel), gradients averaged
    model = parallelize_dlm(tiny_model("sdpa").train(), dp_mesh=mesh)
    rows = slice(rank * BATCH // world_size, (rank + 1) * BATCH // world_size)
    losses, grads = _train(model, rows)
    for loss in losses:
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
    results["fsdp"] = (losses, grads)
    # the full stack in torchtitan's order: checkpointing, per-block compile, then FSDP2
    model = parallelize_dlm(tiny_model("sdpa").train(), dp_mesh=mesh, activation_checkpointing=True, compile=True,
                            compile_options={"backend": "aot_eager"})
    losses, grads = _train(model, rows)
    for loss in losses:
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
    results["fsdp+checkpointing+compile"] = (losses, grads)
    # float8 (tensorwise) under FSDP2, weights cast after the all-gather or all-gathered in float8; every
    # rank trains on the whole batch, since float8 input scales depend on the rows a rank sees
    from hf_dlm.parallel.float8 import precompute_float8_scales

    for layout, all_gather in (("fsdp+float8", False), ("fsdp+float8 all-gather", True)):
        model = parallelize_dlm(tiny_model("sdpa").train(), dp_mesh=mesh, float8_recipe="tensorwise",
                                float8_min_features=FLOAT8_MIN, float8_fsdp_all_gather=all_gather)
        results[layout] = _train(model, after_step=precompute_float8_scales)
        local_weight = model.model.layers[0].mlp.up_proj.weight._local_tensor  # which path really ran
        results[layout + " weight"] = (type(local_weight).__name__, getattr(local_weight, "_precomputed_scale", None))
    # hf-dlm's delayed float8 under FSDP2: scales from the amax history, which each rank keeps itself
    model = parallelize_dlm(tiny_model("sdpa").train(), dp_mesh=mesh, float8_recipe="delayed",
                            float8_min_features=FLOAT8_MIN)
    results["fsdp+float8 delayed"] = _train(model)
    up_proj = model.model.layers[0].mlp.up_proj  # the history filled: step 2 scaled from it
    results["fsdp+float8 delayed weight"] = (type(up_proj.weight._local_tensor).__name__,
                                             up_proj.scales_ready and bool((up_proj.amax_history[:, :STEPS] > 0).all()))
    # tensor parallel: every rank sees the whole batch, each holds half of the heads and MLP columns
    model = parallelize_dlm(tiny_model("sdpa").train(), tp_mesh=mesh)
    results["tp"] = _train(model)
    finish(results, out_file)


@pytest.fixture(scope="module")
def distributed_results():
    return spawn_workers(_worker, 2, 2)


@pytest.fixture(scope="module")
def reference():
    return _train(tiny_model("sdpa").train())


@pytest.mark.parametrize("layout", ["fsdp", "fsdp+checkpointing+compile", "tp"])
def test_two_process_matches_single_process(distributed_results, reference, layout):
    losses, grads = distributed_results[layout]
    ref_losses, ref_grads = reference
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), rtol=0, atol=1e-6)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=0, atol=1e-6, msg=f"{layout} gradient of {name}")
    assert ref_grads["model.layers.0.self_attn.q_norm.weight"].abs().sum() > 0  # the TP norm hook has work to do


@pytest.mark.parametrize("layout", ["fsdp+float8", "fsdp+float8 all-gather", "fsdp+float8 delayed"])
def test_two_process_float8_matches_single_process(distributed_results, layout):
    """Float8 under FSDP2, with weights cast after the all-gather or all-gathered in float8 with scales
    precomputed after each optimizer step, or hf-dlm's delayed scaling: the single process's numbers,
    within 1e-6."""
    recipe = "delayed" if layout.endswith("delayed") else "tensorwise"
    reference = _train(parallelize_dlm(tiny_model("sdpa").train(), float8_recipe=recipe,
                                       float8_min_features=FLOAT8_MIN))
    losses, grads = distributed_results[layout]
    torch.testing.assert_close(torch.stack(losses), torch.stack(reference[0]), rtol=0, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, reference[1][name], rtol=0, atol=1e-6, msg=f"{layout} gradient of {name}")
    weight_type, precomputed_scale = distributed_results[layout + " weight"]
    if layout.endswith("all-gather"):  # sharded as torchao's float8-cast weight, its scale set after the step
        assert weight_type == "WeightWithDynamicFloat8CastTensor" and precomputed_scale is not None
    elif layout.endswith("delayed"):  # here the second entry says the amax history was recorded
        assert weight_type == "Tensor" and precomputed_scale is True
    else:
        assert weight_type == "Tensor" and precomputed_scale is None


def test_activation_checkpointing_gives_the_same_gradients(reference):
    model = parallelize_dlm(tiny_model("sdpa").train(), activation_checkpointing=True)
    assert all(layer.gradient_checkpointing for layer in model.model.layers)
    losses, grads = _train(model)
    torch.testing.assert_close(torch.stack(losses), torch.stack(reference[0]), rtol=0, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, reference[1][name], rtol=0, atol=1e-6)


def _first_row_influence(model, ids):
    """Which query positions' hidden states change when the last token changes."""
    changed = ids.clone()
    changed[0, -1] = (changed[0, -1] + 1) % (VOCAB - 1)
    with torch.no_grad():
        before, after = model.model(ids).last_hidden_state, model.model(changed).last_hidden_state
    return (before - after).abs().amax(-1)[0] > 0


def test_per_block_compile_stays_bidirectional_and_exact():
    eager = tiny_model("sdpa")
    model = tiny_model("sdpa")
    keys = list(model.state_dict())
    parallelize_dlm(model, compile=True, activation_checkpointing=True, compile_options={"backend": "aot_eager"})
    assert list(model.state_dict()) == keys  # in-place compile: save_pretrained keys unchanged
    assert model.compile_loss_head
    ids = torch.randint(0, VOCAB - 1, (2, 10))
    assert _first_row_influence(model, ids).all()  # position 0 sees the last token under compile
    model.train(), eager.train()
    sample_index = torch.arange(2)
    loss, _ = _objective()(model, ids, sample_index)
    loss.backward()
    eager_loss, _ = _objective()(eager, ids, sample_index)
    eager_loss.backward()
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6)
    for (name, p), (_, q) in zip(model.named_parameters(), eager.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_tensor_parallel_rejects_indivisible_heads():
    from hf_dlm.parallel.parallelize import apply_tensor_parallel

    class FakeMesh:
        def size(self):
            return 3

    with pytest.raises(ValueError, match="num_attention_heads"):
        apply_tensor_parallel(tiny_model(), FakeMesh())


def test_bidirectional_sdpa_runs_mask_free(monkeypatch):
    """No padding, bidirectional: SDPA gets no mask and is_causal=False, so the fastest kernel (cuDNN on
    Hopper) can run; also inside a compiled block."""
    import torch.nn.functional as F

    calls = []
    original = F.scaled_dot_product_attention

    def recording_sdpa(*args, **kwargs):
        calls.append((kwargs.get("attn_mask"), kwargs.get("is_causal")))
        return original(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording_sdpa)
    for compile in (False, True):
        calls.clear()
        model = parallelize_dlm(tiny_model("sdpa"), compile=compile, compile_options={"backend": "eager"})
        with torch.no_grad():
            model(torch.randint(0, VOCAB - 1, (2, 8)))
        assert len(calls) == 2 and all(mask is None and causal is False for mask, causal in calls), calls


def test_low_precision_residual_runs_the_layers_in_bf16():
    """The residual stream between layers is bf16 under autocast (fp32 without the option, from the fp32
    embeddings); outside autocast nothing changes, and training stays close to the fp32-residual run."""
    seen = []
    ids = torch.randint(0, VOCAB - 1, (2, 10))
    losses = []
    for low in (False, True):
        model = parallelize_dlm(tiny_model("sdpa").train(), low_precision_residual=low)
        model.model.layers[1].register_forward_pre_hook(lambda module, args: seen.append(args[0].dtype))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, _ = _objective()(model, ids, torch.arange(2))
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters())
        losses.append(loss.detach())
        with torch.no_grad():
            model(ids)  # no autocast: fp32 throughout
    assert seen == [torch.float32, torch.float32, torch.bfloat16, torch.float32]
    torch.testing.assert_close(losses[1], losses[0], rtol=0.02, atol=0)
    parallelize_dlm(model, low_precision_residual=True)  # applying it twice keeps one hook
    assert len(model.model.embed_tokens._forward_hooks) == 1
