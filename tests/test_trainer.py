"""DLMTrainer on CPU: exact resume, atomic checkpoints, gradient accumulation, logged statistics."""

import math
import os

import pytest
import torch
import torch.nn.functional as F
from transformers.trainer_utils import get_last_checkpoint

from hf_dlm.training.trainer import DATA_STATE_NAME, STAGING_DIR
from tests.utils import VOCAB
from tests.utils import SEQ_LEN, StopAfter, flat_params, make_trainer, random_dataset, window_stream


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    """10 uninterrupted steps (24 samples, batch 4: the run crosses an epoch boundary)."""
    trainer = make_trainer(tmp_path_factory.mktemp("straight"), save_strategy="steps", save_steps=5)
    trainer.train()
    return trainer.step_losses, flat_params(trainer.model), trainer.sample_indices


def test_resume_reproduces_the_uninterrupted_run(straight_run, tmp_path):
    losses, params, indices = straight_run
    assert len(losses) == 10 and len(set(indices)) == 40  # sample indices stay unique across epochs
    first = make_trainer(tmp_path, save_strategy="steps", save_steps=5)
    first.add_callback(StopAfter(5))  # interrupted after the checkpoint of step 5
    first.train()
    resumed = make_trainer(tmp_path, model_seed=1, save_strategy="steps", save_steps=5)  # other init: must be overwritten
    resumed.train(resume_from_checkpoint=True)
    assert first.sample_indices + resumed.sample_indices == indices
    torch.testing.assert_close(torch.tensor(first.step_losses + resumed.step_losses, dtype=torch.float64),
                               torch.tensor(losses, dtype=torch.float64), rtol=0, atol=1e-6)
    torch.testing.assert_close(flat_params(resumed.model), params, rtol=0, atol=1e-6)


def test_interrupted_save_leaves_the_previous_checkpoint_loadable(straight_run, tmp_path):
    _, params, _ = straight_run
    trainer = make_trainer(tmp_path, save_strategy="steps", save_steps=5)

    def crash(output_dir):  # the process dies after the model and optimizer of step 10 were written
        if trainer.state.global_step == 10:
            raise RuntimeError("simulated crash during save")

    trainer._save_rng_state = crash
    with pytest.raises(RuntimeError, match="simulated crash"):
        trainer.train()
    assert os.path.isfile(tmp_path / STAGING_DIR / "checkpoint-10" / "model.safetensors")  # the partial save
    assert not os.path.exists(tmp_path / "checkpoint-10")
    assert get_last_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-5")

    resumed = make_trainer(tmp_path, model_seed=1, save_strategy="steps", save_steps=5)
    resumed.train(resume_from_checkpoint=True)
    torch.testing.assert_close(flat_params(resumed.model), params, rtol=0, atol=1e-6)
    assert get_last_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-10")
    assert not os.path.exists(tmp_path / STAGING_DIR)  # the stale partial save was replaced and published


@pytest.mark.parametrize("preset,normalization", [("mdlm", "token"), ("mdlm", "masked"), ("llada", "batch"),
                                                  ("llada", "sequence")])
