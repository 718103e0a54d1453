"""Launchers, before anything heavy is imported (no torch here: a config error must exit in the
time it takes to compose the config): what a rank does about torchrun (:func:`die_with_launcher`),
and how a sweep through hydra-submitit-launcher reports what failed, at submission or on the
cluster, in one line (:func:`guard_submitit`, :class:`JobFailed`; docs/slurm.md)."""

from __future__ import annotations

import os

from framework.errors import first_line


def die_with_launcher() -> None:
    """Under torchrun, die when the launcher dies.

    torchrun starts each rank in a session of its own, so ``kill -9`` of torchrun (or of its
    process group) leaves the ranks running as orphans that keep training and writing into
    the run directory. The kernel's parent-death signal ends them with it instead.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ or not os.path.exists("/proc/self"):
        return
    import ctypes
    import signal

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the launcher died before the signal was armed
        os._exit(137)


# -- SLURM through hydra-submitit-launcher ------------------------------------------------------------
# A sweep's failures end in one line and an exit code, in the process that launched it: an sbatch
# refusal (a bad gres or partition: exit 2), a cluster that cannot be reached (69, EX_UNAVAILABLE),
# a job that failed on the cluster (its own exit code and line, and where its log is).
EXIT_CONFIG = 2
EXIT_UNAVAILABLE = 69
EXIT_STOPPED = 75  # framework.train.preemption.Stopped: submitit requeues the job, it is not a failure
_UNREACHABLE = ("unable to contact slurm controller", "socket timed out", "zero bytes were transmitted")
# sbatch's complaint -> the hydra.launcher fields that make it (named in the error line)
_SBATCH_FIELDS = (
    ("gres", ("gpus_per_node", "gpus_per_task", "gres")),
    ("partition", ("partition",)),
    ("account", ("account",)),
    ("qos", ("qos",)),
    ("time limit", ("timeout_min",)),
    ("memory", ("mem_gb", "mem_per_cpu", "mem_per_gpu")),
    ("node configuration", ("nodes", "tasks_per_node", "cpus_per_task", "gpus_per_node", "mem_gb")),
    ("processors", ("nodes", "tasks_per_node", "cpus_per_task")),
)


class JobFailed(Exception):
    """A job's one-line error, its exit code and its log: what a job hands back through submitit's
    result to the process that launched it (instead of exiting, which leaves no result)."""

    def __init__(self, message: str, exit_code: int, log: str | None = None):
        super().__init__(message, exit_code, log)
        self.message, self.exit_code, self.log = message, exit_code, log

    def __str__(self) -> str:
        return self.message


def in_submitit_job() -> bool:
    """This process is a job that submitit started (``python -m submitit.core._submit``)."""
    import sys

    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return "SUBMITIT_FOLDER" in os.environ and getattr(spec, "name", "") == "submitit.core._submit"


def job_failed(message: str, exit_code: int) -> JobFailed:
    log = None
    try:
        import submitit

        log = str(submitit.JobEnvironment().paths.stderr)
    except Exception:  # noqa: BLE001, S110  (no log path: the line still says what failed)
        pass
    return JobFailed(message, exit_code, log)


def guard_submitit() -> None:
    """Install :func:`_launch` as hydra-submitit-launcher's ``launch`` in this (the launching)
    process. The plugin lets submitit's exceptions through (Hydra prints their traceback, exit 1)
    and, without SLURM accounting, waits forever for a job that died without a result."""
    try:
        from hydra_plugins.hydra_submitit_launcher import submitit_launcher as plugin  # type: ignore[import-untyped]
    except ImportError:
        return
    if getattr(plugin.BaseSubmititLauncher.launch, "_framework", False):
        return
    _launch._framework = True  # type: ignore[attr-defined]
    plugin.BaseSubmititLauncher.launch = _launch


def shared_folder(folder) -> str | None:
    """Why another user could put files into submitit's ``folder`` (created here if missing), or
    None. Its pickles are loaded by the jobs and by the launching process, and a sweep file (not
    trusted) may choose it: it must belong to this user and be writable by no one else, and no
    directory above it may let anyone rename it (world-writable without the sticky bit)."""
    import stat

    from submitit.core.utils import JobPaths

    top = JobPaths.get_first_id_independent_folder(folder)  # the part without %j and the like
    try:
        top.mkdir(mode=0o700, parents=True, exist_ok=True)  # new: this user's alone, whatever the umask
        top = top.resolve()  # a link another user planted is judged by where it leads
        mode, owner = top.stat().st_mode, top.stat().st_uid
        if owner != os.geteuid():
            return f"{top} belongs to another user (uid {owner})"
        if mode & (stat.S_IWGRP | stat.S_IWOTH):
            return f"{top} can be written by other users (mode {stat.filemode(mode)})"
        for parent in top.parents:
            mode = parent.stat().st_mode
            if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
                return f"{parent} can be written by anyone (mode {stat.filemode(mode)})"
    except OSError as e:
        return f"{top}: {e.strerror or e}"
    return None


def _exit(message: str, code: int):
    import sys

    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def _launch(self, job_overrides, initial_job_idx):
    """hydra-submitit-launcher 1.2.0's ``launch``, with submission and waiting apart: sbatch's
    refusal is one line (what sbatch said, the fields that asked for it, the script), and each
    job is waited for until it returns, fails, or leaves the queue without a result."""
    import contextlib
    import io
    import logging
    import sys
    from pathlib import Path

    import submitit
    from hydra.core.singleton import Singleton
    from hydra.core.utils import filter_overrides
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf  # type: ignore[import-untyped]
    from omegaconf import OmegaConf

    log = logging.getLogger("hydra_plugins.hydra_submitit_launcher.submitit_launcher")
    params = dict(self.params)
    unsafe = shared_folder(params["submitit_folder"])
    if unsafe:
        _exit(
            f"hydra.launcher.submitit_folder: {unsafe}; the jobs and this process load pickles from it, "
            "so it must be a folder only you can write",
            EXIT_CONFIG,
        )
    specific = {"max_num_timeout"}
    init = {"folder": params["submitit_folder"]}
    init.update({f"{self._EXECUTOR}_{k}": v for k, v in params.items() if k in specific})
    base = set(OmegaConf.structured(BaseQueueConf).keys())
    rest = {
        k if k in base else f"{self._EXECUTOR}_{k}": v
        for k, v in params.items()
        if k not in {*specific, "submitit_folder"}
    }
    try:
        executor = submitit.AutoExecutor(cluster=self._EXECUTOR, **init)
        executor.update_parameters(**rest)
    except (ValueError, TypeError) as e:  # a field submitit does not know
        _exit(f"hydra.launcher: {first_line(e)}", EXIT_CONFIG)
    log.info(f"Submitit '{self._EXECUTOR}' sweep output dir : {self.config.hydra.sweep.dir}")
    sweep_dir = Path(str(self.config.hydra.sweep.dir))
    sweep_dir.mkdir(parents=True, exist_ok=True)
    if "mode" in self.config.hydra.sweep:
        os.chmod(sweep_dir, mode=int(str(self.config.hydra.sweep.mode), 8))
    job_params = []
    for idx, overrides in enumerate(job_overrides):
        idx = initial_job_idx + idx
        log.info(f"\t#{idx} : {' '.join(filter_overrides(overrides))}")
        job_params.append((list(overrides), "hydra.sweep.dir", idx, f"job_id_for_{idx}", Singleton.get_state()))

    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):  # submitit prints sbatch's complaint, then raises it
            jobs = executor.map_array(self, *zip(*job_params))
    except (submitit.core.utils.FailedJobError, submitit.core.utils.FailedSubmissionError) as e:
        _exit(*_refusal(str(e) or said.getvalue(), params))
    except OSError as e:  # no sbatch on PATH
        _exit(f"cannot submit to SLURM: {e.strerror or e} ({e.filename or 'sbatch'})", EXIT_UNAVAILABLE)
    sys.stderr.write(said.getvalue())  # warnings of a submission that went through
    outcomes = _wait(jobs)
    failed = [(i, job, out) for i, (job, out) in enumerate(zip(jobs, outcomes)) if _failure(job, out) is not None]
    if failed:
        i, job, out = failed[0]
        message, code, where = _failure(job, out) or ("", 1, "")
        more = (
            f" (+{len(failed) - 1} more failed: {', '.join(j.job_id for _, j, _ in failed[1:4])})"
            if len(failed) > 1
            else ""
        )
        _exit(f"job {job.job_id} (#{initial_job_idx + i}) failed: {message}; log: {where}{more}", code)
    return [out for out in outcomes]


def _refusal(said: str, params: dict) -> tuple[str, int]:
    """(line, exit code) for sbatch's refusal of the job."""
    lines = [ln.strip() for ln in said.splitlines() if ln.strip()]
    errors = [ln.split("error:", 1)[1].strip() for ln in lines if "error:" in ln] or lines[-1:] or ["no message"]
    text = "; ".join(dict.fromkeys(errors))
    if any(marker in text.lower() for marker in _UNREACHABLE):
        return f"cannot submit to SLURM: sbatch: {text}", EXIT_UNAVAILABLE
    names: list[str] = []
    for marker, fields in _SBATCH_FIELDS:
        if marker in text.lower():
            names += [f for f in fields if f not in names]
    shown = [f"hydra.launcher.{f}={params[f]}" for f in names if params.get(f) is not None]
    extra = params.get("additional_parameters") or {}
    shown += [
        f"hydra.launcher.additional_parameters.{k}={v}"
        for k, v in extra.items()
        if any(m in k for m, _ in _SBATCH_FIELDS)
    ]
    script = _newest_script(params.get("submitit_folder"))
    return (
        f"sbatch refused the job: {text}"
        + (f" (from {', '.join(shown)})" if shown else "")
        + (f"; script: {script}" if script else ""),
        EXIT_CONFIG,
    )


