"""`DLMTrainingArguments`: `transformers.TrainingArguments` plus the masked-diffusion objective's options,
the trainer's throughput accounting and the parallelisation switches.

The fields shared with `DLMSFTConfig` live in two mixins, so both trainers spell every setting the same way:
`ObjectiveArguments` (the one objective spelling: preset plus explicit fields, `build_objective`),
`DiffusionTrainingFields` (statistics, float8, compile, ELBO evaluation, output-folder safety) and
`PipelineArguments` (`pp_size`, `pp_schedule`, ...); the device-mesh fields are
`hf_dlm.parallel.trainer_parallel.ParallelArguments`.

Defaults that differ from the parent: `remove_unused_columns=False` (the trainer needs `sample_index`,
`position_ids` and `prompt_mask`, which the model's forward does not take), `logging_steps=10`,
`accelerator_config.dispatch_batches=False` (every rank reads its own shard: batches carry the
dataset position) and `average_tokens_across_devices=True` (the loss is normalised by the global
number of supervised items).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from transformers import TrainingArguments

from ..parallel.float8 import FLOAT8_RECIPES as FP8_RECIPES
from ..parallel.trainer_parallel import ParallelArguments
from ..utils.errors import FieldError
from ..diffusion.objective import NORMALIZATIONS, PRESETS, SCHEDULES, T_SAMPLINGS, WEIGHTINGS, MaskedDiffusionObjective


@dataclass
class ObjectiveArguments:
    """The masked-diffusion objective's fields (a mixin of both trainers' arguments): a preset, the fields
    set here on top of it (None keeps the preset's value), and the noise seed. `build_objective` turns them
    into a `MaskedDiffusionObjective` for a model config (mask id and label alignment from the model)."""

    # a trainer's own defaults between the preset and the explicit fields (DLMSFTConfig: LLaDA's SFT recipe)
    _objective_defaults: ClassVar[dict] = {}
    _OBJECTIVE_FIELDS: ClassVar[tuple] = ("schedule", "weighting", "t_sampling", "eps", "normalization",
                                          "at_least_one_masked", "random_length_prob", "subs")

    objective_preset: str | None = field(
        default="mdlm",
        metadata={"help": f"Objective preset, one of {sorted(PRESETS)} (see hf_dlm.diffusion.objective.PRESETS); "
                          "the fields below override it. None: the objective's own defaults (causal models: 'ar')."},
    )
    schedule: str | None = field(
        default=None, metadata={"help": f"Noise schedule alpha(t), one of {SCHEDULES}. None: the preset's."})
    weighting: str | None = field(
        default=None, metadata={"help": f"Loss weight per masked token, one of {WEIGHTINGS}. None: the preset's."})
    t_sampling: str | None = field(
        default=None, metadata={"help": f"How t is drawn per sample, one of {T_SAMPLINGS}. None: the preset's."})
    eps: float | None = field(
        default=None, metadata={"help": "Lower bound of t (t ~ U[eps, 1)), in [0, 1). None: the preset's."})
    normalization: str | None = field(
        default=None,
        metadata={"help": f"Loss normaliser, one of {NORMALIZATIONS}: summed over all accumulated micro-batches and "
                          "ranks (global), so gradient accumulation and world size do not change the loss. "
                          "None: the preset's."},
    )
    at_least_one_masked: bool | None = field(
        default=None, metadata={"help": "Force one masked token in every row (MegaDLMs). None: the preset's."})
    random_length_prob: float | None = field(
        default=None,
        metadata={"help": "Probability that a sample is cut to a random length in [2, L] (LLaDA/MegaDLMs use 0.01). "
                          "None: the preset's."},
    )
    subs: bool | None = field(
        default=None,
        metadata={"help": "MDLM's SUBS parameterisation: [MASK] removed from the loss's softmax (and from the ELBO "
                          "evaluation). None: the preset's (True for mdlm)."},
    )
    objective_seed: int | None = field(
        default=None,
        metadata={"help": "Seed of the diffusion noise, keyed with each sample's global index so the noise does not "
                          "depend on world size, micro-batch or resume point. None: `seed`."},
    )

    def _validate_objective_fields(self) -> None:
        fail = self._field_error
        if self.objective_preset is not None and self.objective_preset not in PRESETS:
            fail("objective_preset", f"one of {sorted(PRESETS)} or None")
        for name, allowed in (("schedule", SCHEDULES), ("weighting", WEIGHTINGS), ("t_sampling", T_SAMPLINGS),
                              ("normalization", NORMALIZATIONS)):
            if getattr(self, name) is not None and getattr(self, name) not in allowed:
                fail(name, f"one of {allowed} or None")
        if self.eps is not None and not 0.0 <= self.eps < 1.0:
            fail("eps", "in [0, 1)")
        if self.random_length_prob is not None and not 0.0 <= self.random_length_prob <= 1.0:
            fail("random_length_prob", "in [0, 1]")

    def _field_error(self, name: str, expected: str):
        raise FieldError(name, f"{type(self).__name__}.{name} must be {expected}, got {getattr(self, name)!r}",
                         getattr(self, name))

    def objective_settings(self) -> dict:
        """The objective fields on top of the preset: this trainer's defaults, then the fields set here."""
        settings = dict(self._objective_defaults)
        settings.update({name: getattr(self, name) for name in self._OBJECTIVE_FIELDS if getattr(self, name) is not None})
        settings.update(getattr(self, "_extra_objective_settings", None) or {})
        settings["seed"] = self.seed if self.objective_seed is None else self.objective_seed
        return settings

    def build_objective(self, model_config) -> MaskedDiffusionObjective:
        """The objective for a DLMConfig: mask id and label alignment from the model, the rest from here."""
        return MaskedDiffusionObjective.from_model_config(model_config, preset=self.objective_preset,
                                                          **self.objective_settings())


@dataclass
class DiffusionTrainingFields:
    """What every diffusion trainer reads besides the objective (a mixin of both trainers' arguments):
    throughput statistics, float8 / compile / residual precision (through hf_dlm.parallel.parallelize), the
    ELBO evaluation and the output-folder guard."""

    peak_flops: float = field(
        default=989e12,
        metadata={"help": "Peak FLOP/s of one accelerator for the MFU figure (H100/H200 dense bf16: 989e12). "
                          "MFU = tokens/s * (6N + 12 * layers * hidden * seq) / (peak_flops * world size)."},
    )
    t_buckets: int = field(
        default=4,
        metadata={"help": "Number of equal-width t buckets for the logged masked-token cross-entropy by t "
                          "(`ce_t/<lo>-<hi>`); 0 turns it off. Read from the backward pass, so it costs no forward."},
    )
    fp8_recipe: str | None = field(
        default=None,
        metadata={"help": f"Float8 training recipe for the linear layers, one of {FP8_RECIPES} (torchao's, or "
                          "'delayed': hf-dlm's delayed scaling, no torchao needed), applied before sharding by "
                          "hf_dlm.parallel.parallelize. None: bf16/fp32 linears."},
    )
    fp8_min_features: int = field(
        default=2048,
        metadata={"help": "With fp8_recipe: only linears whose in and out features are both at least this go to "
                          "float8 (smaller GEMMs do not repay their casts); multiples of 16 only, lm_head never."},
    )
    fp8_fast_accum: bool = field(
        default=False,
        metadata={"help": "With fp8_recipe: fast float8 accumulation in the backward GEMMs too (the forward GEMM "
                          "always uses it). Measured 2-5% faster on an H200 (benchmarks/RESULTS.md), with less "
                          "precise gradient sums."},
    )
    low_precision_residual: bool = field(
        default=False,
        metadata={"help": "With bf16 (or fp16): the residual stream between decoder layers in that dtype rather than "
                          "fp32 (the embeddings are cast), as bf16 weights would give (FSDP2 param_dtype=bf16, "
                          "Megatron-LM's default). Less activation traffic and memory: measured +1.3% tokens/s in bf16, "
                          "+1.8% with float8, about 2 GiB less on an H200 (benchmarks/RESULTS.md)."},
    )
    compile_blocks: bool = field(
        default=False,
        metadata={"help": "torch.compile each decoder block separately (torchtitan's per-block compile), applied by "
                          "hf_dlm.parallel.parallelize."},
    )
    eval_mc_num: int = field(
        default=8, metadata={"help": "Monte Carlo draws per sequence of the ELBO bound that `evaluate` reports "
                                     "(over the scored tokens: all real tokens, or the completion in SFT)."})
    eval_seed: int = field(default=0, metadata={"help": "Seed of the ELBO evaluation's masking draws (batch k: "
                                                        "eval_seed + k)."})
    overwrite_output_dir: bool = field(
        default=False,
        metadata={"help": "Train into an output_dir that already holds checkpoints without resuming from them (they "
                          "are then overwritten as the new run saves). False: `train()` refuses such a folder unless "
                          "resume_from_checkpoint is given."},
    )

    def _validate_diffusion_fields(self) -> None:
        fail = self._field_error
        if not self.peak_flops > 0:
            fail("peak_flops", "positive")
        if self.t_buckets < 0:
            fail("t_buckets", ">= 0")
        if self.fp8_recipe is not None and self.fp8_recipe not in FP8_RECIPES:
            fail("fp8_recipe", f"one of {FP8_RECIPES} or None")
        if self.fp8_min_features < 16:
            fail("fp8_min_features", "at least 16 (float8 GEMMs need dimensions of 16 or more)")
        if self.fp8_fast_accum and self.fp8_recipe is None:
            fail("fp8_fast_accum", "False unless fp8_recipe is set")
        if self.low_precision_residual and not (self.bf16 or self.fp16):
            fail("low_precision_residual", "False unless bf16 or fp16 is set (it acts under autocast)")
        if not isinstance(self.compile_blocks, bool):
            fail("compile_blocks", "a bool")
        if self.eval_mc_num < 1:
            fail("eval_mc_num", ">= 1")


@dataclass
class PipelineArguments:
    """The pipeline-parallel fields of both trainers' arguments (`PipelineTrainingMixin` reads them)."""

    pp_size: int = field(
        default=1,
        metadata={"help": "Pipeline-parallel stages (hf_dlm.parallel.pipeline): the model is cut at decoder-layer "
                          "boundaries over pp_size processes; the processes left over (world size / pp_size) shard "
                          "every stage with FSDP2. The pp ranks of a data-parallel group pool the batches they read, so "
                          "a pipeline micro-batch holds pp_size x per_device_train_batch_size rows, and the "
                          "gradient_accumulation_steps micro-batches of a step are the schedule's micro-batches."},
    )
    pp_schedule: str = field(
        default="1f1b",
        metadata={"help": "Pipeline schedule: 'gpipe', '1f1b' (needs gradient_accumulation_steps >= pp_size) or "
                          "'interleaved_1f1b' (pp_stages_per_rank stages per process, smaller bubble)."},
    )
    pp_stages_per_rank: int | None = field(
        default=None,
        metadata={"help": "Virtual stages per process with 'interleaved_1f1b' (None: 2); 1 for the others."})
    pp_split_points: list[int] | None = field(
        default=None,
        metadata={"help": "First decoder layer of each stage after the first (pp_size x stages per rank - 1 ascending "
                          "indices). None: layers spread evenly."},
    )

    def _validate_pipeline_fields(self, fail) -> None:
        from ..parallel.pipeline import PIPELINE_SCHEDULES

        if not isinstance(self.pp_size, int) or self.pp_size < 1:
            fail("pp_size", "an integer >= 1")
        if self.pp_schedule not in PIPELINE_SCHEDULES:
            fail("pp_schedule", f"one of {PIPELINE_SCHEDULES}")
        if self.pp_size == 1:
            return
        # the schedule runs forward and backward itself: what needs the Trainer's own forward / backward is refused
        if str(getattr(self.eval_strategy, "value", self.eval_strategy)) != "no" or self.load_best_model_at_end:
            fail("eval_strategy", "'no' with pp_size > 1 (evaluation runs the whole model: evaluate a saved "
                                  "checkpoint with pp_size=1; the checkpoints load in any layout)")
        if self.fsdp:
            fail("fsdp", "empty with pp_size > 1 (accelerate's FSDP wraps the whole model; hf-dlm shards each "
                         "pipeline stage with FSDP2 over the processes beyond pp_size itself)")
        if self.fp16:
            fail("fp16", "False with pp_size > 1 (its loss scaling goes through accelerator.backward, which the "
                         "pipeline schedule replaces; use bf16)")
        if self.pp_schedule == "1f1b" and self.gradient_accumulation_steps < self.pp_size:
            fail("gradient_accumulation_steps", f">= pp_size={self.pp_size} with pp_schedule='1f1b' (its micro-batches)")


@dataclass
class DLMTrainingArguments(ObjectiveArguments, DiffusionTrainingFields, PipelineArguments, ParallelArguments,
                           TrainingArguments):
    # -- parent defaults changed ------------------------------------------------------------------
    remove_unused_columns: bool = field(
        default=False,
        metadata={"help": "Parent default True would drop `sample_index` / `prompt_mask`; keep False for DLMTrainer."},
    )
    logging_steps: float = field(
        default=10, metadata={"help": "Log every N optimizer steps (or a ratio of the total if < 1)."})
    ddp_find_unused_parameters: bool | None = field(
        default=False,
        metadata={"help": "Parent default (None) turns DDP's unused-parameter search on, an extra graph traversal "
                          "per step; every DLM parameter gets a gradient, so False."},
    )

    def __post_init__(self):
        self._validate_dlm_fields()
        self._validate_layout_fields()
        if self.accelerator_config is None:
            self.accelerator_config = {"dispatch_batches": False}
        elif isinstance(self.accelerator_config, dict):
            self.accelerator_config.setdefault("dispatch_batches", False)
        super().__post_init__()

    def _validate_dlm_fields(self) -> None:
        fail = self._field_error
        if self.max_steps == 0 or self.max_steps < -1:
            fail("max_steps", ">= 1, or -1 to train for num_train_epochs")
        for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
            if getattr(self, name) < 1:
                fail(name, ">= 1")
        self._validate_objective_fields()
        self._validate_diffusion_fields()
        if not self.average_tokens_across_devices:
            # DLMTrainer always normalises by the global number of supervised items (exact accumulation)
            fail("average_tokens_across_devices", "True (the loss is normalised over all ranks)")
        self._validate_pipeline_fields(fail)
