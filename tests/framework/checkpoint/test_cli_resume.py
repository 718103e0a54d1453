"""Through the real CLI (torchrun, gloo): resharding on resume, kill -9 and resume, async end, export."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, framework_command, run_cli, run_module, tiny_overrides

pytestmark = pytest.mark.timeout(900)

STEPS = 6  # checkpoints at 3 and 6; resumed runs train 4..6
RTOL = 1e-5


def env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def overrides(tmp: Path, run: str, layout: list[str], **extra) -> list[str]:
    o = {
        "hydra.run.dir": str(tmp / run),
        "deterministic": "true",
        "trainer.max_steps": STEPS,
        "trainer.val_every": 0,
        "checkpoint": "dcp",
        "checkpoint.every": 3,
        **extra,
    }
    return [*layout, *tiny_overrides(tmp, tmp / "data", **o)]


def launch(tmp: Path, run: str, layout: list[str], nproc: int, **extra) -> subprocess.CompletedProcess:
    proc = run_cli(overrides(tmp, run, layout, **extra), tmp, env={"OMP_NUM_THREADS": "1"}, nproc=nproc)
    assert proc.returncode == 0, f"{run} failed:\n{proc.stderr[-3000:]}"
    return proc


def losses(run_dir: Path) -> dict[int, float]:
    """Train losses by step (the last row of a step wins: a resumed run appends)."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:  # a line torn by kill -9
            continue
        if row.get("split") == "train":
            out[row["step"]] = row["loss"]
    return out


def assert_same_curve(got: dict[int, float], ref: dict[int, float], steps):
    for s in steps:
        assert abs(got[s] - ref[s]) <= RTOL * abs(ref[s]), (s, got[s], ref[s])


