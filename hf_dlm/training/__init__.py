"""Training: the masked-diffusion objective and its noise, the ELBO, `DLMTrainingArguments`,
`DLMTrainer`, the YAML runner and the quickstart. Names load on first access."""

from ..utils.lazy import lazy_exports

_LAZY = {
    "MaskedDiffusionObjective": ".objective", "elbo_nll": ".elbo", "hashed_uniform": ".noise",
    "DLMTrainingArguments": ".training_args", "DLMTrainer": ".trainer",
    "run_pretraining": ".runner", "register_data_builder": ".runner", "load_config": ".runner",
    "ConfigError": ".runner",
    "QuickstartConfig": ".quickstart", "run_quickstart": ".quickstart",
}

__getattr__, __dir__, __all__ = lazy_exports(__name__, _LAZY)
