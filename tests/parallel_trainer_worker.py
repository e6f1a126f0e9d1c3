"""Run by tests/test_parallel_trainer.py under `torchrun --nproc_per_node 4` (gloo on CPU): DLMTrainer with
device-mesh layouts from its arguments. Rank 0 saves each run's logged losses, the first step's gradients
and the final parameters (full tensors); every rank runs every trainer (the collectives need them all).

- "fsdp x tp": dp_shard 2 x tp 2, 4 steps;        - "hsdp x tp": dp_replicate 2 x tp 2, 2 steps;
- "fsdp x cp": dp_shard 2 x cp 2, 2 steps, saved;  - "hsdp x cp": dp_replicate 2 x cp 2, 2 steps;
- "resumed":   dp_shard 2 x tp 2 from the fsdp x cp checkpoint (another layout), steps 3-4."""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.trainer_utils import StopAfter, make_trainer  # noqa: E402

LAYOUTS = {"fsdp x tp": dict(dp_shard_size=2, tp_size=2), "fsdp x cp": dict(dp_shard_size=2, cp_size=2),
           "hsdp x tp": dict(dp_replicate_size=2, dp_shard_size=1, tp_size=2),
           "hsdp x cp": dict(dp_replicate_size=2, dp_shard_size=1, cp_size=2)}
COMMON = dict(per_device_train_batch_size=2, max_steps=4, max_grad_norm=0.5, ddp_backend="gloo")


def full(tensor):
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor.detach().clone()


def record(trainer, after_step=0):
    model = trainer.accelerator.unwrap_model(trainer.model)
    return {"losses": [log["loss"] for log in trainer.state.log_history if "loss" in log and log["step"] > after_step],
            "grads": {name: full(grad) for name, grad in trainer.grads[0].items()} if trainer.grads else None,
            "params": torch.cat([full(p).reshape(-1) for p in model.parameters()]),
            "grad_norms": [log["grad_norm"] for log in trainer.state.log_history if "grad_norm" in log]}


def main(out_dir: str) -> None:
    results = {}
    for name in ("fsdp x tp", "hsdp x tp", "hsdp x cp"):
        trainer = make_trainer(os.path.join(out_dir, name.replace(" ", "")), **COMMON, **LAYOUTS[name])
        trainer.train(); results[name] = record(trainer)
    first = make_trainer(os.path.join(out_dir, "split"), save_strategy="steps", save_steps=2, **COMMON,
                         **LAYOUTS["fsdp x cp"])
    first.add_callback(StopAfter(2))
    first.train()
    results["fsdp x cp"] = record(first)
    resumed = make_trainer(os.path.join(out_dir, "split"), model_seed=1, **COMMON, **LAYOUTS["fsdp x tp"])
    resumed.train(resume_from_checkpoint=os.path.join(out_dir, "split", "checkpoint-2"))
    results["resumed"] = record(resumed, after_step=2)
    resumed.save_model(os.path.join(out_dir, "final"))  # full weights, gathered
    if resumed.args.process_index == 0:
        torch.save(results, os.path.join(out_dir, "results.pt"))
    resumed.accelerator.wait_for_everyone()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
