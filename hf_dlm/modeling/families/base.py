"""What every published family shares: a config that reads and writes the family's own config.json keys on
top of `DLMConfig`, model classes named as the published ones, and the checkpoint key mapping registered
with transformers' weight-conversion machinery (`transformers.core_model_loading`), so
`AutoModelForMaskedLM.from_pretrained(folder)` reads the published tensors as they are and `save_pretrained`
writes them back under the same names (transformers reverses the mapping on save).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, ClassVar

import torch
from transformers import GenerationConfig, PreTrainedConfig, PreTrainedModel
from transformers.core_model_loading import Concatenate, ConversionOps, WeightConverter, WeightRenaming

from ...generation.configuration import UNSUPPORTED
from ...utils.errors import FieldError
from ..configuration_dlm import DLMConfig

logger = logging.getLogger(__name__)

# hf-dlm fields whose value, when no one set it, follows from others (left out of a published config.json
# when they hold that value)
_DERIVED = {
    "head_dim": lambda c: c.hidden_size // c.num_attention_heads,
    "num_key_value_heads": lambda c: c.num_attention_heads,
    "moe_intermediate_size": lambda c: c.intermediate_size,
    "sdpa_backends": lambda c: ["cudnn", "flash", "efficient", "math"],
    "mlp_only_layers": lambda c: [],
}
# written by transformers for every config; never part of the comparison with a family's own keys
BOOKKEEPING_KEYS = ("transformers_version", "dtype", "torch_dtype", "architectures", "model_type", "auto_map")


class FamilyConfig(DLMConfig):
    """`DLMConfig` read from and written as a published family's config.json.

    Subclasses set `model_type` (the published string), `renames` (published key -> DLM field, same meaning),
    `published_fields` (DLM fields the published config holds under the same name), and may override
    `read_published` / `write_published` for keys whose meaning differs (the published value is then kept in
    `published_values` and written back as read). DLM fields the family fixes (attention mode, label alignment,
    routers) are redeclared with the family's value as default; any hf-dlm field set to something else is
    written too, so a save never loses a setting (the Hub's remote code ignores keys it does not know)."""

    renames: ClassVar[dict[str, str]] = {}
    published_fields: ClassVar[tuple[str, ...]] = ()
    published_rope: ClassVar[bool] = True  # rope_theta / rope_scaling (4.x names) instead of rope_parameters
    # the mask id the family's generate code defaults to, when config.json names none (used when it fits the vocab)
    default_mask_token_id: ClassVar[int | None] = None
    published_values: dict | None = None

    def __post_init__(self, **kwargs):
        published = dict(self.published_values or {})
        kwargs = self.read_published(kwargs, published)
        for key, field in self.renames.items():
            if key in kwargs:
                setattr(self, field, kwargs.pop(key))
        if "rope_scaling" in kwargs and kwargs["rope_scaling"] is None:
            published["rope_scaling"] = None  # written back as the family wrote it
        if self.published_rope:
            self._read_rope(kwargs)
        implied = self.default_mask_token_id
        if self.mask_token_id is None and implied is not None and implied < self.vocab_size:
            self.mask_token_id, published["implied_mask_token_id"] = implied, implied
        self.published_values = {**published, **(self.published_values or {})}
        super().__post_init__(**kwargs)

    def _read_rope(self, kwargs: dict) -> None:
        """rope_theta / rope_scaling / partial_rotary_factor as the 4.x-era configs write them -> rope_parameters."""
        if self.rope_parameters is not None and "rope_theta" not in kwargs:
            return
        rope = {"rope_type": "default", "rope_theta": float(kwargs.pop("rope_theta", 10000.0))}
        scaling = kwargs.pop("rope_scaling", None)
        if scaling:
            scaling = dict(scaling)
            scaling["rope_type"] = scaling.pop("rope_type", scaling.pop("type", "default"))
            rope.update(scaling)
        factor = kwargs.pop("partial_rotary_factor", None)
        if factor is not None and float(factor) != 1.0:
            rope["partial_rotary_factor"] = float(factor)
        elif factor is not None:
            self.published_values = {**(self.published_values or {}), "partial_rotary_factor": factor}
        self.rope_parameters = rope

    def read_published(self, kwargs: dict, published: dict) -> dict:
        """Family hook, run first on the config.json keys that are not hf-dlm fields: check and translate the
        keys whose meaning differs from hf-dlm's (keeping published values in `published`); returns the rest."""
        return kwargs

    def write_published(self, output: dict) -> None:
        """Family hook: the inverse of `read_published`, on the dict `to_dict` writes."""

    @classmethod
    def _field_defaults(cls) -> dict[str, Any]:
        return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}

    def to_dict(self) -> dict[str, Any]:
        output = super().to_dict()
        published = output.pop("published_values", None) or {}
        if self.published_rope:
            rope = dict(output.pop("rope_parameters") or {})
            output["rope_theta"] = rope.pop("rope_theta", 10000.0)
            factor = rope.pop("partial_rotary_factor", published.get("partial_rotary_factor"))
            if factor is not None:
                output["partial_rotary_factor"] = factor
            rope_type = rope.pop("rope_type", "default")
            if rope_type != "default":
                output["rope_scaling"] = {"rope_type": rope_type, **rope}
        if published.pop("implied_mask_token_id", None) == output.get("mask_token_id"):
            output.pop("mask_token_id")
        self.write_published(output)
        for key, field in self.renames.items():
            output[key] = output.pop(field)
        defaults = self._field_defaults()
        own = set(self.published_fields) | set(self.renames.values())
        for field in dataclasses.fields(DLMConfig):
            name = field.name
            if name in own or name not in output or name in PRETRAINED_FIELDS:
                continue
            derived = _DERIVED.get(name)
            if output[name] == defaults.get(name) or (derived is not None and output[name] == derived(self)):
                output.pop(name)
        output.update({k: v for k, v in published.items() if k not in output})
        return output

    def to_diff_dict(self) -> dict[str, Any]:
        # the published layout is the full key set, not a diff against transformers' defaults
        output = self.to_dict()
        output.pop("_name_or_path", None)
        own = {*self.published_fields, *self.renames} | set(self.published_values or {})
        base_defaults = PreTrainedConfig().to_dict()  # transformers-wide fields (id2label, return_dict, ...)
        for key, value in base_defaults.items():
            if key in output and key not in own and key not in BOOKKEEPING_KEYS and output[key] == value:
                output.pop(key)
        return output


