"""Run by tests/test_pipeline_trainer.py under `torchrun --nproc_per_node 2`: `hf-dlm train`'s YAML config with
training.pp_size=2 on 2 gloo processes; writes the logged losses, gradient norms and per-t statistics."""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hf_dlm.training.runner import build_trainer, load_config  # noqa: E402


def main(config_path: str, out_file: str) -> None:
    trainer, _ = build_trainer(load_config(config_path), config_path)
    trainer.train()
    trainer.save_model(os.path.join(trainer.args.output_dir, "final"))
    if trainer.args.process_index == 0:
        with open(out_file, "w") as f:
            json.dump({"logs": [log for log in trainer.state.log_history if "loss" in log],
                       "stages": [list(r) for r in trainer._pipeline.layer_ranges],
                       "world_size": trainer.args.world_size}, f)
    trainer.accelerator.wait_for_everyone()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
