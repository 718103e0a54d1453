"""End-to-end tests on the local SLURM cluster of slurm/local_cluster.sh.

Skipped when `sinfo` is missing or the cluster is not up, unless FRAMEWORK_SLURM=required
(.ci/run exports it after starting the cluster): then a missing cluster fails the tests.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, tiny_overrides

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(300)]

REQUIRED = os.environ.get("FRAMEWORK_SLURM", "").lower() == "required"
# one thread per rank: several ranks share the few cores of the local cluster
ENV = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")


@functools.lru_cache(maxsize=1)
def _idle_nodes() -> tuple[tuple[str, ...], str]:
    """(usable nodes of partition debug, why none) from sinfo; asked once per session."""
    if shutil.which("sinfo") is None:
        return (), "sinfo not found (install with: bash slurm/install.sh)"
    try:
        out = subprocess.run(
            ["sinfo", "-h", "-N", "-p", "debug", "-o", "%N %t"], capture_output=True, text=True, timeout=10
        )
    except subprocess.TimeoutExpired:
        return (), "sinfo timed out: slurmctld does not answer"
    if out.returncode != 0:
        return (
            (),
            f"sinfo failed: {out.stderr.strip() or out.stdout.strip()} (start it: bash slurm/local_cluster.sh start)",
        )
    nodes = tuple(
        ln.split()[0]
        for ln in out.stdout.splitlines()
        if len(ln.split()) == 2 and ln.split()[1].rstrip("*~#").startswith(("idle", "mix", "alloc"))
    )
    return nodes, "" if nodes else f"no usable node in partition debug: {out.stdout.strip()!r}"


def _need_cluster(min_nodes: int = 1) -> tuple[str, ...]:
    nodes, why = _idle_nodes()
    if not nodes:
        msg = f"local SLURM cluster not up: {why}"
        if REQUIRED:
            pytest.fail(f"FRAMEWORK_SLURM=required but {msg}")
        pytest.skip(msg)
    if len(nodes) < min_nodes:
        # a one-node cluster is a valid setup: skip even when required
        pytest.skip(
            f"needs {min_nodes} nodes, the cluster has {len(nodes)} (bash slurm/local_cluster.sh start --nodes 2)"
        )
    return nodes


def _train_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    assert path.is_file(), (
        f"no metrics.jsonl in {run_dir}: {sorted(p.name for p in run_dir.iterdir()) if run_dir.exists() else 'no dir'}"
    )
    rows = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
    return [r for r in rows if r.get("split") == "train"]


def _check(proc: subprocess.CompletedProcess, what: str) -> None:
    assert proc.returncode == 0, (
        f"{what} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}"
    )


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    # generated once by the first run, shared by the others (a shared dir: one host)
    return tmp_path_factory.mktemp("slurm_data") / "synthetic"


def test_srun_ddp_two_tasks(tmp_path, data_root):
    """srun -n 2 python -m framework: ranks and rendezvous come from SLURM's variables."""
    _need_cluster()
    args = tiny_overrides(tmp_path, data_root, parallel="ddp", device="cpu")
    proc = subprocess.run(
        ["srun", "-n", "2", "--time=10", sys.executable, "-m", "framework", *args],
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=240,
    )
    _check(proc, "srun -n 2 python -m framework")
    rows = _train_rows(tmp_path / "run")
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert "dp_shard=2" in proc.stdout + proc.stderr + (tmp_path / "run" / "framework.log").read_text()


def test_multirun_submitit_sweep(tmp_path, data_root):
    """--multirun through hydra/launcher=submitit_slurm: 2 jobs of 2 tasks each (gloo)."""
    _need_cluster()
    sweep = tmp_path / "sweep"
    args = [
        a
        for a in tiny_overrides(tmp_path, data_root, parallel="ddp", device="cpu")
        if not a.startswith("hydra.run.dir=")
    ]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "framework",
            "--multirun",
            "hydra/launcher=submitit_slurm",
            "cluster=slurm_local",
            "optim.lr=1e-3,2e-3",
            f"hydra.sweep.dir={sweep}",
            "hydra.sweep.subdir=job${hydra.job.num}_lr${optim.lr}",
            "hydra.launcher.timeout_min=10",
            *args,
        ],
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=280,
    )
    _check(proc, "python -m framework --multirun (submitit_slurm)")
    job_dirs = sorted(p for p in sweep.iterdir() if p.is_dir() and not p.name.startswith("."))
    assert len(job_dirs) == 2, [p.name for p in sweep.iterdir()]
    for job_dir, lr in zip(job_dirs, ("0.001", "0.002")):
        assert job_dir.name.endswith(f"_lr{lr}"), job_dir.name
        rows = _train_rows(job_dir)
        assert [r["step"] for r in rows] == list(range(1, 7)), job_dir
        assert (job_dir / "checkpoints").is_dir()
    # each job ran 2 tasks (submitit writes one log per task)
    logs = sorted((sweep / ".submitit").glob("*_*/*_log.out"))
    assert len(logs) == 4, [str(p) for p in logs]


