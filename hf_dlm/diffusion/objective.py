"""The masked (absorbing-state) diffusion objective, with the conventions of LLaDA, MDLM and MegaDLMs.

`corrupt` turns clean token ids into the model inputs of one step: the noisy ids x_t, labels (-100
where no loss, already in the model's label alignment), per-position weights and the normaliser.
Every random number comes from (seed, global sample index, position), so a sample gets the same
noise whatever the world size, micro-batch split or resume point.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

import torch

from ..modeling.loss import IGNORE_INDEX
from .noise import hashed_uniform

SCHEDULES = ("linear", "cosine")
WEIGHTINGS = ("elbo", "measured", "uniform")
T_SAMPLINGS = ("uniform", "antithetic")
NORMALIZATIONS = ("token", "masked", "sequence", "sample", "batch")
MODES = ("diffusion", "ar")

# random streams of hashed_uniform
_T, _MASK, _CUT, _CUT_LENGTH = 0, 1, 2, 3

PRESETS = {
    # LLaDA pretraining (ML-GSAI/LLaDA GUIDELINES.md): t ~ U[eps, 1), CE / p_mask, sum / (B * L), 1% of the
    # data at a random length. (LLaDA SFT is normalization="sequence": CE / p_mask / answer length, / B.)
    "llada": dict(schedule="linear", weighting="elbo", t_sampling="uniform", eps=1e-3, normalization="batch",
                  random_length_prob=0.01),
    # MDLM (kuleshov-group/mdlm diffusion.py `_sample_t`, `_loss`): antithetic (stratified) t over the
    # batch, weight 1/t, the weighted CE of masked tokens summed and divided by the number of real tokens:
    # the NELBO per token (also dllm's default "token" mode and NeMo Automodel's MDLM loss); SUBS
    # (`_subs_parameterization`): [MASK]'s logit is -inf, the model never predicts the absorbing state
    "mdlm": dict(schedule="linear", weighting="elbo", t_sampling="antithetic", eps=1e-3, normalization="token",
                 subs=True),
    # MegaDLMs (the seed system's masked-diffusion loss): weight by the measured masked fraction (l / k per
    # row), no eps, at least one masked token, 1% random lengths, sum / (B * L)
    "megadlms": dict(schedule="linear", weighting="measured", t_sampling="uniform", eps=0.0, normalization="batch",
                     at_least_one_masked=True, random_length_prob=0.01),
    # autoregressive LM (MegaDLMs' AR mode): causal attention, next-token CE averaged over every real token
    "ar": dict(mode="ar", normalization="token"),
}

# extra keys of `corrupt`'s result that are not model inputs
CORRUPT_EXTRAS = ("t", "masked", "supervised")


@dataclass
class MaskedDiffusionObjective:
    """Options of the objective (`PRESETS` names the paper or repository each convention comes from).

    mask_token_id: the absorbing state. schedule: alpha(t) = 1 - t ("linear") or cos(pi t / 2)
    ("cosine"); a token is masked with probability 1 - alpha(t). weighting: "elbo" (-alpha'/(1-alpha),
    1/t for linear), "measured" (maskable / masked count of the row, MegaDLMs) or "uniform".
    t_sampling: "uniform" (t ~ U[eps, 1)) or "antithetic" (MDLM's stratified draw over a group of G
    samples: the one in slot j gets t = eps + (1 - eps)(j + u) / G with its own u; the group is the
    batch passed to `corrupt`, or, under DLMTrainer, the optimizer step's global batch).
    normalization (the divisor of the summed, weighted CE of the masked tokens):
      "token": the number of supervised tokens (real, non-prompt; masked or not): the NELBO per token
               (MDLM, dllm "token", NeMo Automodel);
      "masked": the number of masked tokens;
      "sequence": each row by its supervised length, then the mean over rows (LLaDA SFT, dllm "sequence");
      "sample": the number of rows (dllm "batch");
      "batch": B * L (LLaDA pretraining, MegaDLMs).
    label_alignment: "same" or "shift" (logits at i-1 predict token i; position 0 is then never masked).
    at_least_one_masked: force one masked token in every row that has maskable tokens (never a prompt
    or padding token). random_length_prob: each sample is cut, with this probability, to a random length
    in [2, L] (by the attention mask, per sample, so the cut is independent of the batch layout too).
    mode: "diffusion" or "ar" (next-token CE on every real token; the model must be causal).
    subs: MDLM's SUBS parameterisation: [MASK] is removed from the softmax of the loss (its log-probability
    is -inf), as it is in MDLM's `_subs_parameterization`; pass the same to `elbo_nll` when evaluating such
    a model (DLMTrainer.evaluate does). The unmasked positions' carry-over half of SUBS needs nothing here:
    they carry no loss.
    """

    mask_token_id: int | None = None
    schedule: str = "linear"
    weighting: str = "elbo"
    t_sampling: str = "uniform"
    eps: float = 1e-3
    normalization: str = "batch"
    label_alignment: str = "same"
    at_least_one_masked: bool = False
    random_length_prob: float = 0.0
    mode: str = "diffusion"
    seed: int = 0
    subs: bool = False

    def __post_init__(self):
        for name, allowed in (("schedule", SCHEDULES), ("weighting", WEIGHTINGS), ("t_sampling", T_SAMPLINGS),
                              ("normalization", NORMALIZATIONS), ("mode", MODES),
                              ("label_alignment", ("same", "shift"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"MaskedDiffusionObjective.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if not 0.0 <= self.eps < 1.0:
            raise ValueError(f"MaskedDiffusionObjective.eps must lie in [0, 1), got {self.eps}")
        if not 0.0 <= self.random_length_prob <= 1.0:
            raise ValueError(f"MaskedDiffusionObjective.random_length_prob must lie in [0, 1], got {self.random_length_prob}")
        if self.mode == "diffusion" and self.mask_token_id is None:
            raise ValueError("MaskedDiffusionObjective.mask_token_id is required in diffusion mode")
        if self.subs and self.mode == "ar":
            raise ValueError("MaskedDiffusionObjective.subs=True is MDLM's masked-diffusion parameterisation; "
                             "mode='ar' has no [MASK] to remove: set subs=False")

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "MaskedDiffusionObjective":
        if name not in PRESETS:
            raise ValueError(f"unknown objective preset {name!r}; choose from {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    @classmethod
    def from_model_config(cls, config, preset: str | None = None, **overrides) -> "MaskedDiffusionObjective":
        """Takes mask_token_id and label_alignment from a DLMConfig (AR mode for causal models)."""
        base = dict(mask_token_id=config.mask_token_id, label_alignment=config.label_alignment)
        if preset is None and config.attention_mode == "causal":
            preset = "ar"
        options = {**PRESETS.get(preset, {}), **base, **overrides} if preset else {**base, **overrides}
        return cls(**options)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    # -- schedule ------------------------------------------------------------------------------
    def alpha(self, t: torch.Tensor) -> torch.Tensor:
        return 1 - t if self.schedule == "linear" else torch.cos(math.pi * t / 2)

    def mask_probability(self, t: torch.Tensor) -> torch.Tensor:
        return 1 - self.alpha(t)

    def elbo_weight(self, t: torch.Tensor) -> torch.Tensor:
        """-alpha'(t) / (1 - alpha(t))."""
        if self.schedule == "linear":
            return 1 / t
        half = math.pi * t / 2
        return (math.pi / 2) * torch.sin(half) / (1 - torch.cos(half))

    def sample_t(self, sample_index: torch.Tensor, slot: torch.Tensor | None = None,
                 group_size: int | None = None) -> torch.Tensor:
        """(B,) -> (B,) t in [eps, 1). Antithetic: `slot` (B,) is each sample's place in its group of
        `group_size` (default: the batch itself, slots in the order of `sample_index`)."""
        u = hashed_uniform(self.seed, _T, sample_index)
        if self.t_sampling == "antithetic":
            if slot is None:
                slot = torch.argsort(torch.argsort(sample_index))  # rank within the batch
                group_size = sample_index.shape[0]
            u = (slot.to(u.device).float() + u) / group_size
        return self.eps + (1 - self.eps) * u

    def sample_mask_uniforms(self, sample_index: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(B,), (L,) -> (B, L) uniforms; position j of a sample is masked iff its uniform < 1 - alpha(t)."""
        return hashed_uniform(self.seed, _MASK, sample_index, positions)

    # -- one training step's inputs -------------------------------------------------------------
    def loss_items(self, corrupted: dict) -> torch.Tensor:
        """The loss normaliser's count for one corrupted micro-batch (`corrupt`'s output), unclamped so that
        the sum over an optimizer step's micro-batches and ranks is exact: supervised tokens ('token'),
        masked tokens ('masked'), else the micro-batch's own `num_items_in_batch` (rows, or rows x length)."""
        if self.mode == "ar":
            return (corrupted["labels"] != IGNORE_INDEX).sum()
        counted = {"token": corrupted["supervised"], "masked": corrupted["masked"]}.get(self.normalization)
        return corrupted["num_items_in_batch"] if counted is None else counted.sum()

    def corrupt(
        self,
        input_ids: torch.Tensor,
        sample_index: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        prompt_mask: torch.Tensor | None = None,
        t_slot: torch.Tensor | None = None,
        t_group_size: int | None = None,
    ) -> dict:
        """input_ids (B, L) clean tokens; sample_index (B,) global sample indices (unique per draw: a
        new epoch must give new indices); attention_mask (B, L) 0 for padding; prompt_mask (B, L) True
        for prompt tokens (never masked, no loss); t_slot (B,) / t_group_size: the samples' places in
        their antithetic group (see `sample_t`). Returns the model's keyword arguments (input_ids,
        attention_mask, labels, label_weights, num_items_in_batch) plus `t`, `masked` and `supervised`
        (B, L) for logging and for summing normalisers over micro-batches; with `subs`, also the model's
        `suppressed_token_id` (the mask token, removed from the loss's softmax)."""
        batch, length = input_ids.shape
        device = input_ids.device
        sample_index = sample_index.to(device)
        positions = torch.arange(length, device=device)
        valid = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        if self.random_length_prob > 0:
            cut = hashed_uniform(self.seed, _CUT, sample_index) < self.random_length_prob
            cut_length = 2 + (hashed_uniform(self.seed, _CUT_LENGTH, sample_index) * (length - 1)).long()
            keep = positions.unsqueeze(0) < torch.where(cut, cut_length, length).unsqueeze(1)
            valid = valid & keep
            attention_mask = valid.long() if (attention_mask is not None or bool((~keep).any())) else None
        supervised = valid if prompt_mask is None else valid & ~prompt_mask.bool()
        if self.mode == "ar":
            return self._ar_inputs(input_ids, attention_mask, supervised)
        if self.label_alignment == "shift":
            supervised = supervised & (positions > 0).unsqueeze(0)

        t = self.sample_t(sample_index, t_slot, t_group_size)  # (B,)
        u = self.sample_mask_uniforms(sample_index, positions)  # (B, L)
        masked = (u < self.mask_probability(t).unsqueeze(1)) & supervised
        if self.at_least_one_masked:
            none = ~masked.any(1) & supervised.any(1)
            forced = torch.where(supervised, u, 2.0).argmin(1)
            masked = masked | (none.unsqueeze(1) & (positions.unsqueeze(0) == forced.unsqueeze(1)))

        maskable = supervised.sum(1).clamp(min=1).float()
        if self.weighting == "elbo":
            weight = self.elbo_weight(t)
        elif self.weighting == "measured":
            weight = maskable / masked.sum(1).clamp(min=1).float()
        else:
            weight = torch.ones_like(t)
        if self.normalization == "sequence":
            weight = weight / maskable
            num_items = batch
        elif self.normalization == "sample":
            num_items = batch
        elif self.normalization == "batch":
            num_items = batch * length
        else:
            # a tensor, not an int: no host sync per micro-batch; clamped so nothing to count gives loss 0, not nan
            num_items = (supervised if self.normalization == "token" else masked).sum().clamp(min=1)

        labels = torch.where(masked, input_ids, IGNORE_INDEX)
        weights = torch.where(masked, weight.unsqueeze(1), 0.0)
        if self.label_alignment == "shift":
            labels, weights = _shift_left(labels, IGNORE_INDEX), _shift_left(weights, 0.0)
        result = dict(
            input_ids=torch.where(masked, self.mask_token_id, input_ids),
            attention_mask=attention_mask,
            labels=labels,
            label_weights=weights,
            num_items_in_batch=num_items,
            t=t,
            masked=masked,
            supervised=supervised,
        )
        if self.subs:
            result["suppressed_token_id"] = self.mask_token_id
        return result

    def _ar_inputs(self, input_ids, attention_mask, supervised) -> dict:
        labels = _shift_left(torch.where(supervised, input_ids, IGNORE_INDEX), IGNORE_INDEX)
        return dict(
            input_ids=input_ids,
            attention_mask=attention_mask,
            labels=labels,
            label_weights=None,
            num_items_in_batch=(labels != IGNORE_INDEX).sum().clamp(min=1),
            t=None,
            masked=None,
            supervised=labels != IGNORE_INDEX,
        )

    def __call__(self, model, input_ids, sample_index, attention_mask=None, prompt_mask=None, t_slot=None,
                 t_group_size=None, **forward_kwargs):
        """Corrupt and run the model; returns (loss, the corrupted inputs)."""
        inputs = self.corrupt(input_ids, sample_index, attention_mask, prompt_mask, t_slot, t_group_size)
        if self.mode == "ar" and getattr(model.config, "attention_mode", "causal") != "causal":
            raise ValueError("the AR objective needs a model with attention_mode='causal'")
        model_inputs = {k: v for k, v in inputs.items() if k not in CORRUPT_EXTRAS}
        if getattr(model.config, "attention_mode", None) == "block" and self.mode == "diffusion":
            model_inputs["clean_input_ids"] = input_ids  # two-stream block-diffusion training
        model_inputs.update(forward_kwargs)  # e.g. a global num_items_in_batch over micro-batches
        return model(**model_inputs).loss, inputs


def _shift_left(x: torch.Tensor, fill) -> torch.Tensor:
    """x[:, j] <- x[:, j + 1]: the target of position j is token j + 1."""
    return torch.cat([x[:, 1:], torch.full_like(x[:, :1], fill)], dim=1)
