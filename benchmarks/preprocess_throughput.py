"""Preprocess throughput on CPU: `hf-dlm preprocess` against `datasets` (load_dataset("json") + batched
`map` with the same tokenizer), on the stdlib corpus written out as JSONL.

    python benchmarks/preprocess_throughput.py --copies 8 --vocab-size 8192
    python benchmarks/preprocess_throughput.py --tiny   # seconds: 40 files' documents, one round, 1 worker

Both sides start from the same JSONL file and end with token ids on disk (hf-dlm: .bin/.idx; datasets:
its Arrow cache, in a fresh cache directory so nothing is reused). Setups run in interleaved rounds;
the best and median wall times and the median CPU time of each are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import atexit
import shutil
import tempfile
import time


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copies", type=int, default=8, help="how many times the stdlib corpus is repeated")
    parser.add_argument("--vocab-size", type=int, default=8192, help="BPE vocabulary trained on the corpus")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="hf-dlm worker counts to time")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved repetitions; the best time is kept")
    parser.add_argument("--num-proc", type=int, nargs="+", default=[1, 2], help="datasets.map num_proc values")
    parser.add_argument("--tiny", action="store_true", help="smoke run in seconds (a small corpus, one round)")
    args = parser.parse_args()
    if args.tiny:
        args.copies, args.vocab_size, args.workers, args.rounds, args.num_proc = 1, 300, [1], 1, [1]

    from hf_dlm.data.corpus import stdlib_documents, train_bpe_tokenizer
    from hf_dlm.data.preprocess import PreprocessConfig, preprocess

    work = tempfile.mkdtemp(prefix="hf_dlm_bench_")
    atexit.register(shutil.rmtree, work, ignore_errors=True)
    docs = stdlib_documents(max_files=40 if args.tiny else None)
    tokenizer = train_bpe_tokenizer(docs, vocab_size=args.vocab_size)
    tokenizer.save_pretrained(os.path.join(work, "tok"))
    corpus = os.path.join(work, "corpus.jsonl")
    with open(corpus, "w") as f:
        for _ in range(args.copies):
            for doc in docs:
                f.write(json.dumps({"text": doc}) + "\n")
    size_mb = os.path.getsize(corpus) / 2**20
    print(f"corpus: {len(docs) * args.copies:,} documents, {size_mb:.1f} MiB JSONL; "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs")
    import datasets
    from transformers import AutoTokenizer

    datasets.disable_progress_bars()
    hf_tokenizer = AutoTokenizer.from_pretrained(os.path.join(work, "tok"))
    eos = hf_tokenizer.eos_token_id

    def tokenize(batch):
        ids = hf_tokenizer(batch["text"], add_special_tokens=False)["input_ids"]
        return {"input_ids": [row + [eos] for row in ids]}

    def run_hf_dlm(workers):
        start = time.perf_counter()
        report = preprocess(PreprocessConfig(inputs=[corpus], output_prefix=os.path.join(work, f"out{workers}"),
                                             tokenizer=os.path.join(work, "tok"), workers=workers, append_eod=True,
                                             overwrite=True, progress=False))
        return report.tokens, time.perf_counter() - start  # includes tokenizer loading and pool start-up

    def run_datasets(num_proc):
        start = time.perf_counter()
        data = datasets.load_dataset("json", data_files=corpus, split="train", cache_dir=tempfile.mkdtemp(dir=work))
        data = data.map(tokenize, batched=True, remove_columns=["text"], num_proc=None if num_proc == 1 else num_proc)
        seconds = time.perf_counter() - start
        return sum(len(row) for batch in data.iter(batch_size=4096) for row in batch["input_ids"]), seconds

    setups = [(f"hf-dlm preprocess --workers {w}", run_hf_dlm, w) for w in args.workers]
    setups += [(f"datasets load_dataset(json) + map(batched, num_proc={n})", run_datasets, n) for n in args.num_proc]
    def cpu_seconds():  # this process's threads plus reaped worker processes
        own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime

    walls, cpus, token_counts = {}, {}, {}
    for _ in range(args.rounds):  # interleaved rounds: the machine is shared and noisy
        for name, fn, option in setups:
            cpu = cpu_seconds()
            token_counts[name], seconds = fn(option)
            walls.setdefault(name, []).append(seconds)
            cpus.setdefault(name, []).append(cpu_seconds() - cpu)
    assert len(set(token_counts.values())) == 1, f"the setups disagree on the token count: {token_counts}"
    print("\n| setup | tokens | best wall s | tokens/s (best) | tokens/s (median) | CPU s (median) |")
    print("|---|---|---|---|---|---|")
    for name, _, _ in setups:
        tokens, best, median = token_counts[name], min(walls[name]), statistics.median(walls[name])
        print(f"| {name} | {tokens:,} | {best:.2f} | {tokens / best:,.0f} | {tokens / median:,.0f} | "
              f"{statistics.median(cpus[name]):.1f} |")


if __name__ == "__main__":
    main()
