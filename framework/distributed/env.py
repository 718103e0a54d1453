"""Where this process runs: rank, world size, local rank and device.

torchrun's variables first, then SLURM's (through submitit's job environment), else one
process. The same code path serves 1 and N processes.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    source: str = "single"  # single | torchrun | slurm

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def detect() -> DistEnv:
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return DistEnv(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)), "torchrun")
    if "SLURM_JOB_ID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        return _slurm()
    return DistEnv()


def _slurm() -> DistEnv:
    """One task per GPU under srun/submitit; rendezvous on the job's first node.

    The port is derived from the job id, so a requeued job (same id) finds the same one.
    """
    from submitit.slurm.slurm import SlurmJobEnvironment  # parses SLURM_JOB_NODELIST

    job = SlurmJobEnvironment()
    os.environ.setdefault("MASTER_ADDR", job.hostnames[0])
    # SLURM_JOB_ID differs per job of an array (a sweep) and survives a requeue
    os.environ.setdefault("MASTER_PORT", str(20000 + int(os.environ["SLURM_JOB_ID"]) % 20000))
    return DistEnv(job.global_rank, job.num_tasks, job.local_rank, "slurm")


def pick_device(requested: str, env: DistEnv) -> torch.device:
    """``auto`` takes the GPU of this local rank when CUDA exists, else the CPU."""
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        from framework.errors import ConfigError

        raise ConfigError("device: 'cuda' requested but no CUDA device is available")
    device = torch.device("cuda", env.local_rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


@contextlib.contextmanager
def process_group(env: DistEnv, device: torch.device, timeout_s: float):
    """Init the default process group for N > 1 processes; always torn down on exit.

    Every collective gets ``timeout_s``: a rank that died or hangs makes the others fail
    with an error naming the timeout instead of waiting forever.
    """
    import torch.distributed as dist

    if not env.distributed:
        yield
        return
    global _timeout
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend, rank=env.rank, world_size=env.world_size, timeout=timeout, **kwargs)
    _timeout = timeout
    done = False
    try:
        yield
        done = True
    finally:
        _timeout = None
        with contextlib.suppress(Exception):  # a broken group cannot block the exit
            if done:  # every rank finished before any tears gloo down (its C++ teardown can abort)
                dist.barrier()
            dist.destroy_process_group()


_timeout: datetime.timedelta | None = None  # what process_group() gave the default group


def collective_timeout() -> datetime.timedelta:
    """The default group's collective timeout, for groups created beside it (same patience).

    The one ``process_group`` set (``parallel.timeout_s``); for a group initialised by
    someone else (a test harness, an embedding application) the one in its backend
    options (``framework.compat.group_timeout``); else torch's default.
    """
    if _timeout is not None:
        return _timeout
    from framework.compat import group_timeout

    found = group_timeout()
    if found is not None:
        return found
    from torch.distributed import default_pg_timeout

    return default_pg_timeout
