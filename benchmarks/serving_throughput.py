"""Serving and evaluation throughput: `hf-dlm serve`'s app on a real uvicorn (127.0.0.1) and the lm-eval
model `hf-dlm`, for the Qwen3-1.7B shape (28 layers, hidden 2048, 16 heads, 8 KV heads, ffn 6144,
vocab 151936, tied; random bf16 weights).

1. Server: for each number of concurrent clients (default 1, 8, 32, 128), clients send streamed
   /v1/completions requests (prompt = `--prompt-tokens` random token ids, `--max-tokens` new tokens,
   blocks of `--block-length`, `--steps` steps, greedy) until `--requests-per-client` each are done.
   Reported: requests/s, output tokens/s (tokens committed by the engine / wall time), time to first
   block (first SSE event, mean / p50 / p90), mean latency, rows per forward pass (from /metrics).
2. lm-eval: a local multiple-choice task of `--eval-docs` documents x 4 choices (= 4 loglikelihood
   requests each) through `lm_eval.simple_evaluate` with the `hf-dlm` model (`--mc-num` ELBO draws,
   `--eval-batch-size`); falls back to the model's `loglikelihood` on the same requests when the
   harness cannot load its datasets here (said in the output).
Random weights: every token is about as likely as any other, so answers never end early (no EOS)
and threshold decoding would commit one token per step; the figures are the engine's cost per step.

    PYTHONPATH=$PWD PYTHONUNBUFFERED=1 python benchmarks/serving_throughput.py --out results/
    PYTHONPATH=$PWD python benchmarks/serving_throughput.py --tiny --out /tmp/x  # CPU smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="CPU smoke run (tiny model, few requests)")
    p.add_argument("--clients", default="1,8,32,128")
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--block-length", type=int, default=32)
    p.add_argument("--steps", type=int, default=32, help="sampler steps per request (4 tokens per step)")
    p.add_argument("--max-batch-size", type=int, default=128)
    p.add_argument("--level-seconds", type=float, default=45.0, help="stop sending at a level after this long")
    p.add_argument("--eval-docs", type=int, default=250)
    p.add_argument("--mc-num", type=int, default=16)
    p.add_argument("--eval-batch-size", type=int, default=64)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    return p.parse_args()


def build(args):
    """Model (random weights) and a word-level tokenizer over the whole vocabulary (token i = 't{i}')."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from hf_dlm import DLMConfig, DLMForDiffusionLM

    if args.tiny:
        shape = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    else:
        shape = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                     num_attention_heads=16, num_key_value_heads=8, head_dim=128)
    vocab = shape["vocab_size"]
    config = DLMConfig(**shape, max_position_embeddings=4096, tie_word_embeddings=True, qk_norm=True,
                       mask_token_id=vocab - 1, eos_token_id=vocab - 2, pad_token_id=vocab - 3,
                       attention_mode="bidirectional")
    config._attn_implementation = "sdpa"
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        model = DLMForDiffusionLM(config).to(dtype).eval()
    words = {f"t{i}": i for i in range(vocab - 3)}
    words.update({"<pad>": vocab - 3, "<eos>": vocab - 2, "<mask>": vocab - 1})
    backend = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>",
                                        mask_token="<mask>")
    return model, tokenizer, device


async def run_level(url, clients, args, vocab, rng):
    import httpx

    timings, stop_at = [], time.monotonic() + args.level_seconds

    async def client(k, http):
        for i in range(args.requests_per_client):
            if time.monotonic() > stop_at:
                return
            body = {"prompt": [rng.randrange(vocab - 3) for _ in range(args.prompt_tokens)], "stream": True,
                    "max_tokens": args.max_tokens, "block_length": args.block_length, "steps": args.steps,
                    "temperature": 0}
            start, first = time.monotonic(), None
            async with http.stream("POST", url + "/v1/completions", json=body) as response:
                assert response.status_code == 200, await response.aread()
                async for line in response.aiter_lines():
                    if line.startswith("data: ") and first is None:
                        first = time.monotonic()
            timings.append((first - start, time.monotonic() - start))

    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        before = (await http.get(url + "/metrics")).text
        start = time.monotonic()
        await asyncio.gather(*(client(k, http) for k in range(clients)))
        wall = time.monotonic() - start
        after = (await http.get(url + "/metrics")).text
    return timings, wall, before, after


