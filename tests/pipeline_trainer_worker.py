"""Run by tests/test_pipeline_trainer.py under `torchrun`: `hf-dlm train`'s YAML config with training.pp_size=2
on gloo processes; then (unless --no-resume) the same layout resumed from the run's checkpoint-2. Writes the logged losses, gradient
norms and per-t statistics, and whether the resumed run ended on the uninterrupted run's weights."""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hf_dlm.training.runner import build_trainer, load_config  # noqa: E402


def main(config_path: str, out_file: str, resume: bool = True) -> None:
    trainer, _ = build_trainer(load_config(config_path), config_path)
    trainer.train()
    if not resume:  # the logs only
        if trainer.args.process_index == 0:
            with open(out_file, "w") as f:
                json.dump({"logs": [log for log in trainer.state.log_history if "loss" in log]}, f)
        trainer.accelerator.wait_for_everyone()
        torch.distributed.destroy_process_group()
        return
    trainer.save_model(os.path.join(trainer.args.output_dir, "final"))
    straight = {name: p.detach().clone() for name, p in trainer.model.state_dict().items()}

    # the same layout resumed from checkpoint-2 (weights per stage, optimizer through DCP)
    output_dir = trainer.args.output_dir
    resumed, _ = build_trainer(load_config(config_path, [f"training.output_dir={output_dir}-resumed"]), config_path)
    resumed.train(resume_from_checkpoint=os.path.join(output_dir, "checkpoint-2"))
    gap = max(float((p - straight[name]).abs().max().full_tensor() if hasattr(p, "full_tensor")
                    else (p - straight[name]).abs().max()) for name, p in resumed.model.state_dict().items())
    gaps = [None] * trainer.args.world_size
    torch.distributed.all_gather_object(gaps, gap)
    if trainer.args.process_index == 0:
        with open(out_file, "w") as f:
            json.dump({"logs": [log for log in trainer.state.log_history if "loss" in log],
                       "resumed_logs": [log for log in resumed.state.log_history if "loss" in log and log["step"] > 2],
                       "resume_gap": max(gaps), "stages": [list(r) for r in trainer._pipeline.layer_ranges],
                       "world_size": trainer.args.world_size}, f)
    trainer.accelerator.wait_for_everyone()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], resume="--no-resume" not in sys.argv[3:])
