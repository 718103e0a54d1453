"""Through the real CLI: one rule for "latest" after a resume from an earlier step, and
checkpoints named on resume that are crafted or corrupt (exit 3, one line, no code run)."""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.conftest import run_cli, run_module, tiny_overrides
from tests.framework.checkpoint.craft import plant_bytes_entry

pytestmark = [pytest.mark.timeout(900), pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]
ENV = {"OMP_NUM_THREADS": "1"}


def overrides(tmp, run, **extra):
    o = {
        "hydra.run.dir": str(tmp / run),
        "trainer.max_steps": 6,
        "trainer.val_every": 0,
        "checkpoint": "dcp",
        "checkpoint.every": 3,
        **extra,
    }
    return tiny_overrides(tmp, tmp / "data", **o)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A 6-step dcp run: checkpoints at 3 and 6."""
    tmp = tmp_path_factory.mktemp("cli_integrity")
    proc = run_cli(overrides(tmp, "base"), tmp, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp


def test_after_resuming_from_an_earlier_step_every_reader_takes_the_new_branch(base, tmp_path):
    """The run reached 6; resumed from 3 and trained to 5. Resume, task.regression / inference
    (recipes.weather.weights) and export all take step 5; before, the last two took 6, the
    highest step, of the abandoned branch."""
    from framework import registry
    from framework.checkpoint.dcp import DcpBackend
    from framework.checkpoint.manager import CheckpointManager
    from framework.config.schema import CheckpointConfig
    from framework.distributed.env import DistEnv
    from recipes.weather import weights

    run = tmp_path / "branch"
    shutil.copytree(base / "base", run)
    ckpts = run / "checkpoints"
    proc = run_cli(
        overrides(
            tmp_path,
            "branch",
            **{
                "trainer.max_steps": 5,
                "data.root": str(base / "data"),
                "checkpoint.resume": str(ckpts / "step_00000003"),
            },
        ),
        tmp_path,
        env=ENV,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {ckpts / 'step_00000003'} at step 3" in proc.stdout
    five, six = ckpts / "step_00000005", ckpts / "step_00000006"
    assert five.is_dir() and six.is_dir()

    assert CheckpointManager(CheckpointConfig(name="dcp"), DcpBackend(), run, DistEnv()).resume_path() == five
    registry.load_providers()
    assert weights.describe(run).checkpoint == five and weights.describe(ckpts).checkpoint == five
    model, info = weights.load(run)
    want, abandoned = DcpBackend().export_weights(five), DcpBackend().export_weights(six)
    assert any(not torch.equal(want[k], abandoned[k]) for k in want)
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in want.items())

    out = tmp_path / "branch.pt"
    proc = run_module("framework.export", [str(run), str(out)], tmp_path)
    assert proc.returncode == 0 and f"of step 5 ({five})" in proc.stdout, proc.stdout + proc.stderr
    exported = torch.load(out, weights_only=True)
    assert all(torch.equal(exported[k], v) for k, v in want.items())


@pytest.mark.parametrize("damage", ["bytes_entry", "bit_flip"])
def test_resume_from_a_crafted_or_corrupt_checkpoint_exits_3_in_one_line(base, tmp_path, damage):
    ckpt = tmp_path / "given" / "step_00000003"
    shutil.copytree(base / "base" / "checkpoints" / "step_00000003", ckpt)
    marker = tmp_path / "PWNED"
    if damage == "bytes_entry":  # a payload that would run on load; the manifest forged to match
        fqn = plant_bytes_entry(ckpt, marker)
        expected = (
            f"error: checkpoint {ckpt} is refused: entry {fqn} of .metadata is a pickled Python object "
            "(BytesStorageMetadata), which loading would execute; this framework writes only tensors "
            "through DCP"
        )
    else:
        f = ckpt / "__0_0.distcp"
        blob = bytearray(f.read_bytes())
        blob[len(blob) // 3] ^= 1
        f.write_bytes(bytes(blob))
        expected = f"error: checkpoint {ckpt} is corrupt: __0_0.distcp does not match its checksum"
    proc = run_cli(
        overrides(tmp_path, "victim", **{"data.root": str(base / "data"), "checkpoint.resume": str(ckpt)}),
        tmp_path,
        env=ENV,
    )
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [expected]
    assert not marker.exists()
    assert not (tmp_path / "victim" / "checkpoints").exists() or not any(
        (tmp_path / "victim" / "checkpoints").iterdir()
    )  # nothing trained, nothing saved
