"""An existing StormCast user's workflow, on synthetic data in PhysicsNeMo's layout (CPU, tiny):
train the regression stage, export it as a PhysicsNeMo .mdlus, train the diffusion stage on that
.mdlus, roll both out; fine-tune a fresh run from a .mdlus (``checkpoint.init_from``).

The diffusion stage trains through the real CLI (``run_cli``). To keep the module fast, the
other jobs run in this process: training through ``framework.runtime.run_job`` (what
``python -m framework`` runs after validating the composed config; no validation figures), the
export and inference CLIs through their ``main(argv)`` (the same argument parsing and error
handling as ``python -m``, without another interpreter start-up).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from framework.errors import ConfigError
from tests.conftest import run_cli, tiny_overrides

pytestmark = pytest.mark.timeout(600)

# A 16x16 grid, 8 model channels, two levels, two steps: the stages only need to exist.
SMALL = {
    "data.layout": "physicsnemo",  # the synthetic stores are written in PhysicsNeMo's layout
    "data.hours_per_year": 24,
    "data.batch_size": 2,
    "model.channel_mult": "[1,2]",
    "trainer.max_steps": 2,
    "trainer.val_every": 2,
    "checkpoint.every": 2,
    "schedule.warmup_steps": 1,
}
DIFF = {
    "recipe": "tiny_diffusion",
    "task.sampler.num_steps": 2,
    "task.val_members": 2,
}
TINY_DATA = ["recipe=tiny", "data.grid=[16,16]"]  # --data-config: the data node the .mdlus was trained with


def overrides(tmp: Path, run: str, **extra) -> list[str]:
    return tiny_overrides(tmp, tmp / "data", **{**SMALL, "hydra.run.dir": str(tmp / run), **extra})


def run_here(tmp: Path, name: str, **extra) -> dict:
    """One training job in this process, as ``python -m framework`` runs it after validation."""
    from framework.cli import compose
    from framework.config.validate import validate
    from framework.runtime import run_job
    from recipes.weather.task import RegressionTask

    args = [a for a in overrides(tmp, name, **extra) if not a.startswith("hydra.")]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(RegressionTask, "val_figures", lambda self, out_dir, step: {})  # not looked at here
        return run_job(validate(compose(args)), run_dir=tmp / name)


def val_row(run_dir: Path) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("split") == "val"][-1]


def export(argv: list[str], capsys) -> tuple[int, str]:
    from framework.export import main

    code = main([str(a) for a in argv])
    return code, capsys.readouterr().err


def infer(argv: list[str], capsys) -> tuple[int, str]:
    from recipes.stormcast.inference import main

    code = main([*map(str, argv), "--no-progress", "--plot-channels"])  # no frames: not looked at here
    return code, capsys.readouterr().err


@pytest.fixture(scope="module")
def stage1(tmp_path_factory):
    """The regression stage trained on reference-layout data: (tmp, data root, run dir)."""
    tmp = tmp_path_factory.mktemp("physicsnemo_workflow")
    assert run_here(tmp, "regression")["steps"] == 2
    assert (tmp / "data" / "hrrr_v3").is_dir()  # PhysicsNeMo's layout, not ours
    return tmp, tmp / "data", tmp / "regression"


@pytest.fixture(scope="module")
def exported(stage1):
    """The regression stage exported twice from its run dir: ours (.pt + .json) and a .mdlus."""
    tmp, _, run = stage1
    from framework.export import main

    assert main([str(run), str(tmp / "regression.pt")]) == 0
    assert main([str(run), "--format", "physicsnemo", "-o", str(tmp / "regression.mdlus")]) == 0
    return tmp / "regression.pt", tmp / "regression.mdlus"


def test_export_to_physicsnemo_reimports_bit_exactly(stage1, exported):
    """Our export -> .mdlus -> read back: the same tensors, and the same outputs to the bit."""
    from recipes.weather import weights
    from recipes.weather.mdlus import read_mdlus

    pt, mdlus = exported
    ours, info = weights.load(pt)
    theirs, minfo = weights.load(mdlus, data=info.channels)
    assert minfo.config["format"] == "physicsnemo" and minfo.channels == info.channels
    _, read = read_mdlus(mdlus)
    saved = torch.load(pt, weights_only=True)
    assert list(read) == list(saved) and all(torch.equal(read[k], saved[k]) for k in saved)
    x = torch.randn(3, info.config["in_channels"], 16, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(ours(x), theirs(x))


def test_export_refuses_an_unknown_format_in_one_line(stage1, tmp_path, capsys):
    _, _, run = stage1
    code, err = export([run, "--format", "onnx", "-o", tmp_path / "x.onnx"], capsys)
    assert code == 2 and err.strip() == "error: --format: unknown format 'onnx'; valid: native, physicsnemo"
    assert not list(tmp_path.iterdir())


def test_two_stage_workflow_on_the_reference_layout(stage1, exported, capsys):
    """Diffusion on the frozen .mdlus regression stage, then inference of both stages."""
    import zarr

    tmp, data, regression = stage1
    pt, mdlus = exported
    run = tmp / "diffusion"
    proc = run_cli(
        overrides(tmp, "diffusion", **DIFF, **{"task.regression": str(mdlus)}), tmp, env={"OMP_NUM_THREADS": "1"}
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The frozen stage read from the .mdlus is the trained regression model: its validation RMSE
    # (same samples) is the regression run's.
    assert val_row(run)["rmse_regression"] == pytest.approx(val_row(regression)["rmse"], rel=1e-6)

    out = tmp / "forecast.zarr"
    code, err = infer(
        ["--diffusion", run, "--data-root", data, "--start", "2021-01-01T00", "--hours", 2, "--members", 2]
        + ["--steps", 2, "--out", out],
        capsys,
    )
    assert code == 0, err
    g = zarr.open_group(str(out), mode="r")
    assert g["forecast"].shape == (2, 2, 4, 16, 16) and np.isfinite(g["forecast"][:]).all()
    assert g.attrs["regression"] == str(mdlus)  # the stage the diffusion model was trained on

    # The .mdlus alone, its channels named by --data-config: the forecast of our export, to the bit.
    base = ["--data-root", data, "--start", "2021-01-01T00", "--hours", 2]
    code, err = infer(["--regression", pt, *base, "--out", tmp / "pt.zarr"], capsys)
    assert code == 0, err
    code, err = infer(["--regression", mdlus, *base, "--out", tmp / "mdlus.zarr", "--data-config", *TINY_DATA], capsys)
    assert code == 0, err
    a, b = (zarr.open_group(str(tmp / f), mode="r")["forecast"][:] for f in ("pt.zarr", "mdlus.zarr"))
    assert np.array_equal(a, b)


def test_a_mdlus_without_channel_names_is_refused_in_one_line(stage1, exported, capsys):
    tmp, data, _ = stage1
    _, mdlus = exported
    base = ["--regression", mdlus, "--data-root", data, "--start", "2021-01-01T00", "--out", tmp / "no.zarr"]
    cases = [
        ([], "names no channels; name them with --data-config"),
        (["--data-config", *TINY_DATA, "data.invariants=[lsm]"], "maps 9 -> 4 channels but the data config's"),
        (["--data-config", "recipe=nope"], "Could not find 'recipe/nope'"),
    ]
    for extra, text in cases:
        code, err = infer([*base, *extra], capsys)
        assert code == 2 and text in err and len(err.strip().splitlines()) == 1, (extra, err)
    assert not (tmp / "no.zarr").exists()


def test_task_regression_mdlus_channel_counts_are_checked_at_validation(stage1, exported, compose):
    from framework.config.validate import validate

    tmp, data, _ = stage1
    _, mdlus = exported
    base = [*TINY_DATA, "recipe=tiny_diffusion", f"data.root={data}", "model.model_channels=8"]
    validate(compose([*base, f"task.regression={mdlus}"]))  # channel names: this run's
    with pytest.raises(ConfigError, match=r"task.regression: .*regression.mdlus maps 9 -> 4 channels .* make 8 -> 4"):
        validate(compose([*base, f"task.regression={mdlus}", "data.invariants=[lsm]"]))


# -- checkpoint.init_from -------------------------------------------------------------------------


@pytest.fixture
def train():
    """A one-step job in this process."""
    return lambda tmp, name, **extra: run_here(tmp, name, **{"trainer.max_steps": 1, **extra})


def equal_weights(step_dir: Path, weights: dict[str, torch.Tensor]) -> bool:
    from framework.export import model_weights

    got = model_weights(step_dir)
    return list(got) == list(weights) and all(torch.equal(got[k], weights[k]) for k in weights)


def test_init_from_a_mdlus_starts_a_fresh_run_and_a_resume_keeps_its_checkpoint(
    stage1, exported, train, tmp_path, caplog
):
    """optim.lr=0: the model keeps exactly the weights it started from. Resumed with other
    init_from weights, the run continues from its checkpoint, says so, and keeps the record."""
    _, data, _ = stage1
    pt, mdlus = exported
    start = torch.load(pt, weights_only=True)
    common = {"data.root": data, "optim.lr": 0, "checkpoint.every": 1}
    with caplog.at_level(logging.INFO, logger="framework"):
        train(tmp_path, "tuned", **common, **{"checkpoint.init_from": mdlus})
    assert f"checkpoint.init_from: the model starts from {mdlus} ({len(start)} tensors, physicsnemo)" in caplog.text
    ckpts = tmp_path / "tuned" / "checkpoints"
    assert equal_weights(ckpts / "step_00000001", start)
    record = {"path": str(mdlus), "format": "physicsnemo", "tensors": len(start)}
    assert json.loads((ckpts / "step_00000001" / "meta.json").read_text())["init_from"] == record

    other = tmp_path / "other.pt"  # the same names and shapes, other values
    torch.save({k: v + 1 for k, v in start.items()}, other)
    other.with_suffix(".json").write_text(pt.with_suffix(".json").read_text())
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="framework"):
        out = train(tmp_path, "tuned", **common, **{"checkpoint.init_from": other, "trainer.max_steps": 2})
    assert out["resumed_from"] == str(ckpts / "step_00000001")
    assert (
        f"checkpoint.init_from={other} not applied: resuming from {ckpts / 'step_00000001'}, whose weights "
        f"win (this run started from {mdlus})" in caplog.text
    )
    assert "the model starts from" not in caplog.text
    assert equal_weights(ckpts / "step_00000002", start)
    assert json.loads((ckpts / "step_00000002" / "meta.json").read_text())["init_from"] == record


def test_init_from_refuses_weights_that_do_not_fit_in_one_line(stage1, exported, train, tmp_path):
    _, data, regression = stage1
    pt, mdlus = exported
    narrow = tmp_path / "narrow.pt"
    weights = torch.load(pt, weights_only=True)
    weights["out_conv.bias"] = torch.zeros(5)
    torch.save(weights, narrow)
    narrow.with_suffix(".json").write_text(pt.with_suffix(".json").read_text())
    cases = [
        (
            {"checkpoint.init_from": mdlus, "model.model_channels": 4},
            rf"{mdlus} does not fit the model: .* is float32\[.*\] there, float32\[.*\] here",
        ),
        (
            {"checkpoint.init_from": narrow},
            rf"{narrow} does not fit the model: out_conv.bias is float32\[5\] there, float32\[4\] here",
        ),
        ({"checkpoint.init_from": mdlus, "data.invariants": "[lsm]"}, "maps 9 -> 4 channels"),
        (
            {"checkpoint.init_from": regression, "data.invariants": "[lsm]"},
            r"trained with invariants=\['lsm', 'orog'\]",
        ),
        ({"checkpoint.init_from": mdlus, **DIFF, "task.regression": mdlus}, "holds a 'stormcast_regression' model"),
        ({"checkpoint.init_from": tmp_path / "missing.mdlus"}, "checkpoint.init_from: .*missing.mdlus does not exist"),
    ]
    for extra, text in cases:
        with pytest.raises(ConfigError, match=text) as e:
            train(tmp_path, "refused", **{"data.root": data, **extra})
        assert "\n" not in str(e.value)
    assert not (tmp_path / "refused" / "checkpoints").exists()  # nothing trained
