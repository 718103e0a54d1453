"""Checkpoint manager in one process, every backend: contents, atomicity, keep, resume choice."""

import json
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from framework.checkpoint.dcp import DcpBackend
from framework.checkpoint.dcp_async import AsyncDcpBackend
from framework.checkpoint.manager import CheckpointManager
from framework.checkpoint.torch_save import TorchSaveBackend
from framework.config.schema import CheckpointConfig
from framework.distributed.env import DistEnv
from framework.distributed.precision import Precision
from framework.errors import ConfigError, DataError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def make_trainer(seed=0, scaler=False):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    prec = Precision(
        "fp16" if scaler else "fp32", None, False, torch.amp.GradScaler("cpu", init_scale=128.0) if scaler else None
    )
    t = SimpleNamespace(model=model, optimizer=opt, scheduler=sched, precision=prec, step=0, run_id="abc")
    return t


def train(t, steps, m=None):
    for _ in range(steps):
        loss = t.model(torch.randn(16, 4)).pow(2).mean()
        loss.backward()
        if m is not None:
            m.before_optimizer_step()  # as the trainer does: an async save's copy is done
        t.optimizer.step()
        t.optimizer.zero_grad()
        t.scheduler.step()
        t.step += 1


BACKENDS = {"torch_save": TorchSaveBackend, "dcp": DcpBackend, "dcp_async": AsyncDcpBackend}


@pytest.fixture(params=sorted(BACKENDS))
def backend(request):
    return request.param


def manager(tmp_path, backend="torch_save", **kw):
    return CheckpointManager(CheckpointConfig(name=backend, **kw), BACKENDS[backend](), tmp_path, DistEnv())


def save(m, t, config):
    path = m.save(t, config)
    m.finish()  # an async save is committed here
    return path


def test_roundtrip_restores_everything(tmp_path, backend):
    a = make_trainer(scaler=True)
    train(a, 3)
    a.precision.scaler.scale(torch.ones(()))  # initialise the scale tensor, as a real step does
    a.precision.scaler.update(new_scale=32.0)
    m = manager(tmp_path, backend)
    path = save(m, a, {"seed": 0})
    assert path.name == "step_00000003"
    meta = json.loads((path / "meta.json").read_text())
    assert meta["step"] == 3 and meta["config"] == {"seed": 0} and meta["world_size"] == 1
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


def test_exclude_optimizer_keeps_fresh_state(tmp_path, backend):
    a = make_trainer()
    train(a, 2)
    m = manager(tmp_path, backend, exclude=["optimizer"])
    save(m, a, {})
    b = make_trainer(seed=1)
    m.load(m.latest(), b)
    assert b.optimizer.state == {} and b.step == 2
    assert torch.equal(a.model[0].weight, b.model[0].weight)


def test_keep_prunes_oldest_and_never_the_newest(tmp_path, backend):
    t = make_trainer()
    m = manager(tmp_path, backend, keep=2)
    for _ in range(4):
        train(t, 1, m)
        m.save(t, {})  # async: the previous save is committed by this one
    m.finish()
    assert [p.name for p in m.complete()] == ["step_00000003", "step_00000004"]
    assert m.latest().name == "step_00000004"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000003", "step_00000004"]


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
    with pytest.raises(DataError, match="incomplete or corrupt: no meta.json"):
        m.resume_path()
    with pytest.raises(ConfigError, match="does not exist"):
        manager(tmp_path, resume=str(tmp_path / "nope")).resume_path()
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
    assert set(state) >= {"model", "optimizer", "schedule", "scaler", "data", "meta"}
    rng = torch.load(path / "rng" / "rank_0.pt", weights_only=True)
    assert set(rng) >= {"torch", "numpy", "python"}


def test_newest_is_the_last_committed_and_resaving_a_step_replaces_it(tmp_path):
    t = make_trainer()
    m = manager(tmp_path, keep=3)
    for _ in range(3):
        train(t, 1)
        m.save(t, {})
    # Resume from step 1 and train on: the new branch is the newest, whatever its step.
    b = make_trainer(seed=1)
    m.load(tmp_path / "checkpoints" / "step_00000001", b)
    train(b, 1)
    m.save(b, {})  # step 2 again: replaced whole
    assert m.latest().name == "step_00000002"
    assert [p.name for p in m.complete()] == ["step_00000001", "step_00000003", "step_00000002"]
    m.cfg.keep = 1
    m.prune()  # the oldest commits go first, the newest stays
    assert [p.name for p in m.complete()] == ["step_00000002"]
    c = make_trainer(seed=2)
    m.load(m.latest(), c)
    assert torch.equal(c.model[0].weight, b.model[0].weight)
    assert not any(p.name.startswith(".") for p in (tmp_path / "checkpoints").iterdir())


