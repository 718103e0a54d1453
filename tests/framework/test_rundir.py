"""framework.rundir: the run-dir lock (live, stale, crashed, requeued, other hosts) and the I/O checks."""

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from framework import rundir
from framework.errors import ConfigError, RunDirError
from tests.conftest import REPO, run_cli, tiny_overrides

HOLD = (
    "from framework.rundir import RunLock; import sys, time; RunLock(sys.argv[1]).acquire(); "
    "print('locked', flush=True); time.sleep(600)"
)


def _holder(run_dir):
    """A process that takes the lock and keeps it."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True, env=env)
    assert p.stdout.readline().strip() == "locked"
    return p


def _write_lock(run_dir, **fields):
    info = replace(rundir.LockInfo.here(), **fields)
    (run_dir / rundir.LOCK_NAME).write_text(json.dumps(asdict(info)))
    return info


@pytest.fixture
def clean_env(monkeypatch):
    for k in (
        "SLURM_JOB_ID",
        "SLURM_RESTART_COUNT",
        "SLURM_STEP_ID",
        "SLURM_NTASKS",
        "SLURM_PROCID",
        "TORCHELASTIC_RUN_ID",
        "RANK",
        "WORLD_SIZE",
    ):
        monkeypatch.delenv(k, raising=False)


def test_lock_is_created_with_its_holder_and_removed_on_release(tmp_path, clean_env):
    lock = rundir.RunLock(tmp_path).acquire()
    data = json.loads((tmp_path / "run.lock").read_text())
    assert data["pid"] == os.getpid() and data["host"] and data["started"] and data["token"] == lock.info.token
    lock.release()
    assert not (tmp_path / "run.lock").exists()


def test_a_live_lock_is_refused_in_one_line(tmp_path, clean_env):
    holder = _holder(tmp_path)
    try:
        with pytest.raises(
            RunDirError, match=rf"^run dir {tmp_path} is in use by another run \(host .*, pid {holder.pid}"
        ):
            rundir.RunLock(tmp_path).acquire()
        with pytest.raises(RunDirError):
            rundir.refuse_if_locked(tmp_path)  # what precheck and the other ranks do
    finally:
        holder.kill()
        holder.wait()


def test_kill_9_leaves_a_stale_lock_the_next_run_takes_over(tmp_path, clean_env, caplog):
    holder = _holder(tmp_path)
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    assert (tmp_path / "run.lock").exists()
    rundir.refuse_if_locked(tmp_path)  # stale: not refused
    with rundir.RunLock(tmp_path) as lock:
        assert json.loads((tmp_path / "run.lock").read_text())["token"] == lock.info.token
    assert f"process {holder.pid}" in caplog.text and "taking over" in caplog.text
    assert not (tmp_path / "run.lock").exists()


def test_a_reused_pid_does_not_keep_a_lock_alive(tmp_path, clean_env):
    _write_lock(tmp_path, pid=os.getpid(), pid_start=1.0)  # our pid, but a process that started in 1970
    assert rundir.verdict(tmp_path / "run.lock", rundir.read_lock(tmp_path / "run.lock"))[0]


def test_a_requeued_slurm_job_takes_over_its_own_lock(tmp_path, clean_env, monkeypatch):
    _write_lock(tmp_path, machine="othernode|x|y", host="othernode", slurm_job_id="4242", slurm_restart=0)
    monkeypatch.setattr(rundir, "slurm_job_state", lambda job: "RUNNING")  # the requeued job runs again
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    with pytest.raises(RunDirError):  # the same run of the same job on another node: live
        rundir.RunLock(tmp_path).acquire()
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    stale, why = rundir.verdict(tmp_path / "run.lock", rundir.read_lock(tmp_path / "run.lock"))
    assert stale and "requeued" in why
    rundir.RunLock(tmp_path).acquire().release()


@pytest.mark.parametrize(
    "state,stale", [("", True), ("PENDING", True), ("COMPLETED", True), ("RUNNING", False), (None, False)]
)
def test_another_nodes_lock_is_judged_by_its_slurm_job(tmp_path, clean_env, monkeypatch, state, stale):
    _write_lock(tmp_path, machine="othernode|x|y", host="othernode", slurm_job_id="77")
    monkeypatch.setattr(rundir, "slurm_job_state", lambda job: state)
    assert rundir.verdict(tmp_path / "run.lock", rundir.read_lock(tmp_path / "run.lock"))[0] is stale


def test_another_nodes_lock_without_slurm_is_judged_by_its_heartbeat(tmp_path, clean_env):
    _write_lock(tmp_path, machine="othernode|x|y", host="othernode")
    path = tmp_path / "run.lock"
    assert not rundir.verdict(path, rundir.read_lock(path))[0]
    old = time.time() - rundir.STALE_AFTER_S - 5
    os.utime(path, (old, old))
    stale, why = rundir.verdict(path, rundir.read_lock(path))
    assert stale and "no heartbeat" in why


@pytest.mark.parametrize(
    "content", [b"[1]", b"[" * 100_000 + b"]" * 100_000, b"\xff\xfe"], ids=["list", "deep", "binary"]
)
def test_a_damaged_lock_reads_as_unreadable_not_as_an_error(tmp_path, content):
    """Any bytes in run.lock are a lock that cannot be read (stale once old), never a traceback."""
    path = tmp_path / "run.lock"
    path.write_bytes(content)
    assert rundir.read_lock(path) is None
    old = time.time() - rundir.CREATE_GRACE_S - 5
    os.utime(path, (old, old))
    assert rundir.verdict(path, None)[0]


def test_the_heartbeat_refreshes_the_lock(tmp_path, clean_env, monkeypatch):
    monkeypatch.setattr(rundir, "HEARTBEAT_S", 0.05)
    lock = rundir.RunLock(tmp_path).acquire()
    try:
        old = time.time() - 1000
        os.utime(tmp_path / "run.lock", (old, old))
        time.sleep(0.5)
        assert time.time() - (tmp_path / "run.lock").stat().st_mtime < 10
    finally:
        lock.release()


def test_a_half_written_lock_is_live_while_young(tmp_path, clean_env):
    path = tmp_path / "run.lock"
    path.write_text("")
    assert not rundir.verdict(path, None)[0]
    old = time.time() - rundir.CREATE_GRACE_S - 5
    os.utime(path, (old, old))
    assert rundir.verdict(path, None)[0]


def test_the_ranks_of_one_launch_share_the_lock(tmp_path, clean_env, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")
    with rundir.RunLock(tmp_path):
        rundir.refuse_if_locked(tmp_path)  # rank 1 of the same torchrun launch
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "other")
        with pytest.raises(RunDirError):
            rundir.refuse_if_locked(tmp_path)


def test_a_stale_takeover_guard_left_by_a_crash_is_cleared(tmp_path, clean_env):
    _write_lock(tmp_path, pid=2**22 + 12345, pid_start=None)  # no such process
    guard = tmp_path / "run.lock.takeover"
    guard.write_text("")
    old = time.time() - rundir.CREATE_GRACE_S - 5
    os.utime(guard, (old, old))
    rundir.RunLock(tmp_path).acquire().release()
    assert not guard.exists()


# -- I/O checks ------------------------------------------------------------------------------------
def test_preflight_faults_are_one_line(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(RunDirError, match=r"^hydra\.run\.dir: .*/file exists and is not a directory"):
        rundir.preflight(f)
    with pytest.raises(
        RunDirError, match=r"^hydra\.run\.dir: .*/file/run cannot be created: .*/file is not a directory"
    ):
        rundir.preflight(f / "run")
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").write_text("")
    with pytest.raises(RunDirError, match=r"^checkpoint: .*/checkpoints exists and is not a directory"):
        rundir.preflight(run)
    rundir.preflight(run, checkpoints=False)  # checkpoint=none: never written
    (run / "checkpoints").unlink()
    (run / "metrics.jsonl").mkdir()
    with pytest.raises(RunDirError, match=r"metrics\.jsonl is a directory"):
        rundir.preflight(run)


def test_preflight_reports_an_unwritable_dir(tmp_path, monkeypatch):
    real = os.access
    monkeypatch.setattr(
        os, "access", lambda p, mode: False if str(p) == str(tmp_path) and mode & os.W_OK else real(p, mode)
    )
    with pytest.raises(RunDirError, match=rf"^hydra\.run\.dir: {tmp_path} is not writable"):
        rundir.preflight(tmp_path)
    with pytest.raises(RunDirError, match=r"cannot be created: .* is not writable"):
        rundir.preflight(tmp_path / "new" / "run")


def test_preflight_makes_sure_a_missing_dir_can_be_made(tmp_path, monkeypatch):
    """Access bits pass where the kernel still refuses (/sys: EPERM, /proc: ENOENT, a read-only
    mount): a folder is made in the nearest existing one and removed again."""
    real = Path.mkdir
    (tmp_path / "ro").mkdir()  # a read-only mount

    def refuse(self, *a, **k):
        if self.parent == tmp_path / "ro":
            raise OSError(30, "Read-only file system")
        return real(self, *a, **k)

    monkeypatch.setattr(Path, "mkdir", refuse)
    with pytest.raises(
        RunDirError, match=r"^hydra\.run\.dir: .*/ro/run cannot be created: Read-only file system \(.*/ro\)$"
    ):
        rundir.preflight(tmp_path / "ro" / "run")
    rundir.preflight(tmp_path / "rw" / "run")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ro"]  # made and removed: the check leaves nothing
    if Path("/proc/self").is_dir():  # the real thing where there is one
        assert "cannot be created: No such file or directory" in rundir.dir_problem("/proc/run", create=True)


def test_ranks_checking_one_fresh_run_dir_at_once_all_pass(tmp_path):
    """Every rank runs the preflight at start-up, at the same moment, on the same fresh run dir
    (its plots/ and checkpoints/ not made yet). A check that made and removed the missing folder
    itself let another rank see it come and go: "exists and is not a directory" or "is not
    writable", exit 2 for a 4-rank job (seen in this suite). Here 8 threads check 200 times each."""
    import threading

    run = tmp_path / "run"
    run.mkdir()
    errors: list[str] = []

    def check():
        for _ in range(200):
            try:
                rundir.preflight(run)
            except Exception as e:  # noqa: BLE001  (any kind: a thread's own exception would only warn)
                errors.append(repr(e))

    threads = [threading.Thread(target=check) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert not any(run.iterdir())  # nothing left behind


def test_readable_dir(tmp_path, monkeypatch):
    rundir.readable_dir(tmp_path, "data.root")
    with pytest.raises(ConfigError, match=r"^data\.root: directory does not exist"):
        rundir.readable_dir(tmp_path / "nope", "data.root")
    real = os.scandir

    def denied(p):
        if str(p) == str(tmp_path):
            raise PermissionError(13, "Permission denied")
        return real(p)

    monkeypatch.setattr(os, "scandir", denied)
    with pytest.raises(ConfigError, match=rf"^data\.root: {tmp_path} is not readable \(Permission denied\)"):
        rundir.readable_dir(tmp_path, "data.root")


# -- through the CLI ---------------------------------------------------------------------------------
def _assert_one_line(proc, code, pattern):
    import re

    assert proc.returncode == code, proc.stderr[-2000:]
    err = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(err) == 1 and re.search(pattern, err[0]), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr + proc.stdout


def test_a_second_run_on_a_live_run_dir_is_refused_before_writing(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    holder = _holder(run)
    try:
        proc = run_cli(tiny_overrides(tmp_path, tmp_path / "data", **{"trainer.max_steps": 2}), cwd=tmp_path)
    finally:
        holder.kill()
        holder.wait()
    _assert_one_line(proc, 2, rf"^error: run dir {run} is in use by another run .*pid {holder.pid}")
    assert sorted(p.name for p in run.iterdir()) == ["run.lock"]  # nothing written: no .hydra, no metrics


def test_a_crashed_runs_lock_is_taken_over_and_the_run_completes(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    holder = _holder(run)
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    proc = run_cli(
        tiny_overrides(
            tmp_path, tmp_path / "data", checkpoint="none", **{"trainer.max_steps": 2, "trainer.val_every": 0}
        ),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "taking over the stale run-dir lock" in (run / "framework.log").read_text()
    assert not (run / "run.lock").exists()


@pytest.mark.parametrize(
    "setup,extra,pattern",
    [
        ("checkpoints_file", {}, r"^error: checkpoint: .*/run/checkpoints exists and is not a directory"),
        ("run_is_file", {}, r"^error: hydra\.run\.dir: .*/run exists and is not a directory"),
        (
            "parent_is_file",
            {"hydra.run.dir": "{tmp}/blocker/run"},
            r"^error: hydra\.run\.dir: .*/blocker/run cannot be created",
        ),
    ],
)
def test_io_faults_stop_before_any_work(tmp_path, setup, extra, pattern):
    run = tmp_path / "run"
    if setup == "checkpoints_file":
        run.mkdir()
        (run / "checkpoints").write_text("")
    elif setup == "run_is_file":
        run.write_text("")
    else:
        (tmp_path / "blocker").write_text("")
    extra = {k: v.format(tmp=tmp_path) for k, v in extra.items()}
    proc = run_cli(tiny_overrides(tmp_path, tmp_path / "data", **{"trainer.max_steps": 2, **extra}), cwd=tmp_path)
    _assert_one_line(proc, 2, pattern)
    assert not (tmp_path / "data").exists()  # not even the synthetic data was written


def test_dir_problem_for_schema_checks(tmp_path):
    """What a data schema's check_root raises as Invalid("root", problem)."""
    f = tmp_path / "f"
    f.write_text("")
    assert rundir.dir_problem(tmp_path) is None
    assert rundir.dir_problem(tmp_path / "nope") == f"directory does not exist: {tmp_path / 'nope'}"
    assert rundir.dir_problem(f) == f"{f} is not a directory"
    assert rundir.dir_problem(tmp_path / "new" / "root", create=True) is None
    assert rundir.dir_problem(f / "root", create=True) == f"{f / 'root'} cannot be created: {f} is not a directory"
