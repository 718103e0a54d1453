"""Sharded DCP checkpoints written while training continues.

``save`` returns at once: a background thread copies the tensors into CPU staging
buffers (pinned on CUDA, on a side stream; reused from one save to the next), then
DCP's writer thread writes them. The loop blocks only where it must:

- ``Pending.wait_staged`` (called by the manager before the next optimizer step): the
  optimizer must not change parameters or moments while they are being copied; after
  staging, the writer reads only the copy;
- ``Pending.wait`` (next save, end of training): one save in flight at a time.

DCP coordinates the ranks of a save with collectives from its writer thread. Those run
on a dedicated gloo process group: never on the training group, whose collectives the
main thread issues at the same time (two threads on one group could interleave them in
a different order on different ranks), and gloo works on CPU and beside NCCL.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from framework.checkpoint.dcp import DcpBackend, _distributed


class Pending:
    """One save in flight: its staging copy and its write."""

    def __init__(self, response):
        staged = getattr(response, "staging_completion", None)
        self.staged = staged
        self.written = getattr(response, "upload_completion", response)

    def wait_staged(self) -> None:
        if self.staged is not None:
            self.staged.result()
            self.staged = None

    def done(self) -> bool:
        return self.written.done() and (self.staged is None or self.staged.done())

    def wait(self) -> None:
        self.wait_staged()
        self.written.result()


class _Stager(DefaultStager):
    """DCP's stager; on CUDA the copy stream first waits for the work already queued on the
    training stream (the last optimizer step), so the copy sees the updated tensors."""

    def stage(self, state_dict, **kwargs):
        stream = getattr(self, "_staging_stream", None)
        if stream is not None and torch.cuda.is_available():
            stream.wait_stream(torch.cuda.current_stream())
        elif torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.current_stream().synchronize()
        return super().stage(state_dict, **kwargs)


class AsyncDcpBackend(DcpBackend):
    format = "dcp"  # the same files as dcp: either loads the other's checkpoints

    def __init__(self, io_threads: int = 1):
        super().__init__(io_threads)
        self._stager: _Stager | None = None
        self._group = None

    def _coordination_group(self):
        if not _distributed():
            return None
        if self._group is None:  # collective: every rank saves at the same step
            timeout = _default_timeout()
            self._group = dist.new_group(backend="gloo", timeout=timeout)
        return self._group

    def save(self, state: dict, directory, env) -> Pending:
        # Plain tensors (same storage) rather than nn.Parameters: the stager deep-copies what
        # it is given, attributes included; only the data is needed.
        tensors = _detached(self.split(state, directory, env))
        if not _usable(self._stager):
            cuda = torch.cuda.is_available()
            self._stager = _Stager(
                StagingOptions(
                    use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=cuda
                )
            )
        response = dcp.async_save(
            tensors,
            storage_writer=self.writer(directory),
            process_group=self._coordination_group(),
            async_checkpointer_type=AsyncCheckpointerType.THREAD,
            async_stager=self._stager,
            no_dist=not _distributed(),
        )
        return Pending(response)

    def close(self) -> None:
        if self._stager is not None:
            self._stager.close()
            self._stager = None


def _usable(stager) -> bool:
    """A stager kept from the last save still works (its staging buffers are reused).

    torch 2.11's async_save closes the stager it is given once the write is done (2.13
    leaves it to the caller); a closed stager has lost its copy dispatch: make a new one.
    """
    inner = getattr(stager, "_state_dict_stager", None)
    return bool(getattr(inner, "_deepcopy_dispatch", None))


def _detached(tree):
    if isinstance(tree, dict):
        return {k: _detached(v) for k, v in tree.items()}
    if isinstance(tree, torch.nn.Parameter):
        return tree.detach()
    return tree


def _default_timeout() -> datetime.timedelta:
    """The training group's collective timeout (parallel.timeout_s), else torch's default."""
    from framework.distributed.env import collective_timeout

    return collective_timeout()
