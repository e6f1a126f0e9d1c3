"""`hf-dlm sft [--config FILE.yaml] [--key value ...]`: supervised fine-tuning of a DLM with `DLMSFTTrainer`
(one process; for several, `accelerate launch examples/sft.py ...`). Flags and YAML keys are the fields of
`PostTrainingArguments` and `DLMSFTConfig` (trl's `TrlParser`)."""

from __future__ import annotations

# every flag goes to trl's TrlParser in `run` (hf_dlm/cli.py passes them through)
PASS_THROUGH = True


def add_arguments(parser):
    parser.add_argument("--config", help="YAML file whose keys are fields of PostTrainingArguments / DLMSFTConfig "
                                         "(see examples/configs/sft_toy.yaml); any --field value pair overrides it")


def run(args) -> int:
    from ..training.post_training import run_sft

    run_sft((["--config", args.config] if args.config else []) + args.options)
    return 0
