"""`DLMSFTConfig`: trl's `SFTConfig` plus what `DLMTrainingArguments` adds for diffusion, spelled the same:
the objective (`ObjectiveArguments`: `objective_preset` and the fields `schedule`, `weighting`, `t_sampling`,
`eps`, `normalization`, `at_least_one_masked`, `random_length_prob`, `objective_seed`), the statistics and
speed switches (`DiffusionTrainingFields`: `t_buckets`, `peak_flops`, `fp8_recipe`, `compile_blocks`,
`eval_mc_num`, ...), pipeline parallelism (`PipelineArguments`: `pp_size`, `pp_schedule`, ...; every batch is then
padded to `max_length`), the device mesh (`ParallelArguments`: `tp_size`, `cp_size`, `dp_shard_size`, ...) and
the EOS-padding policy.

trl's dataset options keep their meaning (language modelling, prompt-completion, conversational with the
chat template, `completion_only_loss`, `assistant_only_loss`, `max_length`, `packing`); what trl marks as not
supervised (its labels are -100: the prompt) is never noised and carries no loss.

Defaults that differ from the parent: `gradient_checkpointing=False` (the tiny and mid-size DLMs this
targets fit without it; turn it on for memory, as in trl), `objective_preset="llada"` with LLaDA's SFT
recipe on top (`normalization="sequence"`, `random_length_prob=0.0`) unless those fields are set.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import ClassVar

from ..utils.import_utils import require

require("trl", "DLMSFTConfig")

from trl import SFTConfig  # noqa: E402

from ..data.sft_data import PADDING_POLICIES  # noqa: E402
from ..diffusion.objective import PRESETS, MaskedDiffusionObjective  # noqa: E402
from ..parallel.trainer_parallel import ParallelArguments  # noqa: E402
from ..utils.transformers_compat import default_activation_checkpointing  # noqa: E402
from .training_args import DiffusionTrainingFields, ObjectiveArguments, PipelineArguments  # noqa: E402

# LLaDA's SFT recipe on top of the preset: each row's loss divided by its response length, no random cuts
SFT_OBJECTIVE_DEFAULTS = {"normalization": "sequence", "random_length_prob": 0.0}


@dataclass
class DLMSFTConfig(ObjectiveArguments, DiffusionTrainingFields, PipelineArguments, ParallelArguments, SFTConfig):
    _objective_defaults: ClassVar[dict] = SFT_OBJECTIVE_DEFAULTS

    objective_preset: str | None = field(
        default="llada",
        metadata={"help": f"Objective preset, one of {sorted(PRESETS)} (hf_dlm.diffusion.objective.PRESETS), with "
                          f"the SFT defaults {SFT_OBJECTIVE_DEFAULTS} on top (LLaDA SFT: loss per response token "
                          "of each row, no random-length cuts); the objective fields (normalization, t_sampling, "
                          "...) override both."},
    )
    objective_overrides: dict | None = field(
        default=None,
        metadata={"help": "Deprecated: set the objective fields themselves (normalization=..., t_sampling=..., "
                          "objective_seed=...), as in DLMTrainingArguments. Still accepted, with a FutureWarning."},
    )
    padding_policy: str = field(
        default="eos",
        metadata={"help": "What batch padding is: 'eos' (default, LLaDA) pads responses with EOS that are noised and "
                          "trained on, so the model learns to fill the rest of the canvas with EOS, i.e. to stop "
                          "(the sampler's fixed-length canvas needs this); 'exclude' leaves padding out of "
                          "attention and loss (dllm / NeMo). Packed rows always exclude their padding."},
    )
    gradient_checkpointing: bool | None = field(
        default=None, metadata={"help": "Recompute activations in the backward (parent default: True; here False). "
                                        "transformers >= 5.24 spells it activation_checkpointing."})

    def __post_init__(self):
        self._fold_objective_overrides()
        self._validate_objective_fields()
        self._validate_diffusion_fields()
        self._validate_pipeline_fields(self._field_error)
        if self.pp_size > 1 and self.max_length is None:
            self._field_error("max_length", "set with pp_size > 1 (a pipeline sends fixed-shape activations: every "
                                            "batch is padded to max_length)")
        self._validate_layout_fields()
        default_activation_checkpointing(self, False)  # the new name when this transformers has it: no FutureWarning
        super().__post_init__()
        if self.padding_policy not in PADDING_POLICIES:
            self._field_error("padding_policy", f"one of {PADDING_POLICIES}")
        if self.padding_free:
            raise ValueError("DLMSFTConfig.padding_free flattens a batch into one row, but the diffusion noise is "
                             "drawn per sample: use packing=True (documents stay apart through position_ids)")
        if self.packing and self.packing_strategy == "wrapped":
            raise ValueError("DLMSFTConfig: packing_strategy='wrapped' cuts documents across rows without "
                             "boundaries; use 'bfd' (documents kept whole, attention masked per document)")

    def _fold_objective_overrides(self) -> None:
        """The deprecated `objective_overrides` dict -> the objective fields (one spelling from here on)."""
        if not self.objective_overrides:
            return
        warnings.warn("DLMSFTConfig.objective_overrides is deprecated: set the objective fields directly "
                      f"(e.g. DLMSFTConfig(normalization=..., t_sampling=...)), keys {sorted(self.objective_overrides)}",
                      FutureWarning, stacklevel=4)
        unknown = set(self.objective_overrides) - set(MaskedDiffusionObjective.field_names())
        if unknown:
            self._field_error("objective_overrides", f"a dict of {MaskedDiffusionObjective.field_names()} "
                                                     f"(unknown keys {sorted(unknown)})")
        extra = {}
        for key, value in self.objective_overrides.items():
            name = "objective_seed" if key == "seed" else key
            if name in self._OBJECTIVE_FIELDS or name == "objective_seed":
                if getattr(self, name) is not None and getattr(self, name) != value:
                    self._field_error(name, f"set once: objective_overrides[{key!r}] = {value!r} disagrees")
                setattr(self, name, value)
            else:  # fields the model decides by default (mask_token_id, label_alignment, mode)
                extra[key] = value
        self._extra_objective_settings = extra
        self.objective_overrides = None


__all__ = ["DLMSFTConfig"]
