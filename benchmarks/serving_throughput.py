"""Decoding-core and serving throughput, random bf16 weights (LLaDA-8B shape by default: 32 layers, hidden 4096,
32 heads, ffn 12288, vocab 126464; `--shape qwen3-1.7b` for the smaller one).

1. core (issue 27's Must-show): `model.generate` against the continuous-batching engine on the same requests,
   `--new-tokens` (256) new tokens in blocks of `--block-length` (32), dual cache, compiled (`--compile`),
   one token per step and threshold 0.9: all at once at each of `--batches` (16, 64), and `--arrivals` (64)
   requests arriving one per `--arrival-every` (8) engine steps. Reported: tokens/s, engine steps and forwards
   (one forward per step), engine / generate ratio, arrivals / all-at-once ratio; a table at the end. The
   all-at-once engine rows time each step (`StepClock`): block starts against the other steps, the slowest five.
   `--engine-mask bias,bool`: the all-at-once engine runs with the engine's additive-bias mask and with a boolean
   mask (an engine each), to compare the two on one machine.
   `--commit compiled,eager`: the all-at-once runs with the compiled greedy commit (the core's form) and with an
   eager one (the form before 2026-12-07), on one machine. `--engine-sdpa as-now,model-priority`: the engine's
   attention under PyTorch's default SDPA priority and under the model's `sdpa_backends` (cuDNN first).
   `--profile-steps N`: one more run of the largest batch and of the arrivals, N steps of each under
   torch.profiler: wall time per step (without and with the profiler) against the device's kernel time per step,
   and the operators / kernels by time (`profile_*.txt`).
2. http: `hf-dlm serve`'s app on a real uvicorn (127.0.0.1): for each number of concurrent clients
   (`--clients`), streamed and whole /v1/completions requests from closed-loop clients in a process of their
   own (`--clients-in`); requests/s, output tokens/s, time to first block, latency, rows per forward, engine
   steps and ms per step (from /metrics), against the engine alone on as many requests in the same pattern.
3. float8: batch-1 `model.generate` (same shape and options, one token per step, dual cache, compiled) with
   bf16 weights and with float8 weights (`hf_dlm.generation.float8`; CUDA only), the projections separate or
   fused (`--fuse-projections no,yes`), `float8-tensor-head` with the LM head in float8 too, `float8-static`
   with activation scales calibrated once (`activation_scheme="static"`), each with the
   `--commit` forms: tokens/s and the share of tokens equal to bf16 decoding;
   `--profile-steps N` adds a profiled generate of each (device busy ms per token, kernel table).
4. eval: a local multiple-choice task through `lm_eval.simple_evaluate` with the `hf-dlm` model (falls back
   to the model's `loglikelihood` when the harness cannot load its datasets here).
Random weights: answers never end early (stop_on_eos off) and threshold decoding commits about one token
per step; the figures are the decoder's cost per step.

    PYTHONPATH=$PWD PYTHONUNBUFFERED=1 python benchmarks/serving_throughput.py --out results/   # GPU
    PYTHONPATH=$PWD python benchmarks/serving_throughput.py --tiny --out /tmp/x  # CPU smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import statistics
import sys
import tempfile
import time


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="CPU smoke run (tiny model, few requests)")
    p.add_argument("--parts", default="core,float8,http,eval", help="comma-separated, run in this order: core, "
                   "float8, http, eval")
    p.add_argument("--shape", default="llada-8b", choices=("llada-8b", "qwen3-1.7b", "cpu-small"),
                   help="cpu-small: hidden 128, 2 layers, a 512-word vocabulary (the HTTP path on a CPU)")
    p.add_argument("--torch-threads", type=int, default=0, help="torch.set_num_threads (0: torch's own); on a CPU, "
                   "1 leaves a core to the server's event loop as a GPU does")
    p.add_argument("--batches", default="16,64")
    p.add_argument("--rules", default="one,threshold", help="comma-separated core settings: one (one token per step), "
                   "threshold (threshold 0.9), sampled (threshold 0.9 at temperature 0.9, as GRPO rollouts)")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--arrivals", type=int, default=64, help="requests of the arrivals run (0: no arrivals run)")
    p.add_argument("--arrival-every", type=int, default=8, help="engine steps between two arrivals")
    p.add_argument("--arrival-split", default="yes", help="the arrivals runs, comma-separated: yes (a step mixing "
                   "block starts with windows attends in two calls, the engine's default), no (one call padding "
                   "every row to the widest)")
    p.add_argument("--arrival-graph-pool", default="shared", help="the arrivals runs, comma-separated: shared (one "
                   "memory pool for the engine's CUDA graphs, the default), own (a pool per graph)")
    p.add_argument("--compile", default=None, help="'true' (default; 'none' with --tiny), 'none' or a "
                   "DLMGenerationConfig.compile value")
    p.add_argument("--float8-weights", default="bf16,float8", help="the float8 part's runs, in this order: bf16, "
                   "float8 (row scales), float8-tensor (tensor scales), float8-tensor-head (and the LM head), "
                   "float8-static (tensor scales, activation scales calibrated once on another prompt's eager "
                   "generate), float8-static-head; the share of equal tokens needs bf16")
    p.add_argument("--fuse-projections", default="no", help="the float8 part's runs, comma-separated: no (q / k / v "
                   "and gate / up separate), yes (fused: model.fuse_projections())")
    p.add_argument("--float8-inductor", default="default", help="the float8 part's runs, comma-separated, each on "
                   "every model of --float8-weights: default (--compile as given), max-autotune (Inductor's "
                   "max-autotune-no-cudagraphs: GEMMs autotuned against Triton templates, which can fuse the "
                   "residual add and the next cast into the GEMM; the step's CUDA graphs stay hf-dlm's), "
                   "combo-kernels (Inductor's horizontal fusion of independent kernels), coordinate-descent "
                   "(Inductor's coordinate-descent tuning of its kernels' launch configs), pdl (Triton kernels "
                   "with Hopper's programmatic dependent launch: each may start while the one before it ends), "
                   "layers-4 (four decoder layers a compiled graph: a layer's closing residual add can fuse into "
                   "the next one's norm)")
    p.add_argument("--commit", default="compiled", help="the core part's all-at-once runs and the float8 part's, "
                   "comma-separated: compiled (a compiled generate or engine runs a step's vocabulary-sized work "
                   "through torch.compile: greedy steps since 2026-12-07, sampled ones since the twelfth session), "
                   "eager (that work eager, as before), compiled-exp (compiled, a sampled step's Gumbel draw in LLaDA's "
                   "exp / pow form, as before the fourteenth session's log form)")
    p.add_argument("--engine-sdpa", default="as-now", help="the core part's all-at-once engine runs, comma-separated: "
                   "as-now (the engine's attention under PyTorch's default SDPA priority: its memory-efficient kernel "
                   "under a mask), model-priority (the engine compiled and run under the model's `sdpa_backends` "
                   "priority, cuDNN first, as the model's own attention; Dynamo's caches are reset around it)")
    p.add_argument("--engine-mask", default="bias", help="the core part's all-at-once engine runs, comma-separated: "
                   "bias (the engine's attention mask, an additive bias built once per step), bool (a boolean mask, "
                   "converted by SDPA in every layer: the form before 2026-12-07, for a same-machine comparison)")
    p.add_argument("--capture-warmups", type=int, default=None, help="plain forwards before each CUDA graph capture "
                   "(hf_dlm.generation.compiled_step.CAPTURE_WARMUPS; default: the library's)")
    p.add_argument("--clients", default="16,64")
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--clients-in", default="process", help="comma-separated, where the HTTP clients run: process (a "
                   "process of their own, as a real load generator), thread (the server's process: they share its GIL)")
    p.add_argument("--switch-intervals", default="0", help="comma-separated sys.setswitchinterval values (s) for the "
                   "server's process at each level (0: Python's own, 5 ms): how long the engine thread may wait "
                   "for the GIL that the event loop holds")
    p.add_argument("--http-parser", default="auto", choices=("auto", "h11", "httptools"),
                   help="uvicorn's HTTP parser (auto: httptools where installed, as `hf-dlm serve`)")
    p.add_argument("--cache", default="dual", choices=("none", "prefix", "dual"), help="http part: the requests' "
                   "KV cache; the issue's setting is dual, the HTTP figures before 2026-12-07's eleventh session ran "
                   "without one")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--block-length", type=int, default=32)
    p.add_argument("--steps", type=int, default=32, help="sampler steps per request (4 tokens per step)")
    p.add_argument("--max-batch-size", type=int, default=128)
    p.add_argument("--level-seconds", type=float, default=45.0, help="stop sending at a level after this long")
    p.add_argument("--eval-docs", type=int, default=250)
    p.add_argument("--mc-num", type=int, default=16)
    p.add_argument("--eval-batch-size", type=int, default=64)
    p.add_argument("--profile-steps", type=int, default=0, help="core part: one more run of the largest batch and of "
                   "the arrivals under torch.profiler, this many steps after `--profile-skip` (0: none): device busy "
                   "time against wall time per step, and the kernels by time")
    p.add_argument("--profile-skip", type=int, default=100, help="engine steps before the profiled ones")
    p.add_argument("--stacks-every", type=float, default=0, help="print every thread's Python stack to stderr each "
                   "this many seconds (0: never): where a part that prints nothing for minutes is")
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
    elif args.shape == "cpu-small":
        shape = dict(vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    elif args.shape == "llada-8b":
        shape = dict(vocab_size=126464, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=32, head_dim=128)
    else:
        shape = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                     num_attention_heads=16, num_key_value_heads=8, head_dim=128)
    vocab = shape["vocab_size"]
    config = DLMConfig(**shape, max_position_embeddings=4096, tie_word_embeddings=args.shape != "llada-8b",
                       qk_norm=args.shape != "llada-8b",
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


async def run_level(url, clients, args, vocab, rng, stream=True):
    import httpx

    timings, stop_at = [], time.monotonic() + args.level_seconds

    async def client(k, http):
        for i in range(args.requests_per_client):
            if time.monotonic() > stop_at:
                return
            body = {"prompt": [rng.randrange(vocab - 3) for _ in range(args.prompt_tokens)], "stream": stream,
                    "max_tokens": args.max_tokens, "block_length": args.block_length, "steps": args.steps,
                    "temperature": 0, "cache": args.cache}
            start, first = time.monotonic(), None
            async with http.stream("POST", url + "/v1/completions", json=body) as response:
                assert response.status_code == 200, await response.aread()
                async for line in response.aiter_lines():
                    if first is None and (line.startswith("data: ") or not stream):
                        first = time.monotonic()
            end = time.monotonic()  # CLOCK_MONOTONIC: one clock for the server's process and this one
            timings.append((first - start, end - start, start, end, tuple(body["prompt"])))

    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        before = (await http.get(url + "/metrics")).text
        start = time.monotonic()
        await asyncio.gather(*(client(k, http) for k in range(clients)))
        wall = time.monotonic() - start
        after = (await http.get(url + "/metrics")).text
    return timings, wall, before, after


def _run_level_sync(url, clients, args, vocab, seed, stream):
    import random

    return asyncio.run(run_level(url, clients, args, vocab, random.Random(seed), stream))


def run_clients(where, url, clients, args, vocab, seed, stream=True):
    """One level of clients, in this process (their Python shares the server's GIL) or in a spawned one."""
    if where == "thread":
        return _run_level_sync(url, clients, args, vocab, seed, stream)
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_run_level_sync, (url, clients, args, vocab, seed, stream))


