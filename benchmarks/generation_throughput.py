"""Sampler throughput on a DLM trained here with hf-dlm: the reference loop against threshold decoding and
the Fast-dLLM caches.

1. Trains a small bidirectional DLM (hf-dlm model + MaskedDiffusionObjective, bf16 autocast) on the
   stdlib corpus for `--train-seconds` (random weights make confidence meaningless).
2. Held-out prompts (document openings of mixed lengths) -> completions of `--gen-length` tokens in
   blocks of `--block-length`, for each mode: the reference loop (one token per step, steps = gen
   length), threshold decoding, threshold + prefix cache, threshold + dual cache; batch sizes 1, 4, 16
   (left-padded mixed lengths).
3. Prints and writes (`--out`) tokens/s, forward passes per generated token and the % of generated
   tokens equal to the reference loop's on the same prompts.

    python benchmarks/generation_throughput.py --out results.json
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
from tqdm.auto import tqdm

from hf_dlm.modeling import DLMConfig, DLMForDiffusionLM
from hf_dlm.training.corpus import split_documents, stdlib_documents, train_bpe_tokenizer
from hf_dlm.training.objective import MaskedDiffusionObjective
from hf_dlm.training.quickstart import pack_windows

MODES = {  # name -> generate kwargs on top of the shared ones
    "reference (1 token/step)": dict(threshold=None, cache="none"),
    "threshold": dict(cache="none"),
    "threshold + prefix cache": dict(cache="prefix"),
    "threshold + dual cache": dict(cache="dual"),
    "threshold 0.7 + dual cache": dict(cache="dual", threshold=0.7),
}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train-seconds", type=float, default=150.0, help="training time budget")
    p.add_argument("--hidden-size", type=int, default=512, help="model width")
    p.add_argument("--num-layers", type=int, default=8, help="decoder layers")
    p.add_argument("--num-heads", type=int, default=8, help="attention heads")
    p.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary")
    p.add_argument("--seq-len", type=int, default=384, help="training window length")
    p.add_argument("--batch-size", type=int, default=64, help="training micro-batch")
    p.add_argument("--learning-rate", type=float, default=2e-3, help="peak AdamW learning rate")
    p.add_argument("--gen-length", type=int, default=256, help="generated tokens per prompt")
    p.add_argument("--block-length", type=int, default=32, help="sampler block length")
    p.add_argument("--threshold", type=float, default=0.9, help="confidence threshold of the fast modes")
    p.add_argument("--num-prompts", type=int, default=16, help="held-out prompts (the largest batch)")
    p.add_argument("--batch-sizes", type=str, default="1,4,16", help="comma-separated generation batch sizes")
    p.add_argument("--max-files", type=int, default=None, help="limit the stdlib files read (smoke tests)")
    p.add_argument("--device", type=str, default="cuda" if torch.cuda.is_available() else "cpu", help="device")
    p.add_argument("--out", type=str, default=None, help="write the results as JSON here")
    return p.parse_args()


def train(args, device):
    train_docs, heldout_docs = split_documents(stdlib_documents(max_files=args.max_files))
    tokenizer = train_bpe_tokenizer(train_docs, args.vocab_size)
    windows = pack_windows(tokenizer, train_docs, args.seq_len)
    config = DLMConfig(vocab_size=len(tokenizer), hidden_size=args.hidden_size, intermediate_size=3 * args.hidden_size,
                       num_hidden_layers=args.num_layers, num_attention_heads=args.num_heads, qk_norm=True,
                       max_position_embeddings=2048, tie_word_embeddings=True, mask_token_id=tokenizer.mask_token_id,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    config._attn_implementation = "sdpa"
    model = DLMForDiffusionLM(config).to(device)
    print(f"model {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters; "
          f"{windows.numel() / 1e6:.1f}M training tokens")
    objective = MaskedDiffusionObjective.from_model_config(config, preset="mdlm", seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, betas=(0.9, 0.95), weight_decay=0.1,
                                  fused=device.type == "cuda")
    order = torch.randperm(windows.shape[0], generator=torch.Generator().manual_seed(0))
    windows = windows.to(device)
    model.train()
    start, step, losses = time.perf_counter(), 0, []
    bar = tqdm(total=int(args.train_seconds), unit="s", desc="training")
    while (elapsed := time.perf_counter() - start) < args.train_seconds:
        progress = elapsed / args.train_seconds
        lr = args.learning_rate * min(1.0, (step + 1) / 100) * max(0.05, 0.5 * (1 + math.cos(math.pi * progress)))
        for group in optimizer.param_groups:
            group["lr"] = lr
        draw = torch.arange(step * args.batch_size, (step + 1) * args.batch_size)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss, _ = objective(model, windows[order[draw % windows.shape[0]].to(device)], sample_index=draw)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if step % 25 == 0:
            losses.append(loss.item())
            bar.set_postfix(step=step, loss=f"{losses[-1]:.3f}", refresh=False)
            bar.update(int(min(time.perf_counter() - start, args.train_seconds)) - bar.n)
    bar.close()
    print(f"trained {step} steps ({step * args.batch_size * args.seq_len / 1e6:.1f}M tokens) in "
          f"{time.perf_counter() - start:.0f}s; last losses {[round(x, 3) for x in losses[-4:]]}")
    model.eval()  # generation runs under bf16 autocast too (fp32 weights keep RoPE's inv_freq exact)
    return model, tokenizer, heldout_docs


def heldout_prompts(tokenizer, docs, count, seed=0):
    """Openings of held-out documents, 16-64 tokens (mixed lengths)."""
    generator = torch.Generator().manual_seed(seed)
    prompts = []
    for doc in docs:
        ids = tokenizer(doc, add_special_tokens=False)["input_ids"]
        length = int(torch.randint(16, 65, (1,), generator=generator))
        if len(ids) >= length:
            prompts.append(torch.tensor(ids[:length]))
        if len(prompts) == count:
            return prompts
    raise ValueError(f"only {len(prompts)} held-out documents are long enough for {count} prompts")


def left_pad(prompts, pad_id, device):
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :], attention_mask[row, width - len(prompt) :] = prompt, 1
    return input_ids.to(device), attention_mask.to(device)


def run_mode(model, prompts, batch_size, options, pad_id, device):
    """All prompts in batches of `batch_size` -> (completions (N, G) cpu, seconds, forward passes per batch,
    row-forwards in all)."""
    completions, seconds, forwards, row_forwards, batches = [], 0.0, 0, 0, 0
    for first in range(0, len(prompts), batch_size):
        input_ids, attention_mask = left_pad(prompts[first : first + batch_size], pad_id, device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = model.generate(input_ids, attention_mask=attention_mask, return_dict_in_generate=True, **options)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds += time.perf_counter() - start
        forwards, batches = forwards + len(out.forward_batch_sizes), batches + 1
        row_forwards += sum(out.forward_batch_sizes)
        completions.append(out.sequences[:, input_ids.shape[1] :].cpu())
    return torch.cat(completions), seconds, forwards / batches, row_forwards


def main():
    args = parse_args()
    device = torch.device(args.device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        benchmark(args, device)


def benchmark(args, device):
    torch.manual_seed(0)
    model, tokenizer, heldout_docs = train(args, device)
    prompts = heldout_prompts(tokenizer, heldout_docs, args.num_prompts)
    shared = dict(max_new_tokens=args.gen_length, block_length=args.block_length, steps=args.gen_length,
                  temperature=0.0, threshold=args.threshold)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    # warm-up (CUDA context, SDPA kernel choice) on a short generation per mode
    for options in MODES.values():
        model.generate(left_pad(prompts[:2], tokenizer.pad_token_id, device)[0], **{**shared, **options,
                       "max_new_tokens": args.block_length * 2, "steps": args.block_length * 2})

    rows, reference = [], {}
    for batch_size in batch_sizes:
        used = prompts if batch_size > 1 else prompts[:4]  # batch 1: four prompts one after another
        for name, options in MODES.items():
            completions, seconds, forwards, row_forwards = run_mode(
                model, used, batch_size, {**shared, **options}, tokenizer.pad_token_id, device)
            if name.startswith("reference"):
                reference[batch_size] = completions
            agreement = completions.eq(reference[batch_size]).float().mean().item()
            generated = completions.numel()
            rows.append(dict(mode=name, batch_size=batch_size, prompts=len(used), tokens_per_s=generated / seconds,
                             forward_passes_per_token=forwards / args.gen_length,
                             row_forwards_per_token=row_forwards / generated,
                             agreement_with_reference=agreement, seconds=seconds))
            print(json.dumps(rows[-1]))
    for row in rows:
        base = next(r for r in rows if r["batch_size"] == row["batch_size"] and r["mode"].startswith("reference"))
        row["speedup_vs_reference"] = row["tokens_per_s"] / base["tokens_per_s"]
    # the same prompts alone and inside the mixed-length batch of 16 (bf16: a few tokens may flip)
    consistency = {}
    if 1 in batch_sizes and max(batch_sizes) > 1:
        for name, options in MODES.items():
            alone = run_mode(model, prompts[:4], 1, {**shared, **options}, tokenizer.pad_token_id, device)[0]
            batched = run_mode(model, prompts, max(batch_sizes), {**shared, **options}, tokenizer.pad_token_id, device)[0]
            consistency[name] = batched[:4].eq(alone).float().mean().item()

    header = "| mode | batch | tokens/s | speed-up vs reference | forward passes / token | token agreement with reference |"
    lines = [header, "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['batch_size']} | {r['tokens_per_s']:,.0f} | {r['speedup_vs_reference']:.1f}x | "
                     f"{r['forward_passes_per_token']:.3f} | {100 * r['agreement_with_reference']:.1f}% |")
    print("\n".join(lines))
    print(f"batch of {max(batch_sizes)} vs alone, token agreement (first 4 prompts):", json.dumps(consistency))
    sample = tokenizer.decode(prompts[0]) + " ||| " + tokenizer.decode(reference[max(batch_sizes)][0], skip_special_tokens=True)
    print("sample (prompt ||| reference completion):", sample[:600])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(args=vars(args), rows=rows, batch_vs_alone=consistency, table="\n".join(lines),
                           device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                           torch=torch.__version__), f, indent=1)


if __name__ == "__main__":
    main()
