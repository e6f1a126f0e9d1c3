"""`hf-dlm eval`: lm-evaluation-harness on a DLM (the `hf-dlm` lm-eval model), local task folders included.

    hf-dlm eval --model PATH --tasks my_task --include-path tasks/ --mc-num 32 --batch-size 8 \
        --output results.json
"""

from __future__ import annotations

import json
import sys


def add_arguments(parser):
    parser.add_argument("--model", required=True, help="checkpoint folder or Hub id (model and tokenizer)")
    parser.add_argument("--tasks", required=True, help="comma-separated lm-eval task or group names")
    parser.add_argument("--include-path", default=None, help="a folder of task YAMLs (local data files work)")
    parser.add_argument("--only-include-path", action="store_true",
                        help="index only --include-path's tasks, not lm-eval's built-in ones (faster start)")
    parser.add_argument("--peft", default=None, help="a LoRA adapter folder to load on the model")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    parser.add_argument("--batch-size", type=int, default=8, help="rows per forward (scores do not depend on it)")
    parser.add_argument("--mc-num", type=int, default=128, help="Monte Carlo ELBO draws per loglikelihood request")
    parser.add_argument("--seed", type=int, default=1234, help="seeds every request's draws (with its tokens)")
    parser.add_argument("--num-fewshot", type=int, default=None)
    parser.add_argument("--limit", type=float, default=None, help="documents per task (a fraction if < 1)")
    parser.add_argument("--max-gen-toks", type=int, default=128, help="generate_until default answer length")
    parser.add_argument("--block-length", type=int, default=32, help="sampler block length for generate_until")
    parser.add_argument("--steps", type=int, default=None, help="sampler steps (default: one token per step)")
    parser.add_argument("--threshold", type=float, default=None, help="Fast-dLLM confidence threshold")
    parser.add_argument("--cache", default=None, choices=("none", "prefix", "dual"),
                        help="generate_until KV cache (Fast-dLLM's, approximate for bidirectional models)")
    parser.add_argument("--apply-chat-template", action="store_true", help="wrap prompts with the chat template")
    parser.add_argument("--greedy-check", default="one_forward", choices=("one_forward", "iterative"),
                        help="is_greedy: one forward with the continuation masked, or LLaDA's iterative "
                             "suffix_greedy_prediction (one forward per continuation token)")
    parser.add_argument("--subs", action="store_true",
                        help="the model was trained with MDLM's SUBS (the mdlm preset): [MASK] out of the softmax")
    parser.add_argument("--output", default=None, help="write the results JSON here")


def run(args) -> int:
    from ..utils.import_utils import require

    require("lm_eval", "hf-dlm eval")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import make_table

    from ..evaluation.lm_eval_model import DLMEvalHarness

    model = DLMEvalHarness(pretrained=args.model, peft=args.peft, device=args.device, dtype=args.dtype,
                           batch_size=args.batch_size, mc_num=args.mc_num, seed=args.seed,
                           max_gen_toks=args.max_gen_toks, block_length=args.block_length, steps=args.steps,
                           threshold=args.threshold, cache=args.cache, greedy_check=args.greedy_check,
                           subs=args.subs)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    manager = TaskManager(include_path=args.include_path, include_defaults=not args.only_include_path)
    missing = [t for t in tasks if t not in manager.all_tasks]
    if missing:
        print(f"hf-dlm eval: unknown task(s) {missing} (add --include-path for local task YAMLs)", file=sys.stderr)
        return 2
    limit = None if args.limit is None else (int(args.limit) if args.limit >= 1 else args.limit)
    results = simple_evaluate(model=model, tasks=tasks, task_manager=manager, num_fewshot=args.num_fewshot,
                              limit=limit, random_seed=args.seed, numpy_random_seed=args.seed,
                              torch_random_seed=args.seed, fewshot_random_seed=args.seed,
                              apply_chat_template=args.apply_chat_template)
    print(make_table(results))
    if args.output:
        with open(args.output, "w") as f:
            json.dump({k: results[k] for k in ("results", "configs", "versions", "n-shot") if k in results}, f,
                      indent=2, default=str)
    return 0
