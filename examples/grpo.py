"""RL of a diffusion LM with diffu-GRPO on trl (`DiffuGRPOTrainer`), from a YAML config and/or flags.

    accelerate launch examples/grpo.py --config examples/configs/grpo_toy.yaml
    accelerate launch examples/grpo.py --config examples/configs/grpo_toy.yaml \
        --model_name_or_path outputs/sft-toy --logp_estimator coupled --use_peft true

Keys are the fields of `hf_dlm.training.post_training.PostTrainingArguments` and `hf_dlm.DiffuGRPOConfig` (trl's
`GRPOConfig` plus the sampler and the log-probability estimator). Same as `hf-dlm grpo ...` in one process.
"""

import sys

from hf_dlm.training.post_training import run_grpo

if __name__ == "__main__":
    run_grpo(sys.argv[1:])
