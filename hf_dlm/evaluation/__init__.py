"""Evaluation: the lm-evaluation-harness model `hf-dlm` (ELBO log-likelihoods, sampler generation) and
`hf-dlm eval`. lm-eval loads only when the model class is used."""

from ..utils.lazy import lazy_exports

_LAZY = {"DLMEvalHarness": ".lm_eval_model"}

__getattr__, __dir__, __all__ = lazy_exports(__name__, _LAZY)
