"""Generation speed at the LLaDA-8B shape (hidden 4096, 32 layers, 32 heads, ffn 12288, vocab 126,464;
random bf16 weights, 8.0e9 parameters) on one GPU: tokens/s and tokens per forward of each sampler mode
at batch 1, 16 and 64.

Canvas: 64 random prompt tokens + 256 masks, block 32, steps 256 (one token per step unless a threshold
commits more). Random weights are never confident, so threshold modes commit about one token per
forward here: their speed per forward is what this measures (`generation_throughput.py` trains a
confident model for the tokens-per-forward side).

Steady state, not whole generations (a batch-64 reference loop would take minutes): a callback stamps
the time (after a device sync) at every forward and stops the generation once the measured range has
passed: forwards 3-10 for uncached modes (all alike), 41-72 for cached modes (31 window steps and one
refresh, the mix of a whole generation; the CUDA graphs of the window step and of the refresh are
captured at forwards 3 and 33). tokens/s = tokens committed in the range / its time.

    python benchmarks/generation_8b.py --out results/            # one H200, ~6 minutes (two compiled modes)
    python benchmarks/generation_8b.py --tiny                    # CPU smoke run, no speed value
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402

MODES = {  # name -> generate() options
    "reference (no cache)": dict(cache="none"),
    "dual cache": dict(cache="dual"),
    "dual cache, no CUDA-graph replay": dict(cache="dual", _capture=False),
    "prefix cache": dict(cache="prefix"),
    "threshold 0.9": dict(cache="none", threshold=0.9),
    "threshold 0.9 + dual cache": dict(cache="dual", threshold=0.9),
    "reference, compiled": dict(cache="none", compile="cudagraphs"),
    "dual cache, compiled": dict(cache="dual", compile="cudagraphs"),
    "dual cache, compiled (Inductor + graphs)": dict(cache="dual", compile="default"),
    "dual cache, compiled (max-autotune + graphs)": dict(cache="dual", compile="max-autotune-no-cudagraphs"),
    "dual cache, compiled (reduce-overhead)": dict(cache="dual", compile="reduce-overhead"),
    "reference, compiled (Inductor + graphs)": dict(cache="none", compile="default"),
}
BATCH1_ONLY = {"dual cache, no CUDA-graph replay", "prefix cache"}
# compile-mode comparisons (each compiles the 8B graphs again, a minute or more): only when asked by --modes
OPT_IN = {"dual cache, compiled (max-autotune + graphs)", "dual cache, compiled (reduce-overhead)"}


class _Stop(Exception):
    pass


def timed(model, input_ids, options, first, last, mask_id):
    """-> (seconds, tokens committed, forwards) over forwards [first, last)."""
    stamps = []

    def callback(canvas, step, block):
        if canvas.is_cuda:
            torch.cuda.synchronize()
        stamps.append((time.perf_counter(), int(canvas.eq(mask_id).sum())))
        if step >= last:
            raise _Stop

    options = dict(options)
    capture = options.pop("_capture", True)
    from hf_dlm.generation.sampler import DiffusionSampler

    DiffusionSampler.capture_steps = capture
    try:
        model.generate(input_ids, callback=callback, **options)
    except _Stop:
        pass
    finally:
        DiffusionSampler.capture_steps = True
    (t0, m0), (t1, m1) = stamps[first - 1], stamps[min(last, len(stamps)) - 1]
    return t1 - t0, m0 - m1, min(last, len(stamps)) - first


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="CPU smoke run (tiny model)")
    p.add_argument("--batch-sizes", default="1,16,64")
    p.add_argument("--modes", default=";".join(m for m in MODES if m not in OPT_IN),
                   help=f"semicolon-separated mode names (also: {'; '.join(sorted(OPT_IN))})")
    p.add_argument("--budget-seconds", type=float, default=240.0, help="skip the rest past this wall time")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    from hf_dlm import DLMConfig, DLMForDiffusionLM

    device = "cpu" if a.tiny else "cuda"
    shape = (dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4) if a.tiny else
             dict(vocab_size=126464, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32))
    mask_id = shape["vocab_size"] - 128 if not a.tiny else 319
    config = DLMConfig(**shape, mask_token_id=mask_id, qk_norm=False, tie_word_embeddings=False,
                       max_position_embeddings=4096, rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                       attention_mode="bidirectional")
    config._attn_implementation = "sdpa"
    start = time.perf_counter()
    torch.manual_seed(0)
    dtype = torch.float32 if a.tiny else torch.bfloat16
    torch.set_default_dtype(dtype)
    with torch.device(device):
        model = DLMForDiffusionLM(config).eval()
    torch.set_default_dtype(torch.float32)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e9:.2f}e9 parameters, built in {time.perf_counter() - start:.1f}s", flush=True)
    gen, block, prompt_len = (32, 8, 16) if a.tiny else (256, 32, 64)
    base = dict(max_new_tokens=gen, block_length=block, steps=gen, stop_on_eos=False, temperature=0.0)
    rows, errors = [], {}
    for batch in [int(b) for b in a.batch_sizes.split(",")]:
        input_ids = torch.randint(0, mask_id, (batch, prompt_len), device=device)
        for name in a.modes.split(";"):
            if name in BATCH1_ONLY and batch != 1:
                continue
            if time.perf_counter() - start > a.budget_seconds:
                errors[f"{name} @ {batch}"] = "skipped: time budget"
                continue
            options = {**base, **MODES[name]}
            if a.tiny and "compile" in options:
                options["compile"] = "eager"
            cached = options["cache"] != "none"
            # cached: block 2 and the refresh at block 3's start, after both shapes' graphs were captured
            first, last = (40, 72) if cached else (2, 10)
            if a.tiny:
                first, last = (2, 12) if cached else (2, 6)
            try:
                t0 = time.perf_counter()
                timed(model, input_ids, options, 1, first + 2, mask_id)  # warm-up: compile, capture, plans
                warm = time.perf_counter() - t0
                seconds, tokens, forwards = timed(model, input_ids, options, first, last, mask_id)
                row = dict(batch=batch, mode=name, tokens_per_s=tokens / seconds, tokens_per_forward=tokens / forwards / batch,
                           ms_per_forward=seconds / forwards * 1e3, forwards=forwards, warmup_s=warm)
            except Exception as error:  # one mode's failure must not cost the others' rows
                errors[f"{name} @ {batch}"] = repr(error)[:500]
                print(f"{name} @ {batch} failed: {error!r}", flush=True)
                continue
            rows.append(row)
            print(json.dumps(row), flush=True)
        del input_ids
        if device == "cuda":
            torch.cuda.empty_cache()
    ref = {r["batch"]: r["tokens_per_s"] for r in rows if r["mode"] == "reference (no cache)"}
    print("\n| batch | mode | tokens/s | vs reference | tokens / forward (per row) | ms / forward |\n|---|---|---|---|---|---|")
    for r in rows:
        ratio = r["tokens_per_s"] / ref[r["batch"]] if r["batch"] in ref else float("nan")
        print(f"| {r['batch']} | {r['mode']} | {r['tokens_per_s']:,.1f} | {ratio:.2f}x | {r['tokens_per_forward']:.2f} | "
              f"{r['ms_per_forward']:.2f} |")
    if errors:
        print("errors:", json.dumps(errors, indent=1))
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "generation_8b.json"), "w") as f:
            json.dump(dict(rows=rows, errors=errors, params=params, wall_s=time.perf_counter() - start,
                           torch=torch.__version__), f, indent=1)


if __name__ == "__main__":
    main()
