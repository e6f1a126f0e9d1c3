"""Checking a config value against its dataclass field's annotation, so a bad entry of a YAML config is named
(`training.max_steps: 'twenty' is not an integer`) before any data is built, instead of failing deep inside
TrainingArguments, the model or the optimizer.

Hand-written: pydantic or typeguard would check the same annotations, but neither is a dependency of
transformers, and the annotations here are plain (int, float, bool, str, Literal, Enum, list, dict, unions).
"""

from __future__ import annotations

import dataclasses
import enum
import sys
import types
import typing
from functools import lru_cache

_UNCHECKED = object()  # an annotation that cannot be resolved or read: any value passes


@lru_cache(maxsize=None)
def field_types(cls) -> dict[str, object]:
    """field name -> resolved annotation for every init field of the dataclass `cls` (through its bases).
    Resolved one field at a time: a base class may annotate with names it imports only for type checkers."""
    resolved = {}
    for klass in reversed(cls.__mro__):
        module = vars(sys.modules.get(klass.__module__, object())) if klass.__module__ in sys.modules else {}
        for name, annotation in vars(klass).get("__annotations__", {}).items():
            if isinstance(annotation, str):
                try:
                    annotation = eval(annotation, dict(module), dict(vars(klass)))  # noqa: S307 (the class's own source)
                except Exception:
                    annotation = _UNCHECKED
            resolved[name] = annotation
    init = {f.name for f in dataclasses.fields(cls) if f.init}
    return {name: annotation for name, annotation in resolved.items() if name in init}


def _describe(annotation) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is type(None):
        return "null"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(dict.fromkeys(_describe(arg) for arg in args))
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(arg) for arg in args)
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return "one of " + ", ".join(repr(member.value) for member in annotation)
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string", dict: "a mapping",
             list: "a list", tuple: "a list"}
    if origin in (list, tuple, set, dict):
        return names.get(origin, str(origin))
    return names.get(annotation, getattr(annotation, "__name__", str(annotation)))


def conforms(value, annotation) -> bool:
    """Whether `value` (as YAML or a CLI gives it) is acceptable for a field annotated `annotation`."""
    if annotation is _UNCHECKED or annotation is typing.Any or annotation is object:
        return True
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(conforms(value, arg) for arg in args)
    if annotation is type(None) or annotation is None:
        return value is None
    if origin is typing.Literal:
        return value in args
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return isinstance(value, annotation) or value in {member.value for member in annotation}
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    if origin in (list, tuple, set) or annotation in (list, tuple, set):
        if not isinstance(value, (list, tuple)):
            return False
        return not args or all(conforms(item, args[0]) for item in value)
    if origin is dict or annotation is dict:
        return isinstance(value, dict)
    if isinstance(annotation, type):
        return isinstance(value, annotation)
    return True  # generics and forward references this checker does not read


def expected(annotation) -> str:
    return _describe(annotation)


__all__ = ["field_types", "conforms", "expected"]
