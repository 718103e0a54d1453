"""The StormCast diffusion stage on GPUs: bf16 training, and 2-GPU layouts against one. Marked gpu."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from framework.logging.jsonl import read
from scripts.loss_compare import compare
from tests.recipes.stormcast.test_diffusion import DATA, DIFF, cli, stage1, train_losses  # noqa: F401

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def test_diffusion_trains_on_one_gpu_in_bf16(stage1):  # noqa: F811
    tmp, data, _, export = stage1
    run = tmp / "gpu_bf16"
    proc = cli([*DATA, *DIFF, "device=cuda", "precision=bf16", f"data.root={data}", f"task.regression={export}",
                f"hydra.run.dir={run}", "trainer.max_steps=60", "trainer.log_every=1", "trainer.val_every=60",
                "checkpoint.every=60", "optim.lr=3e-3"], tmp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loss = train_losses(run)
    assert np.mean(loss[-15:]) < np.mean(loss[:15])
    val = read(run / "metrics.jsonl", "val")[-1]
    assert np.isfinite(val["crps"]) and np.isfinite(val["spread_skill"])


@pytest.mark.parametrize("layout", [["parallel=fsdp2_domain"], ["parallel=ddp"]], ids=["fsdp2_domain", "ddp"])
def test_two_gpus_log_the_losses_of_one(stage1, layout):  # noqa: F811
    if GPUS < 2:
        pytest.skip(f"needs 2 GPUs, {GPUS} here")
    tmp, data, _, export = stage1
    common = [*DATA, *DIFF, "device=cuda", f"data.root={data}", f"task.regression={export}", "deterministic=true",
              "trainer.max_steps=3", "trainer.log_every=1", "trainer.val_every=3", "checkpoint=none"]
    ref, run = tmp / "gpu_none", tmp / f"gpu_{layout[0].split('=')[1]}"
    if not (ref / "metrics.jsonl").exists():
        proc = cli([*common, "parallel=none", f"hydra.run.dir={ref}"], tmp)
        assert proc.returncode == 0, proc.stderr[-3000:]
    proc = cli([*common, *layout, f"hydra.run.dir={run}"], tmp, nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert compare(train_losses(ref), train_losses(run)) <= 1e-5
    a, b = read(ref / "metrics.jsonl", "val")[-1], read(run / "metrics.jsonl", "val")[-1]
    assert b["crps"] == pytest.approx(a["crps"], rel=1e-4)
