"""`hf-dlm sft [--config FILE.yaml] [--key value ...]`: supervised fine-tuning of a DLM with `DLMSFTTrainer`
(one process; for several, `accelerate launch examples/sft.py ...`). Flags and YAML keys are the fields of
`PostTrainingArguments` and `DLMSFTConfig` (trl's `TrlParser`)."""

from __future__ import annotations

import argparse


def add_arguments(parser):
    parser.add_argument("options", nargs=argparse.REMAINDER,
                        help="--config FILE.yaml and/or --field value pairs of PostTrainingArguments / DLMSFTConfig "
                             "(see examples/configs/sft_toy.yaml)")


def run(args) -> int:
    from ..training.post_training import run_sft

    run_sft(args.options)
    return 0