PRETRAINED_FIELDS = {f.name for f in dataclasses.fields(DLMConfig)} - set(DLMConfig.__annotations__)


def check_field(ok: bool, family: str, field: str, value, message: str) -> None:
    """A published value hf-dlm cannot reproduce exactly is an error naming the config field."""
    if not ok:
        raise FieldError(field, f"{family} config.json: {field}={value!r} {message}", value)


class SplitFusedQKV(ConversionOps):
    """LLaDA2's fused `query_key_value` (rows: all query heads, then key heads, then value heads) -> q / k / v.
    Hand-written because transformers 5.17 has no size-aware split (5.25's `Split` reads the model's shapes)."""

    def __init__(self, dim: int = 0):
        self.dim = dim

    @torch.no_grad()
    def convert(self, input_dict, source_patterns, target_patterns, config=None, **kwargs):
        tensors = next(iter(input_dict.values()))
        tensor = tensors[0] if isinstance(tensors, list) else tensors
        query = config.num_attention_heads * config.head_dim
        key_value = config.num_key_value_heads * config.head_dim
        pieces = torch.split(tensor, [query, key_value, key_value], dim=self.dim)
        return {target: piece.contiguous() for target, piece in zip(target_patterns, pieces)}

    @property
    def reverse_op(self) -> ConversionOps:
        return Concatenate(self.dim)


def renamings(pairs: list[tuple[str, str]]) -> list[WeightRenaming]:
    """(published regex, hf-dlm name) pairs, applied in order on load and reversed on save."""
    return [WeightRenaming(source, target) for source, target in pairs]


def grouped_experts() -> list[WeightConverter]:
    """One key per expert on the Hub -> the grouped `gate_up_proj` / `down_proj` (transformers' Qwen2-MoE rule)."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    return list(get_checkpoint_conversion_mapping("qwen2_moe"))


class FamilyModelMixin:
    """Saves in the published layout only (no hf-dlm remote code or auto_map written over the family's), and
    starts `generation_config` from the family's published sampler defaults (`generation_defaults`, a callable
    of the config). A checkpoint's generation_config.json, loaded later by `from_pretrained`, is read by
    `loaded_generation_config`: hf-dlm's own file wins, a published one keeps only its token ids."""

    generation_defaults: ClassVar = None

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        defaults = type(self).generation_defaults
        if defaults is not None and getattr(self, "generation_config", None) is not None:
            for name, value in defaults(config).items():
                setattr(self.generation_config, name, value)

    def loaded_generation_config(self, loaded):
        """A generation_config.json written by hf-dlm (it holds `stop_on_eos`) is used as saved, the family's
        defaults filling only diffusion fields it lacks (an older hf-dlm). A published one was written for the
        family's remote code, whose generate takes its sampler settings as arguments (Fast-dLLM v2's may be its
        Qwen parent's, with repetition_penalty and a temperature): its token ids stay, the family's sampler
        defaults replace the fields they name, and options the diffusion sampler cannot honour are reset, with a
        warning naming them (with the sampling knobs of a greedy family)."""
        defaults = type(self).generation_defaults
        if defaults is None:
            return loaded
        written_by_hf_dlm = "stop_on_eos" in vars(loaded)
        family = defaults(self.config)
        if not written_by_hf_dlm:
            off = dict(UNSUPPORTED)
            if family.get("do_sample") is False:  # greedy: the file's sampling knobs would only fail validation
                plain = GenerationConfig()
                off.update({name: getattr(plain, name) for name in ("temperature", "top_p", "top_k")})
            dropped = {name: getattr(loaded, name) for name, value in off.items()
                       if getattr(loaded, name, None) not in (value, None)}
            for name in dropped:
                setattr(loaded, name, off[name])
            if dropped:
                logger.warning("%s: generation_config.json sets %s, which the family's sampler does not use (its "
                               "own generate ignores them too); reset", type(self).__name__, dropped)
        for name, value in family.items():
            if not written_by_hf_dlm or name not in vars(loaded):
                setattr(loaded, name, value)
        return loaded

    def save_pretrained(self, save_directory, *args, **kwargs):
        return PreTrainedModel.save_pretrained(self, save_directory, *args, **kwargs)


__all__ = ["FamilyConfig", "SplitFusedQKV", "renamings", "grouped_experts", "FamilyModelMixin", "check_field",
           "BOOKKEEPING_KEYS"]
