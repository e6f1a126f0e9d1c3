"""hf-dlm: diffusion language models on the Hugging Face stack.

Importing the package registers the DLM family (`model_type = "dlm"`) and the published families
(`hf_dlm.modeling.families`) with `AutoConfig`, `AutoModel` and `AutoModelForMaskedLM`. Every other public name (`from hf_dlm import DLMTrainer`) is imported on
first access, so `import hf_dlm` never imports trl, peft, datasets or kernel packages.
"""

__version__ = "0.1.0.dev0"

from transformers import AutoConfig, AutoModel, AutoModelForMaskedLM

from .modeling import DiffusionLMOutput, DLMConfig, DLMForDiffusionLM, DLMModel, DLMPreTrainedModel
from .utils.lazy import lazy_exports
from .utils.publishing import set_publisher


def _register_auto_classes() -> None:
    AutoConfig.register(DLMConfig.model_type, DLMConfig, exist_ok=True)
    AutoModel.register(DLMConfig, DLMModel, exist_ok=True)
    AutoModelForMaskedLM.register(DLMConfig, DLMForDiffusionLM, exist_ok=True)
    from .modeling.families import register_families

    register_families()  # llada, Dream, sdar, sdar_moe, Fast_dLLM_Qwen, lladamoe, llada2_moe


def _hub_publisher():
    from .hub import publish

    return publish


_register_auto_classes()
set_publisher(_hub_publisher)  # modeling / parallel / training save through hub/ without importing upward

# public name -> module that defines it (imported on first access)
_LAZY = {
    # generation
    "DLMGenerationConfig": ".generation.configuration",
    "DLMGenerateOutput": ".generation.sampler",
    # diffusion math
    "MaskedDiffusionObjective": ".diffusion.objective",
    "elbo_nll": ".diffusion.elbo",
    # training
    "DLMTrainer": ".training.trainer",
    "DLMTrainingArguments": ".training.training_args",
    "run_pretraining": ".training.runner",
    "register_data_builder": ".data.builders",
    "ConfigError": ".utils.errors",
    "QuickstartConfig": ".training.quickstart",
    "run_quickstart": ".training.quickstart",
    # post-training on trl / peft
    "DLMSFTConfig": ".training.sft_config",
    "DLMSFTTrainer": ".training.sft_trainer",
    "DiffuGRPOConfig": ".training.grpo_config",
    "DiffuGRPOTrainer": ".training.grpo_trainer",
    "dlm_lora_config": ".training.lora",
    "get_dlm_peft_model": ".training.lora",
    # data
    "DLMDataCollator": ".data.collator",
    "build_pretraining_dataset": ".data.streams",
    "PackedDataset": ".data.streams",
    "BlendedDataset": ".data.streams",
    "ShuffledSamples": ".data.streams",
    "DistributedSampleStream": ".data.streams",
    "data_parallel_rank_and_world": ".data.streams",
    "IndexedDataset": ".data.indexed_dataset",
    "IndexedDatasetWriter": ".data.indexed_dataset",
    "HFPackedStream": ".data.hf_stream",
    "SFTDataset": ".data.sft_data",
    "SFTDataConfig": ".data.sft_data",
    "TokenWindowDataset": ".data.memory_dataset",
    "pack_documents": ".data.memory_dataset",
    "PreprocessConfig": ".data.preprocess",
    "preprocess": ".data.preprocess",
    # parallel
    "parallelize_dlm": ".parallel.parallelize",
    "ParallelOptions": ".parallel.parallelize",
    "apply_expert_parallel": ".parallel.expert_parallel",
    "ParallelDims": ".parallel.mesh",
    "plan_layouts": ".parallel.planner",
    "convert_to_float8": ".parallel.float8",
    "precompute_float8_scales": ".parallel.float8",
    "fp8_autocast": ".parallel.float8",
    "DelayedFloat8Linear": ".parallel.float8_delayed",
    # hub
    "load_model": ".hub.loading",
    # serving and evaluation
    "ContinuousBatchingEngine": ".serving.engine",
    "create_app": ".serving.app",
    "DLMEvalHarness": ".evaluation.lm_eval_model",
    "DLMPipeline": ".parallel.pipeline",
    "pipeline_schedule_terms": ".parallel.pipeline",
    # conversion
    "convert_checkpoint": ".conversion.convert",
    "verify_checkpoints": ".conversion.verify",
}
_EAGER = {name: globals()[name] for name in
          ("DLMConfig", "DLMModel", "DLMForDiffusionLM", "DLMPreTrainedModel", "DiffusionLMOutput")}

__getattr__, __dir__, __all__ = lazy_exports(__name__, _LAZY, _EAGER)
