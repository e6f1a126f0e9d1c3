"""`hf-dlm preprocess`: tokenize text corpora into Megatron-core indexed files (PREFIX.bin / PREFIX.idx)."""

from __future__ import annotations

import dataclasses
import sys


def add_arguments(parser):
    from ..data.preprocess import PreprocessConfig

    for field in dataclasses.fields(PreprocessConfig):
        flag, help_text = f"--{field.name.replace('_', '-')}", field.metadata["help"]
        if field.name == "inputs":
            parser.add_argument("--input", dest="inputs", nargs="+", required=True, metavar="PATH", help=help_text)
        elif field.name == "progress":
            parser.add_argument("--no-progress", dest="progress", action="store_false", help="hide the progress bar")
        elif field.type == "bool":
            parser.add_argument(flag, action="store_true", help=help_text)
        elif field.default is dataclasses.MISSING:
            parser.add_argument(flag, required=True, help=help_text)
        else:
            kind = int if field.type == "int" else str
            suffix = "" if field.default is None else f" (default: {field.default})"
            parser.add_argument(flag, type=kind, default=field.default, help=help_text + suffix)


def run(args) -> int:
    from ..data.preprocess import PreprocessConfig, PreprocessError, preprocess

    config = PreprocessConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(PreprocessConfig)})
    try:
        report = preprocess(config)
    except (PreprocessError, FileExistsError, FileNotFoundError) as error:
        print(f"hf-dlm preprocess: error: {error}", file=sys.stderr)
        return 2
    print(report)
    return 0
