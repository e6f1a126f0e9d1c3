"""Run by tests/test_trainer_ddp.py under `accelerate launch --multi_gpu --num_processes 2 --cpu` (use_cpu):
3 DLMTrainer steps on 2 gloo ranks, 2 samples per rank; writes what each rank saw and did."""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.trainer_utils import flat_params, make_trainer  # noqa: E402


def main(out_dir: str) -> None:
    trainer = make_trainer(os.path.join(out_dir, "run"), per_device_train_batch_size=2, max_steps=3, optim="sgd",
                           max_grad_norm=0.0, ddp_backend="gloo")
    trainer.train()
    rank = trainer.args.process_index
    record = {"world_size": trainer.args.world_size, "sample_indices": trainer.sample_indices,
              "losses": [log["loss"] for log in trainer.state.log_history if "loss" in log],
              "tokens_per_second": [log["tokens_per_second"] for log in trainer.state.log_history if "loss" in log],
              "backend": torch.distributed.get_backend() if torch.distributed.is_initialized() else None}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    torch.save(flat_params(trainer.model), os.path.join(out_dir, f"params_rank{rank}.pt"))
    trainer.accelerator.wait_for_everyone()
    torch.distributed.destroy_process_group()  # a live gloo group can abort the interpreter at exit


if __name__ == "__main__":
    main(sys.argv[1])