def test_srun_two_nodes(tmp_path, data_root):
    """2 nodes x 2 tasks: ranks spread over both nodes (n1, n2 on this one host)."""
    _need_cluster(min_nodes=2)
    probe = subprocess.run(
        ["srun", "-N", "2", "--ntasks-per-node=2", "--time=2", "bash", "-c", "echo $SLURM_PROCID $SLURMD_NODENAME"],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )
    _check(probe, "srun -N 2 --ntasks-per-node=2")
    placed = dict(ln.split() for ln in probe.stdout.splitlines())
    assert sorted(placed) == ["0", "1", "2", "3"] and len(set(placed.values())) == 2, placed

    args = tiny_overrides(tmp_path, data_root, parallel="ddp", device="cpu")
    proc = subprocess.run(
        ["srun", "-N", "2", "--ntasks-per-node=2", "--time=10", sys.executable, "-m", "framework", *args],
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=240,
    )
    _check(proc, "srun -N 2 --ntasks-per-node=2 python -m framework")
    rows = _train_rows(tmp_path / "run")
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert "dp_shard=4" in (tmp_path / "run" / "framework.log").read_text()


def _sbatch(args: list[str], cwd: Path) -> str:
    """Submit; the job's id."""
    sub = subprocess.run(["sbatch", "--parsable", *args], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=30)
    assert sub.returncode == 0, f"sbatch failed: {sub.stderr}"
    return sub.stdout.strip().split(";")[0]


def _sbatch_and_wait(args: list[str], cwd: Path, timeout: float = 240) -> tuple[str, str]:
    """Submit and poll every half second until the job ends: (JobState, ExitCode). sbatch --wait
    polls with a backoff up to 32 s, which tripled this test's time."""
    job, t0 = _sbatch(args, cwd), time.monotonic()
    while time.monotonic() - t0 < timeout:
        info = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True).stdout
        fields = dict(kv.split("=", 1) for kv in info.split() if "=" in kv)
        if fields.get("JobState") not in (None, "PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
            return fields["JobState"], fields.get("ExitCode", "")
        time.sleep(0.5)
    subprocess.run(["scancel", job])
    pytest.fail(f"job {job} still running after {timeout} s")


def test_sbatch_template(tmp_path, data_root):
    """slurm/train.sbatch on the local cluster (CPU: no GPUs, 2 tasks)."""
    _need_cluster()
    args = [
        a
        for a in tiny_overrides(tmp_path, data_root, parallel="ddp", device="cpu")
        if not a.startswith("hydra.run.dir=")
    ]
    state, code = _sbatch_and_wait(
        [
            "--partition=debug",
            "--gpus-per-node=0",
            "--nodes=1",
            "--ntasks-per-node=2",
            "--cpus-per-task=1",
            "--mem=1G",
            "--time=10",
            f"--output={tmp_path}/slurm-%j.out",
            f"--export=ALL,RUN_DIR={tmp_path / 'run'}",
            str(REPO / "slurm" / "train.sbatch"),
            *args,
        ],
        tmp_path,
    )
    logs = "".join(p.read_text() for p in tmp_path.glob("slurm-*.out"))
    assert (state, code) == ("COMPLETED", "0:0"), f"job ended {state} (exit {code})\n{logs[-4000:]}"
    rows = _train_rows(tmp_path / "run")
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert "dp_shard=2" in (tmp_path / "run" / "framework.log").read_text()


def test_one_squeue_names_every_jobs_state_by_any_of_its_ids(tmp_path):
    """The launcher asks the queue once per poll for a whole sweep (framework.rundir.slurm_job_states):
    a running array task by submitit's ARRAY_TASK id and by its own numeric id (its SLURM_JOB_ID),
    a held array's tasks and the array by its id, and jobs that ended or never were ('')."""
    from framework.rundir import slurm_job_state, slurm_job_states

    _need_cluster()

    def submit(*args: str) -> str:
        return _sbatch(["-p", "debug", "-o", "/dev/null", *args], tmp_path)

    def until(ids: list[str], want: dict) -> None:
        t0 = time.monotonic()
        while (states := slurm_job_states(ids)) != want:
            assert time.monotonic() - t0 < 60, states
            time.sleep(0.5)

    finished, running = submit("--wrap", "true"), submit("--array=0-1", "--wrap", "sleep 60")
    held = submit("--hold", "--array=0-2", "--wrap", "sleep 60")
    try:
        first = f"{running}_0"  # a started task that is not its array's last gets an id of its own
        until([finished, first], {finished: "", first: "RUNNING"})
        task = subprocess.run(["squeue", "-h", "-r", "-j", first, "-o", "%A"], capture_output=True, text=True)
        own = task.stdout.strip()
        assert own.isdigit() and own != running, task
        ids = [finished, first, own, f"{held}_1", f"{held}_2", held, "999999"]
        assert slurm_job_states(ids) == {
            finished: "", first: "RUNNING", own: "RUNNING", f"{held}_1": "PENDING", f"{held}_2": "PENDING",
            held: "PENDING", "999999": "",
        }  # fmt: skip
        assert slurm_job_state("999999") == "" and slurm_job_states([]) == {}
    finally:
        subprocess.run(["scancel", running, held], timeout=30)
    until([own, f"{held}_1"], {own: "", f"{held}_1": ""})  # cancelled: out of the queue
