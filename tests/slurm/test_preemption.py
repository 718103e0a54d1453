"""On the real local SLURM cluster: USR2 -> all ranks checkpoint and stop -> submitit requeues
-> the requeued job resumes from that checkpoint in the same run dir and finishes."""

import json
import subprocess
import sys
import time

import pytest

from tests.slurm.test_local_cluster import ENV, _need_cluster

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(600)]


def _train_steps(path):
    steps = []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if row.get("split") == "train":
            steps.append(row["step"])
    return steps


def test_usr2_checkpoints_requeues_and_resumes(tmp_path):
    _need_cluster()
    sweep = tmp_path / "sweep"
    cmd = [
        sys.executable,
        "-m",
        "framework",
        "--multirun",
        "cluster=slurm_local",
        "parallel=ddp",
        "device=cpu",
        f"hydra.sweep.dir={sweep}",
        f"data.root={tmp_path / 'data'}",
        "data.grid=[16,16]",
        "data.hours_per_year=96",
        "data.batch_size=4",
        "model.model_channels=8",
        "trainer.max_steps=150",
        "trainer.log_every=1",
        "trainer.val_every=0",
        "checkpoint.every=1000",
        "trainer.progress=false",
    ]
    launcher = subprocess.Popen(cmd, cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = sweep / "0" / "metrics.jsonl"
    t0 = time.time()
    while not (metrics.exists() and len(_train_steps(metrics)) >= 5):
        assert time.time() - t0 < 240 and launcher.poll() is None, "the job did not start training"
        time.sleep(1)
    # this test's job: submitted from tmp_path (other tests may have jobs of the same name queued)
    rows = subprocess.run(
        ["squeue", "-h", "-o", "%i %Z", "-n", "framework"], capture_output=True, text=True
    ).stdout.splitlines()
    job = [r.split()[0] for r in rows if len(r.split()) == 2 and r.split()[1] == str(tmp_path)]
    assert job, f"no running job submitted from {tmp_path}: {rows}"
    subprocess.run(["scancel", "-s", "USR2", job[0]], check=True)
    out, _ = launcher.communicate(timeout=500)
    assert launcher.returncode == 0, out[-3000:]
    log = (sweep / "0" / "framework.log").read_text()
    assert "stopping at step" in log and "on signal SIGUSR2; checkpoint step_" in log
    stopped = int(log.split("stopping at step ")[1].split()[0])
    assert f"resumed from {sweep / '0' / 'checkpoints' / f'step_{stopped:08d}'} at step {stopped}" in log
    assert "done: 150 steps" in log
    steps = _train_steps(metrics)
    assert steps == list(range(1, stopped + 1)) + list(range(stopped + 1, 151))  # no step lost, none twice


def test_wall_time_margin_reads_the_job_end_time():
    """trainer.stop_before_end_min needs the job's end time: read inside a real 3-minute job."""
    _need_cluster()
    code = (
        "import time; from framework.train.preemption import StopRequest, slurm_end_time; "
        "end = slurm_end_time(); s = StopRequest(stop_before_end_min=5); "
        "print(round(end - time.time()), s.agreed())"
    )
    proc = subprocess.run(
        ["srun", "-n", "1", "--time=3", sys.executable, "-c", code],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    left, agreed = proc.stdout.split()
    assert 100 < int(left) <= 180  # about 3 minutes left
    assert agreed == "True"  # 5 minutes of margin > 3 minutes left: stop now
