"""Mesh topology: named axes dp_replicate x dp_shard x domain, and the views built on them.

Views (as torchtitan folds context parallel into the FSDP axis):
- ``dp``: dp_replicate x dp_shard, the data-parallel ranks (the sampler's split);
- ``fsdp``: dp_shard x domain flattened, the axis FSDP2 shards parameters over;
- ``hsdp``: (dp_replicate, fsdp), the 2-D mesh for replicate-then-shard;
- ``domain``: the ranks that split one sample's rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from framework.config.schema import ParallelConfig
from framework.errors import ConfigError

AXES = ("dp_replicate", "dp_shard", "domain")


@dataclass(frozen=True)
class Degrees:
    dp_replicate: int
    dp_shard: int
    domain: int

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.domain


def resolve(cfg: ParallelConfig, world_size: int) -> Degrees:
    """Fill the one ``-1`` axis and check the product against the world size (exit 2 if not)."""
    sizes = {"dp_replicate": cfg.dp_replicate, "dp_shard": cfg.dp_shard, "domain": cfg.domain}
    fixed = 1
    for v in sizes.values():
        if v != -1:
            fixed *= v
    free = [k for k, v in sizes.items() if v == -1]
    if free:
        if world_size % fixed:
            raise ConfigError(
                f"parallel: dp_replicate x dp_shard x domain = {_fmt(sizes)} cannot fill "
                f"{world_size} ranks ({world_size} is not divisible by {fixed}){_launch_hint(world_size, fixed)}"
            )
        sizes[free[0]] = world_size // fixed
    deg = Degrees(**sizes)
    if deg.world != world_size:
        raise ConfigError(
            f"parallel: dp_replicate x dp_shard x domain = {_fmt(sizes)} = {deg.world} "
            f"does not match the world size {world_size}{_launch_hint(world_size, deg.world)}"
        )
    return deg


def _launch_hint(world_size: int, needed: int) -> str:
    """A single process asked for several ranks: the command that starts them."""
    if world_size != 1 or needed <= 1:
        return ""
    return (
        f"; start {needed} processes: torchrun --nproc-per-node={needed} -m framework ... "
        f"(or srun -n {needed} python -m framework ... on SLURM)"
    )


def _fmt(sizes: dict) -> str:
    return " x ".join(str(v) for v in sizes.values())


@dataclass
class Topology:
    degrees: Degrees
    mesh: Any  # torch DeviceMesh, None in a single process
    dp_rank: int
    domain_rank: int
    # flattened / 2-D meshes, kept here (slicing them off the root is deprecated)
    views: dict[str, Any] = field(default_factory=dict)

    @property
    def dp_size(self) -> int:
        return self.degrees.dp

    def view(self, name: str):
        """A sub-mesh by view name (see module docstring); None in a single process."""
        if self.mesh is None:
            return None
        if name in self.views:
            return self.views[name]
        return self.mesh[name]

    def group(self, name: str):
        mesh = self.view(name)
        return None if mesh is None else mesh.get_group()

    def describe(self) -> str:
        d = self.degrees
        return f"dp_replicate={d.dp_replicate} x dp_shard={d.dp_shard} x domain={d.domain}"


def build(degrees: Degrees, device_type: str) -> Topology:
    if degrees.world == 1:
        return Topology(degrees, None, 0, 0, {})
    from torch.distributed.device_mesh import init_device_mesh

    from framework.compat import flatten_mesh

    r, s, d = degrees.dp_replicate, degrees.dp_shard, degrees.domain
    mesh = init_device_mesh(device_type, (r, s, d), mesh_dim_names=AXES)
    views = {
        "dp": flatten_mesh(mesh, ("dp_replicate", "dp_shard"), "dp"),
        "fsdp": flatten_mesh(mesh, ("dp_shard", "domain"), "fsdp"),
    }
    if r > 1:
        # The same ranks, row-major, seen as (replicate, shard x domain): FSDP2's HSDP mesh.
        views["hsdp"] = init_device_mesh(device_type, (r, s * d), mesh_dim_names=("dp_replicate", "fsdp"))
    dp_rank = mesh.get_local_rank("dp_replicate") * s + mesh.get_local_rank("dp_shard")
    return Topology(degrees, mesh, dp_rank, mesh.get_local_rank("domain"), views)
