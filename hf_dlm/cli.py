"""`hf-dlm` console script. Each subcommand lives in `hf_dlm/commands/<name>.py` with
`add_arguments(parser)` and `run(args) -> int`, imported only when that subcommand runs."""

from __future__ import annotations

import argparse
import importlib
import sys

from . import __version__

COMMANDS = {
    "quickstart": "train a tiny DLM on an embedded corpus on CPU, then sample from it",
    "preprocess": "tokenize JSONL / Parquet / HF datasets into Megatron indexed files",
    "train": "train a DLM from a YAML config (use `accelerate launch` for several processes)",
    "generate": "sample from a DLM with a diffusion sampler",
    "convert": "convert checkpoints between AR / LLaDA / Dream / Megatron layouts and hf-dlm",
    "verify": "compare two checkpoints' logits and fail beyond the tolerance",
    "plan": "per-GPU memory and communication of every parallel layout (FSDP2 x TP x CP x EP), ranked",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="hf-dlm", description="Diffusion language models on the HF stack")
    parser.add_argument("--version", action="version", version=f"hf-dlm {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] in ("-h", "--help", "--version"):
        if argv and argv[0] == "--version":
            parser.parse_args(argv)  # prints the version and exits
        parser.print_help()
        return 0 if argv else 2
    name = argv[0]
    if name not in COMMANDS:
        parser.error(f"unknown command {name!r}; choose from {', '.join(COMMANDS)}")
    module = importlib.import_module(f"hf_dlm.commands.{name}")
    command_parser = argparse.ArgumentParser(prog=f"hf-dlm {name}", description=COMMANDS[name])
    module.add_arguments(command_parser)
    return int(module.run(command_parser.parse_args(argv[1:])) or 0)


if __name__ == "__main__":
    sys.exit(main())
