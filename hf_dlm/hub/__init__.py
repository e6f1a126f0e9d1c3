"""Publishing: model cards, the self-contained remote-code export and Hub upload. Names load on first access."""

from ..utils.lazy import lazy_exports

_EXPORTS = {
    "save_with_remote_code": "publish", "push_to_hub": "publish", "prepare_hub_folder": "publish",
    "upload_folder": "publish", "generate_remote_code": "remote_code", "write_remote_code": "remote_code",
    "build_model_card": "model_card", "load_model": "loading", "write_hub_extras": "publish",
    "write_final_card": "publish",
}

__getattr__, __dir__, __all__ = lazy_exports(__name__, {name: f".{module}" for name, module in _EXPORTS.items()})
