"""Serving: a continuous-batching engine for the diffusion samplers and an OpenAI-compatible FastAPI
app (`hf-dlm serve`). FastAPI and uvicorn load only when the app is built."""

from ..utils.lazy import lazy_exports

_LAZY = {
    "ContinuousBatchingEngine": ".engine", "GenerationRequest": ".engine", "SamplingParams": ".engine",
    "QueueFullError": ".engine", "create_app": ".app", "ServerSettings": ".app",
}

__getattr__, __dir__, __all__ = lazy_exports(__name__, _LAZY)
