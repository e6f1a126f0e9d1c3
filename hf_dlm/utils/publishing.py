"""The seam between the rooms that save models (modeling, parallel, training) and the room that publishes
them (`hf_dlm.hub`: remote code, model card, upload), which sits above them.

The rooms below call `publisher()` and never import `hub/`; the package's front door (`hf_dlm/__init__.py`,
above every room) plugs `hub.publish` in when `hf_dlm` is imported, which any import of an hf-dlm module
does first. A hook rather than a move: publishing needs the whole model package (it regenerates the
remote code from modeling's source), so it cannot sit below modeling.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

_loader: Callable[[], ModuleType] | None = None


def set_publisher(loader: Callable[[], ModuleType]) -> None:
    """`loader()` returns the publishing module (`save_with_remote_code`, `push_to_hub`, `write_hub_extras`,
    `write_final_card`); called on first use, so registering imports nothing."""
    global _loader
    _loader = loader


def publisher() -> ModuleType:
    if _loader is None:
        raise RuntimeError("hf-dlm: no publisher registered; `import hf_dlm` registers hf_dlm.hub.publish")
    return _loader()


__all__ = ["set_publisher", "publisher"]
