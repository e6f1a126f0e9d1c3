"""`hf-dlm train CONFIG.yaml`: pretraining from a YAML config (one process; for several, run
`accelerate launch examples/pretrain.py --config CONFIG.yaml`)."""

from __future__ import annotations

import json
import sys


def add_arguments(parser, config_flag: str | None = None):
    """`config_flag` ("--config" in examples/pretrain.py) makes the YAML path a required option."""
    help_text = "YAML file with sections model, data, training (see examples/configs/)"
    if config_flag:
        parser.add_argument(config_flag, dest="config", required=True, help=help_text)
    else:
        parser.add_argument("config", help=help_text)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config entry at any depth, e.g. --set training.max_steps=10 or "
                             "--set model.config.hidden_size=48 (repeatable)")
    parser.add_argument("--json", action="store_true", help="print the final metrics as one JSON line")


def run(args, prog: str = "hf-dlm train") -> int:
    from ..training.runner import ConfigError, run_pretraining

    try:
        metrics = run_pretraining(args.config, args.overrides)
    except ConfigError as error:
        # one write with its newline: under a launch every rank prints this, and print's two writes
        # (text, then "\n") let the ranks' lines run together on a shared stderr pipe
        sys.stderr.write(f"{prog}: {error}\n")
        sys.stderr.flush()
        return 2
    if args.json:
        print(json.dumps(metrics))
    return 0
