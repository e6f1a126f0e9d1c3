"""A decoding step's vocabulary-sized work alone, timed: the greedy argmax + confidence and the sampled Gumbel-max
draw + confidence, eager (as the eager sampler runs them) and compiled (`generation/commit_rules.py`), and the
compiled sampled draw in LLaDA's exp / pow form against the core's log form (`logit - T log(-log u)`). The logits are (rows, block width, vocabulary) as a
batch of rows' blocks gives them; every form's tokens are checked against the eager one's.

    python benchmarks/commit_kernels.py                  # Qwen3-1.7B's vocabulary, 64 rows of a 32-wide block
    python benchmarks/commit_kernels.py --rows 4         # a CPU fits this
    python benchmarks/commit_kernels.py --tiny           # small sizes (the test suite)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="CPU smoke run (small sizes)")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--width", type=int, default=32, help="block length: positions a row decides per step")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--temperature", type=float, default=0.9)
    p.add_argument("--repeats", type=int, default=10, help="timed calls per form, after one that compiles")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    if args.tiny:
        args.rows, args.vocab, args.repeats = 2, 1000, 2
    return args


def main():
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from serving_throughput import exp_form_sampled_scores  # the exp form, as the serving benchmark times it

    from hf_dlm.generation.commit_rules import _compiled_scores, greedy_scores, sampled_scores, without_mask
    from hf_dlm.generation.sampling import add_gumbel_noise, confidence_scores

    def eager_sampled(logits, noise, mask_id, temperature, remasking):  # the eager sampler's draw (LLaDA's code)
        x0 = add_gumbel_noise(without_mask(logits, mask_id), float(temperature), noise=noise).argmax(-1)
        return x0, confidence_scores(logits, x0, remasking)

    args = parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    generator = torch.Generator(device).manual_seed(0)
    shape = (args.rows, args.width, args.vocab)
    logits = torch.randn(shape, generator=generator, device=device).mul_(4).to(torch.bfloat16)
    noise = torch.rand(shape, dtype=torch.float64, generator=generator, device=device)
    temperature = torch.tensor(args.temperature, dtype=torch.float64, device=device)
    mask_id = args.vocab - 1
    forms = {  # name -> (function, its arguments after the logits)
        "greedy, eager": (greedy_scores, (mask_id, "low_confidence")),
        "greedy, compiled": (_compiled_scores(greedy_scores, "default"), (mask_id, "low_confidence")),
        "sampled, eager (exp form, LLaDA's add_gumbel_noise)": (eager_sampled,
                                                               (noise, mask_id, temperature, "low_confidence")),
        "sampled, compiled (log form)": (_compiled_scores(sampled_scores, "default"),
                                         (noise, mask_id, temperature, "low_confidence")),
        "sampled, compiled (exp form)": (_compiled_scores(exp_form_sampled_scores, "default"),
                                         (noise, mask_id, temperature, "low_confidence")),
    }
    rows, reference = [], {}
    for name, (function, extra) in forms.items():
        with torch.inference_mode():
            x0, _ = function(logits, *extra)  # compiles
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(args.repeats):
                function(logits, *extra)
            if device.type == "cuda":
                torch.cuda.synchronize()
        ms = (time.perf_counter() - start) / args.repeats * 1e3
        kind = name.split(",")[0]
        reference.setdefault(kind, x0)  # the first form of a kind: its eager one
        same = float((x0 == reference[kind]).float().mean())
        rows.append({"form": name, "ms": round(ms, 3), "tokens_equal_to_eager": round(same, 6)})
        print(json.dumps(rows[-1]), flush=True)
    payload = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               "threads": torch.get_num_threads(), "args": vars(args), "rows": rows}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "commit_kernels.json"), "w") as f:
        json.dump(payload, f, indent=2)
    print(f"{payload['device']}, logits {tuple(shape)}")
    print("| form | ms a step | tokens = eager |\n|---|---|---|")
    for row in rows:
        print(f"| {row['form']} | {row['ms']} | {row['tokens_equal_to_eager']} |")


if __name__ == "__main__":
    main()
