"""DLMTrainer under `torchrun` with 4 gloo processes: FSDP2 x TP, FSDP2 x CP, and TP / CP with replicated
data-parallel groups reproduce the single-process run (logged losses, first-step gradients, parameters);
a checkpoint saved under FSDP2 x CP resumes under FSDP2 x TP exactly like the uninterrupted run; the final
`save_model` writes full weights that `from_pretrained` loads. Unsupported layouts are refused up front."""

import math
import os
import re

import pytest
import torch

from hf_dlm import DLMForDiffusionLM
from tests.utils import tiny_model
from tests.utils import flat_params, make_args, make_trainer, torchrun



@pytest.fixture(scope="module")
def torchrun_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("mesh_trainer")
    torchrun(os.path.join("tests", "parallel_trainer_worker.py"), str(out), nproc=4)
    return torch.load(out / "results.pt"), out


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    """One process, the same global batch (2 data-parallel ranks x 2 samples)."""
    trainer = make_trainer(tmp_path_factory.mktemp("single"), per_device_train_batch_size=4, max_steps=4,
                           max_grad_norm=0.5)
    trainer.train()
    return {"losses": [log["loss"] for log in trainer.state.log_history if "loss" in log],
            "grads": trainer.grads[0], "params": flat_params(trainer.model),
            "grad_norms": [log["grad_norm"] for log in trainer.state.log_history if "grad_norm" in log],
            "statistics": [{k: v for k, v in log.items() if k.startswith("ce_t/") or k == "masked_fraction"}
                           for log in trainer.state.log_history if "loss" in log]}


@pytest.mark.parametrize("layout", ["fsdp x tp", "fsdp x cp", "hsdp x tp", "hsdp x cp"])
def test_layout_trains_like_one_process(torchrun_results, single_process, layout):
    run = torchrun_results[0][layout]
    steps = len(run["losses"])
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(single_process["losses"][:steps]),
                               rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.tensor(run["grad_norms"]), torch.tensor(single_process["grad_norms"][:steps]),
                               rtol=1e-5, atol=1e-6)
    for name, grad in run["grads"].items():
        torch.testing.assert_close(grad, single_process["grads"][name], rtol=0, atol=1e-5, msg=f"{layout}: {name}")
    # logged statistics (masked fraction, masked-token CE by t bucket) count each sample once
    for logged, expected in zip(run["statistics"], single_process["statistics"]):
        assert logged.keys() == expected.keys() and "masked_fraction" in logged
        torch.testing.assert_close(torch.tensor(list(logged.values())), torch.tensor(list(expected.values())),
                                   rtol=1e-4, atol=1e-5)
    if steps == 4:
        torch.testing.assert_close(run["params"], single_process["params"], rtol=0, atol=1e-5)


def test_yaml_config_runs_the_layout_like_one_process(torchrun_results, tmp_path):
    from tests.parallel_trainer_worker import run_yaml

    single = run_yaml(str(tmp_path), 0, ["training.per_device_train_batch_size=4"])
    assert len(single) == 3
    torch.testing.assert_close(torch.tensor(torchrun_results[0]["yaml"]), torch.tensor(single), rtol=0, atol=1e-5)


def test_parallel_dims_from_arguments_and_accelerate():
    from accelerate.parallelism_config import ParallelismConfig

    from hf_dlm.parallel.mesh import ParallelDims, build_parallel_dims

    assert ParallelDims(world_size=8, tp=2, cp=2).dp_shard == 2
    with pytest.raises(ValueError, match="must equal the world size 8"):
        ParallelDims(world_size=8, dp_shard=3, tp=2)
    with pytest.raises(ValueError, match="ep .3. borrows from dp_shard x cp"):
        ParallelDims(world_size=4, dp_shard=2, cp=2, ep=3)
    assert ParallelDims(world_size=4, dp_shard=2, cp=2, ep=4).ep == 4
    dims = ParallelDims.from_parallelism_config(ParallelismConfig(dp_shard_size=2, tp_size=2, cp_size=2), 8)
    assert (dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp) == (1, 2, 2, 2)
    args = make_args("unused", tp_size=2, cp_size=2)
    assert build_parallel_dims(args, 8).dp_shard == 2 and build_parallel_dims(args, 8).describe() == "dp_shard=2 x cp=2 x tp=2"


def test_resume_across_layouts_equals_the_uninterrupted_run(torchrun_results, single_process):
    results, out = torchrun_results
    resumed = results["resumed"]
    assert len(resumed["losses"]) == 2  # steps 3 and 4, from a model initialised with another seed
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(results["fsdp x tp"]["losses"][2:]),
                               rtol=0, atol=1e-5)
    torch.testing.assert_close(resumed["params"], results["fsdp x tp"]["params"], rtol=0, atol=1e-5)
    assert os.path.isdir(out / "split" / "checkpoint-2" / "dcp")
    final = DLMForDiffusionLM.from_pretrained(out / "final")
    torch.testing.assert_close(flat_params(final), resumed["params"], rtol=0, atol=0)

    # the same checkpoint into one process (no mesh): the same steps 3 and 4
    single = make_trainer(out / "split", model_seed=1, per_device_train_batch_size=4, max_steps=4, max_grad_norm=0.5)
    single.train(resume_from_checkpoint=str(out / "split" / "checkpoint-2"))
    losses = [log["loss"] for log in single.state.log_history if "loss" in log and log["step"] > 2]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(results["fsdp x tp"]["losses"][2:]), rtol=0, atol=1e-5)
    torch.testing.assert_close(flat_params(single.model), resumed["params"], rtol=0, atol=1e-5)


@pytest.mark.parametrize("sizes, model_options, message", [
    (dict(tp=3), {}, "tp_size 3 must divide num_attention_heads"),
    (dict(cp=2), dict(attention_mode="block", block_size=4), "attention_mode='block'"),
    (dict(cp=2), dict(attn_implementation="flex_attention"), "'sdpa' or 'eager'"),
    (dict(dp_shard=2, ep=2), {}, "needs a mixture-of-experts model"),
    (dict(pp=2, tp=2), {}, "pipeline parallel (pp_size > 1) composes with FSDP2 only"),
])
def test_unsupported_layouts_are_refused(tmp_path, sizes, model_options, message):
    from hf_dlm.parallel.mesh import ParallelDims
    from hf_dlm.parallel.trainer_parallel import check_layout_supported

    dims = ParallelDims(world_size=math.prod(v for k, v in sizes.items() if k != "ep"), **{"dp_shard": 1, **sizes})
    model = tiny_model(model_options.pop("attn_implementation", "sdpa"), **model_options)
    with pytest.raises((ValueError, NotImplementedError), match=re.escape(message)):
        check_layout_supported(model, make_args(tmp_path), dims)
