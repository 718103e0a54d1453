"""Thin collectives that are no-ops in a single process."""

from __future__ import annotations

import torch
import torch.distributed as dist


def active() -> bool:
    return dist.is_available() and dist.is_initialized()


def barrier() -> None:
    if active():
        dist.barrier()


def all_reduce_sum(t: torch.Tensor, group=None) -> torch.Tensor:
    if active():
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def all_reduce_mean(t: torch.Tensor, group=None) -> torch.Tensor:
    if active():
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
        t /= dist.get_world_size(group)
    return t
