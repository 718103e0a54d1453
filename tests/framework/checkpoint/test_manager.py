"""Checkpoint manager with the torch_save backend: contents, atomicity, keep, resume choice."""

import json
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from framework.checkpoint.manager import CheckpointManager
from framework.checkpoint.torch_save import TorchSaveBackend
from framework.config.schema import CheckpointConfig
from framework.distributed.env import DistEnv
from framework.distributed.precision import Precision
from framework.errors import ConfigError, DataError


def make_trainer(seed=0, scaler=False):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    prec = Precision("fp16" if scaler else "fp32", None, False,
                     torch.amp.GradScaler("cpu", init_scale=128.0) if scaler else None)
    t = SimpleNamespace(model=model, optimizer=opt, scheduler=sched, precision=prec, step=0, run_id="abc")
    return t


def train(t, steps):
    for _ in range(steps):
        loss = t.model(torch.randn(16, 4)).pow(2).mean()
        loss.backward()
        t.optimizer.step()
        t.optimizer.zero_grad()
        t.scheduler.step()
        t.step += 1


def manager(tmp_path, **kw):
    return CheckpointManager(CheckpointConfig(**kw), TorchSaveBackend(), tmp_path, DistEnv())


def test_roundtrip_restores_everything(tmp_path):
    a = make_trainer(scaler=True)
    train(a, 3)
    a.precision.scaler.scale(torch.ones(()))  # initialise the scale tensor, as a real step does
    a.precision.scaler.update(new_scale=32.0)
    m = manager(tmp_path)
    path = m.save(a, {"seed": 0})
    assert path.name == "step_00000003"
    meta = json.loads((path / "meta.json").read_text())
    assert meta["step"] == 3 and meta["config"] == {"seed": 0}
    # Draws right after the save must repeat after the restore.
    expected = (torch.rand(3), np.random.rand(), random.random())

    b = make_trainer(seed=1, scaler=True)
    m.load(m.latest(), b)
    assert b.step == 3 and b.run_id == "abc"
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(pa, pb)
    assert b.scheduler.last_epoch == 3
    assert b.precision.scaler.get_scale() == 32.0
    assert torch.equal(torch.rand(3), expected[0])
    assert np.random.rand() == expected[1] and random.random() == expected[2]
    # Optimizer state restored: one more identical step keeps them identical.
    torch.manual_seed(5)
    train(a, 1)
    torch.manual_seed(5)
    train(b, 1)
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(pa, pb)


def test_exclude_optimizer_keeps_fresh_state(tmp_path):
    a = make_trainer()
    train(a, 2)
    m = manager(tmp_path, exclude=["optimizer"])
    m.save(a, {})
    b = make_trainer(seed=1)
    m.load(m.latest(), b)
    assert b.optimizer.state == {} and b.step == 2
    assert torch.equal(a.model[0].weight, b.model[0].weight)


def test_keep_prunes_oldest_and_never_the_newest(tmp_path):
    t = make_trainer()
    m = manager(tmp_path, keep=2)
    for _ in range(4):
        train(t, 1)
        m.save(t, {})
    assert [p.name for p in m.complete()] == ["step_00000003", "step_00000004"]
    assert m.latest().name == "step_00000004"


def test_partial_save_is_invisible_and_latest_is_previous(tmp_path):
    t = make_trainer()
    m = manager(tmp_path)
    train(t, 1)
    m.save(t, {})
    # A crash mid-save leaves a temporary directory with a half-written file.
    tmp = tmp_path / "checkpoints" / ".tmp-step_00000002"
    tmp.mkdir()
    (tmp / "state.pt").write_bytes(b"\x00" * 10)
    # And a directory without meta.json (e.g. copied by hand, truncated) is not complete either.
    (tmp_path / "checkpoints" / "step_00000003").mkdir()
    assert m.latest().name == "step_00000001"
    b = make_trainer(seed=3)
    m.load(m.resume_path(), b)
    assert b.step == 1


def test_explicit_incomplete_checkpoint_is_a_clear_error(tmp_path):
    bad = tmp_path / "checkpoints" / "step_00000009"
    bad.mkdir(parents=True)
    m = manager(tmp_path, resume=str(bad))
    with pytest.raises(ConfigError, match="not a complete checkpoint"):
        m.resume_path()
    (bad / "meta.json").write_text("{}")
    (bad / "state.pt").write_bytes(b"garbage")
    with pytest.raises(DataError, match="cannot be read"):
        m.load(bad, make_trainer())


def test_resume_none_and_latest_without_checkpoints(tmp_path):
    assert manager(tmp_path, resume="none").resume_path() is None
    assert manager(tmp_path).resume_path() is None


def test_files_load_with_weights_only(tmp_path):
    t = make_trainer(scaler=True)
    train(t, 1)
    path = manager(tmp_path).save(t, {})
    state = torch.load(path / "state.pt", weights_only=True)
    assert set(state) >= {"model", "optimizer", "schedule", "scaler", "rng", "data", "meta"}
