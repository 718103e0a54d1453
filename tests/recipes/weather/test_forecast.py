"""Forecasts at scale (python -m recipes.weather.forecast): one store, any layout, resumable.

Real processes on gloo (forked from the test zygote, as torchrun would start them), real zarr
stores, small models with perturbed random weights (a 16x16 grid, 4 members, 2 leads, a 2-step
sampler): every layout writes the same store, a job resumes what it had not marked complete,
and the scores beside the store are those of its fields.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import REPO, _zygote

pytestmark = pytest.mark.timeout(600)

GRID = 16
MODEL = [f"data.grid=[{GRID},{GRID}]", "model.model_channels=8", "model.channel_mult=[1,2]"]


def _export(path: Path, overrides: list[str], seed: int) -> Path:
    """A model as ``python -m framework.export`` writes it (weights + spec), with random weights
    perturbed away from their initialisation (zero-initialised output layers would hide a split)."""
    from omegaconf import OmegaConf

    from framework import registry
    from framework.cli import compose
    from framework.config.validate import validate
    from recipes.weather import weights

    run = validate(compose(overrides))
    config = OmegaConf.to_container(run.raw, resolve=True)
    spec = registry.tasks.entry(run.task.name).builder.export_spec(config)
    spec["weights"] = path.name
    path.with_suffix(".json").write_text(json.dumps(spec))
    path.write_bytes(b"")  # describe() wants the file; the weights follow
    torch.manual_seed(seed)
    model = weights.build(weights.describe(path))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    torch.save({k: v.contiguous() for k, v in model.state_dict().items()}, path)
    return path


@pytest.fixture(scope="module")
def stages(tmp_path_factory):
    """(tmp dir, data root, regression export, diffusion export)."""
    from recipes.weather.synthetic import write_synthetic

    tmp = tmp_path_factory.mktemp("forecast")
    data = write_synthetic(tmp / "data", height=GRID, width=GRID, years=(2021,), hours_per_year=48)
    reg = _export(tmp / "regression.pt", [*MODEL, f"data.root={data}"], seed=1)
    diff = _export(
        tmp / "diffusion.pt",
        [*MODEL, "recipe=tiny_diffusion", f"data.root={data}", f"task.regression={reg}"],
        seed=2,
    )
    return tmp, data, reg, diff


def forecast(args, cwd: Path, nproc: int = 1, timeout: int = 300):
    """``python -m recipes.weather.forecast`` (under torchrun's variables for nproc > 1)."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path, PYTHONUNBUFFERED="1")
    return _zygote().run("recipes.weather.forecast", [str(a) for a in args], cwd, env, nproc, timeout)


def base(stages, out: Path, **extra) -> list[str]:
    tmp, data, _, diff = stages
    o = {
        "infer.diffusion": diff,
        "infer.data_root": data,
        "infer.starts": "[2021-01-01T03,2021-01-01T10]",
        "infer.hours": 2,
        "infer.members": 4,
        "infer.member_batch": 2,
        "infer.steps": 2,
        "infer.out": out,
        "infer.progress": "false",
        "infer.plot_channels": "[t2m]",
        "hydra.run.dir": out.parent / f"{out.stem}_run",
        "device": "cpu",
    }
    o.update(extra)
    return [f"{k}={v}" for k, v in o.items()]


def ok(proc):
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def arrays(out: Path) -> dict[str, np.ndarray]:
    import zarr

    g = zarr.open_group(str(out), mode="r")
    return {k: np.asarray(v[...]) for k, v in g.arrays()}


LAYOUTS = {
    "1": ([], 1),
    "dp2": (["parallel=ddp"], 2),
    "domain2": (["parallel=domain"], 2),
    "dp2xdomain2": (["parallel=domain", "parallel.dp_shard=2", "parallel.domain=2"], 4),
}


@pytest.fixture(scope="module")
def reference(stages):
    """The one-process store every layout is compared to."""
    tmp = stages[0]
    out = tmp / "ref.zarr"
    ok(forecast(base(stages, out), tmp))
    return out


def test_store_format(stages, reference):
    """Named dims, coordinates, CF time units, consolidated metadata, absolute model paths, scores."""
    import zarr

    tmp, data, reg, diff = stages
    assert not Path(f"{reference}.partial").exists() and not Path(f"{reference}.commit").exists()
    g = zarr.open_group(str(reference), mode="r")
    fc = g["forecast"]
    assert fc.shape == (4, 2, 2, 4, GRID, GRID)
    assert tuple(fc.metadata.dimension_names) == ("member", "init", "lead", "channel", "y", "x")
    assert fc.chunks == (1, 1, 1, 4, 2, GRID)  # one member, init and lead, all channels, a row chunk
    assert [str(c) for c in g["channel"][...]] == ["u10m", "v10m", "t2m", "msl"]
    assert [str(c) for c in g["channel_units"][...]] == ["m s-1", "m s-1", "K", "Pa"]
    assert list(g["lead"][...]) == [1, 2] and g["lead"].attrs["units"] == "hours"
    assert g["init"].attrs["units"] == "hours since 1970-01-01 00:00:00"
    init = np.asarray(g["init"][...])
    assert (np.asarray(g["valid_time"][...]) == init[:, None] + np.array([1, 2])).all()
    ident = g.attrs["identity"]
    assert ident["identity"]["diffusion"] == str(diff.resolve()) and ident["identity"]["regression"] == str(reg)
    assert ident["inits"] == ["2021-01-01T03", "2021-01-01T10"]
    assert np.asarray(g["completed"][...]).all()
    f, truth = np.asarray(fc[...]), np.asarray(g["truth"][...])
    assert np.isfinite(f).all() and np.isfinite(truth).all()
    assert not np.array_equal(f[0], f[1])  # members differ
    # physical units (msl in Pa, as the truth), though the random weights forecast nothing useful
    assert 0.5 < f[:, :, :, 3].mean() / truth[:, :, 3].mean() < 1.5
    meta = json.loads((reference / "zarr.json").read_text())
    assert "forecast" in meta["consolidated_metadata"]["metadata"]  # consolidated
    # scores: the ensemble CRPS from the fields themselves, the fair one, rank histograms summing to 1
    from recipes.weather.metrics import crps_ensemble

    s = g["scores"]
    want = crps_ensemble(torch.from_numpy(f).double(), torch.from_numpy(truth).double()).mean((0, 3, 4))
    assert np.allclose(np.asarray(s["crps"][...]), want.numpy(), rtol=1e-10)
    f, truth = f.astype(np.float64), truth.astype(np.float64)
    pairs = (np.abs(f[:, None] - f[None]).sum((0, 1)) / (2 * 4 * 3)).mean((0, 3, 4))
    fair = np.abs(f - truth).mean(0).mean((0, 3, 4)) - pairs
    assert np.allclose(np.asarray(s["crps_fair"][...]), fair, rtol=1e-10)
    assert np.allclose(np.asarray(s["rank_histogram"][...]).sum(-1), 1)
    assert tuple(s["rank_histogram"].metadata.dimension_names) == ("lead", "channel", "rank")
    report = Path(f"{reference}.report")
    summary = json.loads((report / "scores.json").read_text())
    assert summary["channels"] == ["u10m", "v10m", "t2m", "msl"] and len(summary["crps_fair"]) == 2
    pngs = sorted(p.name for p in report.glob("*.png"))
    assert "spectrum_t2m.png" in pngs and "spread_skill.png" in pngs and "rank_histogram_t2m.png" in pngs
    assert sorted(p.name for p in (report / "frames").iterdir()) == ["t2m_001.png", "t2m_002.png"]


def test_store_reads_with_xarray(reference):
    import xarray as xr  # a dev dependency: the promise is checked, never skipped

    ds = xr.open_zarr(reference)
    assert dict(ds.forecast.sizes) == {"member": 4, "init": 2, "lead": 2, "channel": 4, "y": GRID, "x": GRID}
    t2m = ds.forecast.sel(channel="t2m")
    assert t2m.dims == ("member", "init", "lead", "y", "x")
    assert str(ds.init.values[0]).startswith("2021-01-01T03")
    assert str(ds.valid_time.values[1, 1]).startswith("2021-01-01T12")
    assert ds.channel_units.sel(channel="t2m").item() == "K"
    scores = xr.open_zarr(reference, group="scores")
    assert scores.crps.sel(channel="t2m").dims == ("lead",)


@pytest.mark.parametrize("name", ["dp2", "domain2", "dp2xdomain2"])
def test_every_layout_writes_the_same_store(stages, reference, name):
    """Members over data-parallel ranks: bitwise the one-process store. Rows over domain ranks: the
    same draws, and fields equal to float32 rounding (a split GroupNorm sums its statistics per
    band); coordinates, attributes and truth bitwise."""
    tmp = stages[0]
    layout, nproc = LAYOUTS[name]
    out = tmp / f"{name}.zarr"
    proc = ok(forecast([*base(stages, out), *layout], tmp, nproc=nproc))
    ref, got = arrays(reference), arrays(out)
    assert sorted(ref) == sorted(got)
    for key in ref:
        if key != "forecast":
            assert np.array_equal(ref[key], got[key]), key
    import zarr

    assert dict(zarr.open_group(str(out)).attrs) == dict(zarr.open_group(str(reference)).attrs)
    if "domain" in name:
        err = np.abs(got["forecast"] - ref["forecast"]).max() / np.abs(ref["forecast"]).max()
        assert err < 1e-5, err
    else:
        assert np.array_equal(got["forecast"], ref["forecast"])
    # each block written once, by one rank
    log = (out.parent / f"{out.stem}_run" / "infer.log").read_text()
    wrote = [ln.split(" wrote ")[1] for ln in log.splitlines() if " wrote 2021" in ln]
    assert sorted(wrote) == sorted(
        f"{t} members {m}-{m + 1}" for t in ("2021-01-01T03", "2021-01-01T10") for m in (0, 2)
    )
    assert proc.returncode == 0


def test_jobs_share_one_store_and_resume_what_is_not_marked(stages, reference):
    """Two sweep jobs (infer.shard=0,1 of 2) write one store; the first leaves it partial, a block
    whose marker is missing (a job stopped after writing it) is written again on resume and nothing
    else, and the last job commits a store equal to the one-process store."""
    import zarr

    tmp = stages[0]
    out = tmp / "shards.zarr"
    part = Path(f"{out}.partial")
    ok(forecast([*base(stages, out), "infer.shards=2", "infer.shard=0"], tmp))
    assert part.is_dir() and not out.exists()
    done = np.asarray(zarr.open_group(str(part))["completed"][...])
    assert done[0].all() and not done[1].any()
    zarr.open_group(str(part), mode="r+")["completed"][0, 2] = 0  # members 2-3 of the first start not marked
    proc = ok(forecast([*base(stages, out), "infer.shards=2", "infer.shard=0"], tmp))
    log = (out.parent / f"{out.stem}_run" / "infer.log").read_text()
    assert "resuming: 1 of 2 blocks of this job already written, skipped" in log
    assert log.count("wrote 2021-01-01T03 members 2-3") == 2 and log.count("wrote 2021-01-01T03 members 0-1") == 1
    assert not out.exists()
    ok(forecast([*base(stages, out), "infer.shards=2", "infer.shard=1"], tmp))
    assert out.is_dir() and not part.exists()
    ref, got = arrays(reference), arrays(out)
    for key in ("forecast", "truth", "completed"):
        assert np.array_equal(ref[key], got[key]), key
    # a rerun of a complete store does nothing; another forecast on it is refused
    proc = ok(forecast([*base(stages, out), "infer.shards=2", "infer.shard=1"], tmp))
    proc = forecast([*base(stages, out), "seed=5"], tmp)
    assert proc.returncode == 2 and "holds another forecast (identity.seed" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_under_torchrun(stages, reference, tmp_path):
    """The real launcher: torchrun's two ranks split the members and write the one-process store."""
    import subprocess
    import sys

    out = tmp_path / "torchrun.zarr"
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += ["-m", "recipes.weather.forecast", "parallel=ddp", *base(stages, out, **{"infer.frames": "false"})]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)
    ok(subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300))
    assert np.array_equal(arrays(out)["forecast"], arrays(reference)["forecast"])


