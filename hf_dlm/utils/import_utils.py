"""Cached availability checks for optional dependencies (accelerate/peft style).

Nothing here imports the optional package itself: `importlib.util.find_spec` plus the installed
distribution's version, so `import hf_dlm` stays cheap and never pulls in trl, peft, datasets or
kernel packages.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from functools import lru_cache

from packaging import version

# extra name in setup.cfg for each optional package, used in the error messages
_EXTRAS = {
    "datasets": "train",
    "pyarrow": "train",
    "yaml": "train",
    "zstandard": "train",
    "trl": "trl",
    "peft": "trl",
    "torchao": "fp8",
    "transformer_engine": "te",
    "flash_attn": "flash",
    "fastapi": "serve",
    "uvicorn": "serve",
    "lm_eval": "eval",
}
_DISTRIBUTIONS = {"yaml": "pyyaml", "flash_attn": "flash-attn",
                  "lm_eval": "lm-eval", "transformer_engine": "transformer-engine"}


@lru_cache(maxsize=None)
def _package_version(name: str) -> str | None:
    if importlib.util.find_spec(name) is None:
        return None
    try:
        return importlib.metadata.version(_DISTRIBUTIONS.get(name, name))
    except importlib.metadata.PackageNotFoundError:
        return "0"  # importable (a source checkout, say) without distribution metadata


def _is_available(name: str, min_version: str | None = None) -> bool:
    found = _package_version(name)
    if found is None:
        return False
    return min_version is None or found == "0" or version.parse(found) >= version.parse(min_version)


def is_peft_available() -> bool:
    return _is_available("peft")


def is_torchao_available(min_version: str = "0.10") -> bool:
    return _is_available("torchao", min_version)


def is_transformer_engine_available() -> bool:
    return _is_available("transformer_engine")


def require(name: str, feature: str, min_version: str | None = None) -> None:
    """Raise an ImportError that says which extra to install for `feature`."""
    if not _is_available(name, min_version):
        wanted = f"{name}>={min_version}" if min_version else name
        extra = _EXTRAS.get(name)
        hint = f"pip install 'hf-dlm[{extra}]'" if extra else f"pip install {wanted}"
        raise ImportError(f"{feature} needs `{wanted}`, which is not installed. Install it with: {hint}")
