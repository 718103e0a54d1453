"""The StormCast diffusion stage end to end, through the real CLI (CPU, synthetic data).

Stage 1 (regression) is trained and exported once per module; the diffusion stage then
trains on it: its loss falls, domain-parallel layouts log the single-process losses and
validation scores, and the whole workflow ends in an inference store.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from framework.logging.jsonl import read
from scripts.loss_compare import compare
from tests.conftest import run_cli, run_module

pytestmark = pytest.mark.timeout(600)

# Tiny: 18x16 grid (domain=2 splits it 10/8), 8 model channels, a cheap sampler.
DATA = ["data.grid=[18,16]", "data.hours_per_year=48", "data.batch_size=4", "model.model_channels=8"]
DIFF = [
    "recipe=tiny_diffusion",
    "task.sampler.num_steps=3",
    "task.val_members=2",
    "trainer.val_batches=1",
    "trainer.progress=false",
    "trainer.figures=false",  # drawn where a test looks at them
    "schedule.warmup_steps=2",
]


def cli(args, cwd: Path, nproc: int = 1, timeout: int = 300) -> subprocess.CompletedProcess:
    return run_cli(args, cwd, env={"OMP_NUM_THREADS": "1"}, timeout=timeout, nproc=nproc)


@pytest.fixture(scope="module")
def stage1(tmp_path_factory):
    """A trained and exported regression stage: (tmp dir, data root, run dir, export path)."""
    tmp = tmp_path_factory.mktemp("stormcast_two_stage")
    data = tmp / "data"
    run = tmp / "regression"
    proc = cli(
        [
            *DATA,
            f"data.root={data}",
            f"hydra.run.dir={run}",
            "trainer.max_steps=20",
            "trainer.log_every=5",
            "trainer.val_every=20",
            "trainer.val_batches=1",
            "trainer.progress=false",
            "checkpoint.every=20",
            "trainer.figures=false",
            "model.channel_mult=[1,2]",
        ],
        tmp,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ckpt = run / "checkpoints" / "step_00000020"
    export = tmp / "regression.pt"
    proc = run_module("framework.export", [str(ckpt), str(export)], tmp)
    assert proc.returncode == 0, proc.stderr
    return tmp, data, run, export


def train_losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read(run_dir / "metrics.jsonl", "train")]


def test_diffusion_loss_falls(stage1):
    tmp, data, _, export = stage1
    run = tmp / "diffusion_falls"
    proc = cli(
        [
            *DATA,
            *DIFF,
            f"data.root={data}",
            f"task.regression={export}",
            f"hydra.run.dir={run}",
            "trainer.max_steps=100",
            "trainer.log_every=1",
            "trainer.val_every=100",
            "checkpoint.every=100",
            "trainer.figures=true",
            "optim.lr=3e-3",
        ],
        tmp,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    loss = train_losses(run)
    assert len(loss) == 100 and all(np.isfinite(loss))
    first, last = np.mean(loss[:20]), np.mean(loss[-20:])  # EDM losses are noisy: means of 20 steps
    assert last < 0.8 * first, (first, last)
    val = read(run / "metrics.jsonl", "val")[-1]
    for key in ("loss", "rmse", "crps", "spread_skill", "rmse_regression", "rmse_persistence", "crps/u10m"):
        assert np.isfinite(val[key]), key
    assert 0 < val["crps"] < val["rmse_member"]  # CRPS is below the error of any one member
    assert sorted(p.name for p in (run / "plots").iterdir()) == ["spectrum_00000100_u10m.png", "val_00000100_u10m.png"]
    # the closing lines judge an ensemble against the regression stage and persistence, with no verdict
    log = (run / "framework.log").read_text()
    assert f"validation ensemble: CRPS {val['crps']:.4g}, spread/skill {val['spread_skill']:.3g}" in log
    assert (
        f"ensemble-mean RMSE {val['rmse']:.4g} vs the regression stage {val['rmse_regression']:.4g} "
        f"and persistence {val['rmse_persistence']:.4g}" in log
    )
    assert not re.search(r"model (beats|does NOT beat) persistence", log)  # the regression stage's verdict


@pytest.mark.parametrize(
    "layout,nproc",
    [(["parallel=domain"], 2), (["parallel=fsdp2_domain"], 2)],
    ids=["domain-x2-uneven-10/8", "fsdp2_domain-x2"],
)
def test_domain_parallel_diffusion_equals_one_process(stage1, layout, nproc):
    """Keyed draws (sigma per sample, noise by global pixel): every layout trains on the same numbers."""
    tmp, data, _, export = stage1
    common = [
        *DATA,
        *DIFF,
        f"data.root={data}",
        f"task.regression={export}",
        "deterministic=true",
        "trainer.max_steps=3",
        "trainer.log_every=1",
        "trainer.val_every=3",
        "checkpoint=none",
    ]
    ref_dir = tmp / "diffusion_none"
    if not (ref_dir / "metrics.jsonl").exists():
        proc = cli([*common, "parallel=none", f"hydra.run.dir={ref_dir}"], tmp)
        assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp / f"diffusion_{layout[0].split('=')[1]}"
    proc = cli([*common, *layout, f"hydra.run.dir={run}"], tmp, nproc=nproc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert compare(train_losses(ref_dir), train_losses(run)) <= 1e-5
    ref_val, val = read(ref_dir / "metrics.jsonl", "val")[-1], read(run / "metrics.jsonl", "val")[-1]
    for key in ("loss", "rmse", "crps", "spread", "rmse_regression"):  # the sampled ensemble too
        assert val[key] == pytest.approx(ref_val[key], rel=1e-4), key


def test_two_stage_workflow_ends_in_a_forecast_store(stage1):
    """Regression trained and exported (fixture) -> diffusion on it -> export -> inference."""
    import zarr

    tmp, data, _, export = stage1
    run = tmp / "diffusion_workflow"
    proc = cli(
        [
            *DATA,
            *DIFF,
            f"data.root={data}",
            f"task.regression={export}",
            f"hydra.run.dir={run}",
            "trainer.max_steps=4",
            "trainer.log_every=2",
            "trainer.val_every=4",
            "checkpoint.every=4",
        ],
        tmp,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    diff_pt = tmp / "diffusion.pt"
    proc = run_module("framework.export", [str(run / "checkpoints" / "step_00000004"), str(diff_pt)], tmp)
    assert proc.returncode == 0, proc.stderr
    side = json.loads(diff_pt.with_suffix(".json").read_text())
    assert side["task"]["name"] == "stormcast_diffusion" and side["in_channels"] == 4 + 4 + 4 + 2

    out = tmp / "forecast.zarr"
    proc = run_module(
        "recipes.stormcast.inference",
        [
            "--diffusion",
            str(diff_pt),
            "--data-root",
            str(data),
            "--start",
            "2021-01-01T02",
            "--hours",
            "3",
            "--members",
            "2",
            "--out",
            str(out),
            "--plot-channels",
            "u10m",
            "t2m",
            "--no-progress",
        ],
        tmp,
    )
    assert proc.returncode == 0, proc.stderr
    g = zarr.open_group(str(out), mode="r")
    assert g["forecast"].shape == (2, 3, 4, 18, 16)
    assert g["truth"].shape == (3, 4, 18, 16)
    assert tuple(g["forecast"].metadata.dimension_names) == ("member", "time", "channel", "y", "x")
    assert g.attrs["channels"] == ["u10m", "v10m", "t2m", "msl"]
    assert g.attrs["times"] == ["2021-01-01T03", "2021-01-01T04", "2021-01-01T05"]
    assert list(g["time"][:]) == [h for h in range(g["time"][0], g["time"][0] + 3)]
    assert g.attrs["regression"] == str(export)  # the stage the diffusion model was trained on
    fc, truth = g["forecast"][:], g["truth"][:]
    assert np.isfinite(fc).all() and np.isfinite(truth).all()
    assert not np.array_equal(fc[0], fc[1])  # members differ
    # Physical units: the same scale as the truth (msl in Pa, winds in m/s).
    assert np.abs(fc[..., 3, :, :].mean() - truth[:, 3].mean()) < 0.1 * np.abs(truth[:, 3].mean())
    frames = sorted(p.name for p in Path(f"{out}.frames").iterdir())
    assert frames == [f"{c}_{k:03d}.png" for c in ("t2m", "u10m") for k in (1, 2, 3)]
    assert not Path(f"{out}.partial").exists()


def test_inference_is_reproducible_and_refuses_bad_input(stage1):
    tmp, data, _, export = stage1
    base = ["--regression", str(export), "--data-root", str(data), "--hours", "2", "--no-progress"]
    a, b = tmp / "reg_a.zarr", tmp / "reg_b.zarr"
    for out in (a, b):
        proc = run_module("recipes.stormcast.inference", [*base, "--start", "2021-01-01T00", "--out", str(out)], tmp)
        assert proc.returncode == 0, proc.stderr
    import zarr

    assert np.array_equal(
        zarr.open_group(str(a), mode="r")["forecast"][:], zarr.open_group(str(b), mode="r")["forecast"][:]
    )
    cases = [
        (["--start", "2021-01-01T00", "--out", str(a)], 2, "exists"),
        (["--start", "2021-03-01T00", "--out", str(tmp / "c.zarr")], 3, "no sample"),
        (["--start", "yesterday", "--out", str(tmp / "c.zarr")], 2, "not a time"),
        (["--start", "2021-01-01T00", "--members", "3", "--out", str(tmp / "c.zarr")], 2, "deterministic"),
        (["--start", "2021-01-01T00", "--plot-channels", "nope", "--out", str(tmp / "c.zarr")], 2, "'nope'"),
    ]
    for extra, code, text in cases:
        proc = run_module("recipes.stormcast.inference", [*base, *extra], tmp)
        assert proc.returncode == code, (extra, proc.stderr)
        assert text in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_regression_weights_are_checked_at_start(stage1, tmp_path):
    tmp, data, run, export = stage1
    base = [*DATA, *DIFF, f"data.root={data}", "trainer.max_steps=1", f"hydra.run.dir={tmp_path / 'run'}"]
    cases = [
        ([f"task.regression={tmp_path / 'missing.pt'}"], "no such file"),
        ([f"task.regression={export}", "data.invariants=[lsm]"], "invariants"),
        (["task.regression=null"], "needs the regression stage"),
        ([f"task.regression={run}", "model.embedding_type=zero"], "noise level"),
        ([f"task.regression={run}", "task.edm.sigma_data=[0.5,0.5]"], "sigma_data"),
    ]
    for extra, text in cases:
        proc = cli([*base, *extra], tmp)
        assert proc.returncode == 2, (extra, proc.stderr[-2000:])
        assert text in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize(
    "conditions,channels",
    [("[state,invariants]", 4 + 4 + 2), ("[background,invariants]", 4 + 3 + 2)],
    ids=["nowcasting-without-background", "downscaling"],
)
def test_other_condition_lists_train_without_a_regression_stage(stage1, conditions, channels):
    """Nowcasting from the state alone and downscaling from the background: residual=false,
    no regression stage; the denoiser's input is the noisy latent plus exactly those fields."""
    tmp, data, _, _ = stage1
    run = tmp / f"diffusion_{conditions.strip('[]').replace(',', '_')}"
    proc = cli(
        [
            *DATA,
            *DIFF,
            f"data.root={data}",
            "task.regression=null",
            "task.residual=false",
            f"task.conditions={conditions}",
            f"hydra.run.dir={run}",
            "trainer.max_steps=2",
            "trainer.log_every=1",
            "trainer.val_every=2",
            "checkpoint.every=2",
        ],
        tmp,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    val = read(run / "metrics.jsonl", "val")[-1]
    assert np.isfinite(val["crps"]) and "rmse_regression" not in val
    from framework.checkpoint.manager import read_meta
    from framework.export import model_config

    assert model_config(read_meta(run / "checkpoints" / "step_00000002")["config"])["in_channels"] == channels


def test_fp32_inference_runs_its_convolutions_without_tf32(stage1):
    """Training's fp32 turns TF32 off; inference must compute the same way (torch's default
    lets cuDNN run fp32 convolutions in TF32)."""
    from recipes.stormcast.inference import Forecaster

    export = stage1[3]
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = True  # torch's default
    torch.backends.cuda.matmul.allow_tf32 = True  # not the default: the check below must see it turned off
    try:
        Forecaster(str(export), None, torch.device("cpu"), precision="fp32")
        assert not torch.backends.cudnn.allow_tf32 and not torch.backends.cuda.matmul.allow_tf32
    finally:
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cuda.matmul.allow_tf32 = before


def test_a_model_config_larger_than_its_weights_is_refused_before_it_is_built(stage1, tmp_path):
    """weights.load rebuilds the model its recorded config describes before reading weights: a
    crafted config (a copied export, say) must not become a huge allocation."""
    import shutil

    from framework.errors import DataError
    from recipes.weather import weights

    export = Path(shutil.copy(stage1[3], tmp_path / "big.pt"))
    config = json.loads(stage1[3].with_suffix(".json").read_text())
    config["model"]["model_channels"] *= 64
    export.with_suffix(".json").write_text(json.dumps(config))
    with pytest.raises(DataError, match=r"big.pt: its config describes a songunet model of \d+ bytes of weights"):
        weights.load(export)
    model, _ = weights.load(stage1[3])  # the export as written loads
    assert sum(p.numel() for p in model.parameters()) > 0
