"""hf-dlm: diffusion language models on the Hugging Face stack.

Importing the package registers the DLM family (`model_type = "dlm"`) with `AutoConfig`, `AutoModel`
and `AutoModelForMaskedLM`. It never imports trl, peft, datasets or kernel packages.
"""

__version__ = "0.1.0.dev0"

from transformers import AutoConfig, AutoModel, AutoModelForMaskedLM

from .modeling import DiffusionLMOutput, DLMConfig, DLMForDiffusionLM, DLMModel, DLMPreTrainedModel
from .training.objective import MaskedDiffusionObjective


def _register_auto_classes() -> None:
    AutoConfig.register(DLMConfig.model_type, DLMConfig, exist_ok=True)
    AutoModel.register(DLMConfig, DLMModel, exist_ok=True)
    AutoModelForMaskedLM.register(DLMConfig, DLMForDiffusionLM, exist_ok=True)


_register_auto_classes()

__all__ = [
    "DLMConfig",
    "DLMModel",
    "DLMForDiffusionLM",
    "DLMPreTrainedModel",
    "DiffusionLMOutput",
    "MaskedDiffusionObjective",
]
