"""Speed and scale: `ParallelDims` (one named device mesh), `parallelize_dlm` (tensor, expert and context
parallel, activation checkpointing, per-block compile, FSDP2, in torchtitan's order), pipeline parallelism
(`DLMPipeline`), the memory planner and the float8 converters (torchao recipes, hf-dlm's delayed recipe,
Transformer Engine). Names load on first access; torchao and Transformer Engine only when used."""

from ..utils.lazy import lazy_exports

_LAZY = {
    "parallelize_dlm": ".parallelize", "parallelize_from_dims": ".parallelize", "ParallelOptions": ".parallelize",
    "apply_tensor_parallel": ".tensor_parallel", "apply_context_parallel": ".context_parallel",
    "ParallelDims": ".mesh", "build_parallel_dims": ".mesh", "MemoryPlan": ".planner", "plan_layouts": ".planner",
    "apply_expert_parallel": ".expert_parallel",
    "convert_to_float8": ".float8", "precompute_float8_scales": ".float8", "fp8_autocast": ".float8",
    "float8_module_filter": ".float8",
    "DelayedFloat8Linear": ".float8_delayed", "convert_to_delayed_float8": ".float8_delayed",
    "DLMPipeline": ".pipeline", "DLMPipelineStageModule": ".pipeline", "pipeline_schedule_terms": ".pipeline",
    "split_layers": ".pipeline", "save_pipeline_pretrained": ".pipeline_checkpoint",
    "load_pipeline_weights": ".pipeline_checkpoint",
}

__getattr__, __dir__, __all__ = lazy_exports(__name__, _LAZY)
