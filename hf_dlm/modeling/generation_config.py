"""`DLMGenerationConfig`: the diffusion sampler's settings, saved with the model as generation_config.json."""

from __future__ import annotations

from transformers import GenerationConfig

from .generation_compile import COMPILE_CHOICES

REMASKING = ("low_confidence", "random", "margin", "entropy")
CACHE_MODES = ("none", "prefix", "dual")

# field -> (default, help); kept in one table so the CLI and the docs read the same text
DLM_GENERATION_FIELDS = {
    "steps": (None, "forward passes in total (default: max_new_tokens, one token per step), split evenly over blocks"),
    "block_length": (None, "semi-autoregressive block length (default: max_new_tokens, one block)"),
    "remasking": ("low_confidence", f"which masked positions to commit first: one of {REMASKING}"),
    "cfg_scale": (0.0, "classifier-free guidance: un + (s + 1) * (cond - un), the prompt masked for un"),
    "threshold": (None, "Fast-dLLM parallel decoding: commit every masked token of the block whose confidence "
                  "is >= threshold (at least the most confident one) until the block is done; steps is then ignored"),
    "cache": ("none", f"KV cache, one of {CACHE_MODES}; approximate for bidirectional models (Fast-dLLM), "
              "exact for attention_mode='block' models (prefix and dual mean the same there)"),
    "stop_on_eos": (True, "a row whose last finished block is all EOS is done: its remaining masks become EOS"),
    "mask_token_id": (None, "default: model.config.mask_token_id"),
    "compile": (None, "run the sampler's forward through torch.compile with static shapes (fixed batch, block-sized "
                "windows): True (reduce-overhead = CUDA graphs on CUDA, default on CPU), a torch.compile mode "
                "('default', 'reduce-overhead', 'max-autotune', 'max-autotune-no-cudagraphs') or a backend "
                "('cudagraphs': CUDA graphs without Inductor, compiles in seconds; 'eager': tracing only); "
                "same tokens as eager; not for infilling or attention_mode='block' caches"),
}


class DLMGenerationConfig(GenerationConfig):
    """GenerationConfig plus the diffusion fields (`DLM_GENERATION_FIELDS`). Sampling fields that keep
    their transformers meaning: max_new_tokens, temperature (0 = argmax, else Gumbel-max in float64),
    top_k, top_p, eos_token_id, pad_token_id."""

    def __init__(self, **kwargs):
        for name, (default, _) in DLM_GENERATION_FIELDS.items():
            setattr(self, name, kwargs.pop(name, default))
        # transformers rejects a temperature without do_sample: temperature 0 is stored as greedy
        if kwargs.get("temperature") is not None:
            if float(kwargs["temperature"]) == 0.0:
                kwargs["temperature"], kwargs["do_sample"] = None, False
            else:
                kwargs["do_sample"] = True
        super().__init__(**kwargs)

    @property
    def sampling_temperature(self) -> float:
        """0 means argmax (greedy)."""
        return float(self.temperature or 0.0) if self.do_sample else 0.0

    @classmethod
    def from_any(cls, config: GenerationConfig | None, **overrides) -> "DLMGenerationConfig":
        """A DLMGenerationConfig from a plain GenerationConfig (as `from_pretrained` loads it: the
        diffusion keys survive there as extra attributes) with keyword overrides on top."""
        values = {} if config is None else config.to_dict()
        values.update({k: v for k, v in overrides.items() if v is not None or k in DLM_GENERATION_FIELDS})
        for key in ("transformers_version", "_from_model_config"):
            values.pop(key, None)
        out = cls(**values)
        out.validate_dlm()
        return out

    def validate_dlm(self):
        if self.remasking not in REMASKING:
            raise ValueError(f"DLMGenerationConfig.remasking must be one of {REMASKING}, got {self.remasking!r}")
        if self.cache not in CACHE_MODES:
            raise ValueError(f"DLMGenerationConfig.cache must be one of {CACHE_MODES}, got {self.cache!r}")
        if self.compile not in (None, True, False) and self.compile not in COMPILE_CHOICES:
            raise ValueError(f"DLMGenerationConfig.compile must be a bool or one of {tuple(COMPILE_CHOICES)}, "
                             f"got {self.compile!r}")
        if self.threshold is not None and not 0.0 <= float(self.threshold) <= 1.0:
            raise ValueError(f"DLMGenerationConfig.threshold must lie in [0, 1], got {self.threshold}")


__all__ = ["DLMGenerationConfig", "DLM_GENERATION_FIELDS"]
