"""Pretrain a diffusion LM from a YAML config.

    accelerate launch examples/pretrain.py --config examples/configs/tiny_cpu.yaml
    accelerate launch --config_file examples/accelerate/ddp.yaml examples/pretrain.py \
        --config examples/configs/qwen3_1.7b_shape.yaml --set training.max_steps=100

Every process runs this file; `DLMTrainingArguments` reads the distributed setup that accelerate
launched. Same as `hf-dlm train CONFIG` in one process.
"""

import argparse
import sys

from hf_dlm.commands.train import add_arguments, run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser, config_flag="--config")
    return run(parser.parse_args(), prog="pretrain.py")


if __name__ == "__main__":
    sys.exit(main())
