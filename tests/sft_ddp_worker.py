"""Run by tests/test_post_training.py under `accelerate launch --multi_gpu --num_processes 2` with use_cpu
(examples/accelerate/ddp_cpu.yaml): one SGD step of DLMSFTTrainer, 2 micro-batches of 2 rows per rank; each
rank saves its parameters."""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.utils import digit_tokenizer, sft_one_step  # noqa: E402


def main(out_dir: str) -> None:
    params, trainer = sft_one_step(os.path.join(out_dir, "ddp"), digit_tokenizer(), 2, 2, ddp_backend="gloo")
    assert trainer.args.world_size == 2 and torch.distributed.get_backend() == "gloo"
    torch.save(params, os.path.join(out_dir, f"sft_params_rank{trainer.args.process_index}.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