def test_regression_only_on_physicsnemo_data_has_lat_lon(stages, tmp_path):
    """A deterministic forecast (one member) from data in PhysicsNeMo's layout: the store carries the
    stores' 2-D latitude/longitude, and scores without spread."""
    import zarr

    from recipes.weather.layout import PN_LAT, PN_LON
    from recipes.weather.synthetic import write_synthetic

    data = write_synthetic(
        tmp_path / "pn", height=GRID, width=GRID, years=(2021,), hours_per_year=48, layout="physicsnemo"
    )
    out = tmp_path / "pn.zarr"
    extra = {"infer.diffusion": "null", "infer.regression": stages[2], "infer.data_root": data, "infer.members": 1}
    extra["infer.starts"] = "[2021-01-01T10]"  # the store lacks 05:00 (its missing-samples file)
    ok(forecast(base(stages, out, **extra, **{"infer.frames": "false"}), tmp_path))
    g = zarr.open_group(str(out), mode="r")
    src = zarr.open_group(str(next(data.glob("hrrr_v3/**/2021.zarr"))), mode="r")
    assert np.array_equal(np.asarray(g["latitude"][...]), np.asarray(src[PN_LAT][...]))
    assert np.array_equal(np.asarray(g["longitude"][...]), np.asarray(src[PN_LON][...]))
    assert "latitude longitude" in g["forecast"].attrs["coordinates"]
    assert g["forecast"].shape[0] == 1 and "spread" not in g["scores"] and np.isfinite(g["scores"]["crps"][...]).all()


