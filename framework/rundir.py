"""The run directory: checked before any heavy work, and locked so that one run at a time writes it.

I/O checks (:func:`preflight`) read only: the run dir is a directory (or can be created
under a writable directory), ``checkpoints``, ``plots``, ``metrics.jsonl`` and the lock
are of the right kind and writable, a checkpoint named in ``checkpoint.resume`` is
readable. Each failure is one line, exit code 2 (:class:`RunDirError`).

The lock (:class:`RunLock`) is a file ``run.lock`` in the run dir, created atomically with
``O_CREAT | O_EXCL`` (atomic on local filesystems, NFSv3+, Lustre and GPFS; no fcntl) by
the main rank before anything is written, holding host, pid, the process start time, the
start time, the SLURM job id and restart count, the launch id shared by the ranks of one
launch and a random token. It is refreshed (mtime) every :data:`HEARTBEAT_S` seconds and
removed on exit. A lock left by a crash (``kill -9``, a lost node) is *stale* and taken
over with a warning when

1. it was written on this machine (same host name, boot id and pid namespace) and its
   process is gone (or the pid now belongs to a younger process);
2. it was written by this very SLURM job before a requeue (same job id, lower
   ``SLURM_RESTART_COUNT``);
3. its SLURM job is no longer running according to ``squeue`` (gone, pending, requeued);
4. otherwise, its heartbeat is older than :data:`STALE_AFTER_S` (``FRAMEWORK_LOCK_STALE_S``,
   default 300 s): a live holder refreshes it every 30 s, also on another node.

A live lock is refused in one line (exit 2). Takeovers are serialised by a second
``O_EXCL`` file (``run.lock.takeover``), so two runs that find the same stale lock do not
both take it.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import stat
import subprocess
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from framework import untrusted
from framework.errors import ConfigError, RunDirError

log = logging.getLogger("framework")

LOCK_NAME = "run.lock"
HEARTBEAT_S = 30.0
STALE_AFTER_S = float(os.environ.get("FRAMEWORK_LOCK_STALE_S", "300"))
CREATE_GRACE_S = 30.0  # an empty or half-written lock younger than this is being created
# SLURM states in which a job's processes may still run (anything else, or not in the queue: none run)
SLURM_ACTIVE = {"RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED", "STOPPED", "SIGNALING", "RESIZING", "STAGE_OUT"}


# -- who we are ----------------------------------------------------------------------------------
def launch_rank() -> int:
    """This process's rank, from the launcher's variables (as framework.distributed.env.detect)."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return int(env["RANK"])
    if "SLURM_JOB_ID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        return int(env.get("SLURM_PROCID", "0"))
    return 0


def launch_id() -> str | None:
    """Shared by the ranks of one launch: torchrun's run id, or the SLURM job, restart and step."""
    env = os.environ
    if "TORCHELASTIC_RUN_ID" in env:
        return f"torchrun:{env['TORCHELASTIC_RUN_ID']}"
    if "SLURM_JOB_ID" in env:
        return f"slurm:{env['SLURM_JOB_ID']}:{env.get('SLURM_RESTART_COUNT', '0')}:{env.get('SLURM_STEP_ID', '')}"
    return None


def machine_id() -> str:
    """Host name, boot id and pid namespace: where a pid means the same process."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    try:
        ns = str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        ns = ""
    return f"{socket.gethostname()}|{boot}|{ns}"


def _process_start(pid: int) -> float | None:
    try:
        import psutil

        return psutil.Process(pid).create_time()
    except Exception:
        return None


def _pid_alive(pid: int, started: float | None) -> bool:
    try:
        import psutil

        try:
            p = psutil.Process(pid)
            if p.status() == psutil.STATUS_ZOMBIE:
                return False
            return started is None or abs(p.create_time() - started) < 2.0  # else the pid was reused
        except psutil.NoSuchProcess:
            return False
        except psutil.AccessDenied:
            return True
    except ImportError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def slurm_job_state(job_id: str) -> str | None:
    """The job's state per ``squeue`` ('' when not in the queue), or None when SLURM cannot be asked."""
    states = slurm_job_states([job_id])
    return None if states is None else states[str(job_id)]


