"""`DLMTrainer` with `push_to_hub`: the Hub is faked at the `huggingface_hub` boundary (no network).

The fake `upload_folder` lists what it would upload (the folder's files after `allow/ignore_patterns`, with
a hash of each) twice: when called, and, for `run_as_future=True`, again when the background job would
read the folder: after the save returned (an `on_save` callback) or at the end of training. The real
upload lists files inside its job, so a folder renamed or changed in between uploads something else.
"""

import hashlib
import os
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import pytest
import transformers.trainer
from huggingface_hub.hf_api import DEFAULT_IGNORE_PATTERNS
from huggingface_hub.utils import filter_repo_objects
from transformers import TrainerCallback
from transformers.trainer_utils import get_last_checkpoint

from hf_dlm.training.trainer import OBJECTIVE_NAME, STAGING_DIR
from tests.utils import make_trainer


def _listing(folder, allow_patterns=None, ignore_patterns=None) -> dict[str, str] | None:
    """{relative path: sha256} of what `upload_folder` would send from `folder`; None if it is missing."""
    if not os.path.isdir(folder):
        return None  # the real upload raises "Provided path ... is not a directory"
    paths = [Path(root, name).relative_to(folder).as_posix() for root, _, names in os.walk(folder) for name in names]
    ignore = ([ignore_patterns] if isinstance(ignore_patterns, str) else list(ignore_patterns or []))
    kept = filter_repo_objects(paths, allow_patterns=allow_patterns, ignore_patterns=ignore + DEFAULT_IGNORE_PATTERNS)
    return {path: hashlib.sha256(Path(folder, path).read_bytes()).hexdigest() for path in kept}


class FakeHub(TrainerCallback):
    """Stands in for `HfApi.create_repo` / `HfApi.upload_folder`; as a callback, runs the pending uploads."""

    def __init__(self):
        self.uploads, self.pending, self.repos = [], [], []

    def create_repo(self, repo_id, *args, **kwargs):
        self.repos.append(repo_id)
        return SimpleNamespace(repo_id=repo_id)

    def upload_folder(self, *, folder_path, path_in_repo=None, allow_patterns=None, ignore_patterns=None,
                      run_as_future=False, **kwargs):
        record = dict(folder_path=str(folder_path), path_in_repo=path_in_repo or "",
                      patterns=(allow_patterns, ignore_patterns))
        record["at_call"] = _listing(folder_path, allow_patterns, ignore_patterns)
        self.uploads.append(record)
        if not run_as_future:
            record["uploaded"] = record["at_call"]
            return None
        future = Future()
        self.pending.append((record, future))
        return future

    def run_pending(self):
        for record, future in self.pending:
            record["uploaded"] = _listing(record["folder_path"], *record["patterns"])
            future.set_result(None)
        self.pending = []

    def on_save(self, args, state, control, **kwargs):
        self.run_pending()

    def on_train_end(self, args, state, control, **kwargs):
        self.run_pending()


@pytest.fixture
def hub(monkeypatch):
    fake = FakeHub()
    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", lambda api, repo_id, *a, **k: fake.create_repo(repo_id))
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", lambda api, **k: fake.upload_folder(**k))
    for name in ("create_repo", "upload_folder"):  # releases that import huggingface_hub's functions directly
        if hasattr(transformers.trainer, name):
            monkeypatch.setattr(transformers.trainer, name, getattr(fake, name))
    return fake


def _stale_staging(output_dir):
    """What a save that crashed leaves behind (a step that is never saved again): must never reach the Hub."""
    stale = Path(output_dir, STAGING_DIR, "checkpoint-99")
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"partial")
    return stale


def _push_trainer(output_dir, hub, strategy, **overrides):
    options = dict(max_steps=4, save_strategy="steps", save_steps=2, push_to_hub=True, hub_model_id="user/x",
                   hub_strategy=strategy)
    trainer = make_trainer(output_dir, **{**options, **overrides})
    trainer.add_callback(hub)
    return trainer


def _assert_no_staging_uploaded(hub):
    for record in hub.uploads:
        assert STAGING_DIR not in Path(record["folder_path"]).parts, record["folder_path"]
        for listing in (record["at_call"], record["uploaded"]):
            assert not [p for p in listing or {} if STAGING_DIR in p.split("/")], (record["folder_path"], listing)


@pytest.mark.parametrize("strategy", ["every_save", "checkpoint", "all_checkpoints"])
def test_push_uploads_published_checkpoints_and_never_the_staging_folder(tmp_path, hub, strategy):
    _stale_staging(tmp_path)
    trainer = _push_trainer(tmp_path, hub, strategy)
    trainer.train()
    assert hub.repos == ["user/x"] and not hub.pending
    _assert_no_staging_uploaded(hub)
    for record in hub.uploads:  # the folder was there, complete, and unchanged when the background job read it
        assert record["at_call"] and record["uploaded"] == record["at_call"], record["folder_path"]

    model_pushes = [r for r in hub.uploads if r["folder_path"] == str(tmp_path)]
    checkpoint_pushes = [r for r in hub.uploads if r["folder_path"] != str(tmp_path)]
    assert len(model_pushes) == 2  # one per save (each job is done before the next save)
    final = _listing(tmp_path / "checkpoint-4")
    assert OBJECTIVE_NAME in final and "trainer_state.json" in final
    # the model pushed last is the weights of the last checkpoint
    assert model_pushes[-1]["uploaded"]["model.safetensors"] == final["model.safetensors"]
    assert not [p for p in model_pushes[-1]["uploaded"] if p.startswith("checkpoint-")]

    if strategy == "every_save":
        assert not checkpoint_pushes
        return
    expected = ["last-checkpoint"] * 2 if strategy == "checkpoint" else ["checkpoint-2", "checkpoint-4"]
    assert [r["path_in_repo"] for r in checkpoint_pushes] == expected
    assert [r["folder_path"] for r in checkpoint_pushes] == [str(tmp_path / f"checkpoint-{n}") for n in (2, 4)]
    assert checkpoint_pushes[-1]["uploaded"] == final  # `last-checkpoint` is the published checkpoint, extras included


def test_resume_after_checkpoint_pushes(tmp_path, hub):
    _push_trainer(tmp_path, hub, "checkpoint").train()
    assert get_last_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-4")
    resumed = _push_trainer(tmp_path, hub, "checkpoint", max_steps=6)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 6 and len(resumed.step_losses) == 2  # steps 5 and 6 only
    assert get_last_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-6")
    assert hub.uploads[-1]["path_in_repo"] == "last-checkpoint"
    assert hub.uploads[-1]["uploaded"] == _listing(tmp_path / "checkpoint-6")
    _assert_no_staging_uploaded(hub)


def test_final_push_to_hub_skips_staging_leftovers(tmp_path, hub, monkeypatch):
    _stale_staging(tmp_path)
    trainer = _push_trainer(tmp_path, hub, "end")
    trainer.train()
    assert not hub.uploads  # hub_strategy="end": nothing during training
    monkeypatch.setattr(trainer, "create_model_card", lambda **kwargs: None)  # it may look datasets up online
    trainer.push_to_hub()
    (record,) = hub.uploads
    assert record["folder_path"] == str(tmp_path) and "model.safetensors" in record["uploaded"]
    _assert_no_staging_uploaded(hub)
