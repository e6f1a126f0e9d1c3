"""Run by tests/test_trainer_ddp.py under `accelerate launch --multi_gpu --num_processes 2` with use_cpu
(examples/accelerate/ddp_cpu.yaml): DLMTrainer on 2 gloo ranks; writes what each rank saw and did.

1. 3 steps on a map-style dataset, 2 samples per rank.
2. A checkpointable stream: 4 steps straight, and 2 steps + resume + 2 steps."""

import faulthandler
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.utils import StopAfter, flat_params, make_trainer, random_dataset, window_stream  # noqa: E402


def losses(trainer, after_step: int = 0):
    return [log["loss"] for log in trainer.state.log_history if "loss" in log and log["step"] > after_step]


def main(out_dir: str) -> None:
    common = dict(per_device_train_batch_size=2, optim="sgd", max_grad_norm=0.0, ddp_backend="gloo")
    trainer = make_trainer(os.path.join(out_dir, "run"), max_steps=3, **common)
    trainer.train()
    rank = trainer.args.process_index
    record = {"world_size": trainer.args.world_size, "sample_indices": trainer.sample_indices, "losses": losses(trainer),
              "tokens_per_second": [log["tokens_per_second"] for log in trainer.state.log_history if "loss" in log],
              "backend": torch.distributed.get_backend()}
    torch.save(flat_params(trainer.model), os.path.join(out_dir, f"params_rank{rank}.pt"))

    ids = random_dataset(10).input_ids
    stream = dict(max_steps=4, save_strategy="steps", save_steps=2, **common)
    straight = make_trainer(os.path.join(out_dir, "stream_straight"), dataset=window_stream(ids, seed=3), **stream)
    straight.train()
    first = make_trainer(os.path.join(out_dir, "stream_split"), dataset=window_stream(ids, seed=3), **stream)
    first.add_callback(StopAfter(2))
    first.train()
    resumed = make_trainer(os.path.join(out_dir, "stream_split"), dataset=window_stream(ids, seed=3), model_seed=1,
                           **stream)
    resumed.train(resume_from_checkpoint=True)
    record["stream"] = {"straight_indices": straight.sample_indices, "straight_losses": losses(straight),
                        "split_indices": first.sample_indices + resumed.sample_indices,
                        "split_losses": losses(first) + losses(resumed, after_step=2),
                        "params_max_diff": float((flat_params(straight.model) - flat_params(resumed.model)).abs().max())}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    trainer.accelerator.wait_for_everyone()
    torch.distributed.destroy_process_group()  # a live gloo group can abort the interpreter at exit


if __name__ == "__main__":
    # a rank still running after 240 s (the test waits 300; alone the run takes ~12 s) prints every thread's stack
    # and exits: a rare hang seen under a loaded suite then names where it waits
    faulthandler.dump_traceback_later(240, exit=True)
    main(sys.argv[1])
