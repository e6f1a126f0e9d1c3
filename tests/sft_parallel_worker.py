"""Run by tests/test_sft_parallel.py under `torchrun --nproc_per_node 4` (gloo on CPU): DLMSFTTrainer with the
device-mesh layouts DLMTrainer's tests use (tests/parallel_trainer_worker.py). Rank 0 saves each run's logged
losses, grad norms, statistics, first-step gradients and final parameters (full tensors).

- "fsdp x tp": dp_shard 2 x tp 2, 4 steps;   - "hsdp x cp": dp_replicate 2 x cp 2, 2 steps;
- "fsdp x cp": dp_shard 2 x cp 2, checkpoint at step 2, stopped there;
- "resumed":   dp_shard 2 x tp 2 from the fsdp x cp checkpoint (another layout, another init), steps 3-4."""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.utils import flat_params, sft_trainer  # noqa: E402
from tests.utils import StopAfter  # noqa: E402

LAYOUTS = {"fsdp x tp": dict(dp_shard_size=2, tp_size=2), "fsdp x cp": dict(dp_shard_size=2, cp_size=2),
           "hsdp x cp": dict(dp_replicate_size=2, dp_shard_size=1, cp_size=2)}
COMMON = dict(per_device_train_batch_size=2, max_steps=4, ddp_backend="gloo")


def _full(tensor):
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor.detach().clone()


def record(trainer, after_step=0):
    history = [log for log in trainer.state.log_history if "loss" in log and log["step"] > after_step]
    return {"losses": [log["loss"] for log in history], "grad_norms": [log["grad_norm"] for log in history],
            "statistics": [{k: v for k, v in log.items() if k.startswith("ce_t/") or k == "masked_fraction"}
                           for log in history],
            "grads": {name: _full(grad) for name, grad in trainer.grads[0].items()} if trainer.grads else None,
            "params": flat_params(trainer.accelerator.unwrap_model(trainer.model))}


def main(out_dir: str) -> None:
    results = {}
    for name, steps in (("fsdp x tp", 4), ("hsdp x cp", 2)):
        trainer = sft_trainer(os.path.join(out_dir, name.replace(" ", "")), **{**COMMON, "max_steps": steps},
                              **LAYOUTS[name])
        trainer.train()
        results[name] = record(trainer)
    first = sft_trainer(os.path.join(out_dir, "split"), save_strategy="steps", save_steps=2, **COMMON,
                        **LAYOUTS["fsdp x cp"])
    first.add_callback(StopAfter(2))
    first.train()
    results["fsdp x cp"] = record(first)
    resumed = sft_trainer(os.path.join(out_dir, "split"), model_seed=1, save_strategy="steps", save_steps=2,
                          **COMMON, **LAYOUTS["fsdp x tp"])
    resumed.train(resume_from_checkpoint=True)
    results["resumed"] = record(resumed, after_step=2)
    if resumed.args.process_index == 0:
        torch.save(results, os.path.join(out_dir, "results.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
