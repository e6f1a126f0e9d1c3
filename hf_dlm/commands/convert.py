"""`hf-dlm convert`: AR / LLaDA / Dream / Megatron checkpoints into hf-dlm, and hf-dlm into Megatron."""

from __future__ import annotations

import dataclasses


def add_arguments(parser):
    from ..conversion.convert import SOURCES, ConversionOptions

    parser.add_argument("source", help="source checkpoint folder (a Megatron checkpoint folder for --from megatron)")
    parser.add_argument("destination", help="output folder (must be empty unless --overwrite)")
    parser.add_argument("--from", dest="family", choices=SOURCES, default=None,
                        help="source family; default: read from the checkpoint (config.json model_type, or Megatron "
                             "files), dlm for --to megatron / qwen3_moe; a --from that contradicts config.json is an error")
    parser.add_argument("--to", choices=("dlm", "megatron", "qwen3_moe"), default="dlm",
                        help="output layout: an hf-dlm folder (default), a Megatron / MegaDLMs checkpoint, or a "
                             "Qwen3-MoE folder (from an hf-dlm MoE model)")
    parser.add_argument("--keep-causal", action="store_true",
                        help="keep causal attention (same as --attention-mode causal)")
    parser.add_argument("--overwrite", action="store_true", help="write into a non-empty destination")
    parser.add_argument("--push-to-hub", metavar="REPO_ID", default=None,
                        help="upload the converted hf-dlm folder to this Hub model repository (needs network)")
    parser.add_argument("--private", action="store_true", help="create the Hub repository as private")
    for field in dataclasses.fields(ConversionOptions):
        flag = "--" + field.name.replace("_", "-")
        if field.type == "bool":
            parser.add_argument(flag, action="store_true", help=field.metadata["help"])
        else:
            kind = int if field.name in ("mask_token_id", "block_size") else str
            parser.add_argument(flag, type=kind, default=field.default, choices=field.metadata.get("choices"),
                                help=field.metadata["help"])


def run(args) -> int:
    from ..conversion.convert import ConversionOptions, convert_checkpoint

    family = args.family or ("dlm" if args.to in ("megatron", "qwen3_moe") else None)  # None: detected
    if args.push_to_hub and args.to != "dlm":  # before minutes of conversion
        raise SystemExit("hf-dlm convert: --push-to-hub uploads hf-dlm folders only (not --to megatron / qwen3_moe)")
    options = ConversionOptions(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ConversionOptions)})
    if args.keep_causal:
        options.attention_mode = "causal"
    if family is None:
        from ..conversion.convert import detect_family

        family = detect_family(args.source)
    destination = convert_checkpoint(family, args.source, args.destination, options, to=args.to, overwrite=args.overwrite)
    print(f"converted {family} checkpoint {args.source} -> {args.to} checkpoint {destination}")
    if args.push_to_hub:
        from ..hub.publish import upload_folder

        try:
            upload_folder(destination, args.push_to_hub, private=args.private or None,
                          commit_message=f"hf-dlm convert --from {family}")
        except Exception as error:  # offline, no token, no such namespace: the conversion itself is done
            raise OSError(f"the converted folder {destination} is complete, but the upload to {args.push_to_hub} "
                          f"failed: {error}; push it later with `hf upload {args.push_to_hub} "
                          f"{destination}`") from error
        print(f"uploaded {destination} to {args.push_to_hub}")
    return 0
