"""AR -> DLM adaptation: a mask token for model and tokenizer, with a sensible embedding row.

Dream adapted Qwen2.5 this way: same weights, bidirectional attention, shifted labels (the logits at
i-1 predict token i, which is what the AR head was trained to do), and a new `[MASK]` token.
"""

from __future__ import annotations

import torch

DEFAULT_MASK_TOKEN = "<|mdm_mask|>"  # LLaDA's spelling


def add_mask_token(tokenizer, mask_token: str = DEFAULT_MASK_TOKEN) -> tuple[int, int, bool]:
    """Give `tokenizer` a mask token unless it has one. Returns (mask_token_id, number of tokens the
    tokenizer knew before, i.e. the rows that carry trained embeddings, whether the token is new)."""
    known = len(tokenizer)
    if tokenizer.mask_token_id is not None:
        return tokenizer.mask_token_id, known, False
    tokenizer.add_special_tokens({"mask_token": mask_token})
    return tokenizer.mask_token_id, known, True


@torch.no_grad()
def init_mask_row(state_dict: dict[str, torch.Tensor], mask_token_id: int, trained_rows: int, tied: bool) -> dict:
    """Make row `mask_token_id` of the embedding (and of an untied head) the mean of the first
    `trained_rows` rows, growing the matrices by whole rows if the id lies beyond them.

    The mean embedding is the usual choice (transformers' `resize_token_embeddings` starts from it too):
    the new token starts in the middle of the embedding cloud instead of at a random or zero vector,
    so the first diffusion steps see inputs of familiar scale.
    """
    names = ["model.embed_tokens.weight"] + ([] if tied else ["lm_head.weight"])
    for name in names:
        weight = state_dict[name]
        if mask_token_id >= weight.shape[0]:
            grown = weight.new_zeros(mask_token_id + 1, weight.shape[1])
            grown[: weight.shape[0]] = weight
            weight = grown
        else:
            weight = weight.clone()
        weight[mask_token_id] = weight[: min(trained_rows, weight.shape[0])].float().mean(0).to(weight.dtype)
        state_dict[name] = weight
    return state_dict


__all__ = ["DEFAULT_MASK_TOKEN", "add_mask_token", "init_mask_row"]
