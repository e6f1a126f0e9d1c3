"""`hf-dlm grpo [--config FILE.yaml] [--key value ...]`: GRPO of a DLM with `DiffuGRPOTrainer` (diffu-GRPO)
(one process; for several, `accelerate launch examples/grpo.py ...`). Flags and YAML keys are the fields of
`PostTrainingArguments` and `DiffuGRPOConfig` (trl's `TrlParser`)."""

from __future__ import annotations

# every flag goes to trl's TrlParser in `run` (hf_dlm/cli.py passes them through)
PASS_THROUGH = True


def add_arguments(parser):
    parser.add_argument("--config", help="YAML file whose keys are fields of PostTrainingArguments / DiffuGRPOConfig "
                                         "(see examples/configs/grpo_toy.yaml); any --field value pair overrides it")


def run(args) -> int:
    from ..training.post_training import run_grpo

    run_grpo((["--config", args.config] if args.config else []) + args.options)
    return 0