def slurm_job_states(job_ids) -> dict[str, str] | None:
    """Each job's state from one ``squeue`` call ('' for a job not in the queue), or None when SLURM
    cannot be asked. One call for a whole sweep: slurmctld answers every squeue, and a launcher
    asking once per job and poll would load it in proportion to the sweep.

    A job is found by any of its names: its own id, an array task's ``ARRAY_TASK`` form (submitit's
    ids) or its array's id (``SLURM_JOB_ID`` inside a task is the task's own id)."""
    ids = [str(j) for j in job_ids]
    if not ids:
        return {}
    try:
        out = subprocess.run(
            ["squeue", "-h", "-r", "-j", ",".join(ids), "-o", "%A %F %i %T"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:  # one unknown id alone is an error; among others it is left out
        return dict.fromkeys(ids, "") if "invalid job id" in (out.stderr or "").lower() else None
    seen: dict[str, str] = {}
    for line in out.stdout.splitlines():
        *names, state = line.split() or [""]
        for name in names:
            seen.setdefault(name, state)
    return {i: seen.get(i, "") for i in ids}


# -- the lock file ---------------------------------------------------------------------------------
@dataclass
class LockInfo:
    host: str
    pid: int
    pid_start: float | None
    machine: str
    started: str
    started_ts: float
    slurm_job_id: str | None
    slurm_restart: int
    launch: str | None
    token: str = field(default_factory=lambda: uuid.uuid4().hex)

    @classmethod
    def here(cls) -> LockInfo:
        now = time.time()
        return cls(
            host=socket.gethostname(),
            pid=os.getpid(),
            pid_start=_process_start(os.getpid()),
            machine=machine_id(),
            started=time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(now)),
            started_ts=now,
            slurm_job_id=os.environ.get("SLURM_JOB_ID"),
            slurm_restart=int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
            launch=launch_id(),
        )

    def describe(self) -> str:
        job = f", SLURM job {self.slurm_job_id}" if self.slurm_job_id else ""
        return f"host {self.host}, pid {self.pid}{job}, started {self.started}"


def read_lock(path: Path) -> LockInfo | None:
    """The lock's content, or None if it is empty or half-written."""
    try:
        data: Any = untrusted.mapping(untrusted.read_json(path), str(path))  # damaged: any JSON, any depth
        return LockInfo(**{k: data.get(k) for k in LockInfo.__dataclass_fields__})
    except (OSError, ValueError, TypeError):
        return None


def verdict(path: Path, info: LockInfo | None, now: float | None = None) -> tuple[bool, str]:
    """(stale, why) for the lock at ``path`` written as ``info``."""
    now = time.time() if now is None else now
    try:
        age = now - Path(path).stat().st_mtime
    except OSError:
        return True, "the lock disappeared"
    if info is None:
        if age > CREATE_GRACE_S:
            return True, f"an unreadable lock untouched for {age:.0f} s"
        return False, "a lock being created just now"
    if info.machine == machine_id():
        if not _pid_alive(int(info.pid), info.pid_start):
            return True, f"its process {info.pid} on {info.host} is gone"
        return False, "its process is running on this machine"
    here_job = os.environ.get("SLURM_JOB_ID")
    restart = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    if info.slurm_job_id and here_job == str(info.slurm_job_id) and restart > int(info.slurm_restart or 0):
        return True, f"SLURM job {here_job} was requeued (restart {restart}); the lock is its previous run's"
    if info.slurm_job_id:
        state = slurm_job_state(str(info.slurm_job_id))
        if state is not None and state not in SLURM_ACTIVE:
            return True, f"SLURM job {info.slurm_job_id} is {state.lower() if state else 'no longer in the queue'}"
    if age > STALE_AFTER_S:
        return True, f"no heartbeat for {age:.0f} s (more than {STALE_AFTER_S:.0f} s)"
    return False, "it is refreshed by a live run"


def _refusal(run_dir: Path, info: LockInfo | None, why: str) -> RunDirError:
    who = info.describe() if info is not None else "unknown holder"
    return RunDirError(
        f"run dir {run_dir} is in use by another run ({who}; {why}): wait for it to end or choose "
        f"another hydra.run.dir (remove {Path(run_dir) / LOCK_NAME} only if that run is gone)"
    )


def refuse_if_locked(run_dir: str | Path) -> None:
    """Raise if a live run of another launch holds the run dir (reads only; any rank)."""
    path = Path(run_dir) / LOCK_NAME
    if not path.exists():
        return
    info = read_lock(path)
    mine = launch_id()
    if info is not None and mine is not None and info.launch == mine:
        return  # our own main rank's
    stale, why = verdict(path, info)
    if not stale:
        raise _refusal(Path(run_dir), info, why)


class RunLock:
    """The run-directory lock of the main rank: ``acquire()`` ... ``release()``, or a ``with`` block."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self.info: LockInfo | None = None
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire(self, attempts: int = 5) -> RunLock:
        info = LockInfo.here()
        payload = json.dumps(asdict(info), indent=1).encode()
        for _ in range(attempts):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._take_over_if_stale()
                continue
            except OSError as e:
                raise RunDirError(f"hydra.run.dir: cannot write {self.path}: {e.strerror or e}") from None
            try:
                os.write(fd, payload)
                os.fsync(fd)
            finally:
                os.close(fd)
            self.info = info
            self._beat = threading.Thread(target=self._heartbeat, name="run-dir-lock", daemon=True)
            self._beat.start()
            return self
        raise _refusal(self.run_dir, read_lock(self.path), "the lock changed hands while we tried to take it")

    def _take_over_if_stale(self) -> None:
        old = read_lock(self.path)
        stale, why = verdict(self.path, old)
        if not stale:
            raise _refusal(self.run_dir, old, why)
        guard = self.path.with_name(LOCK_NAME + ".takeover")
        try:
            fd = os.open(guard, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                if time.time() - guard.stat().st_mtime > CREATE_GRACE_S:
                    guard.unlink()  # left by a run that died while taking over
            except OSError:
                pass
            time.sleep(0.2)
            return
        try:
            os.close(fd)
            if read_lock(self.path) == old:  # still the one we judged (None == None: an unreadable one)
                try:
                    self.path.unlink()
                except FileNotFoundError:
                    pass
                who = old.describe() if old is not None else "unknown holder"
                log.warning("taking over the stale run-dir lock of %s (%s; %s)", self.run_dir, who, why)
        finally:
            try:
                guard.unlink()
            except OSError:
                pass

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                current = read_lock(self.path)
                if current is None or self.info is None or current.token != self.info.token:
                    log.error(
                        "the run-dir lock %s was taken by another run (%s)",
                        self.path,
                        current.describe() if current else "removed",
                    )
                    return
                os.utime(self.path)
            except OSError:
                pass

    def release(self) -> None:
        self._stop.set()
        if self.info is None:
            return
        current = read_lock(self.path)
        if current is not None and current.token == self.info.token:
            try:
                self.path.unlink()
            except OSError:
                pass
        self.info = None


# -- I/O checks ------------------------------------------------------------------------------------
def _existing_ancestor(path: Path) -> Path:
    p = path
    while not p.exists() and not p.is_symlink() and p != p.parent:
        p = p.parent
    return p


def _writable_dir(path: Path, key: str) -> None:
    try:
        is_dir = stat.S_ISDIR(path.stat().st_mode)  # one look: exists() then is_dir() could straddle a change
    except (FileNotFoundError, NotADirectoryError):  # missing, or under a file: the anchor below says which
        is_dir = None
    except OSError as e:
        raise RunDirError(f"{key}: {path} cannot be read: {e.strerror or e}") from None
    if is_dir is False:
        raise RunDirError(f"{key}: {path} exists and is not a directory")
    if is_dir is None:
        anchor = _existing_ancestor(path)
        if not anchor.is_dir():
            raise RunDirError(f"{key}: {path} cannot be created: {anchor} is not a directory")
        if not os.access(anchor, os.W_OK | os.X_OK):
            raise RunDirError(f"{key}: {path} cannot be created: {anchor} is not writable")
        # Access bits do not tell a read-only mount, /sys (EPERM) or /proc (ENOENT): make a folder
        # in the anchor and remove it again. One of this check's own, never the missing folder
        # itself: every rank runs this check at once, and another's folder made and removed
        # meanwhile read as "exists and is not a directory" or "not writable" (a 4-rank start failed so).
        probe = anchor / f".probe-{uuid.uuid4().hex[:16]}"
        try:
            probe.mkdir()
        except OSError as e:
            raise RunDirError(f"{key}: {path} cannot be created: {e.strerror or e} ({anchor})") from None
        try:
            probe.rmdir()
        except OSError:
            pass
        return
    if not os.access(path, os.W_OK | os.X_OK):
        raise RunDirError(f"{key}: {path} is not writable")


def preflight(
    run_dir: str | Path, *, checkpoints: bool = True, resume: str | None = None, key: str = "hydra.run.dir"
) -> None:
    """Every I/O fault of the run dir that would otherwise surface later (reads only, but for a
    missing folder made and removed again to be sure it can be)."""
    run_dir = Path(run_dir)
    _writable_dir(run_dir, key)
    if run_dir.is_dir():
        if checkpoints:
            _writable_dir(run_dir / "checkpoints", "checkpoint")
        _writable_dir(run_dir / "plots", "plots")
        for name in ("metrics.jsonl", LOCK_NAME):
            p = run_dir / name
            if p.is_dir():
                raise RunDirError(f"{key}: {p} is a directory; a file is written there")
            if p.exists() and not os.access(p, os.W_OK):
                raise RunDirError(f"{key}: {p} is not writable")
    if resume not in (None, "latest", "none"):
        p = Path(resume)
        if p.exists() and not os.access(p, os.R_OK | (os.X_OK if p.is_dir() else 0)):
            raise RunDirError(f"checkpoint.resume: {p} is not readable")


def dir_problem(path: str | Path, *, create: bool = False) -> str | None:
    """What is wrong with an input directory (or, ``create=True``, one the run creates), or None.

    For schema checks that raise their own error (``Invalid("root", problem)``).
    """
    p = Path(path)
    if create:
        try:
            _writable_dir(p, "")
        except RunDirError as e:
            return str(e).split(": ", 1)[1]
        return None
    if not p.exists():
        return f"directory does not exist: {p}"
    if not p.is_dir():
        return f"{p} is not a directory"
    try:
        next(iter(os.scandir(p)), None)
    except OSError as e:
        return f"{p} is not readable ({e.strerror or e})"
    if not os.access(p, os.R_OK | os.X_OK):
        return f"{p} is not readable"
    return None


def readable_dir(path: str | Path, key: str) -> None:
    """A data root (or any input directory) that must exist and be listable: one line otherwise."""
    problem = dir_problem(path)
    if problem:
        raise ConfigError(f"{key}: {problem}")


def creatable_dir(path: str | Path, key: str) -> None:
    """A directory the run will create or write into (e.g. a synthetic data root): one line otherwise."""
    _writable_dir(Path(path), key)
