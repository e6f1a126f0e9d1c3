"""DLMSFTTrainer under `torchrun` with 4 gloo processes, in the layouts DLMTrainer's tests use: FSDP2 x TP,
FSDP2 x CP and HSDP x CP reproduce the single-process run (logged losses, grad norms, masked fraction and CE
by t, first-step gradients, parameters); a checkpoint saved under FSDP2 x CP (atomic, through DCP) resumes
under FSDP2 x TP, from another initialisation, exactly like the uninterrupted run, and in one process too.
With pp_size=2 on 2 processes it trains like one process and its final save carries the model card."""

import json
import os

import pytest
import torch

pytest.importorskip("trl")

from hf_dlm import DLMForDiffusionLM  # noqa: E402
from tests.utils import flat_params, logged, sft_trainer, torchrun  # noqa: E402

# parameters after 4 AdamW steps at learning rate 1e-2: Adam divides by sqrt(v), so the gradients' reduction-order
# differences (1e-6) grow to ~6e-5 on some CPUs where a gradient is near zero; a wrong layout moves them by ~1e-2
PARAMS_ATOL = 2e-4

@pytest.fixture(scope="module")
def torchrun_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("sft_mesh")
    torchrun(os.path.join("tests", "sft_parallel_worker.py"), str(out), nproc=4, timeout=900)
    return torch.load(out / "results.pt"), out


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    """One process, the same global batch (2 data-parallel ranks x 2 rows)."""
    torch.set_num_threads(1)
    trainer = sft_trainer(tmp_path_factory.mktemp("sft_single"), per_device_train_batch_size=4, max_steps=4)
    trainer.train()
    assert logged(trainer, "learning_rate")[-1] > 0
    return {"losses": logged(trainer, "loss"), "grad_norms": logged(trainer, "grad_norm"),
            "grads": trainer.grads[0], "params": flat_params(trainer.model),
            "statistics": [{k: v for k, v in log.items() if k.startswith("ce_t/") or k == "masked_fraction"}
                           for log in trainer.state.log_history if "loss" in log]}


@pytest.mark.parametrize("layout", ["fsdp x tp", "fsdp x cp", "hsdp x cp"])
def test_sft_layout_trains_like_one_process(torchrun_results, single_process, layout):
    run = torchrun_results[0][layout]
    steps = len(run["losses"])
    assert steps in (2, 4)
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(single_process["losses"][:steps]),
                               rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.tensor(run["grad_norms"]), torch.tensor(single_process["grad_norms"][:steps]),
                               rtol=1e-5, atol=1e-6)
    for name, grad in run["grads"].items():
        torch.testing.assert_close(grad, single_process["grads"][name], rtol=0, atol=1e-5, msg=f"{layout}: {name}")
    for logged_stats, expected in zip(run["statistics"], single_process["statistics"]):
        assert logged_stats.keys() == expected.keys() and "masked_fraction" in logged_stats
        torch.testing.assert_close(torch.tensor(list(logged_stats.values())), torch.tensor(list(expected.values())),
                                   rtol=1e-4, atol=1e-5)
    if steps == 4:
        torch.testing.assert_close(run["params"], single_process["params"], rtol=0, atol=PARAMS_ATOL)


def test_sft_resume_across_layouts_equals_the_uninterrupted_run(torchrun_results, single_process):
    results, out = torchrun_results
    resumed = results["resumed"]
    assert len(resumed["losses"]) == 2  # steps 3 and 4
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(single_process["losses"][2:]),
                               rtol=0, atol=1e-5)
    torch.testing.assert_close(resumed["params"], single_process["params"], rtol=0, atol=PARAMS_ATOL)
    checkpoint = out / "split" / "checkpoint-2"
    assert (checkpoint / "dcp").is_dir() and not (out / "split" / "_checkpoint-staging").exists()
    # the mesh checkpoint into one process (no mesh): the same steps 3 and 4
    single = sft_trainer(out / "split", model_seed=1, per_device_train_batch_size=4, max_steps=4)
    single.train(resume_from_checkpoint=str(checkpoint))
    torch.testing.assert_close(torch.tensor(logged(single, "loss", after_step=2)),
                               torch.tensor(single_process["losses"][2:]), rtol=0, atol=1e-5)
    torch.testing.assert_close(flat_params(single.model), single_process["params"], rtol=0, atol=PARAMS_ATOL)