def metric(text, name):
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def serve_benchmark(model, tokenizer, args, report):
    import random

    from hf_dlm.serving.app import ServerSettings, create_app
    from hf_dlm.serving.engine import ContinuousBatchingEngine
    from tests.utils import ThreadedServer

    engine = ContinuousBatchingEngine(model, max_batch_size=args.max_batch_size, max_waiting=4096)
    settings = ServerSettings(model_name="qwen3-1.7b-shape", max_prompt_tokens=4096, max_output_tokens=4096)
    server = ThreadedServer(create_app(engine, tokenizer, settings, log=print))
    rng, vocab = random.Random(0), model.config.vocab_size
    try:
        asyncio.run(run_level(server.url, 2, argparse.Namespace(**{**vars(args), "requests_per_client": 1}), vocab,
                              rng))  # warm-up: kernels, allocator
        for clients in [int(c) for c in args.clients.split(",")]:
            timings, wall, before, after = asyncio.run(run_level(server.url, clients, args, vocab, rng))
            delta = {n: metric(after, n) - metric(before, n) for n in
                     ("hf_dlm_generated_tokens_total", "hf_dlm_forward_passes_total", "hf_dlm_forward_rows_total")}
            first = sorted(t[0] for t in timings)
            row = {"clients": clients, "requests": len(timings), "wall_s": round(wall, 2),
                   "requests_per_s": round(len(timings) / wall, 2),
                   "output_tokens_per_s": round(delta["hf_dlm_generated_tokens_total"] / wall, 1),
                   "first_block_mean_s": round(statistics.mean(first), 3),
                   "first_block_p50_s": round(first[len(first) // 2], 3),
                   "first_block_p90_s": round(first[min(len(first) - 1, int(0.9 * len(first)))], 3),
                   "latency_mean_s": round(statistics.mean(t[1] for t in timings), 3),
                   "rows_per_forward": round(delta["hf_dlm_forward_rows_total"]
                                             / max(delta["hf_dlm_forward_passes_total"], 1), 1)}
            report["serve"].append(row)
            print(json.dumps(row), flush=True)
            dump(report, args)
    finally:
        server.stop(timeout=120)


def eval_benchmark(model, tokenizer, args, report):
    import random

    from hf_dlm.evaluation.lm_eval_model import DLMEvalHarness

    rng = random.Random(1)
    vocab = model.config.vocab_size - 3
    docs = [{"question": " ".join(f"t{rng.randrange(vocab)}" for _ in range(48)),
             "choices": [" " + " ".join(f"t{rng.randrange(vocab)}" for _ in range(4)) for _ in range(4)],
             "answer": rng.randrange(4)} for _ in range(args.eval_docs)]
    lm = DLMEvalHarness(model=model, tokenizer=tokenizer, mc_num=args.mc_num, batch_size=args.eval_batch_size)
    row = {"requests": 4 * len(docs), "mc_num": args.mc_num, "batch_size": args.eval_batch_size}
    folder = tempfile.mkdtemp()
    data = os.path.join(folder, "docs.jsonl")
    with open(data, "w") as f:
        f.writelines(json.dumps(d) + "\n" for d in docs)
    with open(os.path.join(folder, "bench_choice.yaml"), "w") as f:
        f.write(f"task: bench_choice\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
                "test_split: test\noutput_type: multiple_choice\ndoc_to_text: \"{{question}}\"\n"
                "doc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{answer}}\"\nmetric_list:\n  - metric: acc\n"
                "    aggregation: mean\n    higher_is_better: true\n")
    try:
        from lm_eval import simple_evaluate
        from lm_eval.tasks import TaskManager

        start = time.monotonic()
        manager = TaskManager(include_path=folder)  # indexes every built-in task YAML too
        row["task_index_s"] = round(time.monotonic() - start, 2)
        start = time.monotonic()
        results = simple_evaluate(model=lm, tasks=["bench_choice"], task_manager=manager)
        row.update(path="lm_eval.simple_evaluate", wall_s=round(time.monotonic() - start, 2),
                   acc=results["results"]["bench_choice"]["acc,none"])
    except Exception as error:  # noqa: BLE001 (the harness' datasets stack may be missing on the GPU machine)
        from lm_eval.api.instance import Instance

        print(f"simple_evaluate unavailable here ({type(error).__name__}: {error}); timing loglikelihood directly")
        requests = [Instance("loglikelihood", d, (d["question"], c), i)
                    for d in docs for i, c in enumerate(d["choices"])]
        start = time.monotonic()
        lm.loglikelihood(requests)
        row.update(path="DLMEvalHarness.loglikelihood", wall_s=round(time.monotonic() - start, 2))
    row["requests_per_s"] = round(row["requests"] / row["wall_s"], 1)
    report["eval"] = row
    print(json.dumps(row), flush=True)


def dump(report, args):
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "serving_throughput.json"), "w") as f:
        json.dump(report, f, indent=2)


def main():
    args = parse_args()
    if args.tiny:
        args.clients, args.max_tokens, args.block_length, args.steps = "1,4", 8, 4, 4
        args.prompt_tokens, args.eval_docs, args.mc_num, args.eval_batch_size = 8, 10, 2, 8
    import torch

    model, tokenizer, device = build(args)
    report = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "args": vars(args),
              "serve": [], "eval": None}
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}e9 parameters on {report['device']}")
    with torch.inference_mode():
        serve_benchmark(model, tokenizer, args, report)
    dump(report, args)
    with torch.inference_mode():
        eval_benchmark(model, tokenizer, args, report)
    dump(report, args)
    print("| clients | requests | requests/s | output tokens/s | first block mean / p50 / p90 (s) | latency (s) "
          "| rows/forward |")
    print("|---|---|---|---|---|---|---|")
    for r in report["serve"]:
        print(f"| {r['clients']} | {r['requests']} | {r['requests_per_s']} | {r['output_tokens_per_s']:,} | "
              f"{r['first_block_mean_s']} / {r['first_block_p50_s']} / {r['first_block_p90_s']} | "
              f"{r['latency_mean_s']} | {r['rows_per_forward']} |")
    print(json.dumps(report["eval"]))


if __name__ == "__main__":
    main()
