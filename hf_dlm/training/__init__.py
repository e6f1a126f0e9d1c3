"""Training: `DLMTrainingArguments`,
`DLMTrainer`, the YAML runner, the quickstart, and post-training on trl / peft (`DLMSFTTrainer`,
`DiffuGRPOTrainer`, LoRA). Names load on first access."""

from ..utils.lazy import lazy_exports

_LAZY = {
    "DLMTrainingArguments": ".training_args", "DLMTrainer": ".trainer",
    "run_pretraining": ".runner", "register_data_builder": "..data.builders", "load_config": ".runner",
    "ConfigError": "..utils.errors",
    "QuickstartConfig": ".quickstart", "run_quickstart": ".quickstart",
    # post-training on trl / peft (import trl or peft only when used)
    "DLMSFTConfig": ".sft_config", "DLMSFTTrainer": ".sft_trainer", "DiffuGRPOConfig": ".grpo_config",
    "DiffuGRPOTrainer": ".grpo_trainer", "dlm_lora_config": ".lora",
    "get_dlm_peft_model": ".lora",
}

__getattr__, __dir__, __all__ = lazy_exports(__name__, _LAZY)
