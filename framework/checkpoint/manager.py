"""One manager over every backend: naming, atomic commit, discovery, pruning, RNG, async.

Layout: ``<run_dir>/checkpoints/step_00000100/`` holds the backend's files, one RNG file
per rank (``rng/rank_<r>.pt``) and ``meta.json``. A save writes into
``.tmp-step_00000100``; once every rank has written its part, rank 0 writes
``meta.json`` and renames the directory to ``step_00000100``. A visible ``step_*``
directory with ``meta.json`` is therefore always complete, and a crash mid-save leaves
the previous checkpoint untouched (the ``.tmp-*`` leftover is removed by the next
commit).

"Newest" means most recently committed (``meta.json``'s ``committed_ns``), not highest
step: after resuming from an older checkpoint the branch being trained is the newest.
``keep`` prunes the oldest and never the newest complete checkpoint.

Asynchronous backends return a pending save: the manager waits for its staging copy
before the next optimizer step; rank 0's commit thread commits it (meta.json, rename,
prune) once the write has completed on every rank, off the training loop; the next save
and ``finish()`` wait for both.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from framework.checkpoint import state as ckpt_state
from framework.checkpoint.io import first_line, fsync_dir, save_durable
from framework.config.schema import CheckpointConfig
from framework.errors import ConfigError, DataError, FrameworkError

log = logging.getLogger("framework")

try:  # DCP's failures are BaseExceptions
    from torch.distributed.checkpoint.api import CheckpointException as _DcpFailure
except ImportError:  # pragma: no cover
    _DcpFailure = Exception
_ERRORS = (Exception, _DcpFailure)

_NAME = re.compile(r"^(?:\.old-)?step_(\d{8})$")
META = "meta.json"
RNG_DIR = "rng"


class CheckpointSaveError(FrameworkError):
    """A save failed (disk full, a rank died mid-write): the previous checkpoint is intact."""


@dataclass
class _Job:
    step: int
    tmp: Path
    final: Path
    meta: dict


class CheckpointManager:
    def __init__(self, cfg: CheckpointConfig, backend, run_dir: Path, env, barrier=lambda: None):
        self.cfg, self.backend, self.env, self.barrier = cfg, backend, env, barrier
        self.root = Path(run_dir) / "checkpoints"
        self._inflight: tuple[_Job, object, Future | None] | None = None
        self._committer: ThreadPoolExecutor | None = None

    # discovery -------------------------------------------------------------------------
    def complete(self) -> list[Path]:
        """Complete checkpoints, oldest commit first."""
        if not self.root.is_dir():
            return []
        found = []
        for p in self.root.iterdir():
            m = _NAME.match(p.name)
            if not m or not (p / META).is_file():
                continue
            if p.name.startswith(".old-") and (self.root / p.name[len(".old-"):]).exists():
                continue  # replaced by a re-save of the same step (kept only if the rename was cut short)
            try:
                meta = json.loads((p / META).read_text())
                order = int(meta.get("committed_ns") or (p / META).stat().st_mtime_ns)
            except (OSError, ValueError):
                continue
            found.append((order, int(m.group(1)), p))
        return [p for _, _, p in sorted(found)]

    def latest(self) -> Path | None:
        done = self.complete()
        return done[-1] if done else None

    def resume_path(self) -> Path | None:
        if self.cfg.resume == "none":
            return None
        if self.cfg.resume == "latest":
            return self.latest()
        path = Path(self.cfg.resume)
        if not path.exists():
            raise ConfigError(f"checkpoint.resume: {path} does not exist")
        read_meta(path)  # a partial or corrupt checkpoint named explicitly: one line, DataError
        return path

    # save ------------------------------------------------------------------------------
    def due(self, step: int, last: bool) -> bool:
        if last:
            return self.cfg.save_final
        return self.cfg.every > 0 and step % self.cfg.every == 0

    def save(self, trainer, config: dict) -> Path:
        self._settle()  # one save in flight at a time
        step = trainer.step
        final = self.root / f"step_{step:08d}"
        tmp = self.root / f".tmp-{final.name}"
        if self.env.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            (tmp / RNG_DIR).mkdir(parents=True)
        self.barrier()
        save_durable(ckpt_state.rng_state(), tmp / RNG_DIR / f"rank_{self.env.rank}.pt")
        state = ckpt_state.capture(trainer, full=self.backend.full_state)
        meta = {"step": step, "format": self.backend.format, "backend": type(self.backend).__name__,
                "world_size": self.env.world_size, "run_id": trainer.run_id, "config": config}
        job = _Job(step, tmp, final, meta)
        try:
            pending = self.backend.save(state, tmp, self.env)
        except _ERRORS as e:
            raise CheckpointSaveError(_failed(job, e)) from None
        if pending is not None:  # asynchronous: committed once written everywhere
            committer = None
            if self.env.is_main:  # the commit (rename, prune) runs off the training loop too
                if self._committer is None:
                    self._committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-commit")
                committer = self._committer.submit(self._commit_when_written, job, pending)
            self._inflight = (job, pending, committer)
            return final
        self.barrier()  # every rank has written its part
        if self.env.is_main:
            self._commit(job)
        self.barrier()
        return final

    def before_optimizer_step(self) -> None:
        """Called before every optimizer step: an in-flight save must have copied the tensors
        the step is about to change; a finished one is committed."""
        if self._inflight is None:
            return
        job, pending, committer = self._inflight
        try:
            pending.wait_staged()
        except _ERRORS as e:
            self._inflight = None
            raise CheckpointSaveError(_failed(job, e)) from None
        if pending.done() and (committer is None or committer.done()):
            self._settle()  # collects the outcome; nothing left to wait for

    @property
    def in_flight(self) -> bool:
        """An asynchronous save is being written or committed."""
        return self._inflight is not None

    def finish(self) -> None:
        """Called when training ends: wait for the save still in flight and its commit."""
        try:
            self._settle()
            self.barrier()
        finally:
            if self._committer is not None:
                self._committer.shutdown(wait=True)
                self._committer = None
            self.backend.close()

    def _settle(self) -> None:
        if self._inflight is None:
            return
        job, pending, committer = self._inflight
        self._inflight = None
        try:
            pending.wait()
            if committer is not None:
                committer.result()
        except _ERRORS as e:
            raise CheckpointSaveError(_failed(job, e)) from None

    def _commit_when_written(self, job: _Job, pending) -> None:
        """Rank 0, commit thread. The write completed on every rank once DCP's save returns
        here: its last step gathers every rank's result (and each rank wrote its RNG file
        before it started), so the checkpoint is whole and may become visible."""
        pending.wait()
        self._commit(job)

    def _commit(self, job: _Job) -> None:
        job.meta["committed_ns"] = time.time_ns()
        meta_path = job.tmp / META
        with open(meta_path, "w") as f:
            f.write(json.dumps(job.meta, indent=1, default=str))
            f.flush()
            os.fsync(f.fileno())
        for d in (job.tmp / RNG_DIR, job.tmp):
            fsync_dir(d)
        old = None
        if job.final.exists():  # re-saving a step (after resuming from an older checkpoint)
            old = self.root / f".old-{job.final.name}"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(job.final, old)
        os.replace(job.tmp, job.final)
        fsync_dir(self.root)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        self.prune()

    def prune(self) -> None:
        done = self.complete()
        newest = done[-1] if done else None
        for old in done[: max(0, len(done) - self.cfg.keep)]:
            if old != newest:
                shutil.rmtree(old, ignore_errors=True)
        inflight = self._inflight[0].tmp if self._inflight else None
        for stale in self.root.glob(".tmp-step_*"):  # left by a crash mid-save
            if stale != inflight:
                shutil.rmtree(stale, ignore_errors=True)
        for replaced in self.root.glob(".old-step_*"):  # a re-save whose cleanup was cut short
            if (self.root / replaced.name[len(".old-"):]).exists():
                shutil.rmtree(replaced, ignore_errors=True)

    # load ------------------------------------------------------------------------------
    def load(self, path: Path, trainer) -> None:
        path = Path(path)
        meta = read_meta(path)
        reader = self._reader(meta, path)
        exclude = tuple(self.cfg.exclude)
        state = reader.load(path, self.env, lambda: ckpt_state.template(trainer, exclude))
        missing = [p for p in ckpt_state.PARTS if p != "rng" and p not in state and p not in exclude]
        if missing:
            raise DataError(f"checkpoint {path} lacks {', '.join(missing)}")
        ckpt_state.restore(trainer, state, exclude=exclude, full=reader.full_state)
        if "rng" not in exclude:
            self._load_rng(path, meta, state)

    def _reader(self, meta: dict, path: Path):
        fmt = meta.get("format") or ("torch_save" if (path / "state.pt").is_file() else
                                     "dcp" if (path / ".metadata").is_file() else None)
        if fmt == getattr(self.backend, "format", None):
            return self.backend
        if fmt == "dcp":
            from framework.checkpoint.dcp import DcpBackend

            return DcpBackend()
        if fmt == "torch_save":
            from framework.checkpoint.torch_save import TorchSaveBackend

            return TorchSaveBackend()
        raise DataError(f"checkpoint {path} has an unknown format {fmt!r}")

    def _load_rng(self, path: Path, meta: dict, state: dict) -> None:
        rank = self.env.rank
        f = path / RNG_DIR / f"rank_{rank}.pt"
        saved = meta.get("world_size")
        if f.is_file():
            try:
                rng = torch.load(f, map_location="cpu", weights_only=True)
            except Exception as e:
                raise DataError(f"checkpoint file {f} cannot be read: {first_line(e)}") from None
            ckpt_state.set_rng_state(rng)
        elif "rng" in state:  # older torch_save checkpoints: rank 0's state in state.pt
            ckpt_state.set_rng_state(state["rng"])
        elif saved is not None and rank < saved:
            raise DataError(f"checkpoint {path} is incomplete: no RNG state of rank {rank} ({f.name})")
        else:
            seed = (meta.get("config") or {}).get("seed", 0)
            value = ckpt_state.reseed(seed, int(meta.get("step", 0)), rank)
            log.warning("rank %d: checkpoint %s holds RNG states of %s rank(s); rank %d reseeded "
                        "deterministically (seed %d)", rank, path.name, saved, rank, value)


def read_meta(path: Path) -> dict:
    """meta.json of a checkpoint; a missing or unreadable one is a clear one-line DataError."""
    path = Path(path)
    f = path / META
    if not f.is_file():
        why = "a save that did not finish" if path.name.startswith(".tmp-") else "not committed"
        raise DataError(f"checkpoint {path} is incomplete or corrupt: no {META} ({why})")
    try:
        meta = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"checkpoint {path} is corrupt: {META} cannot be read ({first_line(e)})") from None
    if not isinstance(meta, dict):
        raise DataError(f"checkpoint {path} is corrupt: {META} is not an object")
    return meta


def _failed(job: _Job, e: BaseException) -> str:
    from framework.checkpoint.dcp import dcp_error

    cause = e
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:  # DCP: the first rank's exception
        cause = next(iter(failures.values()))
        cause = cause[0] if isinstance(cause, tuple) else cause
    return (f"saving checkpoint {job.final.name} failed: {type(cause).__name__}: {dcp_error(e)}; "
            "the previous checkpoint is intact")
