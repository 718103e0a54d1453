"""Measured, not estimated: throughput, FLOPs per sample, MFU and peak memory."""

from __future__ import annotations

import contextlib
import resource
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch

# Dense peak TFLOP/s by device name fragment and compute dtype (vendor datasheets).
_PEAK_TFLOPS = {
    "H200": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0},
    "H100": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
}


def peak_tflops(device: torch.device, precision: str) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, table in _PEAK_TFLOPS.items():
        if key in name:
            return table.get(precision)
    return None


def peak_memory_gb(device: torch.device) -> float:
    """GPU: peak allocated by torch; CPU: the process's peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


def reserved_memory_gb(device: torch.device) -> float | None:
    """GPU: peak held by torch's caching allocator, CUDA-graph pools included (what the card
    must have; ``peak_memory_gb`` misses a graph pool's memory); None elsewhere."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_reserved(device) / 2**30


def count_flops(fn) -> tuple[Any, int]:
    """Run ``fn`` once under FlopCounterMode; returns (its result, FLOPs it executed)."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        out = fn()
    return out, counter.get_total_flops()


class Stopwatch:
    """Wall time between laps (synchronised with the GPU), and how much of it the loop spent
    waiting for its input (``waiting``): the share a step stalls on the data loader, which
    torchtitan reports as its data-loading time. Where the GPU is the bottleneck the loader's
    workers stay ahead and the wait is near zero."""

    def __init__(self, device: torch.device):
        self.device = device
        self.t = time.perf_counter()
        self._waited = 0.0
        self.waited = 0.0  # seconds spent in ``waiting`` during the last lap

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._waited += time.perf_counter() - t0

    def lap(self, sync: bool = True) -> float:
        if sync and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        dt, self.t = now - self.t, now
        self.waited, self._waited = self._waited, 0.0
        return dt