def test_corrupt_dcp_checkpoint_named_explicitly_is_one_line(tmp_path):
    """Against the manifest: sizes and checksums of every file."""
    t = make_trainer()
    train(t, 1)
    m = manager(tmp_path, "dcp")
    path = m.save(t, {})
    data = path / "__0_0.distcp"
    blob = data.read_bytes()

    def fails(pattern):
        with pytest.raises(DataError, match=pattern) as info:
            m.load(path, make_trainer(seed=1))
        assert "\n" not in str(info.value)

    data.write_bytes(blob[: len(blob) // 2])
    fails(rf"is corrupt: __0_0.distcp has {len(blob) // 2} bytes, its manifest says {len(blob)}$")
    data.write_bytes(blob[:100] + bytes([blob[100] ^ 1]) + blob[101:])  # one flipped bit, same size
    fails(r"is corrupt: __0_0.distcp does not match its checksum$")
    data.unlink()
    fails(r"is incomplete: __0_0.distcp is missing$")
    data.write_bytes(blob)
    (path / "extra.pt").write_bytes(b"nonsense")
    fails(r"is corrupt: extra.pt has 8 bytes, its manifest says")
    (path / ".metadata").unlink()
    fails(r"is incomplete: .metadata is missing")
    (path / "meta.json").write_text("{not json")
    fails(r"is corrupt: meta.json cannot be read")


def test_corrupt_dcp_checkpoint_without_manifest_is_one_line(tmp_path, caplog):
    """A checkpoint of an older version (no manifest): loaded with a warning; DCP's files are
    still checked against .metadata before anything is read."""
    t = make_trainer()
    train(t, 1)
    m = manager(tmp_path, "dcp")
    path = m.save(t, {})
    (path / "manifest.json").unlink()
    with caplog.at_level("WARNING", logger="framework"):
        b = make_trainer(seed=1)
        m.load(path, b)
    assert torch.equal(b.model[0].weight, t.model[0].weight)
    assert "has no manifest.json (written by an older version): its files are not verified" in caplog.text
    data = path / "__0_0.distcp"
    blob = data.read_bytes()

    def fails(pattern):
        with pytest.raises(DataError, match=pattern) as info:
            m.load(path, make_trainer(seed=1))
        assert "\n" not in str(info.value)

    data.write_bytes(blob[: len(blob) // 2])
    fails(r"is corrupt: data file __0_0.distcp is truncated")
    data.unlink()
    fails(r"is incomplete: data file __0_0.distcp is missing")
    data.write_bytes(blob)
    (path / "extra.pt").write_bytes(b"nonsense")
    fails(r"extra.pt cannot be read")
    (path / ".metadata").unlink()
    fails(r"is incomplete: no DCP .metadata file")
    (path / "meta.json").write_text("{not json")
    fails(r"is corrupt: meta.json cannot be read")


def test_dcp_into_a_different_model_is_one_line(tmp_path):
    t = make_trainer()
    train(t, 1)
    m = manager(tmp_path, "dcp")
    path = m.save(t, {})
    other = make_trainer()
    other.model[0] = torch.nn.Linear(4, 9)
    other.model[2] = torch.nn.Linear(9, 2)
    other.optimizer = torch.optim.Adam(other.model.parameters())
    other.scheduler = torch.optim.lr_scheduler.LambdaLR(other.optimizer, lambda s: 1.0)
    with pytest.raises(DataError, match="cannot be loaded into this model") as info:
        m.load(path, other)
    assert "\n" not in str(info.value)


def test_metadata_unpickler_refuses_code(tmp_path):
    import os
    import pickle

    from framework.checkpoint.dcp import read_metadata

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned > " + str(tmp_path / "pwned"),))

    (tmp_path / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(DataError, match="is not allowed in checkpoint metadata"):
        read_metadata(tmp_path)
    assert not (tmp_path / "pwned").exists()


def test_rng_of_a_rank_the_checkpoint_lacks_is_reseeded(tmp_path, caplog):
    t = make_trainer()
    train(t, 1)
    path = manager(tmp_path).save(t, {"seed": 7})
    two = CheckpointManager(CheckpointConfig(), TorchSaveBackend(), tmp_path, DistEnv(rank=1, world_size=2))
    with caplog.at_level("INFO", logger="framework"):
        two._load_rng(path, json.loads((path / "meta.json").read_text()), {})
    assert "rank 1: checkpoint step_00000001 holds RNG states of 1 rank(s); rank 1 reseeded" in caplog.text
    first = torch.rand(2)
    two._load_rng(path, json.loads((path / "meta.json").read_text()), {})
    assert torch.equal(torch.rand(2), first)  # deterministic
    (path / "rng" / "rank_0.pt").unlink()
    with pytest.raises(DataError, match=r"is incomplete: rng/rank_0.pt is missing$"):  # the manifest lists it
        manager(tmp_path).load(path, make_trainer())
    (path / "manifest.json").unlink()  # an older checkpoint: the world size in meta.json says it is missing
    with pytest.raises(DataError, match="no RNG state of rank 0"):
        manager(tmp_path).load(path, make_trainer())
