"""Checkpoints of a pipeline-parallel model in layouts any other run can read.

- Weights: every stage writes its own safetensors shard under the full model's `save_pretrained` keys, and
  rank 0 writes `model.safetensors.index.json`, the config and the remote code, so the folder is an ordinary
  sharded `save_pretrained` folder: `from_pretrained`, a pp_size=1 resume or any other pipeline layout loads
  it. No rank ever holds more than its own stages.
- Optimizer state: `torch.distributed.checkpoint` (DCP) with the optimizer state flattened to the same
  parameter names (`get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)`), so DCP's resharding
  loads it into any layout: another pp_size, FSDP2 or one process.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from ..utils.publishing import publisher

OPTIMIZER_DCP_DIR = "optim_dcp"  # not "optimizer*": the Trainer takes any folder named so for its own format
SHARD_NAME = "model-{index:05d}-of-{total:05d}.safetensors"
INDEX_NAME = "model.safetensors.index.json"


def _full_state_dict(module) -> dict[str, torch.Tensor]:
    """The module's parameters and persistent buffers as full CPU tensors (FSDP2 shards gathered: a
    collective over the module's data-parallel ranks)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # not cpu_offload=True: that keeps the tensors on global rank 0 only, and every stage's rank writes its own
    state_dict = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
    return {key: tensor.detach().cpu() for key, tensor in state_dict.items()}


def save_pipeline_pretrained(pipeline, save_directory: str, is_main_process: bool, dp_rank: int = 0) -> None:
    """Write `pipeline`'s weights as a sharded `save_pretrained` folder (one shard per stage): every rank calls it.
    dp_rank: this rank's data-parallel index (rank 0 of each stage's replicas writes its shard)."""
    from safetensors.torch import save_file

    os.makedirs(save_directory, exist_ok=True)
    total = pipeline.pp_size * pipeline.stages_per_rank
    weight_map: dict[str, tuple[str, int]] = {}
    for stage in pipeline.stages:
        state_dict = _full_state_dict(stage.submod)
        name = SHARD_NAME.format(index=stage.stage_index + 1, total=total)
        if dp_rank == 0:
            save_file({k: v.contiguous() for k, v in state_dict.items()}, os.path.join(save_directory, name),
                      metadata={"format": "pt"})
        weight_map.update({key: (name, tensor.numel() * tensor.element_size()) for key, tensor in state_dict.items()})
    maps: list = [None] * pipeline.pp_size
    dist.all_gather_object(maps, weight_map, group=pipeline.group)
    if is_main_process:
        merged = {key: entry for part in maps for key, entry in part.items()}
        config = pipeline.model.config
        with open(os.path.join(save_directory, INDEX_NAME), "w") as f:
            json.dump({"metadata": {"total_size": sum(size for _, size in merged.values()),
                                    "total_parameters": pipeline.num_parameters},
                       "weight_map": {key: name for key, (name, _) in sorted(merged.items())}}, f, indent=2)
        config.save_pretrained(save_directory)
        publisher().write_hub_extras(save_directory, config)  # what the model's save_pretrained adds


def load_pipeline_weights(pipeline, checkpoint_dir: str) -> None:
    """Load this rank's stages from any `save_pretrained` folder (one file or sharded), reading only their keys."""
    from safetensors import safe_open
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    index_path = os.path.join(checkpoint_dir, INDEX_NAME)
    if os.path.isfile(index_path):
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
    elif os.path.isfile(os.path.join(checkpoint_dir, "model.safetensors")):
        weight_map = None
    else:
        raise FileNotFoundError(f"{checkpoint_dir}: no model.safetensors or {INDEX_NAME} to load the stages from")
    for stage in pipeline.stages:
        keys = list(stage.submod.state_dict())
        files: dict[str, list[str]] = {}
        for key in keys:
            name = "model.safetensors" if weight_map is None else weight_map.get(key)
            if name is None:
                raise KeyError(f"{checkpoint_dir}: {INDEX_NAME} has no weight {key!r}")
            files.setdefault(name, []).append(key)
        state_dict = {}
        for name, names in files.items():
            with safe_open(os.path.join(checkpoint_dir, name), framework="pt") as f:
                missing = set(names) - set(f.keys())
                if missing:
                    raise KeyError(f"{checkpoint_dir}/{name} lacks {sorted(missing)[:3]}")
                state_dict.update({key: f.get_tensor(key) for key in names})
        set_model_state_dict(stage.submod, state_dict, options=StateDictOptions(full_state_dict=True))


def save_optimizer_dcp(model, optimizer, checkpoint_dir: str, process_group=None) -> None:
    """The optimizer state of `model`'s parameters under their names, through DCP (every rank calls it)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    state = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True))
    dcp.save({"optimizer": state}, checkpoint_id=os.path.join(checkpoint_dir, OPTIMIZER_DCP_DIR),
             process_group=process_group)


def load_optimizer_dcp(model, optimizer, checkpoint_dir: str, process_group=None) -> None:
    """Load a DCP optimizer state written by `save_optimizer_dcp` in any layout. Without a process group
    (one process, no torch.distributed) DCP reads it directly."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)

    options = StateDictOptions(flatten_optimizer_state_dict=True)
    # a fresh optimizer gets zero states first (inside get_optimizer_state_dict): DCP loads into tensors
    state = {"optimizer": get_optimizer_state_dict(model, optimizer, options=options)}
    dcp.load(state, checkpoint_id=os.path.join(checkpoint_dir, OPTIMIZER_DCP_DIR), process_group=process_group,
             no_dist=not (dist.is_available() and dist.is_initialized()))
    set_optimizer_state_dict(model, optimizer, state["optimizer"], options=options)


def has_optimizer_dcp(checkpoint_dir: str) -> bool:
    return os.path.isdir(os.path.join(checkpoint_dir, OPTIMIZER_DCP_DIR))


__all__ = ["save_pipeline_pretrained", "load_pipeline_weights", "save_optimizer_dcp", "load_optimizer_dcp",
           "has_optimizer_dcp", "OPTIMIZER_DCP_DIR"]
