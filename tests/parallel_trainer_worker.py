"""Run by tests/test_parallel_trainer.py under `torchrun --nproc_per_node 4` (gloo on CPU): DLMTrainer with
device-mesh layouts from its arguments. Rank 0 saves each run's logged losses, the first step's gradients
and the final parameters (full tensors); every rank runs every trainer (the collectives need them all).

- "fsdp x tp": dp_shard 2 x tp 2, 4 steps;        - "hsdp x tp": dp_replicate 2 x tp 2, 2 steps;
- "fsdp x cp": dp_shard 2 x cp 2, 2 steps, saved;  - "hsdp x cp": dp_replicate 2 x cp 2, 2 steps;
- "resumed":   dp_shard 2 x tp 2 from the fsdp x cp checkpoint (another layout), steps 3-4;
- "yaml":      `hf-dlm train`'s runner on YAML_CONFIG with dp_shard_size 2 x cp_size 2."""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.utils import StopAfter, make_trainer  # noqa: E402

LAYOUTS = {"fsdp x tp": dict(dp_shard_size=2, tp_size=2), "fsdp x cp": dict(dp_shard_size=2, cp_size=2),
           "hsdp x tp": dict(dp_replicate_size=2, dp_shard_size=1, tp_size=2),
           "hsdp x cp": dict(dp_replicate_size=2, dp_shard_size=1, cp_size=2)}
# `hf-dlm train`'s YAML with layout fields (the worker runs it under FSDP2 x CP, the test on one process)
YAML_CONFIG = """
model:
  attn_implementation: sdpa
  config: {vocab_size: 99, mask_token_id: 98, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2,
           num_attention_heads: 4, num_key_value_heads: 2, qk_norm: true, max_position_embeddings: 64}
data: {kind: random, seq_len: 16, num_samples: 32}
training: {output_dir: OUT, use_cpu: true, max_steps: 3, per_device_train_batch_size: 2, learning_rate: 1.0e-2,
           logging_steps: 1, save_strategy: "no", report_to: none, seed: 0, dataloader_num_workers: 0}
"""
COMMON = dict(per_device_train_batch_size=2, max_steps=4, max_grad_norm=0.5, ddp_backend="gloo")


def full(tensor):
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor.detach().clone()


def record(trainer, after_step=0):
    model = trainer.accelerator.unwrap_model(trainer.model)
    return {"losses": [log["loss"] for log in trainer.state.log_history if "loss" in log and log["step"] > after_step],
            "grads": {name: full(grad) for name, grad in trainer.grads[0].items()} if trainer.grads else None,
            "params": torch.cat([full(p).reshape(-1) for p in model.parameters()]),
            "grad_norms": [log["grad_norm"] for log in trainer.state.log_history if "grad_norm" in log],
            "statistics": [{k: v for k, v in log.items() if k.startswith("ce_t/") or k == "masked_fraction"}
                           for log in trainer.state.log_history if "loss" in log and log["step"] > after_step]}


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
    rank = resumed.args.process_index
    results["yaml"] = run_yaml(out_dir, rank, ["training.dp_shard_size=2", "training.cp_size=2"])
    if rank == 0:  # (run_pretraining has left the process group)
        torch.save(results, os.path.join(out_dir, "results.pt"))


def run_yaml(out_dir: str, rank: int, overrides: list) -> list:
    """`hf-dlm train`'s runner on YAML_CONFIG; returns the logged losses."""
    from hf_dlm.training.runner import run_pretraining

    path = os.path.join(out_dir, f"mesh_rank{rank}.yaml")
    with open(path, "w") as f:
        f.write(YAML_CONFIG.replace("OUT", os.path.join(out_dir, "yaml_run")))
    losses = []
    from transformers import TrainerCallback

    class Losses(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses.append(logs["loss"])

    from hf_dlm.training import trainer as trainer_module

    original = trainer_module.DLMTrainer.__init__

    def init_with_callback(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.add_callback(Losses())

    trainer_module.DLMTrainer.__init__ = init_with_callback
    try:
        run_pretraining(path, overrides)
    finally:
        trainer_module.DLMTrainer.__init__ = original
    return losses


if __name__ == "__main__":
    main(sys.argv[1])
