"""`DLMDataCollator`: stacks samples of the hf-dlm data contract into a batch.

A sample is a dict with `input_ids` (L,), optional `position_ids` (L,) restarting at 0 per packed
document, `sample_index` (int, global and unique per draw, epochs included: the diffusion noise is
keyed by it) and, for SFT, optional `attention_mask` (L,) and `prompt_mask` (L,) (True: prompt, never
noised). Rows of different lengths are right-padded. `position_ids` go into the batch only when some
row holds several documents (the model's masks are cheaper without them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

DATA_STATE_KEY = "dlm_data_state"


def _as_tensor(value, dtype) -> torch.Tensor:
    return value.to(dtype) if isinstance(value, torch.Tensor) else torch.as_tensor(value, dtype=dtype)


@dataclass
class DLMDataCollator:
    """pad_token_id: id written into padding (it is never attended to nor supervised);
    pad_to_multiple_of: round the padded length up (tensor-core friendly shapes);
    state_source: a dataset with `state_dict()`; its state right after this batch was drawn is attached
    under `DATA_STATE_KEY`, so the trainer checkpoints the position of the last *consumed* batch even
    though data loaders prefetch."""

    pad_token_id: int = 0
    pad_to_multiple_of: int | None = None
    state_source: Any = None

    def __call__(self, features: list[dict]) -> dict:
        for position, feature in enumerate(features):
            for key in ("input_ids", "sample_index"):
                if key not in feature:
                    raise KeyError(f"DLMDataCollator: sample {position} of the batch has no {key!r} "
                                   f"(keys: {sorted(feature)}); see the data contract in hf_dlm/data/collator.py")
        ids = [_as_tensor(f["input_ids"], torch.long) for f in features]
        lengths = [x.shape[0] for x in ids]
        length = max(lengths)
        if self.pad_to_multiple_of:
            length = -(-length // self.pad_to_multiple_of) * self.pad_to_multiple_of
        padded = any(n != length for n in lengths) or any("attention_mask" in f for f in features)

        def stack(key, dtype, fill, default):
            rows = []
            for feature, n in zip(features, lengths):
                row = _as_tensor(feature[key], dtype) if key in feature else default(n)
                rows.append(torch.cat([row, torch.full((length - n,), fill, dtype=dtype)]))
            return torch.stack(rows)  # (B, length)

        batch = {
            "input_ids": stack("input_ids", torch.long, self.pad_token_id, None),
            "sample_index": torch.tensor([int(f["sample_index"]) for f in features], dtype=torch.long),  # (B,)
        }
        if padded:
            batch["attention_mask"] = stack("attention_mask", torch.long, 0, lambda n: torch.ones(n, dtype=torch.long))
        if any("position_ids" in f for f in features):
            position_ids = stack("position_ids", torch.long, 0, lambda n: torch.arange(n))
            real = torch.arange(length).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)  # (B, length)
            if bool(((position_ids != torch.arange(length)) & real).any()):  # packed rows only
                batch["position_ids"] = position_ids
        if any("prompt_mask" in f for f in features):
            batch["prompt_mask"] = stack("prompt_mask", torch.bool, False, lambda n: torch.zeros(n, dtype=torch.bool))
        if self.state_source is not None:
            batch[DATA_STATE_KEY] = self.state_source.state_dict()
        return batch
