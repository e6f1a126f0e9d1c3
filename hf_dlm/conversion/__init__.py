"""Checkpoint conversion (AR / LLaDA / Dream / Megatron <-> hf-dlm) and asserted verification.

`import hf_dlm` does not import this package; its modules load on first use (PEP 562 `__getattr__`).
"""

from ..utils.lazy import lazy_exports

_EXPORTS = {
    "ConversionOptions": "convert", "convert_checkpoint": "convert", "load_as_dlm": "convert",
    "verify_checkpoints": "verify", "compare_logits": "verify",
    "save_megatron_checkpoint": "megatron", "load_megatron_checkpoint": "megatron",
}


__getattr__, __dir__, __all__ = lazy_exports(__name__, {name: f".{module}" for name, module in _EXPORTS.items()})
