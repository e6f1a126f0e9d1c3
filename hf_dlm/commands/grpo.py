"""`hf-dlm grpo [--config FILE.yaml] [--key value ...]`: GRPO of a DLM with `DiffuGRPOTrainer` (diffu-GRPO)
(one process; for several, `accelerate launch examples/grpo.py ...`). Flags and YAML keys are the fields of
`PostTrainingArguments` and `DiffuGRPOConfig` (trl's `TrlParser`)."""

from __future__ import annotations

import argparse


def add_arguments(parser):
    parser.add_argument("options", nargs=argparse.REMAINDER,
                        help="--config FILE.yaml and/or --field value pairs of PostTrainingArguments / DiffuGRPOConfig "
                             "(see examples/configs/grpo_toy.yaml)")


def run(args) -> int:
    from ..training.post_training import run_grpo

    run_grpo(args.options)
    return 0
