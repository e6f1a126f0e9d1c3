"""Checkpoints of the diffusion trainers (`DLMTrainer`, `DLMSFTTrainer`), one home for both.

- atomic saves: every checkpoint is written into `_checkpoint-staging/` and renamed into place once complete,
  so a crash while saving leaves the previous checkpoints untouched and `get_last_checkpoint` never sees a
  partial one; rotation and `best_model_checkpoint` point at published folders only;
- device-mesh runs (`hf_dlm.parallel.trainer_parallel`): model and optimizer through
  `torch.distributed.checkpoint` (`dcp/`), which any layout (one process included) resumes from;
- extras per rank: the data position of the last consumed batch (`data_state_rank{r}.pt`, given back to a
  train dataset with `load_state_dict` on resume) and float8 delayed-scaling histories; the objective as JSON;
- the final model (any `save_model` outside a checkpoint, in every layout) gets hf-dlm's model card with the
  run's training details (`training_details`, recorded in `hf_dlm_info.json`); transformers' and trl's own
  cards, which describe a causal LM, are never written (`create_model_card`).

`CheckpointingMixin` goes before the `transformers.Trainer` subclass in the bases and after
`DiffusionBatchMixin` (it reads `self.objective`, `self._parallel`, `self._data_state`, `self._paused`).
"""

from __future__ import annotations

import json
import os
import shutil
import time

import torch
from torch.utils.data import IterableDataset
from transformers.trainer import SCHEDULER_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint, rotate_checkpoints

from ..parallel.float8_delayed import float8_state_dict, load_float8_state_dict
from ..parallel.trainer_parallel import (has_sharded_checkpoint, load_scheduler_state, load_sharded_checkpoint,
                                         save_full_model, save_sharded_checkpoint)
from ..utils.checkpoint_files import check_checkpoint_files
from ..utils.publishing import publisher  # hub/ sits above training: its writer is plugged in by `import hf_dlm`

# not matched by get_last_checkpoint's `^checkpoint-\d+$` nor rotation's `checkpoint-*`; the leading "_" is
# the Trainer's own "never upload" pattern (`ignore_patterns=["_*", ...]` when it pushes output_dir to the Hub)
STAGING_DIR = "_checkpoint-staging"
DATA_STATE_NAME = "data_state_rank{rank}.pt"
OBJECTIVE_NAME = "dlm_objective.json"
FLOAT8_STATE_NAME = "float8_state_rank{rank}.pt"  # delayed-scaling amax histories (each rank sees its own data)


