"""One manager over every backend: naming, atomic commit, manifests, discovery, retention,
RNG, async.

Layout: ``<run_dir>/checkpoints/step_00000100/`` holds the backend's files, one RNG file
per rank (``rng/rank_<r>.pt``), ``meta.json`` and ``manifest.json``. A save writes into
``.tmp-step_00000100``; once every rank has written its part, rank 0 writes
``meta.json``, then ``manifest.json`` (a checksum of every other file), and renames the
directory to ``step_00000100``. A visible ``step_*`` directory is therefore always
complete, and a crash mid-save leaves the previous checkpoint untouched (the ``.tmp-*``
leftover is removed by the next commit).

Which checkpoint "latest" is, and how a path given by the user is resolved, is decided by
``framework.checkpoint.locator`` (newest commit on the run's lineage that verifies); the
manager verifies with every rank hashing its share of the files.

Retention (``keep``): the newest ``keep`` usable checkpoints stay; unverified ones (no
manifest: written by an older version) go before verified ones; the newest checkpoint,
the newest verified one and the newest verified one recorded as finite are never
deleted; a corrupt one is never deleted (nor counted): it is reported.

Asynchronous backends return a pending save: the manager waits for its staging copy
before the next optimizer step; rank 0's commit thread commits it (meta.json, manifest,
rename, prune) once the write has completed on every rank, off the training loop; the
next save and ``finish()`` wait for both.

Save failures raise ``CheckpointSaveError``: exit code 5 when a peer rank died or a
collective timed out (``CheckpointSaveCommError``, a ``DistributedError``), 74
(``EX_IOERR``) when the save itself failed (disk full, permissions, I/O error).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from framework.checkpoint import locator
from framework.checkpoint import manifest as manifest_mod
from framework.checkpoint import state as ckpt_state
from framework.checkpoint.backend import PendingSave, Verified, for_checkpoint, read_meta  # noqa: F401  (read_meta: API)
from framework.checkpoint.io import first_line, fsync_dir, load_plain, save_durable, write_durable
from framework.checkpoint.manifest import MANIFEST
from framework.config.schema import CheckpointConfig
from framework.errors import ConfigError, DataError, DistributedError, FrameworkError

log = logging.getLogger("framework")

_DcpFailure: type[BaseException]
try:  # DCP's failures are BaseExceptions
    from torch.distributed.checkpoint.api import CheckpointException as _DcpFailure
except ImportError:  # pragma: no cover
    _DcpFailure = Exception
_ERRORS = (Exception, _DcpFailure)

META = "meta.json"
RNG_DIR = "rng"


class CheckpointSaveError(FrameworkError):
    """A save failed (disk full, permissions, I/O error): the previous checkpoint is intact.
    Exit code 74 (EX_IOERR)."""

    exit_code = 74


class CheckpointSaveCommError(CheckpointSaveError, DistributedError):
    """A save failed because a peer rank died or a collective timed out: exit code 5."""

    exit_code = 5


@dataclass
class _Job:
    step: int
    tmp: Path
    final: Path
    meta: dict
    world: dict
    started: float = field(default_factory=time.monotonic)


class CheckpointManager:
    def __init__(self, cfg: CheckpointConfig, backend, run_dir: Path, env, barrier=lambda: None):
        self.cfg, self.backend, self.env, self.barrier = cfg, backend, env, barrier
        self.root = Path(run_dir) / "checkpoints"
        self._inflight: tuple[_Job, PendingSave, Future | None] | None = None
        self._committer: ThreadPoolExecutor | None = None
        self._parent: dict | None = None  # the checkpoint the next save descends from (lineage)
        self._verified: dict[Path, Verified] = {}  # verified by resume_path, not loaded yet
        self._reported: set[Path] = set()
        self._planned: tuple[Path | None] | None = None  # plan_resume's answer, for the next resume_path

    # discovery -------------------------------------------------------------------------
    def complete(self) -> list[Path]:
        """Committed checkpoints, oldest commit first (corrupt ones included)."""
        return [e.path for e in locator.scan(self.root)]

    def latest(self) -> Path | None:
        """The newest committed checkpoint of this run's lineage that passes the quick check
        (manifest, sizes, meta.json); no data is hashed. None if there is none."""
        try:
            found = locator.latest(self.root, lambda e: self._verify(e.path, full=False, collective=False))
        except DataError:
            return None
        return found.path if found is not None else None

    def plan_resume(self) -> Path | None:
        """``resume_path()`` now, before the model is built (the runtime decides on it whether
        ``checkpoint.init_from`` applies); the next ``resume_path()`` returns it unchanged
        instead of verifying again."""
        self._planned = (self.resume_path(),)
        return self._planned[0]

    def resume_path(self) -> Path | None:
        """What ``checkpoint.resume`` names, fully verified by all ranks together.

        ``latest``: the locator's latest under this run dir (skipping, with a warning, any
        that fails verification); None if there is no checkpoint at all; a DataError if there
        are some and none verifies (never a silent fresh start that would overwrite them).
        A path: that step directory (a failure is a one-line DataError), or the latest of a
        run or ``checkpoints/`` directory.
        """
        if self._planned is not None:
            (path,), self._planned = self._planned, None
            return path
        if self.cfg.resume == "none":
            return None
        if self.cfg.resume == "latest":
            try:
                found = locator.latest(
                    self.root, lambda e: self._verify(e.path), warn=self._warn, what="checkpoint.resume=latest"
                )
            except DataError as e:
                raise DataError(
                    f"{e}; name one with checkpoint.resume=<path>, or start over in another run dir "
                    "with checkpoint.resume=none"
                ) from None
            return found.path if found is not None else None
        path = Path(self.cfg.resume)
        if not path.exists():
            raise ConfigError(f"checkpoint.resume: {path} does not exist")
        return locator.locate(path, lambda e: self._verify(e.path), warn=self._warn, what="checkpoint.resume").path

    def _verify(self, path: Path, *, full: bool = True, collective: bool = True) -> Verified:
        """Verify ``path`` (``full``: every checksum, each rank hashing its share); every rank
        gets the same outcome: the Verified, or the first rank's DataError."""
        path = Path(path)
        share = (self.env.rank, self.env.world_size) if collective else (0, 1)
        found: Verified | None = None
        err: str | None = None
        try:
            found = for_checkpoint(path, prefer=self.backend).verify(path, full=full, share=share)
        except DataError as e:
            err = str(e)
        except OSError as e:  # unreadable (permissions, I/O error): the ranks must still agree
            err = f"checkpoint {path} cannot be read: {e.strerror or e} ({e.filename or path})"
        if collective:
            err = self._agree(err)
        if err:
            raise DataError(err)
        assert found is not None  # verify returned (no rank reported an error)
        if collective:
            self._verified[path.resolve()] = found
        return found

    def _agree(self, err: str | None) -> str | None:
        """The first rank's error (or None) on every rank."""
        import torch.distributed as dist

        if self.env.world_size <= 1 or not (dist.is_available() and dist.is_initialized()):
            return err
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, err)
        return next((e for e in errors if e), None)

    def _warn(self, message: str) -> None:
        if self.env.is_main:
            log.warning(message)

    # save ------------------------------------------------------------------------------
    def due(self, step: int, last: bool) -> bool:
        if last:
            return self.cfg.save_final
        return self.cfg.every > 0 and step % self.cfg.every == 0

    def save(self, trainer, config: dict, *, finite: bool | None = None) -> Path:
        """Save the state of ``trainer`` at its step (collective). ``finite=True`` records in
        meta.json that the caller checked the state is finite (``meta["finite"]``): retention
        never deletes the newest verified checkpoint so recorded; ``finite=False`` marks one
        that ``latest`` must never pick."""
        self._settle()  # one save in flight at a time
        step = trainer.step
        final = self.root / f"step_{step:08d}"
        tmp = self.root / f".tmp-{final.name}"
        meta = {
            "step": step,
            "format": self.backend.format,
            "backend": type(self.backend).__name__,
            "world_size": self.env.world_size,
            "run_id": trainer.run_id,
            "config": config,
        }
        if finite is not None:
            meta["finite"] = bool(finite)
        if getattr(trainer, "init_from", None):  # where a fine-tuned run started (checkpoint.init_from)
            meta["init_from"] = trainer.init_from
        parallel = config.get("parallel") if isinstance(config, dict) else None
        world = {"world_size": self.env.world_size, "format": self.backend.format, "parallel": parallel}
        job = _Job(step, tmp, final, meta, world)
        local: str | None = None  # this rank's save failure
        try:
            if self.env.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
                (tmp / RNG_DIR).mkdir(parents=True)
            self.barrier()
            save_durable(ckpt_state.rng_state(), tmp / RNG_DIR / f"rank_{self.env.rank}.pt")
            state = ckpt_state.capture(trainer, full=self.backend.full_state)
            pending = self.backend.save(state, tmp, self.env)
        except _ERRORS as e:
            self._fail(job, e)  # a peer's failure or a timeout: exit 5 at once
            pending, local = None, _failed(job, e)
        if pending is not None:  # asynchronous: committed once written everywhere
            committer = None
            if self.env.is_main:  # the commit (manifest, rename, prune) runs off the training loop too
                if self._committer is None:
                    self._committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-commit")
                committer = self._committer.submit(self._commit_when_written, job, pending)
            self._inflight = (job, pending, committer)
            return final
        self._raise_agreed(job, local)  # every rank has written its part, or all stop
        if self.env.is_main:
            try:
                self._commit(job)
            except _ERRORS as e:
                local = _failed(job, e)
        self._raise_agreed(job, local)
        return final

    def _raise_agreed(self, job: _Job, local: str | None) -> None:
        try:
            err = self._agree(local)
        except _ERRORS as e:  # the exchange itself failed: a peer is dead or hung
            self._fail(job, e)
            raise
        if err:
            raise CheckpointSaveError(err)

    def _fail(self, job: _Job, e: BaseException) -> None:
        """Raise at once for a communication failure (the peers may be gone)."""
        if _comm_failure(e):
            raise CheckpointSaveCommError(_failed(job, e, comm=True)) from None

    def _error(self, job: _Job, e: BaseException) -> CheckpointSaveError:
        if _comm_failure(e):
            return CheckpointSaveCommError(_failed(job, e, comm=True))
        return CheckpointSaveError(_failed(job, e))

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
            raise self._error(job, e) from None
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
            raise self._error(job, e) from None

    def _commit_when_written(self, job: _Job, pending) -> None:
        """Rank 0, commit thread. The write completed on every rank once DCP's save returns
        here: its last step gathers every rank's result (and each rank wrote its RNG file
        before it started), so the checkpoint is whole and may become visible."""
        pending.wait()
        self._commit(job)

    def _commit(self, job: _Job) -> None:
        ns = time.time_ns()
        job.meta["committed_ns"] = ns
        job.meta["parent"] = self._parent
        write_durable(json.dumps(job.meta, indent=1, default=str).encode(), job.tmp / META)
        # last: the checksums of everything above (meta.json included), then the rename
        manifest_mod.write(job.tmp, manifest_mod.build(job.tmp, job.meta, world=job.world))
        for d in (job.tmp / RNG_DIR, job.tmp):
            fsync_dir(d)
        old = None
        if job.final.exists():  # re-saving a step (after resuming from an older checkpoint)
            existing = locator.entry(job.final)
            kind, why = (
                self._status(existing)
                if existing is not None
                else ("corrupt", f"checkpoint {job.final} is not committed (no {META})")
            )
            if kind == "corrupt":
                # never overwrite what may be repairable (a garbage meta.json): keep it aside
                aside = _unused(self.root / f"{job.final.name}.corrupt")
                os.replace(job.final, aside)
                log.warning("%s; moved to %s (not deleted) to make room for the new step %d", why, aside.name, job.step)
            else:
                old = self.root / f".old-{job.final.name}"
                shutil.rmtree(old, ignore_errors=True)
                os.replace(job.final, old)
        os.replace(job.tmp, job.final)
        fsync_dir(self.root)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        self._parent = {"name": job.final.name, "committed_ns": ns}
        log.info(
            "checkpoint %s saved (%s, %.1f s): %s",
            job.final.name,
            self.backend.format,
            time.monotonic() - job.started,
            job.final,
        )
        self.prune()

    # retention -------------------------------------------------------------------------
    def _status(self, e: locator.Entry) -> tuple[str, str | None]:
        """("verified" | "unverified" | "corrupt", why) from the quick check (no data hashed)."""
        if e.problem:
            return "corrupt", e.problem
        try:
            found = manifest_mod.read(e.path)
            if found is None:
                return "unverified", None
            manifest_mod.verify(e.path, found, e.meta, full=False)
        except DataError as err:
            return "corrupt", str(err)
        return "verified", None

    def prune(self) -> None:
        entries = locator.scan(self.root)
        status = {e.path: self._status(e) for e in entries}
        verified = [e for e in entries if status[e.path][0] == "verified"]
        protected = {entries[-1].path} if entries else set()  # the newest commit
        if verified:
            protected.add(verified[-1].path)
        finite = [e for e in verified if (e.meta or {}).get("finite") is True]
        if finite:
            protected.add(finite[-1].path)
        usable = [e for e in entries if status[e.path][0] != "corrupt"]
        excess = len(usable) - self.cfg.keep
        # unverified (older versions') checkpoints go first, then the oldest verified ones
        order = [e for e in usable if status[e.path][0] == "unverified"] + verified
        for e in order:
            if excess <= 0:
                break
            if e.path not in protected:
                shutil.rmtree(e.path, ignore_errors=True)
                excess -= 1
        for e in entries:
            kind, why = status[e.path]
            if kind == "corrupt" and e.path not in self._reported:
                self._reported.add(e.path)
                log.warning("%s; kept (retention never deletes a corrupt checkpoint): remove it by hand", why)
        inflight = self._inflight[0].tmp if self._inflight else None
        for stale in self.root.glob(".tmp-step_*"):  # left by a crash mid-save
            if stale != inflight:
                shutil.rmtree(stale, ignore_errors=True)
        for replaced in self.root.glob(".old-step_*"):  # a re-save whose cleanup was cut short
            if (self.root / replaced.name[len(".old-") :]).exists():
                shutil.rmtree(replaced, ignore_errors=True)

    # load ------------------------------------------------------------------------------
    def load(self, path: Path, trainer) -> None:
        """Verify (unless resume_path just did), validate, load every part not excluded."""
        path = Path(path)
        found = self._verified.pop(path.resolve(), None) or self._verify(path)
        if found.manifest is None:
            self._warn(f"checkpoint {path} has no {MANIFEST} (written by an older version): its files are not verified")
        meta = found.meta
        reader = for_checkpoint(path, meta, prefer=self.backend)
        exclude = tuple(self.cfg.exclude)
        state = reader.load(path, self.env, lambda: ckpt_state.template(trainer, exclude))
        missing = [p for p in ckpt_state.PARTS if p != "rng" and p not in state and p not in exclude]
        if missing:
            raise DataError(f"checkpoint {path} lacks {', '.join(missing)}")
        try:
            ckpt_state.check(trainer, state, path, exclude)
            step = state["data"]["step"] if "data" not in exclude else None
            if step is not None and isinstance(meta.get("step"), int) and step != meta["step"]:
                raise DataError(f"checkpoint {path} is corrupt: it holds step {step}, its {META} says {meta['step']}")
            ckpt_state.restore(trainer, state, exclude=exclude, full=reader.full_state)
        except FrameworkError:
            raise
        except Exception as e:  # what the checks did not foresee: still one line, never a traceback
            if _comm_failure(e):
                raise
            raise DataError(f"checkpoint {path} cannot be restored into this run: {first_line(e)}") from None
        if meta.get("init_from"):  # kept by the checkpoints to come: the run started from it
            trainer.init_from = meta["init_from"]
        if "rng" not in exclude:
            self._load_rng(path, meta, state, found.manifest)
        committed = meta.get("committed_ns")
        inside = path.resolve().parent == self.root.resolve()
        self._parent = {"name": path.name, "committed_ns": committed} if inside and isinstance(committed, int) else None

    def _load_rng(self, path: Path, meta: dict, state: dict, manifest: dict | None = None) -> None:
        rank = self.env.rank
        rel = f"{RNG_DIR}/rank_{rank}.pt"
        f = path / rel
        saved = meta.get("world_size")
        if f.is_file():
            if not manifest_mod.listed(manifest, rel):
                raise DataError(f"checkpoint {path} is refused: {rel} is not in its manifest")
            rng = load_plain(f)
            try:
                ckpt_state.set_rng_state(rng)
            except Exception as e:
                raise DataError(f"checkpoint file {f} cannot be used: {first_line(e)}") from None
        elif "rng" in state:  # older torch_save checkpoints: rank 0's state in state.pt
            try:
                ckpt_state.set_rng_state(state["rng"])
            except Exception as e:
                raise DataError(f"checkpoint {path} holds an RNG state that cannot be used: {first_line(e)}") from None
        elif saved is not None and rank < saved:
            raise DataError(f"checkpoint {path} is incomplete: no RNG state of rank {rank} ({f.name})")
        else:
            seed = (meta.get("config") or {}).get("seed", 0)
            value = ckpt_state.reseed(seed, int(meta.get("step", 0)), rank)
            log.warning(
                "rank %d: checkpoint %s holds RNG states of %s rank(s); rank %d reseeded deterministically (seed %d)",
                rank,
                path.name,
                saved,
                rank,
                value,
            )


