"""Checks on model / tokenizer locations given on the command line or in a config."""

from __future__ import annotations

import os


def check_model_location(value: str, what: str) -> str:
    """`value` is a local folder or a Hub repo id ('name' or 'namespace/name'). A missing local path is
    named here: transformers would report it as a malformed repo id ("Repo id must be in the form ...")."""
    value = str(value)
    if os.path.exists(os.path.expanduser(value)):
        return os.path.expanduser(value)
    looks_local = value.startswith((".", "/", "~")) or value.endswith("/") or value.count("/") > 1 or "\\" in value
    if looks_local:
        raise FileNotFoundError(f"{what} {value!r}: no such local folder (a Hub model id has the form 'namespace/name')")
    return value
