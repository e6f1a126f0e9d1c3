"""One spelling of activation checkpointing across the transformers versions hf-dlm supports (>= 5.17).

transformers 5.24 renamed `gradient_checkpointing*` to `activation_checkpointing*` (TrainingArguments fields,
`PreTrainedModel` methods) and warns (FutureWarning) whenever the old names are set or called; 5.17 has only
the old ones. hf-dlm code goes through these helpers, so it uses the new name where it exists and the old one
where it does not, and never warns."""

from __future__ import annotations

NEW, OLD = "activation_checkpointing", "gradient_checkpointing"


def default_activation_checkpointing(args, default: bool = False) -> None:
    """For an arguments dataclass that declares `gradient_checkpointing: bool | None = None` to change the
    parent's default: call before the parent's `__post_init__`. Unset (None) means `default`, written under
    the name this transformers reads, so the parent sees no use of the deprecated field."""
    if getattr(args, OLD, None) is not None:
        return
    name = NEW if hasattr(args, NEW) else OLD
    if getattr(args, name) is None:
        setattr(args, name, default)


def activation_checkpointing_requested(args) -> bool:
    return bool(getattr(args, NEW, None) or getattr(args, OLD, None))


def hand_activation_checkpointing_over(args) -> None:
    """Tell the Trainer not to apply activation checkpointing (hf-dlm applied its own): both names, since
    on >= 5.24 the Trainer reads only the new one."""
    for name in (NEW, OLD):
        if hasattr(args, name):
            setattr(args, name, False)


__all__ = ["default_activation_checkpointing", "activation_checkpointing_requested",
           "hand_activation_checkpointing_over"]
