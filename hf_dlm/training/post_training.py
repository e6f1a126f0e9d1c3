"""The `hf-dlm sft` / `hf-dlm grpo` commands and `examples/sft.py` / `examples/grpo.py`: trl's own argument
parser (`TrlParser`: dataclass fields as flags, `--config file.yaml` with the same keys) over
`PostTrainingArguments` and `DLMSFTConfig` / `DiffuGRPOConfig`.

`model_name_or_path: toy` builds a small DLM and the digit tokenizer, and `dataset_name: toy-reverse` the
'reverse the digits' task (prompt-completion rows for SFT, prompts with an `answer` column for GRPO, rewarded
by `toy_reward`), so both scripts run on a laptop CPU without downloads (examples/configs/*_toy.yaml).
"""

from __future__ import annotations

import importlib
import os
import random
from dataclasses import dataclass, field

from ..utils.import_utils import require


@dataclass
class PostTrainingArguments:
    model_name_or_path: str = field(
        default="toy", metadata={"help": "DLM checkpoint (Hub id or folder), or 'toy': a fresh 2-layer DLM + digit "
                                         "tokenizer for the toy task"})
    tokenizer_name_or_path: str | None = field(
        default=None, metadata={"help": "Tokenizer (default: the model's); it must carry the model's mask token"})
    dataset_name: str = field(
        default="toy-reverse", metadata={"help": "Hub dataset id, a local .json / .jsonl / .parquet file, or "
                                                 "'toy-reverse' (answer with the prompt's digits reversed)"})
    dataset_config: str | None = field(default=None, metadata={"help": "Dataset configuration name"})
    dataset_train_split: str = field(default="train", metadata={"help": "Split to train on"})
    dataset_test_split: str | None = field(default=None, metadata={"help": "Split to evaluate on (none by default)"})
    toy_examples: int = field(default=1024, metadata={"help": "Rows of the toy-reverse dataset"})
    reward_funcs: list[str] = field(
        default_factory=lambda: ["toy"],
        metadata={"help": "GRPO rewards: 'toy' (toy-reverse partial credit) or 'module:function' import paths of trl "
                          "reward functions"})
    use_peft: bool = field(default=False, metadata={"help": "Train a LoRA adapter (hf_dlm.training.lora defaults)"})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank"})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha"})
    lora_dropout: float = field(default=0.0, metadata={"help": "LoRA dropout"})
    lora_target_modules: list[str] | None = field(
        default=None, metadata={"help": "LoRA target modules (default: every attention and MLP projection)"})


def toy_rows(n: int, seed: int, min_digits: int = 2, max_digits: int = 3) -> list[dict]:
    """toy-reverse rows: a conversational prompt of min..max digits, its completion and the `answer` text."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(min_digits, max_digits)))
        rows.append({"prompt": [{"role": "user", "content": digits}],
                     "completion": [{"role": "assistant", "content": digits[::-1]}], "answer": digits[::-1]})
    return rows


def toy_reward(completions, answer, **kwargs) -> list[float]:
    """toy-reverse: share of the answer's digits in place, minus 0.5 per extra digit, over the answer length."""
    rewards = []
    for completion, target in zip(completions, answer):
        text = completion[0]["content"] if isinstance(completion, list) else completion
        digits = "".join(ch for ch in text if ch.isdigit())
        rewards.append((sum(a == b for a, b in zip(digits, target)) - 0.5 * max(len(digits) - len(target), 0))
                       / len(target))
    return rewards


def toy_greedy_eval(model, tokenizer, n: int = 64, seed: int = 12345, max_new_tokens: int = 6) -> dict:
    """toy-reverse held-out rows decoded greedily (one token per step): {"reward": mean toy_reward, "right_length":
    share of answers with as many digits as the target, "answers": the decoded texts}."""
    import torch

    rows = toy_rows(n, seed)
    prompts = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in rows]
    batch = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    with torch.no_grad():
        sequences = model.generate(batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device),
                                   max_new_tokens=max_new_tokens, steps=max_new_tokens, temperature=0.0)
    model.train(was_training)
    answers = [text.split(tokenizer.eos_token)[0] for text in
               tokenizer.batch_decode(sequences[:, batch["input_ids"].shape[1]:], skip_special_tokens=False)]
    answers = ["".join(ch for ch in text if ch.isdigit()) for text in answers]
    targets = [r["answer"] for r in rows]
    rewards = toy_reward(answers, targets)
    return {"reward": sum(rewards) / n, "right_length": sum(len(a) == len(t) for a, t in zip(answers, targets)) / n,
            "answers": answers}


