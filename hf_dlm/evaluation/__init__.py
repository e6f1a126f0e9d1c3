"""Evaluation: the lm-evaluation-harness model `hf-dlm` (ELBO log-likelihoods, sampler generation) and
`hf-dlm eval`; `score_continuations`, its log-likelihood path as a plain function. lm-eval loads only when the
model class is used."""

from ..utils.lazy import lazy_exports

_LAZY = {"DLMEvalHarness": ".lm_eval_model", "score_continuations": ".scoring"}

__getattr__, __dir__, __all__ = lazy_exports(__name__, _LAZY)
