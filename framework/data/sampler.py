"""Mesh-independent, resumable batch sampling.

Global batch k is a fixed slice of a permutation drawn from (seed, epoch) alone, so the
samples it holds never depend on how many ranks share it; data-parallel rank r takes
its contiguous share. The position is just the global step: resuming at step k
continues exactly where an unbroken run would be.
"""

from __future__ import annotations

import torch

from framework.errors import ConfigError


def micro_batch(global_batch: int, dp_size: int, grad_accum: int) -> int:
    """Samples per forward on each rank: ``data.batch_size`` split over the data-parallel ranks,
    then into ``trainer.grad_accum`` equal micro-batches (a remainder would never be trained on)."""
    if global_batch % dp_size:
        raise ConfigError(f"data.batch_size: {global_batch} is not divisible by the {dp_size} data-parallel ranks")
    per_rank = global_batch // dp_size
    if per_rank % grad_accum:
        where = f" ({global_batch} over {dp_size} data-parallel ranks)" if dp_size > 1 else ""
        raise ConfigError(
            f"trainer.grad_accum={grad_accum}: the {per_rank} samples per rank{where} do not split into "
            f"{grad_accum} equal micro-batches; make data.batch_size a multiple of {grad_accum * dp_size}"
        )
    return per_rank // grad_accum


class GlobalBatchSampler(torch.utils.data.Sampler):
    def __init__(
        self,
        num_samples: int,
        global_batch: int,
        *,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        start_step: int = 0,
        shuffle: bool = True,
    ):
        if global_batch % dp_size:
            raise ConfigError(f"data.batch_size: {global_batch} is not divisible by the {dp_size} data-parallel ranks")
        if num_samples < global_batch:
            raise ConfigError(f"data.batch_size: {global_batch} exceeds the {num_samples} training samples")
        self.num_samples, self.global_batch = num_samples, global_batch
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.seed, self.shuffle = seed, shuffle
        self.step = start_step
        self.steps_per_epoch = num_samples // global_batch  # the remainder is dropped
        self._epoch: int | None = None  # the epoch _perm belongs to; None: none yet
        self._perm: list[int] = []

    def global_batch_indices(self, step: int) -> list[int]:
        epoch, k = divmod(step, self.steps_per_epoch)
        if epoch != self._epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                self._perm = torch.randperm(self.num_samples, generator=g).tolist()
            else:
                self._perm = list(range(self.num_samples))
            self._epoch = epoch
        return self._perm[k * self.global_batch : (k + 1) * self.global_batch]

    def local_indices(self, step: int) -> list[int]:
        per_rank = self.global_batch // self.dp_size
        batch = self.global_batch_indices(step)
        return batch[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank]

    def __iter__(self):
        # Infinite: training is counted in steps, epochs roll over inside.
        while True:
            step, self.step = self.step, self.step + 1
            yield self.local_indices(step)

    def __len__(self):  # DataLoader asks; one epoch's worth
        return self.steps_per_epoch


def shard_range(n: int, rank: int, size: int) -> range:
    """Contiguous, nearly equal share of ``range(n)`` for evaluation."""
    base, extra = divmod(n, size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))
