"""Errors that carry what they are about, so the CLI, the config loader and the server can name the field
without parsing the message text."""

from __future__ import annotations

_UNSET = object()


class FieldError(ValueError):
    """A value the library cannot take. `field` is the setting's name as the user spelled it
    (`"block_length"`, `"training.max_steps"`), `value` the offending value when there is one.

    A `ValueError`, so existing `except ValueError` handlers keep working."""

    def __init__(self, field: str, message: str, value=_UNSET):
        super().__init__(message)
        self.field = field
        self.value = None if value is _UNSET else value
        self.has_value = value is not _UNSET


class ConfigError(FieldError):
    """A bad entry of a YAML training config (`hf-dlm train`); `field` is its dotted path
    (`training.max_steps`, `model.config.hidden_size`) when the error is about one entry."""

    def __init__(self, message: str, field: str | None = None, value=_UNSET):
        super().__init__(field, message, value)

    def with_prefix(self, prefix: str) -> ConfigError:
        """The same error with `prefix: ` (the config file) in front of its message."""
        return ConfigError(f"{prefix}: {self}", self.field, self.value if self.has_value else _UNSET)


__all__ = ["FieldError", "ConfigError"]
