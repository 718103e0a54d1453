"""The README's main job, as is: ``python -m framework`` with nothing but where to write.

On its own file so that pytest-xdist (``--dist loadfile``) runs this, the longest test,
beside the rest of the suite instead of behind the other CLI tests.
"""

import pytest

from framework.logging.jsonl import read
from tests.conftest import run_cli


@pytest.mark.slow
def test_default_main_job_learns_and_beats_persistence(tmp_path):
    """`python -m framework` with no overrides but where to write (about two minutes)."""
    proc = run_cli([f"hydra.run.dir={tmp_path / 'run'}", f"data.root={tmp_path / 'data'}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "run"
    train, val = read(run / "metrics.jsonl", "train"), read(run / "metrics.jsonl", "val")
    assert train[-1]["step"] == 400
    assert train[-1]["loss"] < train[0]["loss"] / 5  # the loss falls clearly
    assert val[-1]["rmse"] < 0.8 * val[-1]["rmse_persistence"]  # and beats persistence
    for key in ("step", "split", "loss", "lr", "grad_norm", "samples_per_s", "mem_gb"):
        assert key in train[0]
    assert (run / "checkpoints" / "step_00000400" / "meta.json").is_file()
    assert (run / ".hydra" / "config.yaml").is_file() and (run / "framework.log").is_file()
    log = (run / "framework.log").read_text()
    assert "model beats persistence" in log and f"run dir: {run}" in log
