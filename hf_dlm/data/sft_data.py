"""SFT data: chat conversations -> input_ids + prompt_mask (+ attention_mask), fixed length.

The prompt is everything the chat template renders before the last assistant message (with the
generation prompt, e.g. `<|im_start|>assistant\\n`); the response is the rest. Prompt tokens are never
noised and carry no loss (`MaskedDiffusionObjective.corrupt` reads `prompt_mask`).

Padding policy (`padding_policy`, the spelling `DLMSFTConfig` shares), the choice peers disagree on, explicit here:
  "eos" (default, LLaDA): pad to `max_length` with the EOS token, attention_mask all ones. The padding
        is part of the response: it is noised and trained on, so the model learns to fill the rest of
        the canvas with EOS, i.e. to stop. Use it for models sampled LLaDA-style (fixed-length canvas).
  "exclude": pad with the pad token (EOS if there is none) and set attention_mask 0 there; padding is
        never attended to, noised or supervised (dllm's / NeMo's default behaviour).
"""

from __future__ import annotations

import dataclasses
import warnings

import torch
from torch.utils.data import Dataset

from ..utils.errors import FieldError

PADDING_POLICIES = ("eos", "exclude")


@dataclasses.dataclass
class SFTDataConfig:
    max_length: int = dataclasses.field(default=1024, metadata={"help": "every sample is padded / truncated to this"})
    padding_policy: str = dataclasses.field(
        default="eos", metadata={"help": "'eos': pad with EOS and train on it (LLaDA; the model learns to stop); "
                                         "'exclude': pad with the pad token, masked out of attention and loss"})
    messages_key: str = dataclasses.field(default="messages", metadata={"help": "column holding the chat messages"})
    padding: str | None = dataclasses.field(
        default=None, metadata={"help": "Deprecated spelling of padding_policy (FutureWarning)."})

    def __post_init__(self):
        if self.padding is not None:
            warnings.warn("SFTDataConfig.padding is deprecated: use padding_policy (the spelling of DLMSFTConfig)",
                          FutureWarning, stacklevel=3)
            if self.padding_policy not in ("eos", self.padding):  # both spellings, disagreeing
                raise FieldError("padding", f"padding={self.padding!r} disagrees with padding_policy="
                                            f"{self.padding_policy!r}; set padding_policy only", self.padding)
            self.padding_policy, self.padding = self.padding, None
        if self.padding_policy not in PADDING_POLICIES:
            raise FieldError("padding_policy", f"padding_policy must be one of {PADDING_POLICIES}, "
                                               f"got {self.padding_policy!r}", self.padding_policy)


def tokenize_conversation(messages: list[dict], tokenizer, config: SFTDataConfig) -> dict:
    """One conversation -> {input_ids, position_ids, attention_mask, prompt_mask}, each (max_length,).

    The last message must be the assistant's answer. Too long: the response is cut on the right; a prompt
    that leaves no room for a single response token is an error."""
    if not messages or messages[-1].get("role") != "assistant":
        raise ValueError("the last message must have role 'assistant' (the response to train on)")
    if tokenizer.eos_token_id is None:
        raise ValueError("SFT data needs a tokenizer with an EOS token")
    prompt_text = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
    full_text = tokenizer.apply_chat_template(messages, tokenize=False)
    if not full_text.startswith(prompt_text):
        raise ValueError("the chat template does not render the prompt (with add_generation_prompt=True) as a "
                         "prefix of the whole conversation; cannot tell prompt from response")
    # tokenized separately so the boundary is exact whatever the tokenizer merges across it
    prompt_ids = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    response_ids = tokenizer(full_text[len(prompt_text):], add_special_tokens=False)["input_ids"]
    length = config.max_length
    if len(prompt_ids) >= length:
        raise ValueError(f"the prompt has {len(prompt_ids)} tokens, no room for a response in max_length={length}")
    ids = (prompt_ids + response_ids)[:length]
    used = len(ids)
    if config.padding_policy == "eos":
        pad_id, attention = tokenizer.eos_token_id, [1] * length
    else:
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        attention = [1] * used + [0] * (length - used)
    ids = ids + [pad_id] * (length - used)
    return {
        "input_ids": torch.tensor(ids, dtype=torch.long),
        "position_ids": torch.arange(length, dtype=torch.long),
        "attention_mask": torch.tensor(attention, dtype=torch.long),
        "prompt_mask": torch.arange(length) < len(prompt_ids),
    }


class SFTDataset(Dataset):
    """Map-style SFT samples from rows holding chat messages (a list of dicts or an HF `Dataset`),
    tokenized when read. `sample_index` is the row number; wrap in `ShuffledSamples` (datasets.py) for
    several epochs, which re-keys it globally."""

    def __init__(self, rows, tokenizer, config: SFTDataConfig | None = None):
        self.rows, self.tokenizer, self.config = rows, tokenizer, config or SFTDataConfig()
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("the tokenizer has no chat_template; set tokenizer.chat_template first")

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        row = self.rows[i]
        if self.config.messages_key not in row:
            raise KeyError(f"row {i}: missing key {self.config.messages_key!r} (found {list(row)})")
        try:
            sample = tokenize_conversation(row[self.config.messages_key], self.tokenizer, self.config)
        except ValueError as error:
            raise ValueError(f"row {i}: {error}") from None
        sample["sample_index"] = i
        return sample