def _newest_script(folder) -> str | None:
    if not folder:
        return None
    from submitit.core.utils import JobPaths

    scripts = sorted(
        JobPaths.get_first_id_independent_folder(folder).glob(".submission_file_*.sh"),
        key=lambda p: p.stat().st_mtime,
    )
    return str(scripts[-1]) if scripts else None


class _NoResult(str):
    """A job that left the queue without a result (killed, out of memory, cancelled, a rank
    that exited): what SLURM says of its end."""

    exit_code = 1


def _wait(jobs, poll_s: float = 1.0, queue_every_s: float = 10.0) -> list:
    """Each job's JobReturn, or a :class:`_NoResult` for a job that left the queue without one.
    Polls the result files and ``squeue``, never ``sacct``: without SLURM accounting submitit
    cannot tell a job that died from a running one (it would wait forever, and every poll
    prints sacct's complaint)."""
    import time

    from submitit.core.utils import JobPaths

    from framework.rundir import slurm_job_states

    out: dict[int, object] = {}
    gone: dict[int, int] = {}  # consecutive polls that did not find the job in the queue
    last_ask = 0.0
    while len(out) < len(jobs):
        waiting = []
        for i, job in enumerate(jobs):
            if i in out:
                continue
            results = [JobPaths(job.paths.folder, job.job_id, t).result_pickle for t in range(job.num_tasks)]
            if all(p.exists() for p in results):
                out[i] = job.results()[0]  # task 0's
            else:
                waiting.append(i)
        if waiting and time.monotonic() - last_ask >= queue_every_s:
            last_ask = time.monotonic()
            states = slurm_job_states([jobs[i].job_id for i in waiting]) or {}  # one squeue for all
            for i in waiting:
                gone[i] = gone.get(i, 0) + 1 if states.get(str(jobs[i].job_id)) == "" else 0
                if gone[i] >= 2:  # twice, a poll apart: a result written at the very end has landed
                    out[i] = _ended(jobs[i].job_id)
        if len(out) < len(jobs):
            time.sleep(poll_s)
    return [out[i] for i in range(len(jobs))]


