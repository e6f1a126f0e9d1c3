"""`hf-dlm grpo [--config FILE.yaml] [--field value ...]`: GRPO of a DLM with `DiffuGRPOTrainer` (diffu-GRPO) (one process; for several,
`accelerate launch examples/grpo.py ...`). Flags and YAML keys are the fields of `PostTrainingArguments` and
`DiffuGRPOConfig`, parsed by trl's `TrlParser` (hf_dlm/cli.py passes every flag through: PASS_THROUGH)."""

from ..training.post_training import subcommand

PASS_THROUGH = True
add_arguments, run = subcommand("grpo", "DiffuGRPOConfig")