def test_gradient_accumulation_4x1_equals_1x4(tmp_path, preset, normalization):
    runs = []
    for batch, accumulation in ((1, 4), (4, 1)):
        trainer = make_trainer(tmp_path / f"{batch}x{accumulation}", per_device_train_batch_size=batch,
                               gradient_accumulation_steps=accumulation, max_steps=1, optim="sgd",
                               max_grad_norm=0.0, objective_preset=preset, normalization=normalization,
                               random_length_prob=0.0, warmup_steps=0, lr_scheduler_type="constant")
        trainer.train()
        runs.append(trainer)
    accumulated, whole = runs
    assert whole.state.log_history[0]["learning_rate"] > 0  # the compared step moves the parameters
    assert not torch.equal(flat_params(whole.model), flat_params(make_trainer(tmp_path / "init").model))
    assert accumulated.sample_indices == whole.sample_indices
    assert math.isclose(accumulated.step_losses[0], whole.step_losses[0], rel_tol=1e-6)
    assert math.isclose(accumulated.state.log_history[0]["loss"], whole.state.log_history[0]["loss"], rel_tol=1e-6)
    for name, grad in whole.grads[0].items():
        torch.testing.assert_close(accumulated.grads[0][name], grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(flat_params(accumulated.model), flat_params(whole.model), rtol=1e-5, atol=1e-7)


def test_logs_throughput_mfu_masked_fraction_and_ce_by_t(tmp_path):
    import copy

    trainer = make_trainer(tmp_path, max_steps=1, t_buckets=2, peak_flops=1e12)
    initial = copy.deepcopy(trainer.model).eval()
    trainer.train()
    log = trainer.state.log_history[0]
    assert log["tokens_per_second"] > 0 and log["tokens_per_second"] == log["tokens_per_second_per_device"]
    n_params = sum(p.numel() for p in initial.parameters())
    flops_per_token = 6 * n_params + 12 * 2 * 32 * SEQ_LEN
    assert math.isclose(log["mfu"], log["tokens_per_second"] * flops_per_token / 1e12, rel_tol=1e-3)

    # masked fraction and CE by t bucket, recomputed from the step's corrupted batch with the initial model
    (batch,) = trainer.batches[0]
    masked = batch["labels"] != -100
    assert math.isclose(log["masked_fraction"], masked.float().mean().item(), rel_tol=1e-6)
    logits = initial(input_ids=batch["input_ids"]).logits  # (B, L, V)
    if trainer.objective.subs:  # the default preset (mdlm) removes [MASK] from the softmax (MDLM's SUBS)
        logits[..., trainer.objective.mask_token_id] = float("-inf")
    ce = F.cross_entropy(logits.transpose(1, 2), batch["labels"].clamp(min=0), reduction="none") * masked
    t = batch["_dlm_stats"]["t"]
    for lo, hi in ((0.0, 0.5), (0.5, 1.0)):
        rows = (t >= lo) & (t < hi)
        key = f"ce_t/{lo:.2f}-{hi:.2f}"
        if masked[rows].sum() == 0:
            assert key not in log
            continue
        expected = (ce[rows].sum() / masked[rows].sum()).item()
        assert math.isclose(log[key], expected, rel_tol=1e-4), (key, log[key], expected)


def test_evaluate_reports_the_elbo_bound(tmp_path):
    from hf_dlm.diffusion.elbo import elbo_nll

    trainer = make_trainer(tmp_path, per_device_eval_batch_size=4, eval_mc_num=2)
    eval_set = random_dataset(8, seed=1)
    metrics = trainer.evaluate(eval_set)
    model = trainer.model.eval()
    assert trainer.objective.subs  # the default preset's SUBS reaches the evaluation
    parts = [elbo_nll(model, eval_set.input_ids[i:i + 4], mc_num=2, seed=step, subs=True)
             for step, i in enumerate((0, 4))]
    expected = sum(float(p["per_sequence"].sum()) for p in parts) / (8 * SEQ_LEN)
    assert math.isclose(metrics["eval_nll_per_token"], expected, rel_tol=1e-5)
    assert metrics["eval_num_tokens"] == 8 * SEQ_LEN and metrics["eval_loss"] == metrics["eval_nll_per_token"]
    assert math.isclose(metrics["eval_perplexity_bound"], math.exp(expected), rel_tol=1e-5)
    assert expected == pytest.approx(math.log(VOCAB), rel=0.2)  # an untrained model is near uniform


def test_stream_dataset_resumes_from_its_saved_position(tmp_path):
    ids = random_dataset(10).input_ids

    def run(directory, stop=None, resume=None, seed=0):
        trainer = make_trainer(directory, dataset=window_stream(ids, seed=3), model_seed=seed,
                               save_strategy="steps", save_steps=3, max_steps=6, per_device_train_batch_size=2)
        if stop:
            trainer.add_callback(StopAfter(stop))
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    straight = run(tmp_path / "straight")
    first = run(tmp_path / "split", stop=3)
    assert torch.load(tmp_path / "split" / "checkpoint-3" / DATA_STATE_NAME.format(rank=0)) == {"consumed_samples": 6}
    resumed = run(tmp_path / "split", resume=True, seed=1)
    assert first.sample_indices + resumed.sample_indices == straight.sample_indices == list(range(12))
    # `epoch` counts passes over the 10 windows (the Trainer alone would count fractions of max_steps)
    epochs = [log["epoch"] for log in straight.state.log_history if "loss" in log]
    assert epochs == [0.2, 0.4, 0.6, 0.8, 1.0, 1.2]
    assert [log["epoch"] for log in resumed.state.log_history if "loss" in log][-1] == 1.2
    torch.testing.assert_close(torch.tensor(first.step_losses + resumed.step_losses),
                               torch.tensor(straight.step_losses), rtol=0, atol=1e-6)
    torch.testing.assert_close(flat_params(resumed.model), flat_params(straight.model), rtol=0, atol=1e-6)


def test_best_checkpoint_and_rotation_point_at_published_folders(tmp_path):
    import json

    trainer = make_trainer(tmp_path, max_steps=6, save_strategy="steps", save_steps=2, eval_strategy="steps",
                           eval_steps=2, eval_mc_num=1, load_best_model_at_end=True, save_total_limit=1,
                           eval_dataset=random_dataset(4, seed=1))
    trainer.train()
    best = trainer.state.best_model_checkpoint
    assert best.startswith(str(tmp_path / "checkpoint-")) and os.path.isdir(best)
    checkpoints = sorted(p for p in os.listdir(tmp_path) if p.startswith("checkpoint-"))
    assert len(checkpoints) <= 2 and not os.path.exists(tmp_path / STAGING_DIR)  # rotation kept the best (+ last)
    for name in checkpoints:
        state = json.load(open(tmp_path / name / "trainer_state.json"))
        assert STAGING_DIR not in (state["best_model_checkpoint"] or "")


def test_sft_batches_never_supervise_prompt_or_padding(tmp_path):
    from hf_dlm.data.collator import DLMDataCollator

    trainer = make_trainer(tmp_path, objective_preset="llada", normalization="sequence", random_length_prob=0.0)
    features = [{"input_ids": torch.arange(1, 1 + n), "prompt_mask": torch.arange(n) < 3, "sample_index": i}
                for i, n in enumerate((6, 10, 8, 12))]
    batch = trainer._corrupt(DLMDataCollator()(features), "cpu")
    lengths = torch.tensor([6, 10, 8, 12]).unsqueeze(1)
    positions = torch.arange(12).unsqueeze(0)
    supervised = batch["labels"] != -100
    assert not supervised[:, :3].any() and not supervised[positions >= lengths].any() and supervised.any()
    assert torch.equal(batch["attention_mask"], (positions < lengths).long())
    assert batch["_dlm_stats"]["items"] == 4  # "sequence": one item per row
    loss = trainer.compute_loss(trainer.model.train(), batch)
    assert torch.isfinite(loss) and loss > 0


def test_compile_blocks_and_fp8_recipe_go_through_parallelize(tmp_path, monkeypatch):
    """compile_blocks compiles every decoder layer in place (same losses as eager); fp8_recipe reaches
    parallelize_dlm's float8 conversion before accelerate wraps the model."""
    eager = make_trainer(tmp_path / "eager", max_steps=2)
    eager.train()
    compiled = make_trainer(tmp_path / "compiled", max_steps=2, compile_blocks=True)
    layers = compiled.accelerator.unwrap_model(compiled.model).model.layers
    assert all(layer._compiled_call_impl is not None for layer in layers)
    compiled.train()
    torch.testing.assert_close(torch.tensor(compiled.step_losses), torch.tensor(eager.step_losses), rtol=1e-5, atol=1e-5)

    from hf_dlm.parallel import parallelize

    calls = []
    names = ("float8_recipe", "float8_fast_accum", "float8_min_features", "low_precision_residual", "compile")
    monkeypatch.setattr(parallelize, "parallelize_dlm",
                        lambda model, options: calls.append({k: getattr(options, k) for k in names}) or model)
    make_trainer(tmp_path / "fp8", fp8_recipe="rowwise")
    make_trainer(tmp_path / "fp8-fast", fp8_recipe="tensorwise", fp8_fast_accum=True)
    make_trainer(tmp_path / "residual", bf16=True, low_precision_residual=True)
    off = {"float8_fast_accum": False, "float8_min_features": 2048, "low_precision_residual": False, "compile": False}
    assert calls == [{**off, "float8_recipe": "rowwise"},
                     {**off, "float8_recipe": "tensorwise", "float8_fast_accum": True},
                     {**off, "float8_recipe": None, "low_precision_residual": True}]


def test_low_precision_residual_under_the_trainers_bf16_autocast(tmp_path):
    """bf16=True + low_precision_residual: the decoder layers receive a bf16 residual stream (fp32 without
    the option, from the fp32 embeddings) and the loss stays finite."""
    dtypes = {}
    for low in (False, True):
        trainer = make_trainer(tmp_path / str(low), max_steps=2, bf16=True, low_precision_residual=low)
        seen = dtypes.setdefault(low, [])
        trainer.model.model.layers[1].register_forward_pre_hook(lambda module, args, seen=seen: seen.append(args[0].dtype))
        trainer.train()
        assert all(math.isfinite(loss) for loss in trainer.step_losses)
    assert dtypes == {False: [torch.float32] * 2, True: [torch.bfloat16] * 2}
