"""Sharding policies: applied to a finished model; model code stays untouched."""

from __future__ import annotations

import torch.nn as nn

from framework import registry
from framework.config.schema import ShardingConfig


@registry.sharding.register("none", ShardingConfig)
def no_sharding(model: nn.Module, cfg: ShardingConfig, **_) -> nn.Module:
    return model


for _name in ("ddp", "fsdp2", "hsdp"):
    registry.sharding.add(_name, ShardingConfig, pending="issue 3, distributed engine")
