"""`hf-dlm quickstart`: the main job, on CPU with no network."""

from __future__ import annotations

import dataclasses
import json


def add_arguments(parser):
    from ..training.quickstart import QuickstartConfig

    for field in dataclasses.fields(QuickstartConfig):
        flag = f"--{field.name.replace('_', '-')}"
        if field.type == "bool":
            parser.add_argument(flag, action="store_true", help=f"(default: {field.default})")
            continue
        kind = float if field.type == "float" else int if field.type in ("int", "int | None") else str
        help_text = {
            "max_seconds": "wall-clock bound of the whole command: training gets what start-up, corpus, "
                           "evaluation, save and sample leave; ",
            "threads": "torch threads (default: the cores other processes leave idle); ",
            "min_elbo_drop": "exit 1 when the held-out ELBO falls by less than this fraction; ",
        }.get(field.name, "")
        parser.add_argument(flag, type=kind, default=field.default, help=f"{help_text}(default: {field.default})")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line at the end")


def run(args) -> int:
    from ..training.quickstart import QuickstartConfig, process_seconds, run_quickstart
    import time

    started_at = time.perf_counter() - process_seconds()  # the bound counts start-up and imports too
    options = {f.name: getattr(args, f.name) for f in dataclasses.fields(QuickstartConfig)}
    cfg = QuickstartConfig(**options)
    result = run_quickstart(cfg, started_at=started_at)
    if args.json:
        print(json.dumps(result))
    return 1 if result["undertrained"] and not cfg.allow_undertrained else 0
