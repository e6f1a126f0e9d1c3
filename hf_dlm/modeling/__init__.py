from .configuration_dlm import DLMConfig
from .modeling_dlm import DiffusionLMOutput, DLMForDiffusionLM, DLMModel, DLMPreTrainedModel

__all__ = ["DLMConfig", "DLMModel", "DLMForDiffusionLM", "DLMPreTrainedModel", "DiffusionLMOutput"]
