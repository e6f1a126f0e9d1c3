"""`DiffuGRPOConfig`: trl's `GRPOConfig` plus the completion log-probability estimator of a diffusion LM.

Every trl option keeps its meaning (rewards, clipping `epsilon` / `epsilon_high`, KL `beta`, `num_iterations`,
`importance_sampling_level`, `loss_type`, ...). Rollout settings are trl's: `temperature`, `top_p`, `top_k`,
`max_completion_length`, and `generation_kwargs` for the diffusion sampler's own fields (`DLMGenerationConfig`:
steps, block_length, remasking, threshold, cache, compile, ...); the rollouts call `model.generate` with the
`DLMGenerationConfig` that `rollout_generation_config` builds. What the sampler cannot honour is refused by name
(`min_p`, `repetition_penalty`, `cache_implementation`, unknown or out-of-range `generation_kwargs`), as are
options that need an autoregressive sampler (`use_vllm`, `use_transformers_continuous_batching`).

`RECIPES` / `DiffuGRPOConfig.from_recipe` give the published algorithms' settings: "d1" (diffu-GRPO's
`compute_loss`) and "coupled_grpo" (DiffuCoder). The plain defaults are trl 1.16's GRPO (DAPO token-level loss,
group-scaled rewards, beta 0, bias-corrected KL) with d1's one-step estimator scored at the rollout temperature.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..utils.import_utils import require

require("trl", "DiffuGRPOConfig")

from trl import GRPOConfig  # noqa: E402

from ..generation.configuration import DLM_GENERATION_FIELDS, UNSUPPORTED, DLMGenerationConfig  # noqa: E402
from ..diffusion.logp_estimators import ESTIMATORS  # noqa: E402
from ..utils.errors import FieldError  # noqa: E402
from ..utils.transformers_compat import default_activation_checkpointing  # noqa: E402

# generation_kwargs keys the rollouts honour: the sampler's own fields and trl's sampling fields
ROLLOUT_KWARGS = (set(DLM_GENERATION_FIELDS) - {"mask_token_id"}) | {"temperature", "top_p", "top_k", "do_sample"}
# generation_kwargs keys that have a GRPO spelling of their own
_SPELLED_ELSEWHERE = {"max_new_tokens": "max_completion_length", "max_length": "max_completion_length",
                      "num_return_sequences": "num_generations", "eos_token_id": "the tokenizer's EOS",
                      "pad_token_id": "the tokenizer's pad token"}

RECIPES = {
    # d1 (dllm-reasoning/d1, diffu-grpo/diffu_grpo_trainer.py `compute_loss`, `_get_per_token_logps`,
    # `forward_process`; diffu_grpo_config.py): one-step estimator (completion masked, prompt masked with
    # p = 0.15), raw logits (no temperature), advantages = reward - group mean (no division by the std), KL
    # k3 without importance weighting, beta 0.04, loss = sum over completion tokens / their number (bnpo);
    # rollouts at temperature 0.9
    "d1": dict(logp_estimator="d1", prompt_mask_prob=0.15, logp_temperature=1.0, temperature=0.9,
               use_bias_correction_kl=False, scale_rewards="none", beta=0.04, loss_type="bnpo"),
    # DiffuCoder coupled-GRPO (apple/ml-diffucoder recipes/config_coupled_code.yaml and its coupled trainer):
    # complementary masks with t ~ U[0.2, 0.8] plus the fully masked pass, prompt never masked, rollouts at
    # temperature 1.0, beta 0.01 with the reference synced every 64 steps, epsilon 0.5, no reward scaling,
    # num_iterations 2, bnpo loss (trl 0.18's default there), KL without importance weighting
    "coupled_grpo": dict(logp_estimator="coupled", coupled_t_min=0.2, coupled_t_max=0.8, coupled_with_full_mask=True,
                         logp_temperature=1.0, temperature=1.0, use_bias_correction_kl=False, scale_rewards="none",
                         beta=0.01, epsilon=0.5, num_iterations=2, loss_type="bnpo", sync_ref_model=True,
                         ref_model_sync_steps=64),
}


@dataclass
class DiffuGRPOConfig(GRPOConfig):
    # -- log-probability estimator --------------------------------------------------------------
    logp_estimator: str = field(
        default="d1",
        metadata={"help": f"Completion log-probability estimator, one of {sorted(ESTIMATORS)}: 'd1' (one forward, "
                          "completion fully masked, prompt masked with prompt_mask_prob), 'coupled' (DiffuCoder's "
                          "complementary masks), 'mc_elbo' (Monte Carlo ELBO with mc_num draws)."},
    )
    prompt_mask_prob: float = field(
        default=0.15, metadata={"help": "'d1': probability that each prompt token is masked (d1 uses 0.15)."})
    mc_num: int = field(default=4, metadata={"help": "'mc_elbo': Monte Carlo draws per completion."})
    coupled_t_min: float = field(
        default=0.2, metadata={"help": "'coupled': lower end of the mask ratio t ~ U[t_min, t_max] (DiffuCoder: 0.2)."})
    coupled_t_max: float = field(
        default=0.8, metadata={"help": "'coupled': upper end of the mask ratio (DiffuCoder: 0.8)."})
    coupled_with_full_mask: bool = field(
        default=True,
        metadata={"help": "'coupled': average the complementary pair with a fully masked pass, as DiffuCoder's "
                          "released code does (three forwards); False: the pair alone."},
    )
    estimator_seed: int | None = field(
        default=None,
        metadata={"help": "Seed of the estimator's masks; each rollout batch and inner iteration (num_iterations) "
                          "derives its own from it. None: `seed`."},
    )
    logp_temperature: float | None = field(
        default=None,
        metadata={"help": "Temperature the log-probability estimators divide the logits by. None: the rollout "
                          "temperature (trl's convention: the policy scored is the one sampled); 1.0: the raw "
                          "logits, as d1's `_get_per_token_logps` and DiffuCoder's coupled-GRPO score them."},
    )
    # -- rollouts: trl's fields (temperature, top_p, top_k, max_completion_length, generation_kwargs) ------------
    generation_merge_adapters: bool = field(
        default=True,
        metadata={"help": "With LoRA, roll out with the adapters folded into merged copies of the base weights "
                          "(one GEMM per projection instead of three; the base weights are restored bit-exactly "
                          "afterwards; costs one copy of the adapted weights during the rollout). False: unmerged."},
    )
    # -- parent defaults changed ------------------------------------------------------------------
    temperature: float = field(
        default=0.9, metadata={"help": "Sampling temperature of the rollouts (Gumbel-max); d1 uses 0.9. Parent: 1.0."})
    gradient_checkpointing: bool | None = field(
        default=None,
        metadata={"help": "Parent default True; off here (None: off) since DLM rollouts dominate the step (turn on "
                          "for memory). transformers >= 5.24 spells it activation_checkpointing."},
    )

    def __post_init__(self):
        default_activation_checkpointing(self, False)  # no FutureWarning from the parent on transformers >= 5.24
        super().__post_init__()
        if self.logp_estimator not in ESTIMATORS:
            raise ValueError(f"DiffuGRPOConfig.logp_estimator must be one of {sorted(ESTIMATORS)}, "
                             f"got {self.logp_estimator!r}")
        if not 0.0 <= self.prompt_mask_prob < 1.0:
            raise ValueError(f"DiffuGRPOConfig.prompt_mask_prob must lie in [0, 1), got {self.prompt_mask_prob}")
        if self.mc_num < 1:
            raise ValueError(f"DiffuGRPOConfig.mc_num must be >= 1, got {self.mc_num}")
        if not 0.0 < self.coupled_t_min <= self.coupled_t_max < 1.0:
            raise ValueError("DiffuGRPOConfig needs 0 < coupled_t_min <= coupled_t_max < 1, got "
                             f"{self.coupled_t_min}, {self.coupled_t_max}")
        if self.logp_temperature is not None and not self.logp_temperature > 0:
            raise FieldError("logp_temperature", f"DiffuGRPOConfig.logp_temperature must be > 0 (or None: the "
                             f"rollout temperature), got {self.logp_temperature!r}", self.logp_temperature)
        self._refuse_unsupported_rollout_settings()
        self.rollout_generation_config()  # validates every rollout setting now, not at the first rollout
        if self.use_vllm or self.use_transformers_continuous_batching:
            raise ValueError("DiffuGRPOConfig: use_vllm / use_transformers_continuous_batching run an autoregressive "
                             "sampler; DLM rollouts go through model.generate (leave both False)")

    def estimator_options(self) -> dict:
        """Keyword arguments of the chosen estimator class (see logp_estimators)."""
        return {"d1": {"prompt_mask_prob": self.prompt_mask_prob},
                "coupled": {"t_min": self.coupled_t_min, "t_max": self.coupled_t_max,
                            "with_full_mask": self.coupled_with_full_mask},
                "mc_elbo": {"mc_num": self.mc_num}}[self.logp_estimator]

    @classmethod
    def from_recipe(cls, name: str, **overrides) -> "DiffuGRPOConfig":
        """The settings of a published algorithm (`RECIPES`: "d1", "coupled_grpo") with `overrides` on top."""
        if name not in RECIPES:
            raise FieldError("recipe", f"unknown GRPO recipe {name!r}; choose from {sorted(RECIPES)}", name)
        return cls(**{**RECIPES[name], **overrides})

    @property
    def rollout_temperature(self) -> float:
        """The temperature the rollouts sample at (`generation_kwargs` overrides `temperature`, as in trl)."""
        return float((self.generation_kwargs or {}).get("temperature", self.temperature))

    @property
    def estimator_temperature(self) -> float:
        """The temperature the log-probability estimators apply: `logp_temperature`, else the rollout's."""
        if self.logp_temperature is not None:
            return float(self.logp_temperature)
        return self.rollout_temperature or 1.0  # greedy rollouts (temperature 0) score the raw logits

    def _refuse_unsupported_rollout_settings(self):
        """trl's fields the diffusion sampler cannot honour, and generation_kwargs it does not know, by name."""
        for name, off in (("min_p", None), ("repetition_penalty", 1.0), ("cache_implementation", None)):
            if getattr(self, name) != off:
                raise FieldError(name, f"DiffuGRPOConfig.{name}={getattr(self, name)!r} is not supported by the "
                                 f"diffusion sampler of the rollouts; leave it at {off!r}", getattr(self, name))
        kwargs = self.generation_kwargs or {}
        if not isinstance(kwargs, dict):
            raise FieldError("generation_kwargs", f"DiffuGRPOConfig.generation_kwargs must be a dict, got {kwargs!r}",
                             kwargs)
        for key, value in kwargs.items():
            field_name = f"generation_kwargs.{key}"
            if key in _SPELLED_ELSEWHERE:
                raise FieldError(field_name, f"DiffuGRPOConfig.generation_kwargs[{key!r}]: set "
                                 f"{_SPELLED_ELSEWHERE[key]} instead", value)
            if key in UNSUPPORTED:
                raise FieldError(field_name, f"DiffuGRPOConfig.generation_kwargs[{key!r}]={value!r} is not "
                                 "supported by the diffusion sampler of the rollouts", value)
            if key not in ROLLOUT_KWARGS:
                raise FieldError(field_name, f"DiffuGRPOConfig.generation_kwargs has an unknown key {key!r}; "
                                 f"the rollouts take {sorted(ROLLOUT_KWARGS)}", value)

    def rollout_generation_config(self, **overrides) -> DLMGenerationConfig:
        """The `DLMGenerationConfig` the rollouts pass to `model.generate`: trl's temperature / top_p / top_k /
        max_completion_length, then `generation_kwargs` (which override them, as in trl), then `overrides`
        (the trainer's eos / pad ids). A value out of range raises a FieldError naming its field."""
        values = dict(max_new_tokens=self.max_completion_length, temperature=self.temperature, top_p=self.top_p,
                      top_k=self.top_k or None)
        values.update(self.generation_kwargs or {})
        values.update(overrides)
        if values.get("compile") in ("true", "True"):  # YAML / CLI spelling of compile=True
            values["compile"] = True
        try:
            return DLMGenerationConfig.from_any(None, **values)
        except ValueError as error:
            named = re.search(r"DLMGenerationConfig\.(\w+)", str(error))
            name = named.group(1) if named else None
            if name in (self.generation_kwargs or {}):
                field_name = f"generation_kwargs.{name}"
            else:
                field_name = {"max_new_tokens": "max_completion_length", None: "generation_kwargs"}.get(name, name)
            raise FieldError(field_name, f"DiffuGRPOConfig rollout settings ({field_name}): {error}") from error

__all__ = ["DiffuGRPOConfig"]
