"""`DLMSFTConfig`: trl's `SFTConfig` plus the masked-diffusion objective and the EOS-padding policy.

trl's dataset options keep their meaning (language modelling, prompt-completion, conversational with the
chat template, `completion_only_loss`, `assistant_only_loss`, `max_length`, `packing`); what trl marks as not
supervised (its labels are -100: the prompt) is never noised and carries no loss.

Defaults that differ from the parent: `gradient_checkpointing=False` (the tiny and mid-size DLMs this
targets fit without it; turn it on for memory, as in trl).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..utils.import_utils import require

require("trl", "DLMSFTConfig")

from trl import SFTConfig  # noqa: E402

from ..data.sft_data import PADDING_POLICIES  # noqa: E402
from ..diffusion.objective import PRESETS, MaskedDiffusionObjective  # noqa: E402

# LLaDA's SFT recipe on top of the preset: each row's loss divided by its response length, no random cuts
SFT_OBJECTIVE_DEFAULTS = {"normalization": "sequence", "random_length_prob": 0.0}


@dataclass
class DLMSFTConfig(SFTConfig):
    objective_preset: str | None = field(
        default="llada",
        metadata={"help": f"Objective preset, one of {sorted(PRESETS)} (hf_dlm.diffusion.objective.PRESETS), with "
                          f"the SFT defaults {SFT_OBJECTIVE_DEFAULTS} on top (LLaDA SFT: loss per response token "
                          "of each row, no random-length cuts); objective_overrides overrides both."},
    )
    objective_overrides: dict | None = field(
        default=None,
        metadata={"help": "MaskedDiffusionObjective fields to override (e.g. {'normalization': 'token', "
                          "'t_sampling': 'antithetic'}); allowed keys: "
                          f"{MaskedDiffusionObjective.field_names()}."},
    )
    objective_seed: int | None = field(
        default=None,
        metadata={"help": "Seed of the diffusion noise, keyed with each sample's index (and epoch), so the noise "
                          "does not depend on world size or micro-batch split. None: `seed`."},
    )
    padding_policy: str = field(
        default="eos",
        metadata={"help": "What batch padding is: 'eos' (default, LLaDA) pads responses with EOS that are noised and "
                          "trained on, so the model learns to fill the rest of the canvas with EOS, i.e. to stop "
                          "(the sampler's fixed-length canvas needs this); 'exclude' leaves padding out of "
                          "attention and loss (dllm / NeMo). Packed rows always exclude their padding."},
    )
    gradient_checkpointing: bool = field(
        default=False, metadata={"help": "Recompute activations in the backward (parent default: True)."})

    def __post_init__(self):
        super().__post_init__()
        if self.objective_preset is not None and self.objective_preset not in PRESETS:
            raise ValueError(f"DLMSFTConfig.objective_preset must be one of {sorted(PRESETS)} or None, "
                             f"got {self.objective_preset!r}")
        unknown = set(self.objective_overrides or {}) - set(MaskedDiffusionObjective.field_names())
        if unknown:
            raise ValueError(f"DLMSFTConfig.objective_overrides has unknown keys {sorted(unknown)}; allowed: "
                             f"{MaskedDiffusionObjective.field_names()}")
        if self.padding_policy not in PADDING_POLICIES:
            raise ValueError(f"DLMSFTConfig.padding_policy must be one of {PADDING_POLICIES}, "
                             f"got {self.padding_policy!r}")
        if self.padding_free:
            raise ValueError("DLMSFTConfig.padding_free flattens a batch into one row, but the diffusion noise is "
                             "drawn per sample: use packing=True (documents stay apart through position_ids)")
        if self.packing and self.packing_strategy == "wrapped":
            raise ValueError("DLMSFTConfig: packing_strategy='wrapped' cuts documents across rows without "
                             "boundaries; use 'bfd' (documents kept whole, attention masked per document)")

    def build_objective(self, model_config) -> MaskedDiffusionObjective:
        """Mask id and label alignment from the model; preset, SFT defaults, overrides and seed from here."""
        overrides = {**SFT_OBJECTIVE_DEFAULTS, **(self.objective_overrides or {})}
        overrides.setdefault("seed", self.seed if self.objective_seed is None else self.objective_seed)
        return MaskedDiffusionObjective.from_model_config(model_config, preset=self.objective_preset, **overrides)


__all__ = ["DLMSFTConfig"]