def engine_alone(engine, count, args, vocab, rng, clients=None):
    """Tokens/s of `count` requests like the HTTP clients' on an engine without the server, in the clients'
    pattern: `clients` requests at once, each client's next one submitted when its previous one is done (all at
    once without `clients`). The second of two runs (the first compiles and captures) -> tokens/s, engine steps
    and wall ms per step."""
    from hf_dlm.serving.engine import GenerationRequest

    clients = min(clients or count, count)
    params = engine.sampling_params(max_new_tokens=-(-args.max_tokens // args.block_length) * args.block_length,
                                    block_length=args.block_length, steps=args.steps, temperature=0.0,
                                    cache=args.cache)
    for _ in range(2):
        left = [count // clients + (k < count % clients) for k in range(clients)]  # requests per client
        done, finished = [], []

        def send(k):
            left[k] -= 1
            request = GenerationRequest([rng.randrange(vocab - 3) for _ in range(args.prompt_tokens)], params,
                                        on_done=lambda request, reason, error, k=k: done.append((k, request)))
            engine.submit([request])

        _sync()
        steps, busy = engine.stats["engine_steps"], engine.stats["step_seconds"]
        start = time.perf_counter()
        for k in range(clients):
            send(k)
        while engine.has_work():
            engine.step()
            while done:
                k, request = done.pop()
                finished.append(request)
                if left[k]:
                    send(k)
        _sync()
        wall = time.perf_counter() - start
    steps = engine.stats["engine_steps"] - steps
    return {"tokens_per_s": sum(len(r.generated) for r in finished) / wall, "steps": steps,
            "step_ms": 1000 * (engine.stats["step_seconds"] - busy) / max(steps, 1)}


def thread_cpu(*threads) -> tuple[float, ...]:
    """CPU seconds so far of each thread (Linux: its own clock, read from this thread), then of the process."""
    return (*(time.clock_gettime(time.pthread_getcpuclockid(t.ident)) for t in threads), time.process_time())


def metric(text, name):
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def request_phases(timings, served) -> dict:
    """Mean seconds of each phase of a request, the client's clock against the engine's request times: sent ->
    submitted (HTTP, parsing, validation), submitted -> admitted (queued), admitted -> answered (decoding), answered
    -> the client's last byte (the response's way back)."""
    by_prompt = {tuple(request.prompt_ids): request for request in served}
    phases = {"to_engine_s": [], "queued_s": [], "decoding_s": [], "to_client_s": []}
    for _, _, sent, received, prompt in timings:
        request = by_prompt.get(prompt)
        if request is None or request.admitted_at is None or request.finished_at is None:
            continue
        for name, (a, b) in zip(phases, ((sent, request.submitted_at), (request.submitted_at, request.admitted_at),
                                         (request.admitted_at, request.finished_at), (request.finished_at, received))):
            phases[name].append(b - a)
    return {name: round(statistics.mean(v), 4) if v else None for name, v in phases.items()}


def http_row(clients, stream, timings, wall, before, after, alone, alone_runs, args, vocab, rng,
             served=()) -> dict:
    """A level's figures from its timings and /metrics deltas, beside the engine alone on as many requests."""
    delta = {n: metric(after, n) - metric(before, n) for n in
             ("hf_dlm_generated_tokens_total", "hf_dlm_forward_passes_total", "hf_dlm_forward_rows_total",
              "hf_dlm_graph_captures_total", "hf_dlm_engine_steps_total", "hf_dlm_engine_step_seconds_total")}
    first = sorted(t[0] for t in timings)
    http_tps = delta["hf_dlm_generated_tokens_total"] / wall
    key = (clients, len(timings))  # the same requests' pattern: one run serves every level like it
    if key not in alone_runs:
        alone_runs[key] = engine_alone(alone, len(timings), args, vocab, rng, clients)
    alone_run = alone_runs[key]
    engine_tps, steps = alone_run["tokens_per_s"], delta["hf_dlm_engine_steps_total"]
    return {"clients": clients, "stream": stream, "cache": args.cache, "new_tokens": args.max_tokens,
            "steps_per_request": args.steps, "requests": len(timings), "wall_s": round(wall, 2),
            "requests_per_s": round(len(timings) / wall, 2), "output_tokens_per_s": round(http_tps, 1),
            "engine_alone_tokens_per_s": round(engine_tps, 1), "http_over_engine": round(http_tps / engine_tps, 3),
            "first_block_mean_s": round(statistics.mean(first), 3),
            "first_block_p50_s": round(first[len(first) // 2], 3),
            "first_block_p90_s": round(first[min(len(first) - 1, int(0.9 * len(first)))], 3),
            "latency_mean_s": round(statistics.mean(t[1] for t in timings), 3),
            "rows_per_forward": round(delta["hf_dlm_forward_rows_total"]
                                      / max(delta["hf_dlm_forward_passes_total"], 1), 1),
            "graph_captures": int(delta["hf_dlm_graph_captures_total"]),
            # where a gap to the engine alone lies: more steps (rows split over forwards), slower steps
            # (host work competing with the server's threads), or time between steps (busy share < 1)
            "engine_steps": int(steps), "engine_alone_steps": alone_run["steps"],
            "step_ms": round(1000 * delta["hf_dlm_engine_step_seconds_total"] / max(steps, 1), 2),
            "engine_alone_step_ms": round(alone_run["step_ms"], 2),
            "engine_busy_share": round(delta["hf_dlm_engine_step_seconds_total"] / wall, 3),
            **request_phases(timings, served)}


def serve_benchmark(model, tokenizer, args, report):
    import random

    from hf_dlm.serving.app import ServerSettings, create_app
    from hf_dlm.serving.engine import ContinuousBatchingEngine

    rng, vocab = random.Random(0), model.config.vocab_size
    alone, engine = (ContinuousBatchingEngine(model, max_batch_size=args.max_batch_size, max_waiting=4096,
                                              compile=compile_value(args), max_length=canvas_length(args))
                     for _ in range(2))
    for name, warm in (("engine alone", alone), ("server engine", engine)):  # as `hf-dlm serve` does before it listens
        log(f"http: {name} warm-up (compiles the step; Dynamo keeps its graph on the step function)")
        log(f"http: {name} warm-up done: {warm.warmup()}")
    settings = ServerSettings(model_name=f"{args.shape}-shape", max_prompt_tokens=4096, max_output_tokens=4096)
    served, submit = [], engine.submit  # the server's requests: their engine times beside the clients' own

    def recording_submit(requests):
        submit(requests)
        served.extend(requests)

    engine.submit = recording_submit
    app = create_app(engine, tokenizer, settings, log=print)
    server = ThreadedServer(app, args.http_parser)
    # the parser uvicorn loaded (with "auto": httptools where installed)
    parser = "httptools" if "HttpTools" in server.server.config.http_protocol_class.__name__ else "h11"
    try:
        log("http: warm-up, 2 requests (the server engine's first steps capture their CUDA graphs)")
        one = argparse.Namespace(**{**vars(args), "requests_per_client": 1})
        run_clients("thread", server.url, 2, one, vocab, 0)  # warm-up: kernels, allocator
        default_interval = sys.getswitchinterval()
        levels = [(int(c), where, float(si) or default_interval) for c in args.clients.split(",")
                  for where in args.clients_in.split(",") for si in args.switch_intervals.split(",")]

        cpu = {}

        def level(clients, where, interval, seed, stream=True):
            sys.setswitchinterval(interval)  # the server's process during the level only: the engine alone runs alone
            before = thread_cpu(server.thread, engine.thread)
            try:
                return run_clients(where, server.url, clients, args, vocab, seed, stream)
            finally:
                sys.setswitchinterval(default_interval)
                cpu.update(zip(("loop", "engine", "process"), (b - a for a, b in
                                                              zip(before, thread_cpu(server.thread, engine.thread)))))

        warmed, alone_runs = set(), {}
        for seed, (clients, where, interval) in enumerate(levels, start=1):
            if clients not in warmed:
                # an untimed level first: its arrival pattern's step shapes are captured as CUDA graphs at their
                # second sight, as in a server that has run a while (the timed levels report the captures left)
                log(f"http: {clients} clients, warm-up level")
                level(clients, where, interval, 1000 + seed)
                warmed.add(clients)
            for stream in (True, False):
                log(f"http: {clients} clients in a {where}, switch interval {interval * 1e3:g} ms, stream={stream}")
                served.clear()
                shapes_before = len(getattr(engine.graphs, "captured_shapes", ()))
                timings, wall, before, after = level(clients, where, interval, seed, stream)
                row = http_row(clients, stream, timings, wall, before, after, alone, alone_runs, args, vocab, rng,
                               served)
                # the step shapes captured inside the timed level (each stalls the engine while it records):
                # what the warm-up level did not meet
                row["captured_shapes"] = list(getattr(engine.graphs, "captured_shapes", ()))[shapes_before:]
                row.update(clients_in=where, switch_interval_ms=round(interval * 1e3, 3), http_parser=parser,
                           event_loop=type(app.state.server.loop).__module__.split(".")[0])
                # CPU seconds of the server's event loop per request, of the engine thread per step, and of the rest
                # of the server's process (worker threads, clients in a thread) per request
                row.update(loop_cpu_ms_per_request=round(1e3 * cpu["loop"] / max(len(timings), 1), 3),
                           engine_cpu_ms_per_step=round(1e3 * cpu["engine"] / max(row["engine_steps"], 1), 3),
                           other_cpu_ms_per_request=round(1e3 * (cpu["process"] - cpu["loop"] - cpu["engine"])
                                                          / max(len(timings), 1), 3))
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


class ThreadedServer:
    """uvicorn on a thread at 127.0.0.1 (a free port); `stop()` drains as SIGTERM does."""

    def __init__(self, app, http: str = "auto"):
        import socket
        import threading

        import uvicorn

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", http=http)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 120
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{port}"

    def stop(self, timeout: float = 60):
        self.server.should_exit = True
        self.thread.join(timeout)


START = time.monotonic()


def log(message: str):
    """A progress line with the seconds since start (a run cut off by its time limit still shows how far it got)."""
    print(f"[{time.monotonic() - START:7.1f} s] {message}", flush=True)


def print_stacks_every(seconds: float):
    """Every thread's Python stack to stderr each `seconds`, from a daemon thread holding the GIL
    (`faulthandler.dump_traceback_later` reads other threads' frames without it and crashed a compiling run)."""
    import sys
    import threading
    import traceback

    def dump():
        while True:
            time.sleep(seconds)
            names = {t.ident: t.name for t in threading.enumerate()}
            lines = [f"[{time.monotonic() - START:7.1f} s] stacks"]
            for ident, frame in sys._current_frames().items():
                if ident != threading.get_ident():
                    lines += [f"thread {names.get(ident, ident)}:", *traceback.format_stack(frame)[-12:]]
            print("".join(line if line.endswith("\n") else line + "\n" for line in lines), file=sys.stderr,
                  flush=True)

    threading.Thread(target=dump, name="stacks", daemon=True).start()


def canvas_length(args) -> int:
    """The engines' max_length: their slot storage, preallocated when the step is captured, holds these canvases."""
    return args.prompt_tokens + args.new_tokens


def compile_value(args):
    value = str(args.compile).lower()
    return {"true": True, "none": None, "false": None}.get(value, args.compile)


def _sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


ARRIVAL_RUNS = 3


def drive(engine, requests, every: int = 0, on_step=None) -> None:
    """Submits `requests` to `engine` all at once (`every` 0) or one per `every` engine steps, and steps it until
    idle (the core part's schedules; benchmarks/step_shapes.py replays them). `on_step()` after each step."""
    pending, step = list(requests), 0
    while pending or engine.has_work():
        if pending and (every == 0 or step % every == 0):
            take = len(pending) if every == 0 else 1
            engine.submit(pending[:take])
            pending = pending[take:]
        engine.step()
        step += 1
        if on_step is not None:
            on_step()
    failed = next((r for r in requests if r.error is not None), None)
    if failed is not None:  # the engine fails a request, not the server: a benchmark must not time failures
        raise RuntimeError(f"a benchmark request failed in the engine: {failed.error!r}") from failed.error


class StepClock:
    """Each engine step's time in a run, without a host sync of its own: a CUDA event recorded after each step (the
    time between two is the device's view: its work, or its wait for the host), the host's clock on CPU."""

    def __init__(self):
        import torch

        self.cuda, self.marks = torch.cuda.is_available(), []
        self()

    def __call__(self):
        import torch

        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def summary(self, block_steps: int) -> dict:
        """Mean ms of the steps that start a block (every `block_steps`-th: all rows at once, one token a step),
        of the others, and the slowest five steps (index, ms): where a run's time goes beyond its mid-block steps."""
        _sync()
        ms = [a.elapsed_time(b) if self.cuda else 1e3 * (b - a) for a, b in zip(self.marks, self.marks[1:])]
        starts = [t for i, t in enumerate(ms) if i % block_steps == 0]
        others = [t for i, t in enumerate(ms) if i % block_steps] or [0.0]
        slowest = sorted(enumerate(ms), key=lambda item: -item[1])[:5]
        return {"timed_steps": len(ms), "block_start_step_ms": round(sum(starts) / len(starts), 2),
                "other_step_ms": round(sum(others) / len(others), 2),
                "slowest_steps": [[i, round(t, 2)] for i, t in slowest]}


def option_list(value: str, flag: str, allowed) -> list[str]:
    """A comma-separated option's values, in order; an unknown one exits naming the flag and the choices."""
    values = value.split(",")
    unknown = sorted(set(values) - set(allowed))
    if unknown:
        raise SystemExit(f"{flag}: unknown {unknown} (choose from {', '.join(allowed)})")
    return values


def commit_forms(args) -> list[str]:
    return option_list(args.commit, "--commit", ("compiled", "eager", "compiled-exp"))


def exp_form_sampled_scores(logits, noise, mask_id, temperature, remasking):
    """`sampled_scores` as it was before the log-domain draw: LLaDA's argmax(exp(logit) / (-log u)^T)."""
    import torch

    from hf_dlm.generation.commit_rules import confidence_scores, without_mask

    x0 = (without_mask(logits, mask_id).to(torch.float64).exp() / (-torch.log(noise)) ** temperature).argmax(-1)
    return x0, confidence_scores(logits, x0, remasking)


@contextlib.contextmanager
def commit_form(form: str):
    """compiled: the core as it is; eager: a step's vocabulary-sized work eager whatever the forward (the core
    before 2026-12-07), for a same-machine comparison."""
    from hf_dlm.generation import commit_rules

    original = commit_rules.compiled_greedy_scores, commit_rules.compiled_sampled_scores
    if form == "eager":
        commit_rules.compiled_greedy_scores = lambda choice: commit_rules.greedy_scores
        commit_rules.compiled_sampled_scores = lambda choice: commit_rules.sampled_scores
    elif form == "compiled-exp":
        commit_rules.compiled_sampled_scores = lambda choice: commit_rules._compiled_scores(exp_form_sampled_scores,
                                                                                             choice)
    try:
        yield
    finally:
        commit_rules.compiled_greedy_scores, commit_rules.compiled_sampled_scores = original


def core_benchmark(model, args, report):
    """generate vs engine on equal requests (all at once), and the engine with requests arriving over time."""
    import torch

    from hf_dlm.modeling.modeling_dlm import sdpa_backend_context
    from hf_dlm.serving.engine import ContinuousBatchingEngine, GenerationRequest

    vocab, device = model.config.vocab_size, next(model.parameters()).device
    batches = [int(b) for b in args.batches.split(",")]
    compile_choice = compile_value(args)
    masks = option_list(args.engine_mask, "--engine-mask", ("bias", "bool"))
    sdpas = option_list(args.engine_sdpa, "--engine-sdpa", ("as-now", "model-priority"))
    splits = option_list(args.arrival_split, "--arrival-split", ("yes", "no"))
    pools = option_list(args.arrival_graph_pool, "--arrival-graph-pool", ("shared", "own"))
    variants = [(split, pool) for split in splits for pool in pools]
    commits = commit_forms(args)

    def new_engine(mask, split="yes"):  # an engine per variant: its plans and captured graphs hold the variant's
        made = ContinuousBatchingEngine(model, max_batch_size=max(batches + [args.arrivals]), max_waiting=4096,
                                        compile=compile_choice, max_length=canvas_length(args))
        if mask == "bool":
            made.mask_dtype = None  # RaggedStep's boolean form
        made.split_attention = split == "yes"
        return made

    engine = new_engine(masks[0], splits[0])  # kept: the arrivals and the profiles

    def record(row):
        report["core"].append(row)
        print(json.dumps(row), flush=True)
        dump(report, args)

    def free_memory():  # what a variant's engine held (its storage, its graphs)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def same_share(requests, tokens):
        """The share of the requests' generated tokens equal to `tokens` (per request, in order)."""
        same = sum(a == b for r, before in zip(requests, tokens) for a, b in zip(r.generated, before))
        return round(same / sum(map(len, tokens)), 4)

    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, vocab - 3, (max(batches + [args.arrivals]), args.prompt_tokens), generator=generator)
    rules = {"one": ("one token per step", dict(steps=args.new_tokens)),
             "threshold": ("threshold 0.9", dict(steps=args.new_tokens, threshold=0.9)),
             "sampled": ("threshold 0.9, temperature 0.9", dict(steps=args.new_tokens, threshold=0.9, temperature=0.9))}
    option_list(args.rules, "--rules", tuple(rules))

    def core_options(rule):
        return {**dict(max_new_tokens=args.new_tokens, block_length=args.block_length, cache="dual", temperature=0.0,
                       stop_on_eos=False), **rule}

    def make_requests(count, options):
        return [GenerationRequest(prompts[i].tolist(), engine.sampling_params(**options)) for i in range(count)]

    for label, rule in (rules[name] for name in args.rules.split(",")):
        options = core_options(rule)

        last_requests, step_times = [], {}

        def engine_run(count, every=0, engine=engine):
            requests = make_requests(count, options)
            last_requests[:] = requests
            before = {name: engine.stats[name] for name in ("engine_steps", "forward_passes", "graph_captures")}
            _sync()
            start = time.perf_counter()
            clock = StepClock()
            drive(engine, requests, every, on_step=clock)
            step_times["last"] = clock
            _sync()
            wall = time.perf_counter() - start
            return (sum(len(r.generated) for r in requests) / wall,
                    *(engine.stats[name] - before[name] for name in before))

        for batch, commit in ((b, c) for b in batches for c in commits):
            ids = prompts[:batch].to(device)
            with commit_form(commit):
                for attempt in range(2):  # the first run compiles and captures
                    log(f"{label}, batch {batch}, {commit} commit: generate run {attempt + 1} of 2")
                    _sync()
                    start = time.perf_counter()
                    out = model.generate(ids, compile=compile_choice, **options)
                    _sync()
                    generate_tps = batch * args.new_tokens / (time.perf_counter() - start)
            for mask, sdpa in ((m, a) for m in masks for a in sdpas):
                # the other forms' engines live for one batch: each holds its own preallocated storage and graphs
                first = mask == masks[0] and sdpa == sdpas[0]
                if sdpa != "as-now":  # the compiled step chose its attention kernel when traced: trace it again
                    torch._dynamo.reset()
                variant = engine if first else new_engine(mask)
                named = "" if len(masks) * len(sdpas) == 1 else f" ({mask} mask, SDPA {sdpa})"
                priority = (sdpa_backend_context(model.config.sdpa_backends, device) if sdpa == "model-priority"
                            else contextlib.nullcontext())
                with commit_form(commit), priority:
                    log(f"{label}, batch {batch}, {commit} commit: engine{named} warm-up")
                    engine_run(batch, engine=variant)
                    log(f"{label}, batch {batch}, {commit} commit: engine{named} timed run")
                    engine_tps, steps, forwards, captures = engine_run(batch, engine=variant)
                if sdpa != "as-now":  # the later runs trace under the default priority again
                    torch._dynamo.reset()
                same = sum(a == b for r, row_out in zip(last_requests, out[:, args.prompt_tokens:].tolist())
                           for a, b in zip(r.generated, row_out)) / (batch * args.new_tokens)
                row = {"setting": label, "engine_mask": mask, "engine_sdpa": sdpa, "commit": commit, "batch": batch,
                       "arrival": "all at once",
                       "generate_tok_s": round(generate_tps, 1), "engine_tok_s": round(engine_tps, 1),
                       "ratio": round(engine_tps / generate_tps, 3), "engine_steps": steps, "forwards": forwards,
                       "captures_in_timed_run": captures, "tokens_equal_to_generate": round(same, 4),
                       # where the run's time goes: its block starts against its other steps
                       **step_times["last"].summary(max(1, options["steps"] * args.block_length // args.new_tokens))}
                record(row)
                if variant is not engine:
                    del variant
                    free_memory()
        if not args.arrivals:
            continue
        all_at_once = next((r["engine_tok_s"] for r in report["core"] if r["setting"] == label
                            and r["engine_mask"] == masks[0] and r.get("commit") == commits[0]
                            and r.get("engine_sdpa") == sdpas[0] and r["batch"] == args.arrivals), None)
        # A shape is captured the second time it is seen, and this schedule has shapes that occur once per run:
        # runs repeat until one captures nothing (a server in its steady state), at most `ARRIVAL_RUNS`; each
        # run's figures are kept (the first run after the warm-up is what a server's second such burst sees).
        first_tokens = {}  # split -> the tokens of its first variant's last run
        for number, (split, pool) in enumerate(variants):
            if number:  # the kept engine's graphs go (it recaptures for the profiles)
                engine.graphs = engine.graphs_storage = None
                free_memory()
            variant = engine if not number else new_engine(masks[0], split)
            named = "" if len(variants) == 1 else f" (split {split}, graph pool {pool})"
            # own: each captured graph its own memory pool (the engine's form before 2026-12-07)
            handle = torch.cuda.graph_pool_handle
            if pool == "own":
                torch.cuda.graph_pool_handle = lambda: None
            try:
                log(f"{label}, arrivals{named}: engine warm-up")
                engine_run(args.arrivals, args.arrival_every, engine=variant)
                runs, previous = [], [list(r.generated) for r in last_requests]
                while len(runs) < ARRIVAL_RUNS and (not runs or runs[-1]["captures"]):
                    log(f"{label}, arrivals{named}: engine run {len(runs) + 1}")
                    tps, steps, forwards, captures = engine_run(args.arrivals, args.arrival_every, engine=variant)
                    # the same requests as the run before (captured graphs replayed instead of plain steps): a replay
                    # reading memory another graph overwrote would change them
                    runs.append({"engine_tok_s": round(tps, 1), "captures": captures,
                                 "tokens_equal_to_previous_run": same_share(last_requests, previous)})
                    previous = [list(r.generated) for r in last_requests]
            finally:
                torch.cuda.graph_pool_handle = handle
            first_tokens.setdefault(split, previous)
            row = {"setting": label, "engine_mask": masks[0], "split_attention": split, "graph_pool": pool,
                   "batch": args.arrivals, "arrival": f"one per {args.arrival_every} steps",
                   "engine_tok_s": round(tps, 1), "engine_steps": steps, "forwards": forwards,
                   "captures_in_timed_run": captures, "runs": runs,
                   "ratio_to_all_at_once": None if all_at_once is None else round(tps / all_at_once, 3),
                   # the last runs replay graphs only: the variants of one split decode the same tokens
                   "tokens_equal_to_first_variant": same_share(last_requests, first_tokens[split]),
                   "cuda_reserved_gib": round(torch.cuda.memory_reserved() / 2**30, 1) if torch.cuda.is_available()
                   else None}
            record(row)
            if variant is not engine:
                del variant
                free_memory()
    if args.profile_steps:
        label, rule = rules[args.rules.split(",")[-1]]
        options = core_options(rule)
        schedules = [(f"batch {max(batches)}, all at once", max(batches), 0)]
        if args.arrivals:
            schedules.append((f"{args.arrivals} arriving one per {args.arrival_every} steps", args.arrivals,
                              args.arrival_every))
        for name, count, every in schedules:
            log(f"profile: {label}, {name}")
            report["profile"].append({"setting": label, "schedule": name, **profile_run(
                engine, lambda count=count: make_requests(count, options), every, args, f"{label}, {name}")})
            print(json.dumps(report["profile"][-1]), flush=True)
            dump(report, args)


def profile_run(engine, make_requests, every, args, title) -> dict:
    """`drive` under torch.profiler, recording `--profile-steps` steps after `--profile-skip` (+ 2 warm-up; the
    window moves earlier when the run is shorter): wall time per step against the kernels' time per step (a step
    whose host work leaves the device idle shows a gap), and a table of the operators and kernels by time
    (`profile_*.txt` in --out)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    os.makedirs(args.out, exist_ok=True)
    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])

    def timed(prof=None) -> list[float]:
        """The time after each step (and before the first)."""
        times = []

        def on_step():
            _sync()
            times.append(time.perf_counter())
            if prof is not None:
                prof.step()

        _sync()
        times.append(time.perf_counter())
        drive(engine, make_requests(), every, on_step)
        return times

    plain = timed()  # the run without the profiler: its length places the window
    steps = len(plain) - 1
    if steps < args.profile_steps + 2:
        raise SystemExit(f"--profile-steps {args.profile_steps}: the run '{title}' has only {steps} steps")
    skip = min(args.profile_skip, steps - args.profile_steps - 2)
    first, last = skip + 2, skip + 2 + args.profile_steps
    with profile(activities=activities, schedule=schedule(wait=skip, warmup=2, active=args.profile_steps,
                                                          repeat=1)) as prof:
        profiled = timed(prof)
    plain, wall = ((t[last] - t[first]) / args.profile_steps for t in (plain, profiled))
    events = prof.key_averages()
    sort = "self_device_time_total" if cuda else "self_cpu_time_total"
    name = "profile_" + "".join(c if c.isalnum() else "_" for c in title) + ".txt"
    with open(os.path.join(args.out, name), "w") as f:
        f.write(f"{title}: steps {first}-{last - 1}\n{events.table(sort_by=sort, row_limit=40)}\n")
    # the schedule's ProfilerStep* ranges carry their steps' device time as their own: counted once, in the kernels
    busy = sum(e.self_device_time_total for e in events if not e.key.startswith("ProfilerStep")) / 1e6 \
        / args.profile_steps if cuda else None
    return {"steps": [first, last - 1], "wall_ms_per_step": round(plain * 1e3, 3),
            "profiled_wall_ms_per_step": round(wall * 1e3, 3),
            "device_busy_ms_per_step": None if busy is None else round(busy * 1e3, 3),
            "device_busy_share": None if busy is None else round(busy / plain, 3), "table": name}


# --float8-inductor value -> (torch._inductor.config patch, the compile choice in place of --compile's or None,
# decoder layers a compiled graph: compiled_step.LAYERS_PER_GRAPH)
INDUCTOR_VARIANTS = {"default": ({}, None, 1), "max-autotune": ({}, "max-autotune-no-cudagraphs", 1),
                     "combo-kernels": ({"combo_kernels": True}, None, 1),
                     "coordinate-descent": ({"coordinate_descent_tuning": True}, None, 1),
                     # Hopper's programmatic dependent launch: a Triton kernel starts while the one before it ends
                     "pdl": ({"triton.enable_pdl": True}, None, 1),
                     # a layer's closing residual add fused into the next one's norm, within a graph
                     "layers-4": ({}, None, 4)}


def float8_benchmark(model, args, report):
    """Batch-1 decoding with bf16 and float8 weights, projections separate and fused (`--fuse-projections`):
    tokens/s and the share of tokens equal to bf16's; with `--profile-steps`, one more generate of each under
    torch.profiler (device busy time per token, kernel table). On a CPU only the bf16 runs are made."""
    import copy

    import torch

    from hf_dlm.generation import compiled_step
    from hf_dlm.generation.float8 import quantize_float8_for_decoding

    cuda = torch.cuda.is_available()
    ids = torch.randint(0, model.config.vocab_size - 3, (1, args.prompt_tokens),
                        generator=torch.Generator().manual_seed(1)).to(next(model.parameters()).device)
    options = dict(max_new_tokens=args.new_tokens, block_length=args.block_length, steps=args.new_tokens,
                   cache="dual", temperature=0.0, stop_on_eos=False, compile=compile_value(args))
    rows, report["float8"] = {}, {"batch": 1}
    # name -> (granularity, the LM head in float8 too, activation scheme)
    granularity = {"float8": ("row", False, "dynamic"), "float8-tensor": ("tensor", False, "dynamic"),
                   "float8-tensor-head": ("tensor", True, "dynamic"), "float8-static": ("tensor", False, "static"),
                   "float8-static-head": ("tensor", True, "static")}
    calibration_ids = torch.randint(0, model.config.vocab_size - 3, ids.shape,  # not the timed prompt
                                    generator=torch.Generator().manual_seed(2)).to(ids.device)

    def calibrate(target):  # a static scheme's calibration: one eager generate of another prompt, the timed options
        target.generate(calibration_ids, **{**options, "compile": None})

    names = option_list(args.float8_weights, "--float8-weights", ("bf16", *granularity))
    fusings = option_list(args.fuse_projections, "--fuse-projections", ("no", "yes"))
    commits = commit_forms(args)
    inductors = option_list(args.float8_inductor, "--float8-inductor", tuple(INDUCTOR_VARIANTS))
    for fused, name in ((f, n) for f in fusings for n in names):
        base = name + ("_fused" if fused == "yes" else "")
        if name != "bf16" and not cuda:
            print(f"float8: {base} skipped (needs a CUDA GPU with float8 tensor cores)")
            continue
        target = model if name == "bf16" and fused == "no" else copy.deepcopy(model)
        if fused == "yes":
            target.fuse_projections()
        if name != "bf16":
            scales, head, scheme = granularity[name]
            log(f"float8: quantizing a copy of the model ({scales} scales, {scheme} activation scales"
                f"{', LM head too' if head else ''})")
            quantize_float8_for_decoding(target, scales, lm_head=head, activation_scheme=scheme,
                                         calibrate=calibrate if scheme == "static" else None)
        for (inductor, commit) in ((i, c) for i in inductors for c in commits):
            # one model, its compiled forward shared by the commit forms; recompiled for each Inductor setting
            commit_part = "" if commit == "compiled" else f"_{commit}_commit".replace("-", "_")
            default_key = base + commit_part  # the same model and commit under the default setting
            key = base + ("" if inductor == "default" else f"_{inductor}".replace("-", "_")) + commit_part
            if inductor != inductors[0] and commit == commits[0]:
                torch._dynamo.reset()
            patch, choice, layers = INDUCTOR_VARIANTS[inductor]
            missing = [setting for setting in patch if setting not in torch._inductor.config._config]
            if missing:  # an older torch: said in the report, the other settings still run
                report["float8"][f"{key}_tok_s"] = f"not in this torch's Inductor config: {missing}"
                print(f"float8: {key} skipped ({missing} not in this torch's Inductor config)", flush=True)
                continue
            run_options = options if choice is None or options["compile"] is None else {**options, "compile": choice}
            compiled_step.LAYERS_PER_GRAPH = layers
            try:
                with commit_form(commit), torch._inductor.config.patch(patch):
                    for attempt in range(2):  # the first run compiles and captures
                        log(f"float8: {key} generate run {attempt + 1} of 2")
                        _sync()
                        start = time.perf_counter()
                        out = target.generate(ids, **run_options)
                        _sync()
                        wall = time.perf_counter() - start
                    rows[key] = out[0, args.prompt_tokens:]
                    report["float8"][f"{key}_tok_s"] = round(args.new_tokens / wall, 1)
                    if args.profile_steps:
                        report["float8"][f"{key}_profile"] = profile_generate(target, ids, run_options, args,
                                                                              f"float8 {key}")
            except Exception as error:  # noqa: BLE001 (another setting failing is a finding; the default's is a bug)
                if inductor == "default":
                    raise
                report["float8"][f"{key}_tok_s"] = f"failed: {type(error).__name__}: {str(error)[:300]}"
                torch._dynamo.reset()
            if key != default_key and key in rows and default_key in rows:  # the same model, another setting
                report["float8"][f"{key}_tokens_equal_to_default"] = round(
                    float((rows[key] == rows[default_key]).float().mean()), 3)
            print(json.dumps({key: report["float8"][f"{key}_tok_s"]}), flush=True)
            dump(report, args)  # each figure as soon as it exists
        del target
    compiled_step.LAYERS_PER_GRAPH = 1  # the later parts as the library runs them
    for key in sorted(rows):  # against bf16 with the same projections (fused bf16: against separate), compiled commit
        reference = "bf16_fused" if "_fused" in key and key != "bf16_fused" and "bf16_fused" in rows else "bf16"
        if reference in rows and reference != key:
            report["float8"][f"{key}_tokens_equal_to_bf16"] = round(float((rows[key] == rows[reference]).float().mean()),
                                                                    3)
    print(json.dumps(report["float8"]), flush=True)
    dump(report, args)


def profile_generate(model, ids, options, args, title) -> dict:
    """One `generate` under torch.profiler: wall and device busy time per new token, and the kernels by time
    (`profile_*.txt` in --out)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        _sync()
        start = time.perf_counter()
        model.generate(ids, **options)
        _sync()
        wall = time.perf_counter() - start
    events = prof.key_averages()
    name = "profile_" + "".join(c if c.isalnum() else "_" for c in title) + ".txt"
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, name), "w") as f:
        f.write(f"{title}: one generate, {args.new_tokens} new tokens\n"
                f"{events.table(sort_by='self_device_time_total' if cuda else 'self_cpu_time_total', row_limit=40)}\n")
        if cuda:  # the host's side: whether it keeps ahead of the device (launches, syncs, Python between them)
            f.write(f"\nby host time:\n{events.table(sort_by='self_cpu_time_total', row_limit=25)}\n")
    busy = sum(e.self_device_time_total for e in events) / 1e3 / args.new_tokens if cuda else None
    # kernels (and device copies / memsets) per token: inside a CUDA graph each still costs a launch gap
    kernels = sum(e.count for e in events if str(getattr(e, "device_type", "")).endswith("CUDA")) if cuda else None
    return {"profiled_wall_ms_per_token": round(wall * 1e3 / args.new_tokens, 3),
            "device_busy_ms_per_token": None if busy is None else round(busy, 3),
            "device_ops_per_token": None if kernels is None else round(kernels / args.new_tokens, 1), "table": name}


def dump(report, args):
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "serving_throughput.json"), "w") as f:
        json.dump(report, f, indent=2)


def main():
    args = parse_args()
    if args.stacks_every > 0:
        print_stacks_every(args.stacks_every)
    if args.tiny:
        args.clients, args.max_tokens, args.block_length, args.steps = "1,4", 8, 4, 4
        args.clients_in, args.switch_intervals = "process,thread", "0.001"
        args.fuse_projections, args.profile_steps, args.profile_skip = "no,yes", 2, 1
        args.engine_mask, args.arrival_split, args.arrival_graph_pool = "bias,bool", "yes,no", "shared,own"
        args.commit, args.engine_sdpa = "compiled,eager", "as-now,model-priority"
        args.float8_inductor = "default,pdl,layers-4"
        args.prompt_tokens, args.eval_docs, args.mc_num, args.eval_batch_size = 8, 10, 2, 8
        args.batches, args.new_tokens, args.arrivals, args.arrival_every = "2,4", 16, 4, 2
    if args.compile is None:
        args.compile = "none" if args.tiny else "true"
    option_list(args.parts, "--parts", ("core", "float8", "http", "eval"))
    import torch

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    from hf_dlm.generation import compiled_step

    if args.capture_warmups is not None:
        compiled_step.CAPTURE_WARMUPS = args.capture_warmups
    args.capture_warmups = compiled_step.CAPTURE_WARMUPS  # the report names what ran
    model, tokenizer, device = build(args)
    report = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "args": vars(args),
              "core": [], "profile": [], "float8": None, "serve": [], "eval": None}
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}e9 parameters on {report['device']}")
    runners = {"core": core_benchmark, "float8": float8_benchmark,
               "http": lambda model, args, report: serve_benchmark(model, tokenizer, args, report),
               "eval": lambda model, args, report: eval_benchmark(model, tokenizer, args, report)}
    for part in args.parts.split(","):  # in the order given: a run cut off by its time limit has the first ones
        log(f"part {part}")
        with torch.inference_mode():
            runners[part](model, args, report)
        dump(report, args)
    if report["core"]:
        print("| setting | engine mask / commit | batch | arrival | generate tok/s | engine tok/s | engine / generate | steps "
              "| forwards | graph captures in the run | vs all at once | tokens = generate |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in report["core"]:
            arrival = r["arrival"] + (f" (split {r['split_attention']})" if "split_attention" in r else "")
            print(f"| {r['setting']} | {r['engine_mask']} / {r.get('commit', 'compiled')} | {r['batch']} | {arrival} | {r.get('generate_tok_s', '-')} | "
                  f"{r['engine_tok_s']} | {r.get('ratio', '-')} | {r['engine_steps']} | {r['forwards']} | "
                  f"{r['captures_in_timed_run']} | {r.get('ratio_to_all_at_once', '-')} | "
                  f"{r.get('tokens_equal_to_generate', '-')} |")
    if report["serve"]:
        print("| clients | in | switch ms | stream | requests | requests/s | output tokens/s | engine alone tokens/s | HTTP / engine "
              "| first block mean / p50 / p90 (s) | latency (s) | rows/forward | graph captures | steps HTTP / alone "
              "| ms per step HTTP / alone | engine busy share | sent -> engine / queued / decoding / back (s) "
              "| CPU ms: loop / request, engine / step, rest / request |")
        print("|---" * 18 + "|")
        for r in report["serve"]:
            print(f"| {r['clients']} | {r['clients_in']} | {r['switch_interval_ms']} | {r['stream']} | {r['requests']} | {r['requests_per_s']} | "
                  f"{r['output_tokens_per_s']:,} | {r['engine_alone_tokens_per_s']:,} | {r['http_over_engine']} | "
                  f"{r['first_block_mean_s']} / {r['first_block_p50_s']} / {r['first_block_p90_s']} | "
                  f"{r['latency_mean_s']} | {r['rows_per_forward']} | {r['graph_captures']} | "
                  f"{r['engine_steps']} / {r['engine_alone_steps']} | {r['step_ms']} / {r['engine_alone_step_ms']} | "
                  f"{r['engine_busy_share']} | {r['to_engine_s']} / {r['queued_s']} / {r['decoding_s']} / "
                  f"{r['to_client_s']} | {r['loop_cpu_ms_per_request']} / {r['engine_cpu_ms_per_step']} / "
                  f"{r['other_cpu_ms_per_request']} |")
    if report["eval"]:
        print(json.dumps(report["eval"]))


if __name__ == "__main__":
    main()