TOY_SPECIAL_TOKENS = ["<pad>", "<|endoftext|>", "<|mask|>", "<|user|>", "<|assistant|>"]
TOY_CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}<|user|>{{ m['content'] }}"
                     "{% else %}<|assistant|>{{ m['content'] }}<|endoftext|>{% endif %}{% endfor %}"
                     "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def toy_tokenizer(vocab_size: int | None = None):
    """Word-level tokenizer: the five special tokens, the ten digits (one token each), then filler words up to
    `vocab_size` (benchmarks: every id a random large-vocabulary model samples decodes). The chat template's
    prompt with the generation prompt is a prefix of the whole conversation."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = TOY_SPECIAL_TOKENS + list("0123456789")
    words += [f"w{i}" for i in range((vocab_size or len(words)) - len(words))]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Digits(individual_digits=True)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<|endoftext|>",
                                        mask_token="<|mask|>", additional_special_tokens=TOY_SPECIAL_TOKENS[3:])
    tokenizer.chat_template = TOY_CHAT_TEMPLATE
    return tokenizer


def load_model_and_tokenizer(script):
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    from .. import DLMConfig, DLMForDiffusionLM

    if script.model_name_or_path == "toy":
        tokenizer = toy_tokenizer()
        config = DLMConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, mask_token_id=tokenizer.mask_token_id,
                           eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                           max_position_embeddings=64)
        return DLMForDiffusionLM(config), tokenizer
    model = AutoModelForMaskedLM.from_pretrained(script.model_name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(script.tokenizer_name_or_path or script.model_name_or_path)
    return model, tokenizer


def load_datasets(script, seed: int, for_grpo: bool):
    require("datasets", "hf-dlm sft / grpo")
    from datasets import Dataset, load_dataset

    if script.dataset_name == "toy-reverse":
        columns = ("prompt", "answer") if for_grpo else ("prompt", "completion")
        train, heldout = toy_rows(script.toy_examples, seed), toy_rows(64, seed + 1)
        return tuple(Dataset.from_list([{k: row[k] for k in columns} for row in rows]) for rows in (train, heldout))
    name = script.dataset_name
    if name.endswith((".json", ".jsonl", ".parquet")):
        data = load_dataset("parquet" if name.endswith(".parquet") else "json", data_files=name)
    else:
        data = load_dataset(name, script.dataset_config)
    return data[script.dataset_train_split], (data[script.dataset_test_split] if script.dataset_test_split else None)


def peft_config(script):
    if not script.use_peft:
        return None
    from .lora import dlm_lora_config

    return dlm_lora_config(r=script.lora_r, lora_alpha=script.lora_alpha, lora_dropout=script.lora_dropout,
                           target_modules=script.lora_target_modules)


def prepare_peft_base(script, model, tokenizer, output_dir: str) -> None:
    """LoRA on a base that exists only in memory (`model_name_or_path: toy`): save it to OUTPUT_DIR/base first, so
    the adapter names a base that can be loaded (else its base_model_name_or_path is null and nobody can use it)."""
    from .lora import has_saved_base, save_in_memory_base

    if script.use_peft and not has_saved_base(model):
        save_in_memory_base(model, tokenizer, os.path.join(output_dir, "base"))


def save_outputs(script, trainer, tokenizer, output_dir: str) -> None:
    """The trained model (or adapter) and the tokenizer; an adapter loads with peft's AutoPeftModel. On the toy task,
    also the greedy toy reward of held-out prompts (the number the example's README lines quote)."""
    if script.dataset_name == "toy-reverse" and trainer.args.process_index == 0:
        result = toy_greedy_eval(trainer.accelerator.unwrap_model(trainer.model), tokenizer, n=256)
        trainer.log({"toy_greedy_reward": result["reward"], "toy_right_length": result["right_length"]})
        print(f"toy-reverse, 256 held-out prompts decoded greedily: reward {result['reward']:.3f}, answers of the "
              f"right length {result['right_length']:.1%}")
    trainer.save_model(output_dir)
    tokenizer.save_pretrained(output_dir)
    if script.use_peft:
        from .lora import make_adapter_auto_loadable

        make_adapter_auto_loadable(output_dir)


def resolve_rewards(names: list[str]) -> list:
    rewards = []
    for name in names:
        if name == "toy":
            rewards.append(toy_reward)
            continue
        module, sep, attribute = name.partition(":")
        if not sep:
            raise ValueError(f"reward {name!r}: expected 'toy' or 'module:function'")
        rewards.append(getattr(importlib.import_module(module), attribute))
    return rewards


def _parse(config_class, argv):
    require("trl", "hf-dlm sft / grpo")
    from trl import TrlParser

    return TrlParser((PostTrainingArguments, config_class)).parse_args_and_config(argv)


def run_sft(argv: list[str] | None = None):
    from .sft_config import DLMSFTConfig
    from .sft_trainer import DLMSFTTrainer

    script, args = _parse(DLMSFTConfig, argv)
    model, tokenizer = load_model_and_tokenizer(script)
    train, evaluation = load_datasets(script, args.seed, for_grpo=False)
    prepare_peft_base(script, model, tokenizer, args.output_dir)
    trainer = DLMSFTTrainer(model=model, args=args, train_dataset=train, eval_dataset=evaluation,
                            processing_class=tokenizer, peft_config=peft_config(script))
    trainer.train()
    save_outputs(script, trainer, tokenizer, args.output_dir)
    return trainer


def run_grpo(argv: list[str] | None = None):
    from .grpo_config import DiffuGRPOConfig
    from .grpo_trainer import DiffuGRPOTrainer

    script, args = _parse(DiffuGRPOConfig, argv)
    model, tokenizer = load_model_and_tokenizer(script)
    train, evaluation = load_datasets(script, args.seed, for_grpo=True)
    prepare_peft_base(script, model, tokenizer, args.output_dir)
    trainer = DiffuGRPOTrainer(model=model, reward_funcs=resolve_rewards(script.reward_funcs), args=args,
                               train_dataset=train, eval_dataset=evaluation, processing_class=tokenizer,
                               peft_config=peft_config(script))
    trainer.train()
    save_outputs(script, trainer, tokenizer, args.output_dir)
    return trainer


# -- the `hf-dlm sft` / `hf-dlm grpo` subcommands (flags pass through to TrlParser; see hf_dlm/cli.py) ----------
def subcommand(name: str, config_class: str):
    """(add_arguments, run) of `hf-dlm NAME`; light until `run` (no trl / datasets import in `--help`)."""

    def add_arguments(parser):
        parser.add_argument("--config", help=f"YAML file whose keys are fields of PostTrainingArguments / "
                                             f"{config_class} (see examples/configs/{name}_toy.yaml); any "
                                             "--field value pair overrides it")

    def run(args) -> int:
        runner = {"sft": run_sft, "grpo": run_grpo}[name]
        runner((["--config", args.config] if args.config else []) + args.options)
        return 0

    return add_arguments, run