def _ended(job_id: str) -> _NoResult:
    import subprocess

    try:
        info = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True, timeout=20)
        fields = dict(kv.split("=", 1) for kv in info.stdout.split() if "=" in kv)
    except (OSError, subprocess.SubprocessError):
        fields = {}
    state, code = fields.get("JobState"), fields.get("ExitCode", "")
    found = _NoResult(
        f"it left the queue without a result ({f'state {state}, exit code {code}' if state else 'state unknown'})"
    )
    status = code.split(":")[0]
    found.exit_code = int(status) if status.isdigit() and int(status) > 0 else 1
    return found


def _failure(job, out) -> tuple[str, int, str] | None:
    """(message, exit code, log) of a job that failed, or None."""
    from hydra.core.utils import JobStatus

    log = str(job.paths.stderr).replace("%t", "0")  # a job of several tasks: task 0's
    if isinstance(out, _NoResult):
        last = _last_line(log)
        if last.startswith(("error: ", "stopped: ")):  # the job's own line, printed before it exited
            return last.split(": ", 1)[1], out.exit_code, log
        return f"{out}{f': {last}' if last else ''}", out.exit_code, log
    if getattr(out, "status", None) != JobStatus.FAILED:
        return None
    value = out._return_value
    if isinstance(value, JobFailed):
        return value.message, value.exit_code, value.log or log
    return f"{type(value).__name__}: {first_line(value)}", 1, log


def _last_line(path) -> str:
    try:
        lines = [ln.strip() for ln in open(path, errors="replace").read().splitlines()[-50:] if ln.strip()]
    except OSError:
        return ""
    return lines[-1] if lines else ""
