"""Stop cleanly when SLURM or the user says so: preemption / time-limit signals, Ctrl-C, a wall-time margin.

A signal (SIGUSR2, as submitit asks SLURM to send before the limit; SIGTERM; the first
Ctrl-C, SIGINT) only sets a flag. At the next step boundary every rank learns whether any
rank was signalled (one tiny all-reduce on a CPU group, so a GPU stream never waits), they
save a checkpoint together and stop (exit 75); the handler that was installed before ours
(submitit's requeue) then runs, and the requeued job resumes from that checkpoint. A
second Ctrl-C while the first is pending aborts at once (KeyboardInterrupt: exit 130, no
checkpoint).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from framework.errors import FrameworkError

SIGNALS = (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)
# What signal.getsignal returns and signal.signal takes (typeshed's private signal._HANDLER).
SignalHandler = Callable[[int, FrameType | None], Any] | int | None


class Stopped(FrameworkError):
    """Stopped early with a checkpoint: resubmit or requeue to continue (exit 75, EX_TEMPFAIL)."""

    exit_code = 75
    prefix = "stopped"


def slurm_end_time() -> float | None:
    """The job's end time (epoch seconds) from SLURM, or None outside SLURM."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return None
    try:
        out = subprocess.run(
            ["squeue", "-h", "-j", job, "-o", "%e"], capture_output=True, text=True, timeout=30
        ).stdout.strip()
        return time.mktime(time.strptime(out, "%Y-%m-%dT%H:%M:%S"))
    except Exception:  # no squeue, unlimited time ("N/A"), ...
        return None


class StopRequest:
    def __init__(self, stop_before_end_min: float = 0.0):
        self.signum: int | None = None
        self.previous: dict[int, SignalHandler] = {}
        self.deadline = None
        if stop_before_end_min > 0:
            end = slurm_end_time()
            if end is not None:
                self.deadline = end - 60 * stop_before_end_min
        self.group = None

    def install(self) -> None:
        for s in SIGNALS:
            previous = signal.getsignal(s)
            if s == signal.SIGINT and previous is signal.SIG_IGN:
                continue  # Ctrl-C is ignored here (e.g. a background job): leave it so
            self.previous[s] = previous
            signal.signal(s, self._on_signal)
        if dist.is_available() and dist.is_initialized():
            # CPU group: agreeing on the flag never synchronises a GPU stream
            self.group = dist.new_group(backend="gloo")

    def uninstall(self) -> None:
        for s, h in self.previous.items():
            signal.signal(s, h)
        self.previous = {}

    def _on_signal(self, signum, frame) -> None:
        first, self.signum = self.signum, self.signum or signum  # first: a handler can interrupt a handler
        if signum != signal.SIGINT:
            return  # acted on at the next step boundary
        if first is not None:
            # a second Ctrl-C: give up on the orderly stop and abort now
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        # os.write: print is not reentrant in a signal handler
        os.write(
            sys.stderr.fileno(),
            b"interrupt: stopping at the next step with a checkpoint (Ctrl-C again to abort at once)\n",
        )

    def reason(self) -> str:
        if self.signum is not None:
            return f"signal {signal.Signals(self.signum).name}"
        return "the wall-time margin (trainer.stop_before_end_min)"

    def agreed(self) -> bool:
        """True on every rank when any rank was signalled or passed the deadline."""
        local = self.signum is not None or (self.deadline is not None and time.time() >= self.deadline)
        if self.group is None:
            return local
        flag = torch.tensor([1 if local else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if flag.item() and self.signum is None and not local:
            self.signum = signal.SIGUSR2  # another rank was told: act as if we were
        return bool(flag.item())

    def hand_over(self) -> None:
        """Run the handler that was there before ours (submitit: requeue on rank 0)."""
        signum = self.signum
        previous = self.previous.get(signum) if signum is not None else None
        self.uninstall()
        # signum is not None whenever previous is set; Python's own handler raises KeyboardInterrupt
        if signum is not None and callable(previous) and previous is not signal.default_int_handler:
            previous(signum, None)
