"""Lazy attribute exports for a package (PEP 562), the way transformers' `_LazyModule` keeps its
top-level import cheap. Hand-written because `_LazyModule` is private to transformers and its
signature changes between releases."""

from __future__ import annotations

import importlib
from collections.abc import Callable


def lazy_exports(package: str, exports: dict[str, str], eager: dict | None = None) -> tuple[Callable, Callable, list[str]]:
    """`(__getattr__, __dir__, __all__)` for `package`: each name in `exports` maps to the module
    (relative to `package`, e.g. ".training.trainer") that defines it, imported on first access and
    cached in the package's namespace. `eager` holds names already bound (listed in `__all__` too)."""
    names = sorted({*exports, *(eager or {})})

    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name], package), name)
        setattr(importlib.import_module(package), name, value)  # later lookups skip __getattr__
        return value

    def __dir__() -> list[str]:
        return sorted({*names, *vars(importlib.import_module(package))})

    return __getattr__, __dir__, names