class CheckpointingMixin:
    _staging_root: str | None = None
    _parallel = None
    _data_state = None
    card_trainer: str | None = None  # the model card's "trainer" field (None: the class name)

    def _get_output_dir(self, trial) -> str:
        run_dir = super()._get_output_dir(trial)
        return os.path.join(run_dir, STAGING_DIR) if self._staging_root is not None else run_dir

    def _save_checkpoint(self, model, trial) -> None:
        """Write the checkpoint into the staging folder, then rename it into place."""
        start = time.perf_counter()
        run_dir = self._get_output_dir(trial)
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        staging_root = os.path.join(run_dir, STAGING_DIR)
        staging, final = os.path.join(staging_root, name), os.path.join(run_dir, name)
        if self.args.should_save and os.path.isdir(staging):
            shutil.rmtree(staging)  # left over by a save that crashed
        self.accelerator.wait_for_everyone()
        self._staging_root = staging_root
        try:
            super()._save_checkpoint(model, trial)
            self._save_extras(staging)
        finally:
            self._staging_root = None
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            publish_checkpoint(staging, final)
            if self.state.best_model_checkpoint and self.state.best_model_checkpoint.startswith(staging_root):
                self.state.best_model_checkpoint = os.path.join(run_dir, os.path.basename(self.state.best_model_checkpoint))
                state_path = os.path.join(final, "trainer_state.json")
                self.state.save_to_json(state_path + ".tmp")
                os.replace(state_path + ".tmp", state_path)
            if self.args.push_to_hub:  # the parent's upload runs in the background: give it the final folder
                self._push_from_checkpoint(final)
            rotate_checkpoints(output_dir=run_dir, save_total_limit=self.args.save_total_limit,
                               best_model_checkpoint=self.state.best_model_checkpoint)
        self.accelerator.wait_for_everyone()
        self._paused += time.perf_counter() - start  # saving is not training throughput

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        if self._staging_root is not None:
            return  # called by the parent's save with the staging folder, renamed away before the upload reads it
        super()._push_from_checkpoint(checkpoint_folder)

    # -- device-mesh checkpoints (torch.distributed.checkpoint; hf_dlm.parallel.trainer_parallel) ---------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        output_dir = output_dir or self.args.output_dir
        if self._parallel is None:
            super().save_model(output_dir, _internal_call)
        elif _internal_call:  # a checkpoint: the sharded model is saved with the optimizer, in dcp/
            if self.args.should_save:
                self.accelerator.unwrap_model(self.model).config.save_pretrained(output_dir)
            return
        else:
            save_full_model(self.accelerator.unwrap_model(self.model), output_dir, self.args.should_save)
        if self._staging_root is None:  # final models, not every checkpoint
            self._write_model_card(output_dir)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self._parallel is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        save_sharded_checkpoint(self.model, self.optimizer.optimizer, output_dir)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        if self._parallel is None and not has_sharded_checkpoint(resume_from_checkpoint):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        # loaded with the optimizer (_load_optimizer_and_scheduler), once it exists

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        # a mesh checkpoint loads into any layout, one process included
        if checkpoint is None or (self._parallel is None and not has_sharded_checkpoint(checkpoint)):
            return super()._load_optimizer_and_scheduler(checkpoint)
        load_sharded_checkpoint(self.model, self.optimizer.optimizer, checkpoint)
        load_scheduler_state(self.lr_scheduler, self.optimizer, os.path.join(checkpoint, SCHEDULER_NAME))

    def _issue_warnings_after_load(self, load_result) -> None:
        """A tied lm_head is not saved (it is the embedding, which loading keeps shared): not a missing key."""
        model = self.accelerator.unwrap_model(self.model)
        tied = set(getattr(model, "_tied_weights_keys", None) or ())
        if getattr(model.config, "tie_word_embeddings", False) and tied & set(load_result.missing_keys):
            load_result = load_result._replace(missing_keys=[k for k in load_result.missing_keys if k not in tied])
        super()._issue_warnings_after_load(load_result)

    # -- model card ---------------------------------------------------------------------------------------
    def training_details(self) -> dict:
        """What the model card's "Training details" table records about this run."""
        args, objective = self.args, self.objective
        details = {"trainer": self.card_trainer or type(self).__name__, "objective_preset": args.objective_preset,
                   **{name: getattr(objective, name) for name in ("mode", "schedule", "weighting", "t_sampling",
                                                                  "eps", "normalization", "label_alignment")},
                   "global_step": self.state.global_step, "epochs": round(float(self.state.epoch or 0), 4),
                   "learning_rate": args.learning_rate, "lr_scheduler_type": str(getattr(args.lr_scheduler_type,
                                                                                      "value", args.lr_scheduler_type)),
                   "global_batch_size": args.per_device_train_batch_size * args.gradient_accumulation_steps
                   * args.world_size, "world_size": args.world_size, "seed": args.seed,
                   "precision": "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"}
        if args.fp8_recipe:
            details["fp8_recipe"] = args.fp8_recipe
        if args.pp_size > 1:
            details["pp_size"] = args.pp_size
        return details

    def _write_model_card(self, output_dir: str) -> None:
        if self.args.should_save:
            publisher().write_final_card(output_dir, self.accelerator.unwrap_model(self.model).config,
                                         self.training_details())

    def create_model_card(self, *args, **kwargs) -> None:
        """transformers' and trl's cards describe a causal LM (trl writes its own at every checkpoint, both at
        `push_to_hub`): write hf-dlm's card into output_dir instead; their arguments (model and dataset names,
        tags) describe those cards and are not used. Not while a checkpoint is written: output_dir gets its
        card with the final model."""
        if self._staging_root is None:
            self._write_model_card(self.args.output_dir)

    # -- per-rank extras ------------------------------------------------------------------------------
    def _rank_file(self, checkpoint_dir: str, name: str) -> str:
        return os.path.join(checkpoint_dir, name.format(rank=self.args.process_index))

    def _load_rank_file(self, checkpoint_dir: str, name: str):
        """This rank's file `name` of a checkpoint, loaded; None if the checkpoint has none."""
        path = self._rank_file(checkpoint_dir, name)
        return torch.load(path, weights_only=True) if os.path.isfile(path) else None

    def _save_extras(self, checkpoint_dir: str) -> None:
        os.makedirs(checkpoint_dir, exist_ok=True)
        if self._data_state is not None:
            torch.save(self._data_state, self._rank_file(checkpoint_dir, DATA_STATE_NAME))
        float8_state = float8_state_dict(self.accelerator.unwrap_model(self.model))
        if float8_state:
            torch.save(float8_state, self._rank_file(checkpoint_dir, FLOAT8_STATE_NAME))
        if self.args.should_save:
            with open(os.path.join(checkpoint_dir, OBJECTIVE_NAME), "w") as f:
                json.dump(self.objective.to_dict(), f, indent=2)

    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, ignore_keys_for_eval=None, **kwargs):
        """As `Trainer.train`; on resume, a train dataset with `load_state_dict` gets its saved position
        back (an iterable one then is not fast-forwarded batch by batch), and float8 histories are restored."""
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"no valid checkpoint found in output_dir {self.args.output_dir!r}")
        # every rank refuses (not only the one that saves): a rank that went on would block in the first collective
        if not resume_from_checkpoint and not self.args.overwrite_output_dir:
            existing = get_last_checkpoint(self.args.output_dir) if os.path.isdir(self.args.output_dir) else None
            if existing is not None:
                raise ValueError(f"output_dir {self.args.output_dir!r} already holds {os.path.basename(existing)}: "
                                 "pass resume_from_checkpoint=True to continue it, or overwrite_output_dir=True "
                                 "(or another output_dir) to start a new run")
        restore_skip = self.args.ignore_data_skip
        if resume_from_checkpoint:
            check_checkpoint_files(resume_from_checkpoint)  # a truncated file: one line naming it, on every rank
            data_state = (self._load_rank_file(resume_from_checkpoint, DATA_STATE_NAME)
                          if hasattr(self.train_dataset, "load_state_dict") else None)
            if data_state is not None:
                self.train_dataset.load_state_dict(data_state)
                self._data_state = None
                if isinstance(self.train_dataset, IterableDataset):
                    self.args.ignore_data_skip = True
            float8_state = self._load_rank_file(resume_from_checkpoint, FLOAT8_STATE_NAME)
            if float8_state is not None:
                load_float8_state_dict(self.accelerator.unwrap_model(self.model), float8_state)
        self._reset_window()
        try:
            return super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial,
                                 ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)
        finally:
            self.args.ignore_data_skip = restore_skip


def _fsync_tree(path: str) -> None:
    for root, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())


def publish_checkpoint(staging: str, final: str) -> None:
    """Rename a fully written checkpoint folder into place (replacing one of the same step)."""
    _fsync_tree(staging)
    previous = None
    if os.path.exists(final):
        previous = f"{os.path.dirname(final)}/{STAGING_DIR}/replaced-{os.path.basename(final)}"
        if os.path.exists(previous):
            shutil.rmtree(previous)
        os.rename(final, previous)
    os.rename(staging, final)
    dir_fd = os.open(os.path.dirname(final), os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    if previous is not None:
        shutil.rmtree(previous, ignore_errors=True)
    try:
        os.rmdir(os.path.dirname(staging))
    except OSError:
        pass  # other (stale) staging content stays for inspection
