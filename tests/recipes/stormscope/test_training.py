"""StormScope (DiT, diffusion only) through the real CLI: it learns from stores under its own names
and records them, every layout logs the single-process losses, a 2-D mesh checkpoint resumes, and
inference runs on it (gloo, CPU).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from framework.logging.jsonl import read
from scripts.loss_compare import compare
from tests.conftest import run_cli, run_module

pytestmark = pytest.mark.timeout(900)

# 18 x 16 pixels, patch 2: 9 x 8 tokens; domain=2 splits rows 10/8 (5/4 patch rows, enough
# for kernel 5's halo of 2 rows).
BASE = [
    "recipe=tiny_stormscope",
    "data.grid=[18,16]",
    "data.hours_per_year=48",
    "data.batch_size=4",
    "task.sampler.num_steps=3",
    "task.val_members=2",
    "trainer.val_batches=1",
    "trainer.progress=false",
    "schedule.warmup_steps=2",
]


def cli(args, cwd: Path, nproc: int = 1, timeout: int = 600) -> subprocess.CompletedProcess:
    return run_cli(args, cwd, env={"OMP_NUM_THREADS": "1"}, timeout=timeout, nproc=nproc)


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read(run_dir / "metrics.jsonl", "train")]


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("stormscope")


def test_stormscope_learns_and_rolls_out(tmp):
    import zarr

    from framework.export import model_config

    run = tmp / "learns"
    proc = cli(
        [
            *BASE,
            f"data.root={tmp / 'data'}",
            f"hydra.run.dir={run}",
            "trainer.max_steps=80",
            "trainer.log_every=1",
            "trainer.val_every=80",
            "checkpoint.every=80",
            "optim.lr=2e-3",
        ],
        tmp,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    loss = losses(run)
    assert np.mean(loss[-20:]) < 0.8 * np.mean(loss[:20]), (loss[:20], loss[-20:])
    val = read(run / "metrics.jsonl", "val")[-1]
    assert np.isfinite(val["crps"]) and "rmse_regression" not in val  # diffusion only
    # Throughput in model FLOPs the DiT states (FlopCounterMode cannot see flex_attention).
    from recipes.stormscope.dit import DiT, train_flops

    flops = train_flops(
        DiT((18, 16), 3 + 3 + 3 + 2, 3, patch_size=2, hidden_size=32, depth=2, num_heads=2, attn_kernel=5)
    )
    row = read(run / "metrics.jsonl", "train")[-1]
    assert row["tflops"] == pytest.approx(flops * row["samples_per_s"] / 1e12, rel=1e-6)
    # StormScope's names: the synthetic stores it trained on are state/ and background/, and the
    # checkpoint (hence an export) records its channels under StormScope's keys
    data = tmp / "data"
    assert sorted(p.name for p in data.iterdir()) == [
        "background",
        "invariants.zarr",
        "state",
        "stats",
        "synthetic.json",
    ]
    assert sorted(p.name for p in (data / "state").iterdir()) == ["2020.zarr", "2021.zarr"]
    assert sorted(p.stem for p in (data / "stats").iterdir()) == [
        "background_means",
        "background_stds",
        "state_means",
        "state_stds",
    ]
    channels = {"state_channels": ["abi08", "abi13", "refc"], "background_channels": ["u850", "v850", "t850"]}
    assert json.loads((data / "synthetic.json").read_text()).items() >= channels.items()
    meta = json.loads((run / "checkpoints" / "step_00000080" / "meta.json").read_text())
    recorded = meta["config"]["data"]
    assert recorded["name"] == "stormscope_synthetic" and recorded.items() >= channels.items()
    assert not {"hrrr_channels", "era5_channels"} & set(recorded)
    assert model_config(meta["config"])["channels"] == {**channels, "invariants": ["lsm", "orog"]}
    out = tmp / "scope.zarr"
    proc = run_module(
        "recipes.stormcast.inference",
        [
            "--diffusion",
            str(run),
            "--data-root",
            str(tmp / "data"),
            "--start",
            "2021-01-01T00",
            "--hours",
            "2",
            "--members",
            "2",
            "--out",
            str(out),
            "--no-progress",
        ],
        tmp,
    )
    assert proc.returncode == 0, proc.stderr
    g = zarr.open_group(str(out), mode="r")
    assert g["forecast"].shape == (2, 2, 3, 18, 16) and g.attrs["channels"] == ["abi08", "abi13", "refc"]
    assert g.attrs["regression"] is None


@pytest.mark.parametrize(
    "layout,nproc",
    [
        (["parallel=fsdp2_domain"], 2),
        (["parallel=fsdp2_domain", "parallel.dp_shard=2"], 4),
        (["parallel=fsdp2_domain", "model.pos_embed=rope"], 2),
    ],
    ids=["fsdp2_domain-1x2-uneven", "fsdp2_domain-2x2", "fsdp2_domain-1x2-rope"],
)
def test_layouts_log_the_losses_of_one_process(tmp, layout, nproc):
    common = [
        *BASE,
        f"data.root={tmp / 'data'}",
        "deterministic=true",
        "trainer.max_steps=4",
        "trainer.log_every=1",
        "trainer.val_every=0",
        "checkpoint=none",
    ]
    extra = [o for o in layout if o.startswith("model.")]
    ref = tmp / "_".join(["none", *extra]).replace("=", "-")
    if not (ref / "metrics.jsonl").exists():
        proc = cli([*common, *extra, "parallel=none", f"hydra.run.dir={ref}"], tmp)
        assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp / "_".join(layout).replace("=", "-")
    proc = cli([*common, *layout, f"hydra.run.dir={run}"], tmp, nproc=nproc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = (run / "framework.log").read_text()  # one unit per transformer block, then the root
    assert "FSDP2 units (3): net.blocks.0 (reshard=True), net.blocks.1 (reshard=False), <root>" in log
    assert compare(losses(ref), losses(run)) <= 1e-5, (losses(ref), losses(run))


def test_checkpoint_of_a_2d_mesh_resumes_on_any_layout(tmp):
    """dp=2 x domain=2 writes a DCP checkpoint at step 2 of 4; resumed from it on 2x2 and on one
    process, steps 3-4 log the losses of the uninterrupted run."""
    common = [
        *BASE,
        f"data.root={tmp / 'data'}",
        "deterministic=true",
        "trainer.log_every=1",
        "trainer.val_every=0",
        "checkpoint=dcp",
        "checkpoint.every=2",
        "trainer.max_steps=4",
    ]
    mesh = ["parallel=fsdp2_domain", "parallel.dp_shard=2"]
    full = tmp / "ckpt_full"
    proc = cli([*common, *mesh, f"hydra.run.dir={full}"], tmp, nproc=4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reference = losses(full)
    ckpt = full / "checkpoints" / "step_00000002"
    for name, layout, nproc in (("2x2", mesh, 4), ("none", ["parallel=none"], 1)):
        run = tmp / f"ckpt_resumed_{name}"
        proc = cli([*common, *layout, f"checkpoint.resume={ckpt}", f"hydra.run.dir={run}"], tmp, nproc=nproc)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert f"resumed from {ckpt}" in proc.stderr + proc.stdout
        resumed = [r["loss"] for r in read(run / "metrics.jsonl", "train")]
        assert [r["step"] for r in read(run / "metrics.jsonl", "train")] == [3, 4]
        assert compare(reference[2:], resumed) <= 1e-5, (name, reference, resumed)
