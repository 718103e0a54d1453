"""On the real local SLURM cluster: what goes wrong when a sweep is launched through
hydra-submitit-launcher ends in one line on stderr and an exit code, in the launching process:
sbatch refusing the job (a gres or partition the cluster does not have: exit 2), a job that
fails on the cluster (its own line and exit code, and its log), a job that leaves the queue
without a result (cancelled), which the launcher used to wait for forever without accounting."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

from tests.conftest import tiny_overrides
from tests.slurm.test_local_cluster import ENV, _need_cluster

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(300)]


def _sweep(tmp_path, *args, timeout=240) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "framework", "--multirun", f"hydra.sweep.dir={tmp_path / 'sweep'}", *args]
    return subprocess.Popen(cmd, cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _one_line(proc: subprocess.Popen, code: int, pattern: str, timeout: float = 240) -> str:
    out, err = proc.communicate(timeout=timeout)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert proc.returncode == code and len(lines) == 1, f"exit {proc.returncode}\n{err[-3000:]}\n{out[-2000:]}"
    assert "Traceback" not in out + err
    assert re.search(pattern, lines[0]), lines[0]
    return lines[0]


def _queued_from(tmp_path) -> list[str]:
    rows = subprocess.run(["squeue", "-h", "-o", "%i %Z"], capture_output=True, text=True).stdout.splitlines()
    return [r.split()[0] for r in rows if len(r.split()) == 2 and r.split()[1] == str(tmp_path)]


def _tiny(tmp_path) -> list[str]:
    return [a for a in tiny_overrides(tmp_path, tmp_path / "data") if not a.startswith("hydra.run.dir=")]


def test_an_impossible_gres_is_one_line_and_exit_2(tmp_path):
    """The GPU preset on a cluster without GPUs: sbatch's own message, the field that asked for it."""
    _need_cluster()
    line = _one_line(
        _sweep(tmp_path, "cluster=slurm_gpu_example", "device=cpu", *_tiny(tmp_path)),
        2,
        r"^error: sbatch refused the job: Invalid generic resource \(gres\) specification "
        r"\(from hydra\.launcher\.gpus_per_node=8\); script: .*/sweep/\.submitit/\.submission_file_\w+\.sh$",
    )
    script = line.rsplit("script: ", 1)[1]
    assert "#SBATCH --gpus-per-node=8" in open(script).read()  # the script sbatch refused
    assert not _queued_from(tmp_path)


def test_an_unknown_partition_is_one_line_and_exit_2(tmp_path):
    _need_cluster()
    _one_line(
        _sweep(tmp_path, "cluster=slurm_local", "hydra.launcher.partition=nosuch", *_tiny(tmp_path)),
        2,
        r"^error: sbatch refused the job: invalid partition specified: nosuch; Batch job submission failed: "
        r"Invalid partition name specified \(from hydra\.launcher\.partition=nosuch\); script: ",
    )


def test_a_job_that_fails_on_the_cluster_is_its_own_line_and_exit_code(tmp_path):
    """3 data-parallel ranks asked of a job of 2 tasks: refused in the job (the launching process
    cannot know the job's world); the launcher says so, with the job's log, and exits 2."""
    _need_cluster()
    line = _one_line(
        _sweep(tmp_path, "cluster=slurm_local", "parallel=ddp", "parallel.dp_shard=3", "device=cpu", *_tiny(tmp_path)),
        2,
        r"^error: job \d+ \(#0\) failed: parallel: dp_replicate x dp_shard x domain = 1 x 3 x 1 = 3 does not match "
        r"the world size 2; log: .*/sweep/\.submitit/\d+/\d+_0_log\.err$",
    )
    log = line.rsplit("log: ", 1)[1]
    assert "error: parallel: dp_replicate x dp_shard x domain" in open(log).read()
    history = (tmp_path / "sweep" / "0" / ".hydra" / "override_history.jsonl").read_text()
    assert '"exit": 2' in history  # the job's run dir records the refused invocation


def test_a_job_cancelled_on_the_cluster_ends_the_launcher_in_one_line(tmp_path):
    """Without accounting, submitit cannot tell a job that died without a result from a running
    one; the launcher asks squeue and stops waiting."""
    _need_cluster()
    proc = _sweep(
        tmp_path, "cluster=slurm_local", "parallel=ddp", "device=cpu", *_tiny(tmp_path), "trainer.max_steps=100000"
    )
    metrics = tmp_path / "sweep" / "0" / "metrics.jsonl"
    t0 = time.monotonic()
    while not metrics.exists():
        assert time.monotonic() - t0 < 200 and proc.poll() is None, "the job did not start training"
        time.sleep(1)
    jobs = _queued_from(tmp_path)
    assert jobs, "the running job is not in the queue"
    subprocess.run(["scancel", jobs[0]], check=True)
    _one_line(
        proc,
        1,
        rf"^error: job {jobs[0]} \(#0\) failed: it left the queue without a result \(state CANCELLED, exit code "
        r"\d+:\d+\).*; log: .*_0_log\.err$",
        timeout=120,
    )
