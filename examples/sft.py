"""Supervised fine-tuning of a diffusion LM on trl (`DLMSFTTrainer`), from a YAML config and/or flags.

    accelerate launch examples/sft.py --config examples/configs/sft_toy.yaml
    accelerate launch --config_file examples/accelerate/ddp.yaml examples/sft.py \
        --config examples/configs/sft_toy.yaml --model_name_or_path ORG/MY-DLM --dataset_name trl-lib/Capybara

Keys are the fields of `hf_dlm.training.post_training.PostTrainingArguments` and `hf_dlm.DLMSFTConfig` (trl's
`SFTConfig` plus the diffusion objective). Same as `hf-dlm sft ...` in one process.
"""

import sys

from hf_dlm.training.post_training import run_sft

if __name__ == "__main__":
    run_sft(sys.argv[1:])
