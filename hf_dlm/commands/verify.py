"""`hf-dlm verify SRC DST`: compare two checkpoints' logits on random inputs; non-zero exit beyond tolerance."""

from __future__ import annotations


def add_arguments(parser):
    from ..conversion.verify import TOLERANCES

    parser.add_argument("source", help="reference checkpoint (hf-dlm, transformers causal LM or Megatron folder)")
    parser.add_argument("candidate", help="checkpoint to check against the reference")
    parser.add_argument("--dtype", choices=tuple(TOLERANCES), default="float32", help="compute dtype of both models")
    parser.add_argument("--batch-size", type=int, default=2, help="rows of random token ids")
    parser.add_argument("--seq-len", type=int, default=32, help="length of each row")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random token ids")
    parser.add_argument("--atol", type=float, default=None,
                        help=f"absolute tolerance on the max logit difference (default per dtype: {TOLERANCES})")
    parser.add_argument("--rtol", type=float, default=None, help="tolerance relative to the reference's max |logit|")
    parser.add_argument("--attention", choices=("auto", "as-saved", "causal", "bidirectional"), default="auto",
                        help="auto: an hf-dlm side facing an AR model runs causal; or force a mode on hf-dlm sides")
    parser.add_argument("--trust-remote-code", action="store_true", help="allow remote code for non-hf-dlm models")
    parser.add_argument("--trust-pickle", action="store_true", help="allow full unpickling of Megatron checkpoints")


def run(args) -> int:
    from ..conversion.verify import verify_checkpoints
    from ..utils.paths import check_model_location

    args.source = check_model_location(args.source, "source")
    args.candidate = check_model_location(args.candidate, "candidate")

    result = verify_checkpoints(
        args.source, args.candidate, dtype=args.dtype, batch_size=args.batch_size, seq_len=args.seq_len,
        seed=args.seed, atol=args.atol, rtol=args.rtol, attention=args.attention,
        trust_remote_code=args.trust_remote_code, trust_pickle=args.trust_pickle,
    )
    print(f"hf-dlm verify {args.source} vs {args.candidate} ({args.dtype}): {result}")
    return 0 if result.passed else 1
