"""Sharding policies: applied to a finished model; model code stays untouched.

- ``none``: the model as is (one process, or a domain-only layout).
- ``ddp``: DistributedDataParallel over the data-parallel ranks.
- ``fsdp2``: ``fully_shard`` per unit (bottom-up), then the root, over dp_shard x domain
  flattened; with ``dp_replicate > 1`` that mesh is 2-D and FSDP2 does HSDP.
- ``hsdp``: the same policy; its preset sets dp_replicate=2.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.nn as nn

from framework import registry
from framework.config.schema import ShardingConfig
from framework.errors import ConfigError


@dataclass
class Sharded:
    """What a policy did, for the start-up report and the trainer."""

    model: nn.Module
    kind: str
    units: list[str] = field(default_factory=list)  # "name (reshard=...)" per wrapped unit
    mixed_precision: bool = False  # FSDP2 casts params: no autocast needed for that dtype


@registry.sharding.register("none", ShardingConfig)
def no_sharding(model: nn.Module, cfg: ShardingConfig, **_) -> Sharded:
    return Sharded(model, "none")


@registry.sharding.register("ddp", ShardingConfig)
def ddp(model: nn.Module, cfg: ShardingConfig, *, topology, device, **_) -> Sharded:
    if topology.mesh is None:
        return Sharded(model, "none")
    from torch.nn.parallel import DistributedDataParallel

    ids = [device.index] if device.type == "cuda" else None
    # Over every rank: domain ranks of one sample hold replicas too, and their gradient
    # contributions must be summed (the task weights their losses so the average is right).
    wrapped = DistributedDataParallel(model, device_ids=ids)
    return Sharded(wrapped, "ddp")


def find_units(model: nn.Module, names: list[str]) -> list[tuple[str, nn.Module]]:
    """FSDP units: modules of the named classes, or by default the repeated composite blocks.

    "Repeated composite" = a model class with child modules that occurs at least twice (a
    UNet block, a transformer block; not torch's generic containers such as nn.Sequential);
    units nested inside another unit are left to it.
    """
    modules = list(model.named_modules())[1:]
    if names:
        unknown = set(names) - {type(m).__name__ for _, m in modules}
        if unknown:
            raise ConfigError(f"sharding.units: no module of class {sorted(unknown)} in the model")
        wanted = set(names)
    else:
        containers = (nn.ModuleDict, nn.ModuleList, nn.Sequential)
        counts = Counter(
            type(m).__name__ for _, m in modules if any(True for _ in m.children()) and not isinstance(m, containers)
        )
        wanted = {n for n, c in counts.items() if c >= 2}
    picked: list[tuple[str, nn.Module]] = []
    for name, m in modules:
        if type(m).__name__ in wanted and not any(name.startswith(p + ".") for p, _ in picked):
            if any(p.requires_grad for p in m.parameters()):
                picked.append((name, m))
    return picked


def _contiguous_params(model: nn.Module) -> None:
    # FSDP2 rejects non-contiguous parameters (channels_last conv weights); the
    # activations may stay channels_last, only the parameter storage changes.
    for p in model.parameters():
        if not p.is_contiguous():
            p.data = p.data.contiguous()


@registry.sharding.register("fsdp2", ShardingConfig)
def fsdp2(model: nn.Module, cfg: ShardingConfig, *, topology, precision, **_) -> Sharded:
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, fully_shard

    if topology.mesh is None:
        return Sharded(model, "none")
    mesh = topology.view("hsdp" if topology.degrees.dp_replicate > 1 else "fsdp")
    kwargs: dict[str, Any] = {"mesh": mesh}
    mp = precision.mixed_precision_policy() if precision.autocast_dtype == torch.bfloat16 else None
    if mp is not None:
        kwargs["mp_policy"] = mp
    if cfg.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    _contiguous_params(model)
    units = find_units(model, list(cfg.units))
    described = []
    for i, (name, unit) in enumerate(units):
        # default: free each unit's gathered params after forward, except the last one,
        # whose backward starts at once (torchtitan's choice)
        reshard = {"always": True, "never": False}.get(cfg.reshard_after_forward, i < len(units) - 1)
        fully_shard(unit, reshard_after_forward=reshard, **kwargs)
        described.append(f"{name} (reshard={reshard})")
    fully_shard(model, reshard_after_forward=cfg.reshard_after_forward == "always", **kwargs)
    described.append(f"<root> (reshard={cfg.reshard_after_forward == 'always'})")
    if cfg.forward_prefetch:
        sharded = [cast(FSDPModule, unit) for _, unit in units]  # fully_shard made them FSDPModules
        for cur, nxt in zip(sharded, sharded[1:]):
            cur.set_modules_to_forward_prefetch([nxt])
    kind = "hsdp" if topology.degrees.dp_replicate > 1 else "fsdp2"
    return Sharded(model, kind, described, mixed_precision=mp is not None)


registry.sharding.add("hsdp", ShardingConfig, fsdp2)
