"""`DiffuGRPOConfig`: trl's `GRPOConfig` plus the diffusion sampler and the log-probability estimator.

Every trl option keeps its meaning (rewards, clipping `epsilon` / `epsilon_high`, KL `beta`, `num_iterations`,
`importance_sampling_level`, `loss_type`, ...). Options that need an autoregressive sampler are refused by
the trainer (`use_vllm`, `use_transformers_continuous_batching`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..utils.import_utils import require

require("trl", "DiffuGRPOConfig")

from trl import GRPOConfig  # noqa: E402

from ..generation.configuration import CACHE_MODES, REMASKING  # noqa: E402
from ..diffusion.logp_estimators import ESTIMATORS  # noqa: E402


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
    # -- diffusion sampler (model.generate) for rollouts --------------------------------------------
    diffusion_steps: int | None = field(
        default=None,
        metadata={"help": "Sampler forward passes per completion (generate's `steps`). None: max_completion_length "
                          "(one token per step)."},
    )
    block_length: int | None = field(
        default=None,
        metadata={"help": "Semi-autoregressive block length of the sampler. None: max_completion_length (one block)."})
    remasking: str = field(
        default="low_confidence", metadata={"help": f"Which masked positions the sampler commits first: {REMASKING}."})
    threshold: float | None = field(
        default=None,
        metadata={"help": "Fast-dLLM parallel decoding: commit every masked token of the block whose confidence is "
                          ">= threshold (diffusion_steps then ignored). None: a fixed number of tokens per step."},
    )
    generation_cache: str = field(
        default="none", metadata={"help": f"Sampler KV cache, one of {CACHE_MODES} (see DLMGenerationConfig.cache)."})
    generation_compile: str | None = field(
        default=None,
        metadata={"help": "Run the sampler's forward through torch.compile (DLMGenerationConfig.compile): 'true' "
                          "(Inductor plus CUDA graphs on GPU), a torch.compile mode or 'cudagraphs'; pays off on "
                          "GPU when rollout batches keep one shape. None: eager."},
    )
    generation_merge_adapters: bool = field(
        default=True,
        metadata={"help": "With LoRA, roll out with the adapters folded into merged copies of the base weights "
                          "(one GEMM per projection instead of three; the base weights are restored bit-exactly "
                          "afterwards; costs one copy of the adapted weights during the rollout). False: unmerged."},
    )
    # -- parent defaults changed ------------------------------------------------------------------
    temperature: float = field(
        default=0.9, metadata={"help": "Sampling temperature of the rollouts (Gumbel-max); d1 uses 0.9. Parent: 1.0."})
    gradient_checkpointing: bool = field(
        default=False,
        metadata={"help": "Parent default True; off here since DLM rollouts dominate the step (turn on for memory)."},
    )

    def __post_init__(self):
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
        if self.remasking not in REMASKING:
            raise ValueError(f"DiffuGRPOConfig.remasking must be one of {REMASKING}, got {self.remasking!r}")
        if self.generation_cache not in CACHE_MODES:
            raise ValueError(f"DiffuGRPOConfig.generation_cache must be one of {CACHE_MODES}, "
                             f"got {self.generation_cache!r}")
        if self.use_vllm or self.use_transformers_continuous_batching:
            raise ValueError("DiffuGRPOConfig: use_vllm / use_transformers_continuous_batching run an autoregressive "
                             "sampler; DLM rollouts go through model.generate (leave both False)")

    def estimator_options(self) -> dict:
        """Keyword arguments of the chosen estimator class (see logp_estimators)."""
        return {"d1": {"prompt_mask_prob": self.prompt_mask_prob},
                "coupled": {"t_min": self.coupled_t_min, "t_max": self.coupled_t_max,
                            "with_full_mask": self.coupled_with_full_mask},
                "mc_elbo": {"mc_num": self.mc_num}}[self.logp_estimator]

    def generate_kwargs(self) -> dict:
        """Keyword arguments of `model.generate` for rollouts (DLMGenerationConfig fields)."""
        compile_choice = True if str(self.generation_compile).lower() == "true" else self.generation_compile
        return dict(max_new_tokens=self.max_completion_length, steps=self.diffusion_steps,
                    block_length=self.block_length, remasking=self.remasking, threshold=self.threshold,
                    cache=self.generation_cache, compile=compile_choice, temperature=self.temperature,
                    top_k=self.top_k or None, top_p=self.top_p)

__all__ = ["DiffuGRPOConfig"]
