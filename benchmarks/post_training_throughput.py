"""Post-training throughput on one GPU: DiffuGRPOTrainer (LoRA and full parameters) and DLMSFTTrainer against
DLMTrainer pretraining, Qwen3-1.7B shape (28 layers, hidden 2048, 16 heads, 8 KV heads, ffn 6144, vocab 151936,
tied, qk-norm), random weights.

    python benchmarks/post_training_throughput.py            # every section, a table, JSON lines
    python benchmarks/post_training_throughput.py --tiny     # CPU-sized model, to debug the script

Sections (each in a try block: one failing still leaves the others' figures):
- pretrain: DLMTrainer, random token windows of --seq tokens, micro-batch --mbs, fp32 weights + bf16 autocast.
- sft: DLMSFTTrainer on prompt-completion rows of the same total length (prompt a quarter of it), same setup.
  Both report tokens/s over the steps after the first two (real tokens, prompt included).
- grpo-lora / grpo-full: DiffuGRPOTrainer, bf16 weights, `--prompts` prompts x `--generations` rollouts of
  `--completion` tokens (sampler: blocks of 32, 2 tokens per step or `--threshold`, dual cache, temperature 0.9,
  `--compile-rollouts` for the compiled step), d1 estimator,
  beta 0.04 (LoRA: the reference is the adapter-free model; full: a frozen copy). Step time (rollout included)
  and rollout tokens/s (completion tokens / generate time) over the steps after the first; peak memory.
Writes results.json under $OUT when that is set.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="CPU-sized model and batches (debugging the script)")
    p.add_argument("--sections", default="pretrain,sft,grpo-lora,grpo-full")
    p.add_argument("--seq", type=int, default=2048, help="pretraining / SFT sequence length")
    p.add_argument("--mbs", type=int, default=4, help="pretraining / SFT micro-batch")
    p.add_argument("--steps", type=int, default=8, help="pretraining / SFT optimizer steps")
    p.add_argument("--prompts", type=int, default=4, help="GRPO: distinct prompts per step")
    p.add_argument("--generations", type=int, default=8, help="GRPO: rollouts per prompt")
    p.add_argument("--prompt-len", type=int, default=64, help="GRPO: prompt tokens")
    p.add_argument("--completion", type=int, default=128, help="GRPO: completion tokens (max_completion_length)")
    p.add_argument("--grpo-steps", type=int, default=3)
    p.add_argument("--threshold", type=float, default=None, help="GRPO rollouts: threshold decoding (e.g. 0.9)")
    p.add_argument("--compile-rollouts", action="store_true", help="GRPO rollouts: the compiled decoding step")
    p.add_argument("--micro-batch", type=int, default=0, help="GRPO: rows per loss micro-batch (0: all of a step's "
                   "prompts x generations at once); the rollouts still decode the step's rows together (trl's "
                   "generation batch = micro-batch x gradient accumulation)")
    a = p.parse_args(argv)
    if a.tiny:
        a.seq, a.mbs, a.steps, a.prompts, a.generations, a.prompt_len, a.completion, a.grpo_steps = (
            64, 2, 4, 2, 4, 8, 32, 2)
    return a


def shape(a) -> dict:
    if a.tiny:
        return dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2)
    return dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                num_attention_heads=16, num_key_value_heads=8)


def build_model(a, tokenizer, device, dtype):
    import torch

    from hf_dlm import DLMConfig, DLMForDiffusionLM

    config = DLMConfig(**shape(a), head_dim=None, max_position_embeddings=max(a.seq, 4096), tie_word_embeddings=True,
                       qk_norm=True, mask_token_id=tokenizer.mask_token_id, eos_token_id=tokenizer.eos_token_id,
                       pad_token_id=tokenizer.pad_token_id)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = DLMForDiffusionLM(config).to(dtype)
    return model.train()


class StepTimer:
    """Trainer callback: wall time of every optimizer step (CUDA synchronised)."""

    def __init__(self, device):
        from transformers import TrainerCallback

        timer = self

        class Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                timer.sync()
                timer.start = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                timer.sync()
                timer.times.append(time.perf_counter() - timer.start)

        self.device, self.times, self.callback = device, [], Callback()

    def sync(self):
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize()


def common_args(a, device, output_dir) -> dict:
    return dict(output_dir=output_dir, report_to="none", save_strategy="no", disable_tqdm=True, seed=0,
                logging_steps=1000, use_cpu=device.type == "cpu", bf16=device.type == "cuda",
                dataloader_num_workers=0)


def run_pretrain(a, tokenizer, device, out_dir) -> dict:
    import torch

    from hf_dlm import DLMTrainer, DLMTrainingArguments
    from hf_dlm.data.memory_dataset import TokenWindowDataset

    model = build_model(a, tokenizer, device, torch.float32)
    ids = torch.randint(15, model.config.vocab_size, (a.mbs * a.steps, a.seq))
    timer = StepTimer(device)
    args = DLMTrainingArguments(**common_args(a, device, out_dir), max_steps=a.steps, per_device_train_batch_size=a.mbs,
                                learning_rate=1e-5, t_buckets=0)
    DLMTrainer(model=model, args=args, train_dataset=TokenWindowDataset(ids), callbacks=[timer.callback]).train()
    return {"tokens_per_step": a.mbs * a.seq, "step_s": timer.times}


def run_sft(a, tokenizer, device, out_dir) -> dict:
    import random

    import torch
    from datasets import Dataset

    from hf_dlm.training.sft_config import DLMSFTConfig
    from hf_dlm.training.sft_trainer import DLMSFTTrainer

    rng = random.Random(0)
    # <|user|> P digits <|assistant|> C digits <|endoftext|> = seq tokens
    prompt_len = a.seq // 4 - 2
    completion_len = a.seq - prompt_len - 3
    rows = [{"prompt": [{"role": "user", "content": "".join(rng.choice("0123456789") for _ in range(prompt_len))}],
             "completion": [{"role": "assistant",
                             "content": "".join(rng.choice("0123456789") for _ in range(completion_len))}]}
            for _ in range(a.mbs * a.steps)]
    model = build_model(a, tokenizer, device, torch.float32)
    timer = StepTimer(device)
    args = DLMSFTConfig(**common_args(a, device, out_dir), max_steps=a.steps, per_device_train_batch_size=a.mbs,
                        learning_rate=1e-5, max_length=a.seq, dataset_num_proc=None)
    trainer = DLMSFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
                            callbacks=[timer.callback])
    lengths = {len(trainer.train_dataset[i]["input_ids"]) for i in range(len(rows))}
    trainer.train()
    return {"tokens_per_step": a.mbs * max(lengths), "sequence_lengths": sorted(lengths), "step_s": timer.times}


def rollout_kwargs(a) -> dict:
    """The rollouts' sampler settings: blocks of 32, 2 tokens per step (or `--threshold`), dual cache."""
    kwargs = dict(block_length=32, steps=a.completion // 2, cache="dual")
    if a.threshold is not None:
        kwargs["threshold"] = a.threshold
    if a.compile_rollouts:
        kwargs["compile"] = True
    return kwargs


def run_grpo(a, tokenizer, device, out_dir, lora: bool) -> dict:
    import random

    import torch
    from datasets import Dataset

    from hf_dlm.training.grpo_config import DiffuGRPOConfig
    from hf_dlm.training.grpo_trainer import DiffuGRPOTrainer

    rng = random.Random(1)
    digits = a.prompt_len - 2  # <|user|> digits <|assistant|>
    rows = [{"prompt": [{"role": "user", "content": "".join(rng.choice("0123456789") for _ in range(digits))}]}
            for _ in range(a.prompts * (a.grpo_steps + 1))]

    def even_ids(completions, completion_ids, **kwargs):  # any verifiable reward: the share of even token ids
        return [sum(1 for t in ids if t % 2 == 0) / max(len(ids), 1) for ids in completion_ids]

    model = build_model(a, tokenizer, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    peft_config = None
    if lora:
        from hf_dlm.training.lora import dlm_lora_config

        peft_config = dlm_lora_config(r=64, lora_alpha=64)
    timer = StepTimer(device)
    batch = a.prompts * a.generations
    micro = a.micro_batch or batch
    if batch % micro:
        raise SystemExit(f"--micro-batch {micro} must divide prompts x generations ({batch})")
    args = DiffuGRPOConfig(**common_args(a, device, out_dir), max_steps=a.grpo_steps,
                           per_device_train_batch_size=micro, gradient_accumulation_steps=batch // micro,
                           num_generations=a.generations,
                           max_completion_length=a.completion,
                           generation_kwargs=rollout_kwargs(a),
                           learning_rate=1e-6, beta=0.04, logp_estimator="d1")
    trainer = DiffuGRPOTrainer(model=model, reward_funcs=even_ids, args=args, train_dataset=Dataset.from_list(rows),
                               processing_class=tokenizer, peft_config=peft_config, callbacks=[timer.callback])
    rollouts = []
    original = trainer._generate_single_turn

    def timed(*args, **kwargs):
        timer.sync()
        start = time.perf_counter()
        completion_ids, logprobs = original(*args, **kwargs)
        timer.sync()
        rollouts.append({"s": time.perf_counter() - start, "rows": len(completion_ids),
                         "tokens": sum(map(len, completion_ids)), "canvas_tokens": len(completion_ids) * a.completion})
        return completion_ids, logprobs

    trainer._generate_single_turn = timed
    trainer.train()
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    return {"rows_per_step": batch, "trainable_parameters": trainable, "step_s": timer.times, "rollouts": rollouts}


def summarize(name, result) -> dict:
    steps = result["step_s"][2:] or result["step_s"][1:] or result["step_s"]
    step_s = sum(steps) / len(steps)
    row = {"section": name, "step_s": round(step_s, 4), "peak_gib": result.get("peak_gib")}
    if "tokens_per_step" in result:
        row["tokens_per_s"] = round(result["tokens_per_step"] / step_s)
    if "rollouts" in result:
        later = result["rollouts"][1:] or result["rollouts"]
        row["rollout_s"] = round(sum(r["s"] for r in later) / len(later), 3)
        row["rollout_canvas_tokens_per_s"] = round(sum(r["canvas_tokens"] for r in later) / sum(r["s"] for r in later))
        row["trainable_parameters"] = result["trainable_parameters"]
        row["step_s"] = round(sum(result["step_s"][1:] or result["step_s"]) / max(len(result["step_s"]) - 1, 1), 3)
    return row


def main(argv=None) -> int:
    import tempfile

    import torch

    a = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not a.tiny else "cpu")
    print(f"device {device}, torch {torch.__version__}", flush=True)
    from hf_dlm.training.post_training import toy_tokenizer

    tokenizer = toy_tokenizer(shape(a)["vocab_size"])  # every id a random model samples decodes
    runners = {"pretrain": run_pretrain, "sft": run_sft,
               "grpo-lora": lambda *x: run_grpo(*x, lora=True), "grpo-full": lambda *x: run_grpo(*x, lora=False)}
    rows, out = [], os.environ.get("OUT")
    for name in a.sections.split(","):
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        try:
            with tempfile.TemporaryDirectory() as tmp:
                result = runners[name](a, tokenizer, device, tmp)
            if device.type == "cuda":
                result["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
            row = summarize(name, result)
            print(json.dumps({**row, "raw": result}), flush=True)
        except Exception as error:  # one section failing still leaves the others' figures
            traceback.print_exc()
            row = {"section": name, "error": f"{type(error).__name__}: {error}"[:500]}
            print(json.dumps(row), flush=True)
        rows.append(row)
        if out:
            with open(os.path.join(out, "results.json"), "w") as f:
                json.dump(rows, f, indent=1)
    print("\n| section | step s | tokens/s | rollout s | rollout canvas tokens/s | peak GiB |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['section']} | {r.get('step_s', r.get('error'))} | {r.get('tokens_per_s', '')} | "
              f"{r.get('rollout_s', '')} | {r.get('rollout_canvas_tokens_per_s', '')} | {r.get('peak_gib', '')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
