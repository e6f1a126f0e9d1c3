"""Resuming from a checkpoint whose files cannot be read (issue 29: a truncated model.safetensors, optimizer.pt or
trainer_state.json), and output folders that would be trained over: one line naming the file or field, the
previous checkpoint suggested, before any data is built, the same on every rank of a launch."""

import os
import shutil
import subprocess
import sys

import pytest
import yaml

from hf_dlm.cli import main as cli_main
from hf_dlm.data import builders
from hf_dlm.utils.checkpoint_files import CheckpointFileError, check_checkpoint_files, previous_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = {"attn_implementation": "sdpa",
         "config": {"vocab_size": 99, "mask_token_id": 98, "hidden_size": 32, "intermediate_size": 64,
                    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                    "max_position_embeddings": 64}}


def write_config(folder, output_dir, **training):
    options = {"output_dir": str(output_dir), "use_cpu": True, "max_steps": 2, "save_steps": 1, "learning_rate": 1e-3,
               "per_device_train_batch_size": 4, "report_to": "none", "disable_tqdm": True, "eval_strategy": "no"}
    options.update(training)
    path = os.path.join(folder, "run.yaml")
    with open(path, "w") as f:
        yaml.safe_dump({"model": MODEL, "data": {"kind": "random", "seq_len": 16, "num_samples": 16},
                        "training": options}, f)
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished 2-step run with checkpoint-1 and checkpoint-2."""
    folder = tmp_path_factory.mktemp("run")
    path = write_config(folder, folder / "out")
    assert cli_main(["train", path]) == 0
    assert {"checkpoint-1", "checkpoint-2"} <= set(os.listdir(folder / "out"))
    return folder / "out"


@pytest.fixture
def data_never_built(monkeypatch):
    def refuse(options, model_options):
        raise AssertionError("the data was built before the checkpoint was checked")

    monkeypatch.setitem(builders.DATA_BUILDERS, "random", refuse)


def one_line(capsys, argv):
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def truncate(path, keep=0.5):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(int(size * keep))


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.pt", "trainer_state.json", "scheduler.pt"])
def test_a_truncated_checkpoint_file_is_named_with_the_previous_checkpoint(trained, tmp_path, capsys,
                                                                          data_never_built, name):
    out = tmp_path / "out"
    shutil.copytree(trained, out)
    broken = out / "checkpoint-2" / name
    truncate(broken)
    path = write_config(tmp_path, out, max_steps=3, resume_from_checkpoint=True)
    err = one_line(capsys, ["train", path])
    assert err.startswith(f"hf-dlm train: {broken}: cannot be read ("), err
    assert err.endswith(f"resume from the previous checkpoint (--set training.resume_from_checkpoint="
                        f"{out / 'checkpoint-1'})"), err


def test_the_trainer_itself_names_the_file(trained, tmp_path):
    """DLMTrainer.train(resume_from_checkpoint=...) checks the files too (API users, every rank)."""
    from tests.utils import make_trainer, random_dataset

    out = tmp_path / "out"
    shutil.copytree(trained, out)
    truncate(out / "checkpoint-2" / "optimizer.pt", 0.9)
    trainer = make_trainer(out, dataset=random_dataset(16), max_steps=3, save_strategy="steps", save_steps=1)
    with pytest.raises(CheckpointFileError, match=r"optimizer\.pt: cannot be read .*checkpoint-1\)$") as error:
        trainer.train(resume_from_checkpoint=True)
    assert error.value.field == str(out / "checkpoint-2" / "optimizer.pt")


def test_intact_checkpoints_pass_and_the_first_has_no_predecessor(trained, tmp_path):
    for name in ("checkpoint-1", "checkpoint-2"):
        check_checkpoint_files(str(trained / name))  # every file of a real checkpoint reads
    assert previous_checkpoint(str(trained / "checkpoint-2")) == str(trained / "checkpoint-1")
    assert previous_checkpoint(str(trained / "checkpoint-1")) is None
    shutil.copytree(trained / "checkpoint-1", tmp_path / "checkpoint-1")
    (tmp_path / "checkpoint-1" / "trainer_state.json").write_text('{"global_step": 1, "log')
    with pytest.raises(CheckpointFileError, match="Unterminated string.*no earlier checkpoint to resume from"):
        check_checkpoint_files(str(tmp_path / "checkpoint-1"))


def test_an_output_dir_holding_checkpoints_is_refused_before_the_data(trained, tmp_path, capsys, data_never_built):
    path = write_config(tmp_path, trained)
    err = one_line(capsys, ["train", path])
    assert f"training.output_dir {str(trained)!r} already holds checkpoint-2" in err
    assert "--set training.resume_from_checkpoint=true" in err
    err = one_line(capsys, ["train", write_config(tmp_path, tmp_path / "empty", resume_from_checkpoint=True)])
    assert "training.resume_from_checkpoint:" in err and "holds no checkpoint" in err


@pytest.mark.parametrize("launcher", ["torchrun", "accelerate"])
def test_every_rank_of_a_launch_refuses_in_one_line_and_none_hangs(trained, tmp_path, launcher):
    """torchrun or `accelerate launch --cpu`, 2 gloo ranks, an output_dir that already holds checkpoints: each rank
    prints the refusal and exits 2 (before, rank 0 refused and rank 1 blocked in a collective until gloo timed
    out). The launcher polls its ranks every `--monitor-interval` seconds and stops the others at the first
    failure it sees: at its default 0.1 s a loaded machine's slower rank was stopped before it reached its
    refusal, so the launcher here looks every 10 s (a rank that hung would still be stopped then)."""
    from tests.utils import free_port

    path = write_config(tmp_path, trained)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    launch = {"torchrun": ["torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
                           "--monitor-interval", "10"],
              "accelerate": ["accelerate.commands.launch", "--cpu", "--num_processes", "2", "--num_machines", "1",
                             "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
                             str(free_port()), "--monitor_interval", "10"]}[launcher]
    run = subprocess.run([sys.executable, "-m", *launch, os.path.join(ROOT, "examples", "pretrain.py"), "--config",
                          path], capture_output=True, text=True, env=env, timeout=240)
    assert run.returncode != 0
    refusals = [line for line in run.stderr.splitlines() if "already holds checkpoint-2" in line]
    assert len(refusals) == 2, run.stderr[-3000:]
    # no worker traceback (torchrun's own report of the exit codes follows the two lines) and no collective timeout
    assert "hf_dlm" + os.sep not in run.stderr and "Connection closed" not in run.stderr, run.stderr[-3000:]
    assert all(line.startswith("pretrain.py: ") for line in refusals), refusals
