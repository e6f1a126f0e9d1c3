"""Hub export: save with remote code, prepare a repository folder, upload it.

`DLMPreTrainedModel.save_pretrained` routes through `save_with_remote_code`, so every saved hf-dlm
model carries `auto_map`, self-contained modeling files (`remote_code.py`) and a model card. `push_to_hub`
here prepares the complete folder (weights, code, tokenizer, full card) and uploads it in one commit
with `huggingface_hub`.
"""

from __future__ import annotations

import os
import stat
import tempfile
import warnings
from pathlib import Path

from .model_card import write_info, write_model_card
from .remote_code import remove_remote_code, write_remote_code

_HUB_KWARGS = ("repo_id", "commit_message", "create_pr", "private")


def save_with_remote_code(model, transformers_save, save_directory, *args, **kwargs):
    """`transformers_save(save_directory, ...)` plus remote code, `auto_map` and a default model card.

    `push_to_hub=True` is taken out of transformers' save (it would upload before the code files exist)
    and done here once the folder is complete. `strict_remote_code=True`: a code-export failure raises
    instead of warning (the weights stay saved either way).
    """
    push = kwargs.pop("push_to_hub", False)
    strict = kwargs.pop("strict_remote_code", False)  # raise (Hub export) instead of warning (checkpoints)
    hub_options = {key: kwargs.pop(key) for key in _HUB_KWARGS if key in kwargs}
    result = transformers_save(save_directory, *args, **kwargs)
    if kwargs.get("is_main_process", args[0] if args else True):
        try:
            write_remote_code(save_directory)
        except (ImportError, NotImplementedError, NameError, SyntaxError) as error:
            if strict:
                remove_remote_code(save_directory)
                raise
            # the weights are saved; a checkpoint save in a training run must not die over the extra files
            _without_remote_code(save_directory, error)
        if not (Path(save_directory) / "README.md").exists():
            write_model_card(save_directory, model.config)
        _default_file_modes(save_directory)
        if push:
            repo_id = hub_options.pop("repo_id", Path(save_directory).name)
            upload_folder(save_directory, repo_id, token=kwargs.get("token"), **hub_options)
    return result


def _without_remote_code(save_directory, error) -> None:
    warnings.warn(f"{save_directory}: saved without remote code ({error}); it loads where hf-dlm is installed",
                  stacklevel=4)
    remove_remote_code(save_directory)


def write_hub_extras(save_directory, config) -> None:
    """What `save_with_remote_code` adds to a folder saved another way (a pipeline's stage shards): the remote
    code (a warning, not an error, when it cannot be generated) and a default model card."""
    try:
        write_remote_code(save_directory)
    except (ImportError, NotImplementedError, NameError, SyntaxError) as error:
        _without_remote_code(save_directory, error)
    if not (Path(save_directory) / "README.md").exists():
        write_model_card(save_directory, config)


def write_final_card(output_dir, config, training_details: dict) -> None:
    """A trained model's record (`hf_dlm_info.json`) and the model card that shows it."""
    write_info(output_dir, training=training_details)
    write_model_card(output_dir, config)


def _default_file_modes(folder) -> None:
    """transformers writes weight shards through temporary files, which are created 0600: give the files
    of a saved model the modes of ordinary files (0644 under umask 022), as `cp` or a Hub download would."""
    umask = os.umask(0)
    os.umask(umask)
    for path in Path(folder).iterdir():
        if path.is_file() and not path.is_symlink() and stat.S_IMODE(path.stat().st_mode) == 0o600:
            os.chmod(path, 0o666 & ~umask)


def prepare_hub_folder(
    model,
    folder: str | os.PathLike,
    tokenizer=None,
    base_model: str | None = None,
    training_details: dict | None = None,
    repo_id: str | None = None,
    license: str | None = None,
    max_shard_size: str | int = "5GB",
    tags: list[str] | None = None,
) -> Path:
    """Write everything a Hub repository of `model` holds into `folder`: safetensors weights, config with
    `auto_map`, generated modeling code, generation config, tokenizer and a model card with `base_model`
    and `training_details`."""
    folder = Path(folder)
    model.save_pretrained(folder, max_shard_size=max_shard_size, strict_remote_code=True)  # no Hub repo without code
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    write_info(folder, base_model=base_model, training=training_details or None)
    write_model_card(folder, model.config, repo_id=repo_id, license=license, tags=tags)
    return folder


def upload_folder(folder, repo_id: str, token=None, private: bool | None = None, commit_message: str | None = None,
                  create_pr: bool = False, commit_description: str | None = None, revision: str | None = None):
    """Create the model repository if needed and upload `folder` in one commit."""
    import huggingface_hub

    api = huggingface_hub.HfApi(token=token)
    repo_id = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model").repo_id
    return api.upload_folder(
        repo_id=repo_id,
        folder_path=str(folder),
        repo_type="model",
        commit_message=commit_message or "Upload hf-dlm model",
        commit_description=commit_description,
        revision=revision,
        create_pr=create_pr,
    )


def push_to_hub(
    model,
    repo_id: str,
    tokenizer=None,
    base_model: str | None = None,
    training_details: dict | None = None,
    private: bool | None = None,
    token: str | None = None,
    commit_message: str | None = None,
    license: str | None = None,
    folder: str | os.PathLike | None = None,
    max_shard_size: str | int = "5GB",
    tags: list[str] | None = None,
    **upload_options,
):
    """Prepare the repository folder (in `folder`, or a temporary one) and upload it. Returns the
    `huggingface_hub` commit info. `upload_options`: create_pr, commit_description, revision."""
    with tempfile.TemporaryDirectory() as scratch:
        target = prepare_hub_folder(model, folder or scratch, tokenizer, base_model, training_details, repo_id, license,
                                    max_shard_size, tags)
        return upload_folder(target, repo_id, token=token, private=private, commit_message=commit_message,
                             **upload_options)


__all__ = ["save_with_remote_code", "write_hub_extras", "write_final_card", "prepare_hub_folder", "upload_folder",
           "push_to_hub"]
