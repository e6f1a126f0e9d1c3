"""peft LoRA on DLM models: default target modules and a one-call wrapper.

`register_peft_defaults()` adds the DLM family to peft's table of default LoRA targets, so a plain
`LoraConfig(r=16)` (no `target_modules`) works on a DLM as it does on Llama; the trainers of this package
call it. LoRA layers wrap `nn.Linear`s in place, so DLMTrainer, DLMSFTTrainer, DiffuGRPOTrainer and
`generate` run unchanged; adapters save / load / merge through peft's own API. `merged_lora_weights` folds
the adapters into the base weights for the duration of a rollout (DiffuGRPOTrainer).

Reloading: `PeftModel.from_pretrained(base, adapter_dir)` always works. peft's `AutoPeftModel` imports the base
class named in adapter_config.json only from an allowlist (transformers, diffusers, ...): adapters written by
`save_adapter` name transformers' `AutoModelForMaskedLM` (which loads hf-dlm checkpoints once `hf_dlm` is
imported), so `AutoPeftModel.from_pretrained(adapter_dir)` loads them; for other hf-dlm adapters pass
`import_allowlist=["hf_dlm"]`. A base that exists only in memory is saved beside the adapter (`save_adapter`),
since an adapter whose `base_model_name_or_path` is null cannot be used.
"""

from __future__ import annotations

import json
import os

from contextlib import contextmanager

import torch

from ..utils.import_utils import require

# every projection of the decoder (attention and SwiGLU MLP); the tied lm_head / embeddings stay frozen
DLM_LORA_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def register_peft_defaults() -> None:
    """peft picks default LoRA targets by `config.model_type`; add the DLM family ("dlm") and the published
    families hf-dlm loads natively (llada, Dream, sdar, ...: the same module names)."""
    require("peft", "LoRA on DLM models")
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as targets

    from ..modeling.families import FAMILIES

    for model_type in ("dlm", *FAMILIES):
        targets.setdefault(model_type, list(DLM_LORA_TARGET_MODULES))


def dlm_lora_config(r: int = 16, lora_alpha: int = 32, lora_dropout: float = 0.0, target_modules=None, **kwargs):
    """A `peft.LoraConfig` for DLM models. No `task_type`: peft's task wrappers (CAUSAL_LM, ...) reshape causal
    inputs; the plain `PeftModel` calls the DLM's own forward and `generate`."""
    require("peft", "LoRA on DLM models")
    from peft import LoraConfig

    register_peft_defaults()
    return LoraConfig(r=r, lora_alpha=lora_alpha, lora_dropout=lora_dropout,
                      target_modules=list(target_modules or DLM_LORA_TARGET_MODULES), **kwargs)


def get_dlm_peft_model(model, peft_config=None, **config_kwargs):
    """`peft.get_peft_model` with the DLM defaults (`dlm_lora_config(**config_kwargs)` when no config is given)."""
    from peft import get_peft_model

    register_peft_defaults()
    return get_peft_model(model, peft_config or dlm_lora_config(**config_kwargs))


def _mergeable_adapters(layer) -> list[str] | None:
    """The active adapters of a plain LoRA Linear whose `get_delta_weight`s add to a local (unsharded) weight;
    None for any other layer."""
    from peft.tuners.lora.layer import Linear

    if not isinstance(layer, Linear) or layer.merged or layer.disable_adapters:
        return None
    if type(layer.get_base_layer().weight.data) is not torch.Tensor:  # DTensor (FSDP2 / TP): left unmerged
        return None
    adapters = [name for name in layer.active_adapters if name in layer.lora_A]
    if any(layer.use_dora.get(name, False) or getattr(layer, "lora_bias", {}).get(name, False) for name in adapters):
        return None
    return adapters


ADAPTER_AUTO_MAPPING = {"base_model_class": "AutoModelForMaskedLM", "parent_library": "transformers"}


def has_saved_base(model) -> bool:
    """Whether the model was loaded from a folder or a Hub id (a LoRA adapter then names its base)."""
    return bool(getattr(model, "name_or_path", None))


def save_in_memory_base(model, tokenizer, base_dir: str) -> str:
    """Save a base that exists only in memory (never loaded from a folder or the Hub) to `base_dir`, and make it
    the base an adapter trained on it names. Returns the absolute folder."""
    base_dir = os.path.abspath(base_dir)
    model.save_pretrained(base_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(base_dir)
    model.name_or_path = base_dir  # peft records base_model_name_or_path from the base's name_or_path
    return base_dir


def make_adapter_auto_loadable(adapter_dir: str) -> None:
    """Point an hf-dlm adapter's `auto_mapping` at transformers' AutoModelForMaskedLM, so that peft's
    `AutoPeftModel.from_pretrained(adapter_dir)` loads it without an import allowlist (see the module docstring).
    A FieldError if the adapter names no base (an in-memory base that was not saved)."""
    from ..utils.errors import FieldError

    path = os.path.join(adapter_dir, "adapter_config.json")
    with open(path) as f:
        config = json.load(f)
    if not config.get("base_model_name_or_path"):
        raise FieldError("base_model_name_or_path", f"{path}: the adapter names no base model (it was trained on a "
                         "model that exists only in memory): save the base first (model.save_pretrained(DIR), "
                         "then train on the model loaded from DIR), or use save_in_memory_base before training")
    mapping = config.get("auto_mapping") or {}
    if config.get("task_type") is None and str(mapping.get("parent_library", "")).startswith("hf_dlm"):
        config["auto_mapping"] = dict(ADAPTER_AUTO_MAPPING)
        with open(path, "w") as f:
            json.dump(config, f, indent=2)


@contextmanager
def merged_lora_weights(model):
    """Within the block, every LoRA Linear of `model` runs as one GEMM with W + delta instead of W plus the
    adapter's two extra GEMMs (a GRPO rollout is dozens of small forwards: unmerged adapters doubled its
    time, benchmarks/RESULTS.md). The base weight is swapped for a merged copy, not changed in place, and
    gets its own storage back afterwards: bit-exact, unlike peft's `merge_adapter` / `unmerge_adapter`,
    whose in-place add and subtract drift in bf16 at every rollout. Costs one copy of the adapted weights
    while it lasts. Layers that cannot merge this way (DoRA, LoRA bias, sharded weights) stay as they are;
    a model without LoRA layers is untouched."""
    try:
        import peft  # noqa: F401
    except ImportError:  # peft absent: nothing can be adapted
        yield model
        return
    swapped = []
    try:
        with torch.no_grad():
            for layer in model.modules():
                adapters = _mergeable_adapters(layer)
                if not adapters:
                    continue
                base = layer.get_base_layer()
                original = base.weight.data
                delta = sum(layer.get_delta_weight(name) for name in adapters)
                base.weight.data = original + delta.to(original.dtype)
                # peft's own flag, not enable_adapters(False): that one also rewrites requires_grad on the way back
                layer._disable_adapters = True
                swapped.append((layer, base, original))
        yield model
    finally:
        for layer, base, original in swapped:
            base.weight.data = original
            layer._disable_adapters = False


__all__ = ["DLM_LORA_TARGET_MODULES", "register_peft_defaults", "dlm_lora_config", "get_dlm_peft_model",
           "merged_lora_weights", "has_saved_base", "save_in_memory_base", "make_adapter_auto_loadable"]
