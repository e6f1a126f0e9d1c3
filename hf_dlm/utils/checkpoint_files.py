"""Reading a checkpoint folder's files before a resume, so a truncated or corrupt file is one line naming it
(and the checkpoint to fall back to) instead of a 39-line traceback from deep inside torch.load, or a JSON
error that names no file. Only the files' framing is read (a safetensors header, a zip directory, a JSON
document), never the tensors, so the check costs nothing next to the resume itself."""

from __future__ import annotations

import json
import os
import re
import struct
import zipfile

from .errors import FieldError

_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


class CheckpointFileError(FieldError):
    """A checkpoint file that cannot be read; `field` is the file's path."""


def _safetensors_problem(path: str) -> str | None:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{size} bytes, shorter than a safetensors header"
        (length,) = struct.unpack("<Q", head)
        if 8 + length > size:
            return f"its header needs {8 + length} bytes, the file has {size}"
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            return f"its header is not valid JSON ({error})"
    end = max((entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"), default=0)
    if 8 + length + end > size:
        return f"its tensors need {8 + length + end} bytes, the file has {size}"
    return None


def _torch_file_problem(path: str) -> str | None:
    """torch.save writes a zip archive whose directory sits at the end: a truncated file has none."""
    if not zipfile.is_zipfile(path):
        with open(path, "rb") as f:
            if f.read(2) == b"\x80\x02":  # the legacy pickle format (_use_new_zipfile_serialization=False)
                return None
        return "not a complete torch.save archive (no zip directory: truncated?)"
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
            if not any(name.endswith("data.pkl") for name in names):
                return "its archive has no data.pkl"
    except (zipfile.BadZipFile, OSError) as error:
        return f"not a readable torch.save archive ({error})"
    return None


def _json_problem(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        return f"not valid JSON ({error})"
    return None


_READERS = {".safetensors": _safetensors_problem, ".pt": _torch_file_problem, ".pth": _torch_file_problem,
            ".bin": _torch_file_problem, ".json": _json_problem}


def previous_checkpoint(checkpoint: str) -> str | None:
    """The sibling `checkpoint-N` folder with the largest step below this one's, or None."""
    folder, name = os.path.split(os.path.normpath(checkpoint))
    match = _CHECKPOINT.match(name)
    if match is None or not os.path.isdir(folder or "."):
        return None
    step = int(match.group(1))
    earlier = [(int(m.group(1)), entry) for entry in os.listdir(folder or ".")
               if (m := _CHECKPOINT.match(entry)) and int(m.group(1)) < step]
    return os.path.join(folder, max(earlier)[1]) if earlier else None


def check_checkpoint_files(checkpoint: str, resume_hint: str = "resume_from_checkpoint") -> None:
    """Raise CheckpointFileError naming the first file of `checkpoint` (top level: weights, optimizer,
    scheduler, RNG and trainer state) that cannot be read, and the checkpoint to resume from instead."""
    for name in sorted(os.listdir(checkpoint)):
        path = os.path.join(checkpoint, name)
        reader = _READERS.get(os.path.splitext(name)[1])
        if reader is None or not os.path.isfile(path):
            continue
        problem = reader(path)
        if problem is not None:
            earlier = previous_checkpoint(checkpoint)
            hint = (f"resume from the previous checkpoint ({resume_hint}={earlier})" if earlier
                    else f"no earlier checkpoint to resume from: unset {resume_hint} to start afresh")
            raise CheckpointFileError(path, f"{path}: cannot be read ({problem}); {hint}", path)


__all__ = ["CheckpointFileError", "check_checkpoint_files", "previous_checkpoint"]
