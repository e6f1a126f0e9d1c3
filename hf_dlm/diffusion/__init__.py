"""The diffusion math every trainer, evaluation and serving use: the masked-diffusion objective and its
presets, noise keyed by (seed, global sample index), LLaDA's Monte Carlo ELBO and the completion
log-probability estimators of post-training. Names load on first access."""

from ..utils.lazy import lazy_exports

_LAZY = {
    "MaskedDiffusionObjective": ".objective", "elbo_nll": ".elbo", "hashed_uniform": ".noise",
    "build_estimator": ".logp_estimators",
}

__getattr__, __dir__, __all__ = lazy_exports(__name__, _LAZY)
