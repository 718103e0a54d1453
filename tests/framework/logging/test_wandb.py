"""logger=wandb in offline mode through the real CLI: the run, its config, resume into the same run."""

import pytest

from tests.conftest import run_cli, tiny_overrides

wandb = pytest.importorskip("wandb")


def _runs(run_dir):
    return sorted(p for p in (run_dir / "wandb").glob("offline-run-*") if p.is_dir())


def test_offline_run_logs_config_and_resumes_the_same_run(tmp_path):
    over = tiny_overrides(
        tmp_path, tmp_path / "data", logger="wandb", **{"logger.project": "tests", "trainer.max_steps": 3}
    )
    proc = run_cli(over, cwd=tmp_path, env={"WANDB_MODE": "offline"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = tmp_path / "run"
    first = _runs(run_dir)
    assert len(first) == 1
    run_id = first[0].name.rsplit("-", 1)[-1]
    assert (first[0] / f"run-{run_id}.wandb").is_file()

    # Resume the same run dir with more steps: the checkpoint carries the run id.
    over = tiny_overrides(
        tmp_path, tmp_path / "data", logger="wandb", **{"logger.project": "tests", "trainer.max_steps": 6}
    )
    proc = run_cli(over, cwd=tmp_path, env={"WANDB_MODE": "offline"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    ids = {p.name.rsplit("-", 1)[-1] for p in _runs(run_dir)}
    assert ids == {run_id}


def _without_wandb(tmp_path):
    """A PYTHONPATH on which ``import wandb`` fails, as on an image without it."""
    fake = tmp_path / "nowandb" / "wandb"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('no wandb here')\n")
    return {"PYTHONPATH": str(fake.parent)}


def test_console_logger_never_imports_wandb(tmp_path):
    over = tiny_overrides(tmp_path, tmp_path / "data", **{"trainer.max_steps": 1, "checkpoint": "none"})
    proc = run_cli(over + ["logger=console"], cwd=tmp_path, env=_without_wandb(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_wandb_logger_without_wandb_is_one_clear_line(tmp_path):
    over = tiny_overrides(tmp_path, tmp_path / "data", **{"trainer.max_steps": 1, "checkpoint": "none"})
    proc = run_cli(over + ["logger=wandb"], cwd=tmp_path, env=_without_wandb(tmp_path))
    assert proc.returncode == 2
    assert (
        proc.stderr.strip().splitlines()[-1] == "error: logger=wandb needs the wandb package: pip install -e '.[wandb]'"
    )