# -- the reshard matrix -----------------------------------------------------------------------------
SOURCES = {
    "none_x1": (["parallel=none"], 1),
    "ddp_x2": (["parallel=ddp"], 2),
    "fsdp2_x2": (["parallel=fsdp2"], 2),
    "fsdp2_domain_x4": (["parallel=fsdp2_domain"], 4),
}  # the 2-D mesh: dp_shard 2 x domain 2


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Unbroken dcp runs of 6 steps under each source layout, made on first use."""
    tmp = tmp_path_factory.mktemp("reshard")
    done = {}

    def get(name):
        if name not in done:
            layout, nproc = SOURCES[name]
            launch(tmp, name, layout, nproc)
            done[name] = losses(tmp / name)
        return tmp, done[name]

    return get


@pytest.mark.parametrize(
    "source,target,nproc",
    [
        ("fsdp2_x2", ["parallel=none"], 1),
        ("none_x1", ["parallel=fsdp2"], 2),
        ("fsdp2_x2", ["parallel=hsdp"], 4),
        ("ddp_x2", ["parallel=fsdp2"], 2),
        ("fsdp2_domain_x4", ["parallel=none"], 1),  # 2-D dp x domain checkpoint into one process
        ("none_x1", ["parallel=fsdp2_domain"], 4),  # and back into the 2-D mesh
    ],
)
def test_dcp_checkpoint_resumes_under_another_layout(sources, source, target, nproc):
    tmp, ref = sources(source)
    ckpt = tmp / source / "checkpoints" / "step_00000003"
    run = f"{source}_to_{target[0].split('=')[1]}_x{nproc}"
    proc = launch(tmp, run, target, nproc, **{"checkpoint.resume": str(ckpt)})
    got = losses(tmp / run)
    assert sorted(got) == [4, 5, 6]
    assert_same_curve(got, ref, [4, 5, 6])
    out = proc.stdout + proc.stderr
    assert f"resumed from {ckpt} at step 3" in out
    warned = [ln for ln in proc.stderr.splitlines() if "Warning: " in ln]  # FSDP2's view warning under fsdp2_domain
    assert len(warned) == len(set(warned)), warned  # library warnings once per job, not once per rank
    saved_world = SOURCES[source][1]
    for rank in range(saved_world, nproc):  # ranks the checkpoint has no RNG state for say so
        assert f"rank {rank}: checkpoint step_00000003 holds RNG states of {saved_world} rank(s)" in out, out[-2000:]


# -- kill -9 after a checkpoint, resume=latest; dcp_async; a run that ends right after a save -------
def test_kill_9_after_a_checkpoint_then_resume_latest(sources):
    tmp, ref = sources("fsdp2_x2")
    run = tmp / "killed"
    # Validating every step only slows the run down (it changes no training state), so the
    # kill lands between the step-3 checkpoint and the end.
    cmd = framework_command(2) + overrides(
        tmp,
        "killed",
        ["parallel=fsdp2"],
        **{"checkpoint": "dcp_async", "trainer.val_every": 1, "trainer.val_batches": 0},
    )
    proc = subprocess.Popen(
        cmd, cwd=tmp, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )

    def ready():  # the step-3 checkpoint is committed and step 4 has trained
        return (
            (run / "checkpoints" / "step_00000003" / "meta.json").is_file()
            and (run / "metrics.jsonl").is_file()
            and max(losses(run), default=0) >= 4
        )

    try:
        deadline = time.monotonic() + 300
        while not ready():
            assert proc.poll() is None, "the run ended before it could be killed"
            assert time.monotonic() < deadline
            time.sleep(0.02)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert "step_00000003" in names and "step_00000006" not in names, names

    launch(tmp, "killed", ["parallel=fsdp2"], 2, **{"checkpoint": "dcp_async"})  # resume=latest
    got = losses(run)
    assert_same_curve(got, ref, [4, 5, 6])
    # The resumed run ended right after its final (async) save: committed, nothing left over.
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000003", "step_00000006"]
    assert json.loads((run / "checkpoints" / "step_00000006" / "meta.json").read_text())["step"] == 6


# -- export -------------------------------------------------------------------------------------------
def _export(ckpt: Path, out: Path) -> subprocess.CompletedProcess:
    return run_module("framework.export", [ckpt, out], REPO, timeout=120)


def _plain(out: Path):
    from recipes.stormcast.songunet import SongUNet

    cfg = json.loads(out.with_suffix(".json").read_text())
    model = SongUNet(**cfg["kwargs"])
    model.load_state_dict(torch.load(out, weights_only=True))  # strict: every key, every shape
    return model.eval(), cfg


def test_export_from_dcp_and_torch_save(sources, tmp_path):
    from types import SimpleNamespace

    from framework.checkpoint.dcp import DcpBackend
    from framework.checkpoint.manager import CheckpointManager
    from framework.checkpoint.torch_save import TorchSaveBackend
    from framework.config.schema import CheckpointConfig
    from framework.distributed.env import DistEnv
    from framework.distributed.precision import Precision

    src, _ = sources("fsdp2_x2")
    ckpt = src / "fsdp2_x2" / "checkpoints" / "step_00000006"
    proc = _export(ckpt, tmp_path / "dcp" / "songunet.pt")
    assert proc.returncode == 0, proc.stderr
    exported, cfg = _plain(tmp_path / "dcp" / "songunet.pt")
    assert cfg["in_channels"] == 9 and cfg["out_channels"] == 4 and cfg["img_resolution"] == [16, 16]
    assert cfg["model"]["model_channels"] == 8 and cfg["source"]["step"] == 6

    # The same checkpoint through the resume path (one process, resharded from 2 ranks).
    from recipes.stormcast.songunet import SongUNet

    model = SongUNet(**cfg["kwargs"])
    opt = torch.optim.Adam(model.parameters())
    t = SimpleNamespace(
        model=model,
        optimizer=opt,
        scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
        precision=Precision("fp32", None, False, None),
        step=0,
        run_id="x",
    )
    m = CheckpointManager(CheckpointConfig(name="dcp"), DcpBackend(), tmp_path / "unused", DistEnv())
    m.load(ckpt, t)
    x = torch.randn(2, 9, 16, 16)
    with torch.no_grad():
        assert torch.equal(exported(x), model.eval()(x))

    # torch_save: save that model consolidated, export, same outputs.
    ts = CheckpointManager(CheckpointConfig(name="torch_save"), TorchSaveBackend(), tmp_path / "ts", DistEnv())
    path = ts.save(t, json.loads((ckpt / "meta.json").read_text())["config"])
    proc = _export(path, tmp_path / "ts.pt")
    assert proc.returncode == 0, proc.stderr
    again, _ = _plain(tmp_path / "ts.pt")
    with torch.no_grad():
        assert torch.equal(again(x), exported(x))
    assert all(type(v) is torch.Tensor for v in torch.load(tmp_path / "ts.pt", weights_only=True).values())


def test_export_bad_input_is_one_line(tmp_path, capsys):
    from framework import export

    cases = [tmp_path / "missing", tmp_path]
    (tmp_path / "step_00000001").mkdir()  # no meta.json: never committed
    cases.append(tmp_path / "step_00000001")
    broken = tmp_path / "checkpoints" / "step_00000002"
    broken.mkdir(parents=True)
    (broken / "meta.json").write_text(
        json.dumps(
            {
                "step": 2,
                "format": "dcp",
                "config": {"model": {"name": "songunet"}, "data": {"hrrr_channels": ["a"], "grid": [16, 16]}},
            }
        )
    )
    (broken / ".metadata").write_bytes(b"\x80\x04garbage")
    cases.append(broken)
    nomodel = tmp_path / "checkpoints" / "step_00000003"
    nomodel.mkdir()
    (nomodel / "meta.json").write_text(json.dumps({"step": 3, "format": "dcp", "config": {"seed": 0}}))
    cases.append(nomodel)
    for ckpt in cases:
        assert export.main([str(ckpt), str(tmp_path / "out.pt")]) != 0, ckpt
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (ckpt, lines)
    assert not (tmp_path / "out.pt").exists()
    proc = _export(broken, tmp_path / "out.pt")  # as a user runs it: exit code, one line, no traceback
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 3 and len(lines) == 1, proc.stderr
    expected = f"error: checkpoint file {broken / '.metadata'} cannot be read: not DCP metadata ("
    assert lines[0].startswith(expected), lines
