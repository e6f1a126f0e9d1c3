"""DDP through `accelerate launch --multi_gpu --num_processes 2` with use_cpu (gloo): 2 ranks x 2 samples
train exactly like 1 process x 4 samples, the ranks draw distinct samples, and a checkpointable stream
resumes exactly on 2 ranks."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from tests.utils import flat_params, free_port, make_trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(shutil.which("accelerate") is None and not os.path.exists(os.path.join(os.path.dirname(sys.executable), "accelerate")),
                    reason="the accelerate launcher is not installed")
def test_ddp_two_cpu_ranks_train_like_one_process(tmp_path):
    launcher = os.path.join(os.path.dirname(sys.executable), "accelerate")
    launcher = launcher if os.path.exists(launcher) else shutil.which("accelerate")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    command = [launcher, "launch", "--config_file", os.path.join(ROOT, "examples", "accelerate", "ddp_cpu.yaml"),
               "--multi_gpu", "--num_processes", "2", "--main_process_port", str(free_port()),
               os.path.join(ROOT, "tests", "ddp_trainer_worker.py"), str(tmp_path)]
    result = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    ranks = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(2)]
    assert [r["world_size"] for r in ranks] == [2, 2] and ranks[0]["backend"] == "gloo"
    seen = [set(r["sample_indices"]) for r in ranks]
    assert len(ranks[0]["sample_indices"]) == 6 and not seen[0] & seen[1]  # distinct data on each rank
    assert ranks[0]["losses"] == ranks[1]["losses"] and all(v > 0 for v in ranks[0]["tokens_per_second"])
    params = [torch.load(tmp_path / f"params_rank{r}.pt") for r in range(2)]
    torch.testing.assert_close(params[0], params[1], rtol=0, atol=0)

    # one process with the same global batch: same samples, losses and parameters
    single = make_trainer(tmp_path / "single", per_device_train_batch_size=4, max_steps=3, optim="sgd", max_grad_norm=0.0)
    single.train()
    assert seen[0] | seen[1] == set(single.sample_indices)
    single_losses = [log["loss"] for log in single.state.log_history if "loss" in log]
    torch.testing.assert_close(torch.tensor(ranks[0]["losses"]), torch.tensor(single_losses), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(params[0], flat_params(single.model), rtol=1e-5, atol=1e-6)

    for record in ranks:  # the stream: 2 steps + resume + 2 steps == 4 steps, on each rank
        stream = record["stream"]
        assert stream["split_indices"] == stream["straight_indices"]
        # 1e-6, not bit equality: the resumed weights come back from safetensors (mmap'd, other alignment),
        # where CPU GEMMs may take another SIMD path (a few fp32 ulps); a lost optimizer step moves them ~lr
        assert stream["params_max_diff"] <= 1e-6
        torch.testing.assert_close(torch.tensor(stream["split_losses"]), torch.tensor(stream["straight_losses"]),
                                   rtol=0, atol=1e-6)
    assert not set(ranks[0]["stream"]["straight_indices"]) & set(ranks[1]["stream"]["straight_indices"])
    assert torch.load(tmp_path / "stream_split" / "checkpoint-2" / "data_state_rank1.pt") == {"consumed_samples": 8}