def _unused(path: Path) -> Path:
    if not path.exists():
        return path
    n = 1
    while path.with_name(f"{path.name}.{n}").exists():
        n += 1
    return path.with_name(f"{path.name}.{n}")


def _causes(e: BaseException) -> list[BaseException]:
    """Every rank's exception of DCP's CheckpointException (whose text holds tracebacks); else ``e``."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        return [c[0] if isinstance(c, tuple) else c for c in failures.values()]
    return [e]


def _comm_failure(e: BaseException) -> bool:
    from framework.runtime import is_comm_failure

    if isinstance(e, DistributedError):
        return True
    return any(
        isinstance(c, BaseException) and not isinstance(c, (OSError, DataError)) and is_comm_failure(c)
        for c in _causes(e)
    )


def _failed(job: _Job, e: BaseException, comm: bool = False) -> str:
    from framework.checkpoint.dcp import dcp_error

    cause = _causes(e)[0]
    if comm:
        return (
            f"saving checkpoint {job.final.name} failed: a peer rank died or a collective timed out "
            f"({type(cause).__name__}: {dcp_error(e)}); the previous checkpoint is intact"
        )
    return (
        f"saving checkpoint {job.final.name} failed: {type(cause).__name__}: {dcp_error(e)}; "
        "the previous checkpoint is intact"
    )
