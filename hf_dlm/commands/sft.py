"""`hf-dlm sft [--config FILE.yaml] [--field value ...]`: supervised fine-tuning of a DLM with `DLMSFTTrainer` (one process; for several,
`accelerate launch examples/sft.py ...`). Flags and YAML keys are the fields of `PostTrainingArguments` and
`DLMSFTConfig`, parsed by trl's `TrlParser` (hf_dlm/cli.py passes every flag through: PASS_THROUGH)."""

from ..training.post_training import subcommand

PASS_THROUGH = True
add_arguments, run = subcommand("sft", "DLMSFTConfig")