def test_sampler_dtype_float64(stages, reference):
    """The default (float32) sampler state against float64: other bits, the same forecast to rounding."""
    tmp = stages[0]
    out = tmp / "f64.zarr"
    ok(forecast([*base(stages, out), "infer.sampler_dtype=float64", "infer.scores=false", "infer.frames=false"], tmp))
    ref, got = arrays(reference)["forecast"], arrays(out)["forecast"]
    assert not np.array_equal(ref, got)
    assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-4
    assert "scores" not in arrays(out) and not Path(f"{out}.report").exists()


@pytest.mark.parametrize(
    "extra,text",
    [
        (["infer.out=null"], "infer.out"),
        (["infer.shard=2", "infer.shards=2"], "infer.shard: must be below infer.shards=2"),
        (["infer.sampler_dtype=float16"], "infer.sampler_dtype: must be one of float64, float32"),
        (["infer.starts=[yesterday]"], "infer.starts: 'yesterday' is not a time"),
        (["infer.diffusion=/nonexistent.pt"], "infer.diffusion: /nonexistent.pt does not exist"),
        (["+infer.x._target_=os.system"], "os.system"),
        (["precision=fp16"], "precision: 'fp16' is not used for inference"),
        (["precision=tf32"], "precision: 'tf32' is not used for inference; use one of fp32, bf16"),
        (["+hydra.job.env_set.LD_PRELOAD=/x.so"], "hydra.job.env_set"),  # training's gate
        (["parallel=fsdp2_domain"], "parallel: dp_replicate x dp_shard x domain"),
    ],
)
def test_bad_config_is_one_line(stages, tmp_path, extra, text):
    proc = forecast([*base(stages, tmp_path / "x.zarr"), *extra], tmp_path)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert text in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_a_joined_store_must_hold_the_arrays_this_forecast_writes(tmp_path):
    """A .partial store is joined on its identity attribute alone: one whose arrays are missing or
    declared with other shapes (damaged, or made to match by someone else) is one DataError naming
    the array before anything is allocated or written, and a metadata file that is not a JSON
    object (any depth) reads as no identity."""
    from framework.errors import DataError
    from recipes.weather.forecast_store import ForecastStore, StoreSpec, partial_path, read_identity

    spec = StoreSpec(members=2, inits=(438000,), leads=2, dt=1, channels=("t2m",), grid=(4, 6), row_chunk=2)
    out = tmp_path / "fc.zarr"
    assert ForecastStore.prepare(out, spec, {}, overwrite=False) == "created"
    part = partial_path(out)
    assert ForecastStore(out, spec).done().shape == (1, 2)
    root = part / "zarr.json"
    for meta in (part / "completed" / "zarr.json", root):  # the array's own and the consolidated copy
        doc = json.loads(meta.read_text())
        (doc if meta != root else doc["consolidated_metadata"]["metadata"]["completed"])["shape"] = [10**6, 10**6]
        meta.write_text(json.dumps(doc))  # 931 GiB if read
    with pytest.raises(DataError, match=r"array 'completed' is \(1000000, 1000000\) uint8, not \(1, 2\) uint8"):
        ForecastStore(out, spec)
    shutil.rmtree(part / "completed")
    doc = json.loads(root.read_text())
    del doc["consolidated_metadata"]["metadata"]["completed"]
    root.write_text(json.dumps(doc))
    with pytest.raises(DataError, match="holds no array 'completed'"):
        ForecastStore(out, spec)
    for bad in ("[1]", "[" * 100_000 + "]" * 100_000, '{"attributes": [1]}'):
        (part / "zarr.json").write_text(bad)
        assert read_identity(part) is None
