"""`hf-dlm plan CONFIG --gpus N`: per-GPU memory (parameters, gradients, optimizer, activations) and
per-step communication of every parallel layout, ranked (`hf_dlm.parallel.planner`).

CONFIG is a training YAML (`hf-dlm train`'s: model.config or model.name_or_path, data.seq_len,
training.per_device_train_batch_size and gradient_checkpointing are read), a model folder or config.json,
or a Hub model id."""

from __future__ import annotations

import json
import sys


def add_arguments(parser):
    parser.add_argument("config", help="training YAML, model folder, config.json or Hub id")
    parser.add_argument("--gpus", type=int, required=True, help="number of GPUs to plan for")
    parser.add_argument("--seq-len", type=int, default=None, help="sequence length (default: the YAML's data.seq_len)")
    parser.add_argument("--micro-batch", type=int, default=None,
                        help="per-GPU micro-batch (default: the YAML's per_device_train_batch_size, else 1)")
    parser.add_argument("--activation-checkpointing", action=argparse_bool(), default=None,
                        help="recompute each layer in backward (default: the YAML's gradient_checkpointing)")
    parser.add_argument("--mixed-precision", choices=("autocast", "bf16_params"), default="autocast",
                        help="fp32 weights under bf16 autocast (the trainer's default), or FSDP2 bf16 parameters")
    parser.add_argument("--gpu-memory-gib", type=float, default=139.0, help="usable memory per GPU (H200: 139)")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--intra-node-gbps", type=float, default=400.0, help="GB/s per GPU inside a node (NVLink)")
    parser.add_argument("--inter-node-gbps", type=float, default=50.0, help="GB/s per GPU between nodes")
    parser.add_argument("--pp-microbatches", type=int, default=None,
                        help="micro-batches per step of a pipeline layout (default: the YAML's "
                             "gradient_accumulation_steps, at least 8)")
    parser.add_argument("--pp-schedule", choices=("gpipe", "1f1b", "interleaved_1f1b"), default=None,
                        help="pipeline schedule of pipeline layouts (default: the YAML's pp_schedule, else 1f1b)")
    parser.add_argument("--top", type=int, default=15, help="show the best N layouts (0: all)")
    parser.add_argument("--json", action="store_true", help="print the plans as JSON lines")


def argparse_bool():
    import argparse

    return argparse.BooleanOptionalAction


def load_model_config(source: str):
    """(model config, data options, training options) from a YAML, a folder / config.json or a Hub id."""
    if source.endswith((".yaml", ".yml")):
        from ..modeling import DLMConfig
        from ..training.runner import load_config

        config = load_config(source)
        model = config.get("model", {})
        if model.get("name_or_path"):
            from transformers import AutoConfig

            model_config = AutoConfig.from_pretrained(model["name_or_path"], **(model.get("config") or {}))
        else:
            model_config = DLMConfig(**(model.get("config") or {}))
        return model_config, config.get("data", {}), config.get("training", {})
    from transformers import AutoConfig

    import hf_dlm  # noqa: F401  (registers the dlm model type)

    path = source[: -len("config.json")] or "." if source.endswith("config.json") else source
    return AutoConfig.from_pretrained(path), {}, {}


def run(args, prog: str = "hf-dlm plan") -> int:
    from dataclasses import asdict

    from ..parallel.planner import ModelShape, format_plans, plan_layouts

    try:
        config, data, training = load_model_config(args.config)
    except (OSError, ValueError) as error:
        print(f"{prog}: {args.config}: {error}", file=sys.stderr)
        return 2
    seq_len = args.seq_len or data.get("seq_len") or data.get("max_length")
    if not seq_len:
        print(f"{prog}: {args.config} has no data.seq_len: pass --seq-len", file=sys.stderr)
        return 2
    micro_batch = args.micro_batch or training.get("per_device_train_batch_size") or 1
    checkpointing = args.activation_checkpointing
    if checkpointing is None:
        checkpointing = bool(training.get("gradient_checkpointing", False))
    if args.gpus < 1:
        print(f"{prog}: --gpus must be positive, got {args.gpus}", file=sys.stderr)
        return 2
    plans = plan_layouts(config, args.gpus, seq_len, micro_batch, activation_checkpointing=checkpointing,
                         mixed_precision=args.mixed_precision, loss_chunk_size=getattr(config, "loss_chunk_size", 4096),
                         gpu_memory_gib=args.gpu_memory_gib, gpus_per_node=args.gpus_per_node,
                         intra_node_gbps=args.intra_node_gbps, inter_node_gbps=args.inter_node_gbps,
                         pp_microbatches=args.pp_microbatches or max(8, training.get("gradient_accumulation_steps", 1)),
                         pp_schedule=args.pp_schedule or training.get("pp_schedule", "1f1b"))
    shown = plans[: args.top] if args.top else plans
    if args.json:
        for plan in shown:
            print(json.dumps(dict(asdict(plan), communication_ms_per_mtoken=plan.communication_ms_per_mtoken)))
        return 0
    shape = ModelShape.from_config(config)
    print(f"{shape.total_params() / 1e9:.2f}B parameters ({shape.active_params() / 1e9:.2f}B active), seq {seq_len}, "
          f"micro-batch {micro_batch}, activation checkpointing {'on' if checkpointing else 'off'}, "
          f"{args.mixed_precision}; {args.gpus} GPUs of {args.gpu_memory_gib:g} GiB. Memory in GiB per GPU, "
          "communication (GiB, ms) per GPU and optimizer step (one micro-batch per data-parallel rank); ranked: "
          "fits, then pipeline bubble, then communication time per million tokens.")
    print(format_plans(shown))
    if not any(plan.fits for plan in plans):
        print(f"no layout fits in {args.gpu_memory_gib:g} GiB: try --activation-checkpointing, a smaller "
              "--micro-batch or more GPUs")
    return 0
