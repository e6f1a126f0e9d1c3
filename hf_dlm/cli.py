"""`hf-dlm` console script. Each subcommand lives in `hf_dlm/commands/<name>.py` with
`add_arguments(parser)` and `run(args) -> int`, imported only when that subcommand runs."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from . import __version__

COMMANDS = {
    "quickstart": "train a tiny DLM on an embedded corpus on CPU, then sample from it",
    "preprocess": "tokenize JSONL / Parquet / HF datasets into Megatron indexed files",
    "train": "train a DLM from a YAML config (use `accelerate launch` for several processes)",
    "sft": "supervised fine-tuning of a DLM on trl (DLMSFTTrainer; YAML via --config)",
    "grpo": "RL of a DLM with diffu-GRPO on trl (DiffuGRPOTrainer; YAML via --config)",
    "generate": "sample from a DLM with a diffusion sampler",
    "convert": "convert checkpoints between AR / LLaDA / Dream / Megatron layouts and hf-dlm",
    "verify": "compare two checkpoints' logits and fail beyond the tolerance",
    "serve": "serve a DLM over an OpenAI-compatible HTTP API with continuous batching",
    "eval": "evaluate a DLM with lm-evaluation-harness (loglikelihood by the Monte Carlo ELBO)",
    "plan": "per-GPU memory and communication of every parallel layout (FSDP2 x TP x CP x EP), ranked",
}


DEBUG_ENV = "HF_DLM_DEBUG"


def _user_errors() -> tuple:
    """Exceptions that mean a mistake in the command line, a config or an input file (their messages name
    the file, field or value): shown as one line and exit status 2, unless debugging."""
    import zlib

    errors = [ValueError, OSError, EOFError, ImportError, zlib.error]
    try:
        from safetensors import SafetensorError

        errors.append(SafetensorError)
    except ImportError:
        pass
    return tuple(errors)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in argv or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    argv = [a for a in argv if a != "--debug"]
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
    command_parser = argparse.ArgumentParser(
        prog=f"hf-dlm {name}", description=COMMANDS[name],
        epilog=f"--debug (or {DEBUG_ENV}=1) shows the traceback of an error")
    module.add_arguments(command_parser)
    if getattr(module, "PASS_THROUGH", False):  # the command parses its own flags (e.g. trl's TrlParser)
        args, rest = command_parser.parse_known_args(argv[1:])
        args.options = rest
    else:
        args = command_parser.parse_args(argv[1:])
    if debug:
        return int(module.run(args) or 0)
    try:
        return int(module.run(args) or 0)
    except SystemExit as exit_:
        if isinstance(exit_.code, str):  # raise SystemExit("hf-dlm ...: message")
            print(exit_.code, file=sys.stderr)
            return 2
        raise
    except _user_errors() as error:
        message = " ".join(line.strip() for line in str(error).splitlines() if line.strip()) or type(error).__name__
        print(f"hf-dlm {name}: {message} (--debug for the traceback)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
