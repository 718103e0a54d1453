"""ShardTensor: a tensor split along one spatial dim over the domain axis.

Used at the boundaries (data, loss, metrics, plots): the local rows plus the spec
(mesh axis, tensor dim, global shape, every rank's extent). Inside the model the
domain-parallel layers work on plain local tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from framework.errors import ConfigError


def split_extents(rows: int, parts: int, multiple: int = 1) -> list[int]:
    """Rows per rank, each a multiple of ``multiple`` (the model's total down-sampling),
    as even as that allows; the first ranks take the remainder."""
    if rows % multiple:
        raise ConfigError(f"data.grid: {rows} rows are not a multiple of {multiple}, the model's total "
                          f"down-sampling")
    units = rows // multiple
    if units < parts:
        raise ConfigError(f"parallel.domain: {rows} rows cannot be split over {parts} domain ranks in "
                          f"multiples of {multiple} (at most {units} ranks)")
    base, extra = divmod(units, parts)
    return [(base + (1 if r < extra else 0)) * multiple for r in range(parts)]


@dataclass(frozen=True)
class ShardSpec:
    mesh_axis: str
    dim: int
    global_shape: tuple[int, ...]
    extents: tuple[int, ...]

    def offset(self, rank: int) -> int:
        return sum(self.extents[:rank])


class ShardTensor:
    def __init__(self, local: torch.Tensor, spec: ShardSpec, group=None):
        self.local, self.spec, self.group = local, spec, group
        self.rank = dist.get_rank(group) if group is not None else 0
        if local.shape[spec.dim] != spec.extents[self.rank]:
            raise ValueError(f"local tensor has {local.shape[spec.dim]} rows along dim {spec.dim}, "
                             f"spec says {spec.extents[self.rank]}")

    # -- construction ------------------------------------------------------------------
    @classmethod
    def scatter(cls, full: torch.Tensor, group, dim: int = 2, extents=None, mesh_axis="domain"):
        """Every rank holds ``full``; each keeps its rows (no communication)."""
        size = dist.get_world_size(group) if group is not None else 1
        extents = list(extents) if extents is not None else split_extents(full.shape[dim], size)
        rank = dist.get_rank(group) if group is not None else 0
        spec = ShardSpec(mesh_axis, dim, tuple(full.shape), tuple(extents))
        return cls(full.narrow(dim, spec.offset(rank), extents[rank]).contiguous(), spec, group)

    @classmethod
    def from_local(cls, local: torch.Tensor, group, dim: int = 2, mesh_axis="domain"):
        """Build from each rank's rows; the extents are exchanged (one small all-gather)."""
        size = dist.get_world_size(group) if group is not None else 1
        mine = torch.tensor([local.shape[dim]], dtype=torch.int64, device=local.device)
        every = [torch.zeros_like(mine) for _ in range(size)]
        if group is not None:
            dist.all_gather(every, mine, group=group)
        else:
            every = [mine]
        extents = tuple(int(e) for e in every)
        shape = list(local.shape)
        shape[dim] = sum(extents)
        return cls(local, ShardSpec(mesh_axis, dim, tuple(shape), extents), group)

    # -- views ----------------------------------------------------------------------------
    def full_tensor(self) -> torch.Tensor:
        """Gather every rank's rows (differentiable)."""
        from framework.domain.comm import DomainGroup, gather_rows

        if self.group is None:
            return self.local
        dg = DomainGroup(self.group, list(self.spec.extents))
        return gather_rows(self.local, dg, self.spec.dim)

    def to_dtensor(self, mesh):
        """As a torch DTensor sharded on ``dim`` (extents must follow torch.chunk's split)."""
        from torch.distributed.tensor import DTensor, Shard

        n, size = self.spec.global_shape[self.spec.dim], len(self.spec.extents)
        chunk = -(-n // size)
        expected = tuple(max(0, min(chunk, n - r * chunk)) for r in range(size))
        if expected != self.spec.extents:
            raise ValueError(f"extents {self.spec.extents} do not follow DTensor's even split {expected}")
        return DTensor.from_local(self.local, mesh, [Shard(self.spec.dim)], shape=self.spec.global_shape,
                                  stride=_contiguous_stride(self.spec.global_shape))

    @classmethod
    def from_dtensor(cls, dt, mesh_axis="domain"):
        from torch.distributed.tensor import Shard

        (placement,) = dt.placements
        if not isinstance(placement, Shard):
            raise ValueError(f"DTensor placement {placement} is not a Shard")
        group = dt.device_mesh.get_group()
        return cls.from_local(dt.to_local(), group, placement.dim, mesh_axis)

    @property
    def shape(self):
        return torch.Size(self.spec.global_shape)

    def __repr__(self):
        return f"ShardTensor(local={tuple(self.local.shape)}, spec={self.spec})"


def _contiguous_stride(shape):
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= n
    return tuple(reversed(stride))
