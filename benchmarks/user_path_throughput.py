"""Training throughput on the path a user runs: `hf-dlm preprocess` -> `hf-dlm train` on indexed data.

The synthetic benchmark (`train_throughput.py`) times random unpacked windows. Here the data is real
text (Python's own documentation, `hf_dlm.data.corpus`), tokenized by `hf-dlm preprocess` into Megatron
indexed files, and trained by `hf-dlm train` from a YAML config (the Qwen3-1.7B shape of
`examples/configs/qwen3_1.7b_shape.yaml`, with `data.kind: indexed`): packed 4,096-token windows whose
`position_ids` restart at every document, so attention stays inside documents. Tokens/s are the
trainer's own `tokens_per_second` log entries (one per `logging_steps` window; the first holds the
compilation and is left out).

    python benchmarks/user_path_throughput.py --out results/          # one H200, ~2 minutes
    python benchmarks/user_path_throughput.py --tiny                     # CPU smoke run of the same path

`--set SECTION.KEY=VALUE` is passed on to `hf-dlm train` (e.g. `--set training.low_precision_residual=true`).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny model, few steps")
    p.add_argument("--steps", type=int, default=20, help="training steps")
    p.add_argument("--logging-steps", type=int, default=5, help="steps per tokens/s window")
    p.add_argument("--tokens", type=int, default=2_000_000, help="at least this many tokens of text to preprocess")
    p.add_argument("--vocab", type=int, default=8192, help="BPE vocabulary trained on the text")
    p.add_argument("--set", dest="overrides", action="append", default=[], help="passed on to hf-dlm train")
    p.add_argument("--out", default=None, help="folder for user_path_throughput.json")
    return p.parse_args(argv)


def write_config(path, work, a, tokenizer):
    """The 1.7B example config with indexed data (or a tiny CPU model); the mask id is the one of the
    tokenizer the data brings (the YAML's Qwen id 151669 is not in this BPE vocabulary)."""
    import yaml

    with open(os.path.join(ROOT, "examples", "configs", "qwen3_1.7b_shape.yaml")) as f:
        config = yaml.safe_load(f)
    seq = 64 if a.tiny else config["data"]["seq_len"]
    config["model"]["config"]["mask_token_id"] = tokenizer.mask_token_id
    config["data"] = {"kind": "indexed", "prefixes": [os.path.join(work, "docs")],
                      "tokenizer": os.path.join(work, "tokenizer"), "seq_len": seq}
    config["training"].update(output_dir=os.path.join(work, "run"), max_steps=a.steps, logging_steps=a.logging_steps,
                              save_steps=10**6, warmup_steps=min(10, a.steps // 2), disable_tqdm=True)
    if a.tiny:
        config["model"]["config"].update(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=16, max_position_embeddings=seq)
        config["training"].update(use_cpu=True, bf16=False, optim="adamw_torch", per_device_train_batch_size=2,
                                  compile_blocks=False, dataloader_num_workers=0)
    with open(path, "w") as f:
        yaml.safe_dump(config, f, sort_keys=False)
    return config


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.tiny:  # seconds: 6 steps in windows of 2 (the first window, with start-up, is left out)
        a.steps, a.logging_steps = min(a.steps, 6), min(a.logging_steps, 2)
    sys.path.insert(0, ROOT)
    from hf_dlm.data.corpus import stdlib_documents, train_bpe_tokenizer

    work = tempfile.mkdtemp(prefix="hf_dlm_user_path_")
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    docs = stdlib_documents(max_files=40 if a.tiny else None)
    tokenizer = train_bpe_tokenizer(docs[:2000], vocab_size=256 + 128 if a.tiny else a.vocab)
    tokenizer.save_pretrained(os.path.join(work, "tokenizer"))
    lengths = [len(ids) + 1 for ids in tokenizer(docs[:500])["input_ids"]]
    need = (20_000 if a.tiny else a.tokens) // max(1, sum(lengths) // len(lengths))
    with open(os.path.join(work, "docs.jsonl"), "w") as f:
        for i in range(max(need, len(docs))):
            f.write(json.dumps({"text": docs[i % len(docs)]}) + "\n")

    cli = [sys.executable, "-m", "hf_dlm.cli"]
    t0 = time.perf_counter()
    subprocess.run(cli + ["preprocess", "--input", os.path.join(work, "docs.jsonl"), "--output-prefix",
                          os.path.join(work, "docs"), "--tokenizer", os.path.join(work, "tokenizer"), "--append-eod",
                          "--no-progress"], check=True, env=env)
    preprocess_s = time.perf_counter() - t0
    config = write_config(os.path.join(work, "train.yaml"), work, a, tokenizer)
    sets = [x for o in a.overrides for x in ("--set", o)]
    t0 = time.perf_counter()
    proc = subprocess.run(cli + ["train", os.path.join(work, "train.yaml"), *sets], env=env, capture_output=True, text=True)
    train_s = time.perf_counter() - t0
    windows = []
    for line in proc.stdout.splitlines():  # the trainer's log dicts, one per logging window
        line = line.strip()
        if line.startswith("{") and "tokens_per_second" in line:
            try:
                windows.append(ast.literal_eval(line))
            except (ValueError, SyntaxError):
                pass
    rates = [float(w["tokens_per_second"]) for w in windows]
    steady = rates[1:] or rates
    result = dict(
        command="hf-dlm preprocess -> hf-dlm train (data.kind indexed)", returncode=proc.returncode,
        documents_written=max(need, len(docs)), mean_document_tokens=sum(lengths) / len(lengths),
        median_document_tokens=statistics.median(lengths), preprocess_s=preprocess_s, train_wall_s=train_s,
        micro_batch=config["training"]["per_device_train_batch_size"], seq_len=config["data"]["seq_len"],
        window_tokens_per_second=rates, tokens_per_second=statistics.median(steady) if steady else None,
        mfu=[float(w.get("mfu", 0)) for w in windows], losses=[float(w["loss"]) for w in windows], overrides=a.overrides,
    )
    if proc.returncode or not rates:
        result["stderr_tail"] = proc.stderr[-3000:]
        result["stdout_tail"] = proc.stdout[-2000:]
    print(json.dumps(result))
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "user_path_throughput.json"), "a") as f:
            f.write(json.dumps(result) + "\n")
    return 0 if rates else 1


if __name__ == "__main__":
    sys.exit(main())
