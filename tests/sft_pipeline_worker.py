"""Run by tests/test_sft_parallel.py under `torchrun --nproc_per_node 2` (gloo on CPU): DLMSFTTrainer with
pp_size=2 (one decoder layer a stage; the two ranks pool 2 + 2 rows into each micro-batch, 2 micro-batches a
step through the 1F1B schedule), 3 steps, checkpoint at step 2, then the final save (stage by stage, with the
model card). Rank 0 writes the logged losses, gradient norms and per-t statistics."""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.utils import sft_trainer  # noqa: E402

PIPELINE = dict(pp_size=2, pp_schedule="1f1b", per_device_train_batch_size=2, gradient_accumulation_steps=2,
                max_steps=3, save_strategy="steps", save_steps=2, ddp_backend="gloo")


def main(out_dir: str) -> None:
    trainer = sft_trainer(os.path.join(out_dir, "pp"), **PIPELINE)
    trainer.train()
    trainer.save_model()
    if trainer.args.process_index == 0:
        with open(os.path.join(out_dir, "logs.json"), "w") as f:
            json.dump({"logs": [log for log in trainer.state.log_history if "loss" in log],
                       "stages": [list(r) for r in trainer._pipeline.layer_ranges]}, f)
    trainer.accelerator.wait_for_everyone()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
