"""The decoding core: settings (`DLMGenerationConfig`), commit arithmetic, KV caches, the compiled step and
the sampler loop behind `model.generate`. It sits below `modeling/` and calls a model only through its
forward, as `transformers.generation` sits below `modeling_utils`. Names load on first access."""

from ..utils.lazy import lazy_exports

_LAZY = {
    "DLMGenerationConfig": ".configuration", "DLMGenerationMixin": ".sampler", "DLMGenerateOutput": ".sampler",
    "DLMKVCache": ".cache", "StepGraphs": ".compiled_step", "COMMIT_RULES": ".commit_rules",
    "CommitSettings": ".commit_rules", "decide_step": ".commit_rules", "RowSchedule": ".row_schedule",
    "SlotStorage": ".slot_cache", "quantize_float8_for_decoding": ".float8",
}

__getattr__, __dir__, __all__ = lazy_exports(__name__, _LAZY)
