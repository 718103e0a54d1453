"""DataLoader construction: workers, pinning, a start method that is safe with CUDA."""

from __future__ import annotations

import signal

import torch
from torch.utils.data import DataLoader

from framework.data.sampler import GlobalBatchSampler, shard_range


def _context(num_workers: int):
    if num_workers == 0:
        return None
    # fork after CUDA initialisation breaks the child; forkserver is safe and cheap.
    return "forkserver" if torch.cuda.is_available() and torch.cuda.is_initialized() else None


def _worker_init(_):
    # A terminal's Ctrl-C reaches the workers too; the main process turns it into a checkpoint
    # and a clean stop, which a worker dying of KeyboardInterrupt would break.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def train_loader(
    dataset, sampler: GlobalBatchSampler, *, num_workers: int, pin_memory: bool, device: torch.device
) -> DataLoader:
    return DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        pin_memory=pin_memory and device.type == "cuda",
        multiprocessing_context=_context(num_workers),
        worker_init_fn=_worker_init if num_workers else None,
        persistent_workers=num_workers > 0,
    )


def eval_loader(
    dataset,
    *,
    batch_size: int,
    dp_rank: int,
    dp_size: int,
    max_batches: int,
    num_workers: int,
    pin_memory: bool,
    device: torch.device,
) -> DataLoader:
    """Fixed order; ``max_batches`` (0: all) counts global batches of ``batch_size``."""
    n = len(dataset)
    if max_batches:
        n = min(n, max_batches * batch_size)
    stride = max(1, len(dataset) // n)  # spread a limited evaluation over the whole split
    picked = list(range(0, stride * n, stride))[:n]
    mine = [picked[i] for i in shard_range(len(picked), dp_rank, dp_size)]
    subset = torch.utils.data.Subset(dataset, mine)
    local_batch = max(1, batch_size // dp_size)
    return DataLoader(
        subset,
        batch_size=local_batch,
        shuffle=False,
        num_workers=num_workers,
        pin_memory=pin_memory and device.type == "cuda",
        multiprocessing_context=_context(num_workers),
        worker_init_fn=_worker_init if num_workers else None,
    )
