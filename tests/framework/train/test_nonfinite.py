"""A diverging run stops with exit 4 and never checkpoints a non-finite model."""

from __future__ import annotations

import json

import torch

from tests.conftest import run_cli, tiny_overrides


def test_divergence_stops_before_saving_and_keeps_the_good_checkpoint(tmp_path):
    # lr=1e6 without clipping: step 1 is finite (its update is huge but finite), step 2's
    # gradients are NaN. checkpoint.every=1 and keep=1: a NaN step_2 would replace step_1.
    args = tiny_overrides(
        tmp_path,
        tmp_path / "data",
        **{
            "optim.lr": 1e6,
            "trainer.grad_clip": 0,
            "checkpoint.every": 1,
            "checkpoint.keep": 1,
            "trainer.log_every": 5,
            "trainer.val_every": 0,
            "trainer.max_steps": 20,
        },
    )
    r = run_cli(args, cwd=tmp_path)
    assert r.returncode == 4, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines[-1].startswith("error: the loss or gradient norm became NaN/inf at step 2"), lines[-3:]
    assert "newest checkpoint kept: step_00000001" in lines[-1]
    assert "Traceback" not in r.stderr
    ckpts = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_00000001"]
    state = torch.load(ckpts / "step_00000001" / "state.pt", weights_only=True)
    assert all(torch.isfinite(v).all() for v in state["model"].values())
    rows = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(row["step"] < 2 for row in rows)  # nothing logged from the diverged model


def test_resume_beyond_max_steps_is_a_config_error(tmp_path):
    args = tiny_overrides(tmp_path, tmp_path / "data", **{"trainer.max_steps": 3, "trainer.val_every": 0})
    assert run_cli(args, cwd=tmp_path).returncode == 0
    again = run_cli(args, cwd=tmp_path)  # the same run again: already done, nothing to train
    assert again.returncode == 0, again.stderr[-2000:]
    assert "nothing to train" in again.stderr + again.stdout
    lower = run_cli([*args, "trainer.max_steps=2"], cwd=tmp_path)
    assert lower.returncode == 2
    assert lower.stderr.strip().splitlines()[-1].startswith("error: trainer.max_steps=2 is below the step")
