"""`hf-dlm generate`: sample from a saved DLM with a diffusion sampler, streaming to the terminal.

    hf-dlm generate --model PATH --prompt "The for statement" --max-new-tokens 64 --block-length 32 \
        --threshold 0.9 --cache dual
"""

from __future__ import annotations

import sys

# CLI options forwarded to `model.generate` besides DLM_GENERATION_FIELDS: name -> (type, help)
SAMPLING_OPTIONS = {
    "max_new_tokens": (int, "tokens to generate (a multiple of --block-length unless --align-blocks)"),
    "temperature": (float, "0 = argmax (greedy); > 0 samples with float64 Gumbel noise"),
    "top_k": (int, "sample among the k most likely tokens only"),
    "top_p": (float, "nucleus sampling: the smallest set of tokens with this much probability"),
}


def add_arguments(parser):
    from ..generation.compiled_step import COMPILE_CHOICES
    from ..generation.configuration import CACHE_MODES, DLM_GENERATION_FIELDS, REMASKING
    from ..generation.sampling import SCHEDULES

    parser.add_argument("--model", required=True, help="checkpoint folder or Hub id (model and tokenizer)")
    parser.add_argument("--prompt", required=True, help="the prompt text")
    parser.add_argument("--chat", action="store_true",
                        help="wrap the prompt as a user turn with the tokenizer's chat template")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                        help="weights' dtype (auto: bfloat16 on cuda, float32 on cpu)")
    parser.add_argument("--seed", type=int, default=None, help="seed of the sampler's random numbers")
    for name, (kind, help_text) in SAMPLING_OPTIONS.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, default=None,
                            help=f"{help_text} (default: the model's generation config)")
    kinds = {"steps": int, "block_length": int, "cfg_scale": float, "threshold": float, "mask_token_id": int,
             "factor": float, "entropy_bound": float, "editing_threshold": float, "hierarchy_threshold": float,
             "max_post_steps": int,
             "schedule_eps": float, "sub_block_length": int, "credit_alpha": float, "credit_boost": float,
             "credit_decay": float}
    choices = {"remasking": REMASKING, "cache": CACHE_MODES, "compile": tuple(COMPILE_CHOICES), "schedule": SCHEDULES}
    for name, (default, help_text) in DLM_GENERATION_FIELDS.items():
        flag = f"--{name.replace('_', '-')}"
        if isinstance(default, bool):
            parser.add_argument(flag, action="store_true", default=None, help=f"{help_text} (default: {default})")
            parser.add_argument(f"--no-{name.replace('_', '-')}", dest=name, action="store_false",
                                help=f"turn off {flag}")
        else:
            parser.add_argument(flag, type=kinds.get(name, str), choices=choices.get(name), default=None,
                                help=help_text if default is None else f"{help_text} (default: {default})")


def run(args) -> int:
    import torch
    from transformers import AutoModelForMaskedLM, AutoTokenizer, TextStreamer

    from ..generation.configuration import DLM_GENERATION_FIELDS

    from ..utils.paths import check_model_location

    args.model = check_model_location(args.model, "--model")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if args.chat and not getattr(tokenizer, "chat_template", None):
        print(f"hf-dlm generate: --chat needs a chat template, but the tokenizer of {args.model!r} has none "
              "(set tokenizer.chat_template and save it, or drop --chat)", file=sys.stderr)
        return 2
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(
        args.dtype, torch.bfloat16 if device.type == "cuda" else torch.float32)
    model = AutoModelForMaskedLM.from_pretrained(args.model, dtype=dtype).to(device).eval()

    if args.chat:
        input_ids = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}],
                                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)
        input_ids = input_ids["input_ids"]
    else:
        input_ids = tokenizer(args.prompt, return_tensors="pt")["input_ids"]
    options = {name: getattr(args, name) for name in (*SAMPLING_OPTIONS, *DLM_GENERATION_FIELDS)}
    options = {name: value for name, value in options.items() if value is not None}  # unset: the model's config
    generator = None if args.seed is None else torch.Generator(device).manual_seed(args.seed)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    try:
        model.generate(input_ids.to(device), streamer=streamer, generator=generator, **options)
    except ValueError as error:  # bad option combinations, named by the sampler
        print(f"hf-dlm generate: {error}", file=sys.stderr)
        return 2
    return 0