@pytest.fixture(scope="module")
def pipeline_results(tmp_path_factory):
    """DLMSFTTrainer with pp_size=2 under torchrun on 2 gloo processes (tests/sft_pipeline_worker.py)."""
    out = tmp_path_factory.mktemp("sft_pp")
    torchrun(os.path.join("tests", "sft_pipeline_worker.py"), str(out), nproc=2)
    return json.loads((out / "logs.json").read_text()), out / "pp"


def test_sft_pp2_trains_like_one_process_and_writes_the_model_card(pipeline_results, tmp_path):
    """pp_size=2 (a stage per decoder layer, the two ranks' 2 + 2 rows pooled into each micro-batch, every batch
    padded to max_length) gives one process's logged losses, gradient norms, masked fraction, CE by t and trl's
    token count for the same 4-row micro-batches, Adam with a constant 1e-2 learning rate; its final weights,
    saved stage by stage, load as one model equal to the single process's, with the model card of the run; its
    step-2 checkpoint resumed in one process (another initialisation) ends on the same weights."""
    record, final = pipeline_results
    assert record["stages"] == [[0]]  # rank 0 holds decoder layer 0 of 2
    torch.set_num_threads(1)
    single = sft_trainer(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=3)
    single.train()
    logs = [log for log in single.state.log_history if "loss" in log]
    assert [log["step"] for log in record["logs"]] == [log["step"] for log in logs] == [1, 2, 3]
    assert logs[-1]["learning_rate"] == 0.01 and logs[0]["grad_norm"] > 0.5  # clipping at 0.5 acted
    for key in ("loss", "grad_norm", "masked_fraction", "num_tokens", "supervised_fraction"):
        torch.testing.assert_close(torch.tensor([log[key] for log in record["logs"]]),
                                   torch.tensor([log[key] for log in logs]), rtol=1e-5, atol=1e-5, msg=key)
    for pp_log, log in zip(record["logs"], logs):
        ce = sorted(k for k in log if k.startswith("ce_t/"))
        assert ce and ce == sorted(k for k in pp_log if k.startswith("ce_t/"))
        torch.testing.assert_close(torch.tensor([pp_log[k] for k in ce]), torch.tensor([log[k] for k in ce]),
                                   rtol=1e-5, atol=1e-5)
    loaded = DLMForDiffusionLM.from_pretrained(final)
    torch.testing.assert_close(flat_params(loaded), flat_params(single.model), rtol=0, atol=1e-5)
    training = json.loads((final / "hf_dlm_info.json").read_text())["training"]
    assert {k: training[k] for k in ("trainer", "global_step", "global_batch_size", "world_size", "pp_size")} == \
        {"trainer": "hf_dlm.DLMSFTTrainer", "global_step": 3, "global_batch_size": 8, "world_size": 2, "pp_size": 2}
    assert "| pp_size | `2` |" in (final / "README.md").read_text()
    # the pipeline's checkpoint (stage shards, optimizer through DCP) resumed in one process: step 3 as straight
    checkpoint = final / "checkpoint-2"
    assert (checkpoint / "optim_dcp").is_dir() and not (final / "_checkpoint-staging").exists()
    resumed = sft_trainer(tmp_path / "resumed", model_seed=1, per_device_train_batch_size=4,
                          gradient_accumulation_steps=2, max_steps=3)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert len(resumed.step_losses) == 1
    torch.testing.assert_close(torch.tensor(logged(resumed, "loss", after_step=2)), torch.tensor([logs[2]["loss"]]),
                               rtol=0, atol=1e-5)
    torch.testing.assert_close(flat_params(resumed.model), flat_params(single.model), rtol=0, atol=1e-5)
