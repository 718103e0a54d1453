"""Shared fixtures: configs composed through Hydra's compose API, runs in tmp_path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def pytest_configure(config):
    # Under pytest-xdist the workers share the cores: one thread per process (inherited by the
    # runs a test launches), else two multi-threaded runs on two cores oversubscribe them (the
    # main-job test took 4.5x longer).
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["OMP_NUM_THREADS"] = "1"
        import torch

        torch.set_num_threads(1)


@pytest.fixture
def compose():
    from framework.cli import compose as _compose

    return _compose


def framework_command(nproc: int = 1) -> list[str]:
    """``python -m framework``, under torchrun on one host when ``nproc`` > 1."""
    if nproc == 1:
        return [sys.executable, "-m", "framework"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    return [*torchrun, "-m", "framework"]


def run_cli(args, cwd, env=None, timeout=600, nproc=1):
    """Run ``python -m framework`` as a user would (under torchrun for ``nproc`` > 1); returns the
    CompletedProcess. The checkout is on PYTHONPATH (after any PYTHONPATH in ``env``), so a run
    from any ``cwd`` imports this tree."""
    launcher = framework_command(nproc)
    env = dict(env or {})
    # the caller's PYTHONPATH first (a test may shadow a package), then this checkout
    path = os.pathsep.join(filter(None, [env.pop("PYTHONPATH", None), str(REPO), os.environ.get("PYTHONPATH")]))
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=path, **env)
    return subprocess.run([*launcher, *args], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)


def run_module(name: str, args, cwd, timeout=300):
    """``python -m name args`` (an export or inference CLI) from ``cwd``, importing this checkout."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", name, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path),
    )


def tiny_overrides(tmp_path, data_root, **extra):
    """A fast tiny run: small synthetic grid and few steps, outputs under tmp_path."""
    o = {
        "hydra.run.dir": str(tmp_path / "run"),
        "data.root": str(data_root),
        "data.grid": "[16,16]",
        "data.hours_per_year": 48,
        "data.batch_size": 4,
        "model.model_channels": 8,
        "trainer.max_steps": 6,
        "trainer.log_every": 1,
        "trainer.val_every": 3,
        "trainer.val_batches": 1,
        "trainer.progress": "false",
        "checkpoint.every": 3,
        "schedule.warmup_steps": 2,
    }
    o.update(extra)
    return [f"{k}={v}" for k, v in o.items()]


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run with -m gpu on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def zarr_reads(monkeypatch):
    """Every value zarr's LocalStore hands back, as (key, bytes): chunk reads, counted."""
    from zarr.storage import LocalStore

    calls = []
    original = LocalStore.get

    async def counting_get(self, key, *args, **kwargs):
        buf = await original(self, key, *args, **kwargs)
        calls.append((key, 0 if buf is None else len(buf)))
        return buf

    monkeypatch.setattr(LocalStore, "get", counting_get)
    return calls


def layout_reference(tmp_path_factory, name: str, extra: list[str], steps: int = 5):
    """A parallel=none run every layout is compared to: (tmp dir, overrides, losses)."""
    from scripts.loss_compare import run_layout

    tmp = tmp_path_factory.mktemp(name)
    extra = [*extra, f"data.root={tmp / 'data'}"]
    return tmp, extra, run_layout(["parallel=none"], 1, tmp / "none", steps, extra)
