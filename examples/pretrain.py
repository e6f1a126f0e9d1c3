"""Pretrain a diffusion LM from a YAML config.

    accelerate launch examples/pretrain.py --config examples/configs/tiny_cpu.yaml
    accelerate launch --config_file examples/accelerate/ddp.yaml examples/pretrain.py \
        --config examples/configs/qwen3_1.7b_shape.yaml --set training.max_steps=100

Every process runs this file; `DLMTrainingArguments` reads the distributed setup that accelerate
launched. Same as `hf-dlm train CONFIG` in one process.
"""

import argparse
import json
import sys

from hf_dlm.training.pretrain import ConfigError, run_pretraining


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="YAML file with sections model, data, training")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config entry, e.g. --set training.max_steps=10 (repeatable)")
    parser.add_argument("--json", action="store_true", help="print the final metrics as one JSON line")
    args = parser.parse_args()
    try:
        metrics = run_pretraining(args.config, args.overrides)
    except ConfigError as error:
        print(f"pretrain.py: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(metrics))
    return 0


if __name__ == "__main__":
    sys.exit(main())
