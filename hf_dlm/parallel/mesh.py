"""One device mesh with named dimensions for every parallelism (torchtitan's `ParallelDims`).

World mesh dimensions, outermost first: `pp`, `dp_replicate`, `dp_shard`, `cp`, `tp` (tensor parallel
innermost: its collectives run every layer, so its ranks are neighbours on the fastest links). Every
dimension is in the mesh even at size 1, so a sub-mesh always exists and adding one is a one-line change.
Flattened sub-meshes (DeviceMesh `_flatten`, as torchtitan), kept in `ParallelDims.meshes`:

- `dp` = dp_replicate x dp_shard: ranks that read different data;
- `dp_shard_cp` = dp_shard x cp: what FSDP2 shards parameters over (CP ranks hold the same weights, so
  they shard them too, and their gradients are summed by the same reduce-scatter);
- `dp_cp` = dp_replicate x dp_shard x cp: ranks whose losses and gradients are summed;
- `ep` = part of dp_shard x cp, borrowed for experts (torchtitan's layout), in `ParallelDims.expert_meshes`:
  a second mesh over the same ranks splits `dp_shard` into `efsdp` x `dp_shard_in_ep`, and `ep` =
  dp_shard_in_ep x cp. Experts are FSDP-sharded over `efsdp` (the rest of dp_shard x cp).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

DIM_NAMES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass
class ParallelDims:
    """Sizes of the parallel dimensions. `dp_shard=-1` takes whatever the world size leaves.

    ep: expert-parallel size, borrowed from dp_shard x cp (it must be a multiple of cp, and ep // cp must
    divide dp_shard), so experts add no ranks of their own.
    """

    world_size: int
    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1

    def __post_init__(self):
        for field in fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, int) or (value < 1 and not (field.name == "dp_shard" and value == -1)):
                raise ValueError(f"ParallelDims.{field.name} must be a positive integer"
                                 f"{' or -1' if field.name == 'dp_shard' else ''}, got {value!r}")
        others = self.dp_replicate * self.cp * self.tp * self.pp
        if self.dp_shard == -1:
            if self.world_size % others:
                raise ValueError(f"world size {self.world_size} is not divisible by dp_replicate x cp x tp x pp = {others}")
            self.dp_shard = self.world_size // others
        if others * self.dp_shard != self.world_size:
            raise ValueError(
                f"pp ({self.pp}) x dp_replicate ({self.dp_replicate}) x dp_shard ({self.dp_shard}) x cp ({self.cp}) "
                f"x tp ({self.tp}) = {others * self.dp_shard} must equal the world size {self.world_size}")
        if self.ep > 1 and (self.ep % self.cp or self.dp_shard % (self.ep // self.cp)):
            raise ValueError(f"ep ({self.ep}) borrows from dp_shard x cp: it must be a multiple of cp ({self.cp}) "
                             f"and ep // cp must divide dp_shard ({self.dp_shard})")

    @classmethod
    def from_parallelism_config(cls, parallelism_config, world_size: int, ep: int = 1, pp: int = 1) -> "ParallelDims":
        """From accelerate's `ParallelismConfig` (transformers' `TrainingArguments.parallelism_config`)."""
        def size(name):
            return getattr(parallelism_config, f"{name}_size", None) or 1

        if size("sp") > 1:
            raise ValueError("ParallelismConfig.sp_size (DeepSpeed Ulysses) is not supported by hf-dlm; use cp_size")
        dp_shard = getattr(parallelism_config, "dp_shard_size", None) or -1
        return cls(world_size=world_size, dp_replicate=size("dp_replicate"), dp_shard=dp_shard, cp=size("cp"),
                   tp=size("tp"), pp=pp, ep=ep)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def loss_parallel_size(self) -> int:
        """Ranks whose losses are summed (the data-parallel and context-parallel ranks)."""
        return self.dp_replicate * self.dp_shard * self.cp

    def describe(self) -> str:
        return " x ".join(f"{name}={getattr(self, name)}" for name in DIM_NAMES + ("ep",) if getattr(self, name) > 1) or "single"

    def build_mesh(self, device_type: str = "cuda"):
        """The world `DeviceMesh` over (pp, dp_replicate, dp_shard, cp, tp) with the flattened sub-meshes `dp`,
        `dp_shard_cp` and `dp_cp`; with ep > 1 also `self.expert_meshes` {"ep", "efsdp"} (see the module docstring).
        accelerate reads the root dimension names (its data loaders give TP / CP ranks the same batches)."""
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device_type, tuple(getattr(self, name) for name in DIM_NAMES), mesh_dim_names=DIM_NAMES)
        self.meshes = {name: mesh[name] for name in DIM_NAMES}
        for name, dims in (("dp", ("dp_replicate", "dp_shard")), ("dp_shard_cp", ("dp_shard", "cp")),
                           ("dp_cp", ("dp_replicate", "dp_shard", "cp"))):
            self.meshes[name] = mesh[dims]._flatten(name)
        self.expert_meshes = {}
        if self.ep > 1:  # a second mesh over the same ranks, dp_shard split into (efsdp, the part ep borrows)
            in_ep = self.ep // self.cp
            names = ("pp", "dp_replicate", "efsdp", "dp_shard_in_ep", "cp", "tp")
            shape = (self.pp, self.dp_replicate, self.dp_shard // in_ep, in_ep, self.cp, self.tp)
            expert_mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
            self.expert_meshes = {"ep": expert_mesh["dp_shard_in_ep", "cp"]._flatten("ep"),
                                  "efsdp": expert_mesh["efsdp"]}
        self.world_mesh = mesh
        return mesh

    def fsdp_mesh(self):
        """FSDP2's mesh: 1-D dp_shard x cp, or 2-D (dp_replicate, dp_shard x cp) for HSDP."""
        if self.dp_replicate > 1:
            return self.world_mesh["dp_replicate", "dp_shard_cp"]
        return self.meshes["dp_shard_cp"]


def build_parallel_dims(args, world_size: int) -> ParallelDims:
    """From hf-dlm's training arguments (`tp_size`, `cp_size`, `dp_shard_size`, `dp_replicate_size`, `ep_size`,
    `pp_size`; a `parallelism_config` was turned into these when the arguments were built), or from
    `args.parallelism_config` (accelerate's) for other argument objects that carry one."""
    ep, pp = getattr(args, "ep_size", 1) or 1, getattr(args, "pp_size", 1) or 1
    config = getattr(args, "parallelism_config", None)
    if config is not None:
        return ParallelDims.from_parallelism_config(config, world_size, ep=ep, pp=pp)
    return ParallelDims(world_size=world_size, dp_replicate=getattr(args, "dp_replicate_size", 1) or 1,
                        dp_shard=getattr(args, "dp_shard_size", -1) or -1, cp=getattr(args, "cp_size", 1) or 1,
                        tp=getattr(args, "tp_size", 1) or 1, pp=pp, ep=ep)
