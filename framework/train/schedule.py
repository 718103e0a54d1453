"""Learning-rate schedules: linear warmup, then constant or cosine, as LambdaLR factors."""

from __future__ import annotations

import math

import torch

from framework import registry
from framework.config.schema import ScheduleConfig


def _warmup(step: int, warmup: int) -> float:
    # Step 0 trains at lr/(warmup+1) rather than 0, so no optimizer step is wasted.
    return min(1.0, (step + 1) / (warmup + 1)) if warmup > 0 else 1.0


@registry.schedules.register("constant", ScheduleConfig)
def constant(cfg: ScheduleConfig, max_steps: int):
    return lambda step: _warmup(step, cfg.warmup_steps)


@registry.schedules.register("cosine", ScheduleConfig)
def cosine(cfg: ScheduleConfig, max_steps: int):
    span = max(1, max_steps - cfg.warmup_steps)

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return _warmup(step, cfg.warmup_steps)
        t = min(1.0, (step - cfg.warmup_steps) / span)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t))

    return factor


def build(cfg: ScheduleConfig, optimizer: torch.optim.Optimizer, max_steps: int):
    factor = registry.schedules.build(cfg.name, cfg, max_steps)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
