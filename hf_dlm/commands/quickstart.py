"""`hf-dlm quickstart`: the main job, on CPU with no network."""

from __future__ import annotations

import dataclasses
import json


def add_arguments(parser):
    from ..training.quickstart import QuickstartConfig

    for field in dataclasses.fields(QuickstartConfig):
        kind = float if field.type in ("float",) else int if field.type in ("int", "int | None") else str
        help_text = ("wall-clock bound of the whole command: training gets what corpus, evaluation, save and "
                     "sample leave; " if field.name == "max_seconds" else "")
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=kind, default=field.default,
                            help=f"{help_text}(default: {field.default})")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line at the end")


def run(args) -> int:
    from ..training.quickstart import QuickstartConfig, run_quickstart

    options = {f.name: getattr(args, f.name) for f in dataclasses.fields(QuickstartConfig)}
    result = run_quickstart(QuickstartConfig(**options))
    if args.json:
        print(json.dumps(result))
    return 0
