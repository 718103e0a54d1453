"""On the real local SLURM cluster: a 2-job inference sweep (start times sharded over the jobs,
members over each job's 2 ranks) writes one store; both jobs are sent USR2 mid-way, stop after
their current block, are requeued by submitit, skip the blocks they had marked and complete the
store, with no block written twice and none missing."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.slurm.test_local_cluster import ENV, _need_cluster

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(600)]

STARTS = ["2021-01-01T02", "2021-01-01T08", "2021-01-01T14", "2021-01-01T20"]
MEMBERS = 6


def _marked(partial: Path) -> int:
    """Members marked complete so far: one chunk file per marked (init, member)."""
    return sum(1 for p in (partial / "completed" / "c").glob("*/*") if p.is_file())


def test_interrupted_sweep_resumes_and_completes(tmp_path):
    _need_cluster()
    import zarr

    from recipes.weather.synthetic import write_synthetic
    from tests.recipes.weather.test_forecast import GRID, MODEL, _export

    data = write_synthetic(tmp_path / "data", height=GRID, width=GRID, years=(2021,), hours_per_year=48)
    reg = _export(tmp_path / "regression.pt", [*MODEL, f"data.root={data}"], seed=1)
    diff = _export(
        tmp_path / "diffusion.pt", [*MODEL, "recipe=tiny_diffusion", f"data.root={data}", f"task.regression={reg}"], 2
    )
    sweep, out = tmp_path / "sweep", tmp_path / "forecast.zarr"
    cmd = [
        sys.executable,
        "-m",
        "recipes.weather.forecast",
        "--multirun",
        "cluster=slurm_local",
        "parallel=ddp",
        "device=cpu",
        "infer.shards=2",
        "infer.shard=0,1",
        f"hydra.sweep.dir={sweep}",
        "hydra.launcher.timeout_min=10",
        f"infer.diffusion={diff}",
        f"infer.data_root={data}",
        f"infer.starts=[{','.join(STARTS)}]",
        "infer.hours=3",
        f"infer.members={MEMBERS}",
        "infer.member_batch=1",
        "infer.steps=12",
        f"infer.out={out}",
        "infer.progress=false",
        "infer.frames=false",
    ]
    launcher = subprocess.Popen(cmd, cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    partial = Path(f"{out}.partial")
    t0 = time.time()
    while not (partial.is_dir() and _marked(partial) >= 1):
        assert time.time() - t0 < 240 and launcher.poll() is None, "the jobs did not start writing"
        time.sleep(0.2)
    rows = subprocess.run(["squeue", "-h", "-o", "%i %Z", "-n", "infer"], capture_output=True, text=True).stdout
    jobs = [r.split()[0] for r in rows.splitlines() if len(r.split()) == 2 and r.split()[1] == str(tmp_path)]
    assert len(jobs) == 2, f"not two running jobs submitted from {tmp_path}: {rows}"
    for job in jobs:
        subprocess.run(["scancel", "-s", "USR2", job], check=True)
    stdout, _ = launcher.communicate(timeout=500)
    assert launcher.returncode == 0, stdout[-3000:]

    assert out.is_dir() and not partial.exists()
    g = zarr.open_group(str(out), mode="r")
    assert np.asarray(g["completed"][...]).all()
    assert np.isfinite(np.asarray(g["forecast"][...])).all() and np.isfinite(np.asarray(g["truth"][...])).all()
    logs = [(sweep / str(j) / "infer.log").read_text() for j in (0, 1)]
    stopped = [log for log in logs if "stopping on signal SIGUSR2" in log]
    assert stopped, "no job was stopped by the signal (did both finish first?)"
    for log in stopped:
        assert re.search(r"resuming: \d+ of \d+ blocks of this job already written, skipped", log), log[-2000:]
    wrote = [m.group(1) for log in logs for m in re.finditer(r"rank \d+ wrote (\S+ members \d+-\d+)", log)]
    want = [f"{t} members {m}-{m}" for t in STARTS for m in range(MEMBERS)]
    assert sorted(wrote) == sorted(want)  # every block exactly once, over both jobs and their requeues
