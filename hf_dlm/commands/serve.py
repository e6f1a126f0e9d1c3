"""`hf-dlm serve`: an OpenAI-compatible HTTP server with continuous batching.

    hf-dlm serve --model PATH --host 127.0.0.1 --port 8000 --max-batch-size 32
    hf-dlm serve --model PATH --compile true --max-length 2048   # GPU: the compiled, CUDA-graph engine step

Then any OpenAI client works: `OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="...")`, with the
diffusion fields (steps, block_length, threshold, cache) in `extra_body`. SIGTERM / Ctrl-C drains:
open requests finish, new connections are refused.
"""

from __future__ import annotations

import argparse
import os

from ..generation.compiled_step import COMPILE_CHOICES


def add_arguments(parser):
    parser.add_argument("--model", required=True, help="checkpoint folder or Hub id (model and tokenizer)")
    parser.add_argument("--host", default="127.0.0.1", help="interface to listen on (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="name(s) in /v1/models that requests may use; the first one is named in responses "
                             "(default: --model)")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                        help="weights' dtype (auto: bfloat16 on cuda, float32 on cpu)")
    parser.add_argument("--peft", default=None, help="a LoRA adapter folder to load on the model (merged)")
    parser.add_argument("--fuse-projections", action=argparse.BooleanOptionalAction, default=True,
                        help="serve with q / k / v and gate / up fused into one linear layer each, as vLLM serves "
                        "Llama-style models (default: on; small decoding batches read the weights faster)")
    parser.add_argument("--max-batch-size", type=int, default=32, help="most sequences in one forward pass")
    parser.add_argument("--max-queue", type=int, default=256, help="most waiting sequences; beyond: 429")
    parser.add_argument("--compile", default=None, choices=("true", *COMPILE_CHOICES),
                        help="the engine step through torch.compile (true: Inductor, on CUDA with CUDA graphs per "
                             "bucketed shape; or a mode / backend as DLMGenerationConfig.compile); default: eager")
    parser.add_argument("--max-length", type=int, default=None,
                        help="longest canvas (prompt + max_tokens) the engine takes; with --compile on CUDA its "
                             "slot storage is preallocated at this length (default: the model's "
                             "max_position_embeddings)")
    parser.add_argument("--max-prompt-tokens", type=int, default=4096, help="longer prompts get 400")
    parser.add_argument("--max-output-tokens", type=int, default=1024, help="larger max_tokens gets 400")
    parser.add_argument("--default-max-tokens", type=int, default=64, help="max_tokens when a request has none")
    parser.add_argument("--api-key", default=None,
                        help="require `Authorization: Bearer KEY` on /v1/* (default: $HF_DLM_API_KEY, else none)")
    parser.add_argument("--chat-template", default=None,
                        help="a Jinja chat template file for /v1/chat/completions (default: the tokenizer's own)")
    parser.add_argument("--drain-timeout", type=float, default=30.0,
                        help="on SIGTERM / Ctrl-C, seconds open requests may still run before they are answered 503")
    parser.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))


def run(args) -> int:
    from ..utils.import_utils import require

    require("fastapi", "hf-dlm serve")
    require("uvicorn", "hf-dlm serve")

    from ..hub.loading import load_model
    from ..serving.app import ServerSettings, create_app, serve
    from ..serving.engine import ContinuousBatchingEngine

    model, tokenizer = load_model(args.model, args.device, args.dtype, args.peft, args.fuse_projections)
    engine = ContinuousBatchingEngine(model, max_batch_size=args.max_batch_size, max_waiting=args.max_queue,
                                      eos_token_id=tokenizer.eos_token_id,
                                      compile=True if args.compile == "true" else args.compile,
                                      max_length=args.max_length)
    if engine.compiled is not None:  # compile before listening: the first client must not wait for the compiler
        print(f"hf-dlm serve: compiling the engine step ({engine.compile_choice}) ...", flush=True)
        done = engine.warmup()
        print(f"hf-dlm serve: step compiled in {done['seconds']:.1f} s", flush=True)
    names = args.served_model_name or [args.model]
    chat_template = None
    if args.chat_template:
        with open(args.chat_template, encoding="utf-8") as file:
            chat_template = file.read()
    settings = ServerSettings(model_name=names[0], aliases=tuple(names[1:]), max_prompt_tokens=args.max_prompt_tokens,
                              max_output_tokens=args.max_output_tokens, default_max_tokens=args.default_max_tokens,
                              api_key=args.api_key or os.environ.get("HF_DLM_API_KEY") or None,
                              drain_timeout=args.drain_timeout, chat_template=chat_template)
    app = create_app(engine, tokenizer, settings, log=lambda line: print(line, flush=True))
    serve(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
