"""Manifests, verification, the locator's rule, fallback, retention, save failures, and the
optimizer's hyper-parameters on resume (one process; real files)."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import shutil

import pytest
import torch

from framework.checkpoint import locator, manifest
from framework.checkpoint.dcp import DcpBackend
from framework.checkpoint.manager import CheckpointManager, CheckpointSaveError
from framework.checkpoint.torch_save import TorchSaveBackend
from framework.config.schema import CheckpointConfig
from framework.distributed.env import DistEnv
from framework.errors import DataError
from tests.framework.checkpoint.test_manager import make_trainer, train

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
BACKENDS = {"torch_save": TorchSaveBackend, "dcp": DcpBackend}


def manager(tmp_path, backend="torch_save", **kw):
    return CheckpointManager(CheckpointConfig(name=backend, **kw), BACKENDS[backend](), tmp_path, DistEnv())


def at(m, t, step, **kw):
    """A checkpoint of ``t`` labelled ``step`` (no training needed to tell them apart)."""
    t.step = step
    with torch.no_grad():
        t.model[0].bias.fill_(step)
    return m.save(t, {"seed": 0, "parallel": {"name": "none"}}, **kw)


def flip(path, name):
    f = path / name
    blob = bytearray(f.read_bytes())
    blob[len(blob) // 2] ^= 1
    f.write_bytes(bytes(blob))


def bias(path) -> float:
    t = make_trainer(seed=9)
    manager(path.parent.parent, json.loads((path / "meta.json").read_text())["format"]).load(path, t)
    return float(t.model[0].bias[0])


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_manifest_lists_every_file_with_checksums_step_config_and_world(tmp_path, backend):
    m, t = manager(tmp_path, backend), make_trainer()
    first = at(m, t, 1)
    second = at(m, t, 2)
    man = json.loads((second / "manifest.json").read_text())
    on_disk = sorted(p.relative_to(second).as_posix() for p in second.rglob("*") if p.is_file())
    assert sorted([*man["files"], "manifest.json"]) == on_disk  # everything but itself
    assert "meta.json" in man["files"] and "rng/rank_0.pt" in man["files"]
    for name, entry in man["files"].items():
        blob = (second / name).read_bytes()
        assert entry["size"] == len(blob) and entry["chunks"] == [hashlib.blake2b(blob, digest_size=32).hexdigest()]
    meta = json.loads((second / "meta.json").read_text())
    config = {"seed": 0, "parallel": {"name": "none"}}
    assert man["step"] == meta["step"] == 2 and man["algorithm"] == "blake2b"
    assert (
        man["config_sha256"]
        == hashlib.sha256(json.dumps(config, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    )
    assert man["world"] == {"world_size": 1, "format": backend, "parallel": {"name": "none"}}
    # the lineage: a fresh start has no parent, the next save names the previous one
    first_meta = json.loads((first / "meta.json").read_text())
    assert first_meta["parent"] is None
    assert meta["parent"] == man["parent"] == {"name": "step_00000001", "committed_ns": first_meta["committed_ns"]}


def test_chunks_are_verified_by_shares(tmp_path, monkeypatch):
    """n ranks verify one checkpoint together: each hashes every n-th chunk."""
    monkeypatch.setattr(manifest, "CHUNK", 1024)
    d = tmp_path / "c"
    d.mkdir()
    (d / "meta.json").write_text(json.dumps({"step": 1, "config": {}}))
    (d / "data").write_bytes(torch.randn(1000).numpy().tobytes())  # 4000 bytes: 4 chunks
    man = manifest.build(d, {"step": 1, "config": {}}, world={})
    assert len(man["files"]["data"]["chunks"]) == 4
    blob = bytearray((d / "data").read_bytes())
    blob[1500] ^= 1  # chunk 1; with meta.json first in sorted order, item 2 of 5 -> rank 0 of 2
    (d / "data").write_bytes(bytes(blob))
    items = [("data", 0), ("data", 1), ("data", 2), ("data", 3), ("meta.json", 0)]
    owner = items.index(("data", 1)) % 2
    with pytest.raises(manifest.CorruptCheckpoint, match=r"data does not match its checksum \(bytes 1024-2048\)"):
        manifest.verify(d, man, None, full=True, share=(owner, 2))
    manifest.verify(d, man, None, full=True, share=(1 - owner, 2))  # not this rank's chunk
    manifest.verify(d, man, None, full=False)  # the quick check reads no data


def test_resume_latest_falls_back_past_a_corrupt_newest_with_a_warning(tmp_path, caplog):
    m, t = manager(tmp_path, "dcp"), make_trainer()
    at(m, t, 1)
    second = at(m, t, 2)
    third = at(m, t, 3)
    flip(third, "__0_0.distcp")
    with caplog.at_level(logging.WARNING, logger="framework"):
        assert m.resume_path() == second
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        f"checkpoint {third} is corrupt: __0_0.distcp does not match its checksum; skipped",
        f"checkpoint.resume=latest: falling back to {second} (step 2), the newest verified checkpoint "
        "of this run; 1 newer one(s) skipped",
    ]
    assert bias(second) == 2.0
    # named explicitly, the corrupt one is an error: one line, no fallback
    explicit = manager(tmp_path, "dcp", resume=str(third))
    with pytest.raises(DataError, match=r"is corrupt: __0_0.distcp does not match its checksum$"):
        explicit.resume_path()
    # a run dir or checkpoints/ dir named explicitly: its latest verified one
    assert manager(tmp_path, "dcp", resume=str(tmp_path)).resume_path() == second
    assert manager(tmp_path, "dcp", resume=str(tmp_path / "checkpoints")).resume_path() == second


def test_garbage_meta_json_is_reported_kept_and_never_overwritten(tmp_path, caplog):
    """The newest checkpoint's meta.json is garbage: resume=latest says so and falls back; when
    the run reaches that step again the damaged directory is moved aside, not replaced."""
    m, t = manager(tmp_path), make_trainer()
    at(m, t, 1)
    bad = at(m, t, 2)
    (bad / "meta.json").write_text("{garbage")
    resumed = manager(tmp_path)
    with caplog.at_level(logging.WARNING, logger="framework"):
        path = resumed.resume_path()
    assert path.name == "step_00000001"
    assert f"checkpoint {bad} is corrupt: meta.json cannot be read" in caplog.text
    assert "falling back to" in caplog.text
    resumed.load(path, t)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="framework"):
        at(resumed, t, 2)
    aside = tmp_path / "checkpoints" / "step_00000002.corrupt"
    assert (aside / "meta.json").read_text() == "{garbage"  # kept for a human to look at
    assert "moved to step_00000002.corrupt (not deleted)" in caplog.text
    assert resumed.latest() == bad and bias(bad) == 2.0  # the new step 2 is whole and verified


def test_no_verified_checkpoint_refuses_rather_than_starting_over(tmp_path):
    m, t = manager(tmp_path), make_trainer()
    for step in (1, 2):
        flip(at(m, t, step), "state.pt")
    with pytest.raises(
        DataError,
        match=r"^checkpoint.resume=latest: no usable checkpoint in .* \(2 committed, none "
        r"verified; the newest: .*step_00000002 is corrupt: state.pt does not match "
        r"its checksum\); name one with checkpoint.resume=<path>",
    ) as info:
        manager(tmp_path).resume_path()
    assert "\n" not in str(info.value)


def test_the_lineage_never_falls_back_onto_an_abandoned_branch(tmp_path):
    """3 and 6 saved; resumed from 3, 4 and 5 saved: 6 is abandoned. Latest is 5; with 5
    corrupt, 4; with 4 corrupt too, 3, never 6 (whose step is higher and whose commit is newer
    than 3's)."""
    m, t = manager(tmp_path, keep=10), make_trainer()
    three = at(m, t, 3)
    six = at(m, t, 6)
    m2 = manager(tmp_path, keep=10)
    m2.load(three, t)
    four = at(m2, t, 4)
    five = at(m2, t, 5)
    assert m2.latest() == five and manager(tmp_path).resume_path() == five
    assert [e.name for e in locator.lineage(locator.scan(tmp_path / "checkpoints"))] == [
        "step_00000005",
        "step_00000004",
        "step_00000003",
    ]
    flip(five, "state.pt")
    assert manager(tmp_path).resume_path() == four
    flip(four, "state.pt")
    assert manager(tmp_path).resume_path() == three
    assert six.exists()


def test_checkpoints_of_older_versions_load_unverified_and_are_pruned_first(tmp_path, caplog):
    m, t = manager(tmp_path, keep=2), make_trainer()
    old1, old2 = at(m, t, 1), at(m, t, 2)
    for p in (old1, old2):  # as an older version wrote them: no manifest, no parent
        (p / "manifest.json").unlink()
        meta = json.loads((p / "meta.json").read_text())
        del meta["parent"]
        (p / "meta.json").write_text(json.dumps(meta))
    resumed = manager(tmp_path, keep=2)
    with caplog.at_level(logging.WARNING, logger="framework"):
        assert resumed.resume_path() == old2
        resumed.load(old2, t)
    assert (
        f"checkpoint {old2} has no manifest.json (written by an older version): its files are not verified"
        in caplog.text
    )
    new3 = at(resumed, t, 3)
    assert resumed.complete() == [old2, new3]  # keep=2: the older unverified one went
    at(resumed, t, 4)
    assert [p.name for p in resumed.complete()] == ["step_00000003", "step_00000004"]  # unverified before verified


def test_retention_keeps_the_newest_finite_verified_checkpoint(tmp_path):
    m, t = manager(tmp_path, keep=1), make_trainer()
    at(m, t, 1, finite=True)
    at(m, t, 2)  # finiteness not recorded
    at(m, t, 3)
    assert [p.name for p in m.complete()] == ["step_00000001", "step_00000003"]
    at(m, t, 4, finite=True)
    assert [p.name for p in m.complete()] == ["step_00000004"]
    assert json.loads((tmp_path / "checkpoints" / "step_00000004" / "meta.json").read_text())["finite"] is True


def test_retention_never_deletes_or_counts_a_corrupt_checkpoint(tmp_path, caplog):
    m, t = manager(tmp_path, keep=2), make_trainer()
    at(m, t, 1)
    bad = at(m, t, 2)
    (bad / "state.pt").write_bytes(b"short")
    with caplog.at_level(logging.WARNING, logger="framework"):
        at(m, t, 3)
        at(m, t, 4)
    assert [p.name for p in m.complete()] == ["step_00000002", "step_00000003", "step_00000004"]
    assert caplog.text.count(f"checkpoint {bad} is corrupt: state.pt has 5 bytes") == 1  # reported once
    assert "retention never deletes a corrupt checkpoint" in caplog.text


def test_a_checkpoint_recorded_non_finite_is_never_latest(tmp_path):
    m, t = manager(tmp_path), make_trainer()
    one = at(m, t, 1, finite=True)
    at(m, t, 2, finite=False)
    assert m.latest() == one and manager(tmp_path).resume_path() == one


def test_a_save_that_fails_on_io_exits_74_and_keeps_the_previous(tmp_path, monkeypatch):
    m, t = manager(tmp_path, "dcp"), make_trainer()
    first = at(m, t, 1)

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(m.backend, "save", full)
    with pytest.raises(CheckpointSaveError) as info:
        at(m, t, 2)
    assert info.value.exit_code == 74
    assert str(info.value) == (
        "saving checkpoint step_00000002 failed: OSError: [Errno 28] No space left on device; "
        "the previous checkpoint is intact"
    )
    assert m.latest() == first and not (tmp_path / "checkpoints" / "step_00000002").exists()


def test_locate_accepts_run_checkpoints_and_step_dirs(tmp_path):
    m, t = manager(tmp_path), make_trainer()
    at(m, t, 1)
    two = at(m, t, 2)
    ok = lambda e: None  # noqa: E731
    for path in (tmp_path, tmp_path / "checkpoints", two):
        assert locator.locate(path, ok).path == two
    copy = tmp_path / "best"
    shutil.copytree(two, copy)  # a checkpoint copied under any name is still one
    assert locator.locate(copy, ok).path == copy
    with pytest.raises(DataError, match="neither a checkpoint, a checkpoints directory nor a run directory"):
        locator.locate(tmp_path / "checkpoints" / "step_00000002" / "rng", ok)
    (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
    with pytest.raises(DataError, match="holds no committed checkpoint"):
        locator.locate(tmp_path / "empty", ok)


# -- optimizer hyper-parameters on resume ---------------------------------------------------------
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_resume_takes_optimizer_hyper_parameters_from_the_config(tmp_path, backend, caplog):
    a = make_trainer()  # Adam(lr=1e-2), LambdaLR 1/(1+s)
    train(a, 3)
    m = manager(tmp_path, backend)
    path = m.save(a, {})
    moments = [s["exp_avg"].clone() for s in a.optimizer.state.values()]

    b = make_trainer(seed=1)
    b.optimizer = torch.optim.Adam(b.model.parameters(), lr=4e-4, betas=(0.8, 0.95), weight_decay=0.1)
    b.scheduler = torch.optim.lr_scheduler.LambdaLR(b.optimizer, lambda s: 1.0 / (1 + s))
    with caplog.at_level(logging.INFO, logger="framework"):
        m.load(path, b)
    g = b.optimizer.param_groups[0]
    assert g["lr"] == 4e-4 * (1.0 / (1 + 3)) and g["initial_lr"] == 4e-4 and b.scheduler.base_lrs == [4e-4]
    assert g["betas"] == (0.8, 0.95) and g["weight_decay"] == 0.1
    assert b.scheduler.get_last_lr() == [g["lr"]] and b.scheduler.last_epoch == 3
    assert len(b.optimizer.state) == len(moments) > 0
    for s, want in zip(b.optimizer.state.values(), moments):  # the state itself is the checkpoint's
        assert torch.equal(s["exp_avg"], want)
    assert (
        "resume: optimizer hyper-parameters from the config, not the checkpoint: "
        "betas (0.9, 0.999) -> (0.8, 0.95), weight_decay 0 -> 0.1, lr 0.01 -> 0.0004"
    ) in caplog.text
    b.scheduler.step()
    assert b.optimizer.param_groups[0]["lr"] == 4e-4 * (1.0 / (1 + 4))

    # the same config: nothing changes, nothing is logged, the lr is bit-identical
    c = make_trainer(seed=2)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="framework"):
        m.load(path, c)
    assert "hyper-parameters" not in caplog.text
    assert c.optimizer.param_groups[0]["lr"] == a.optimizer.param_groups[0]["lr"]


def _with_adam(t, **kw):
    t.optimizer = torch.optim.Adam(t.model.parameters(), lr=1e-2, **kw)
    t.scheduler = torch.optim.lr_scheduler.LambdaLR(t.optimizer, lambda s: 1.0 / (1 + s))
    return t


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize(("saved", "live"), [(True, None), (None, True)])
def test_resume_keeps_the_live_optimizers_kernel_and_logs_no_change(tmp_path, backend, saved, live, caplog):
    """``fused`` is how the optimizer computes, not what: a checkpoint from a foreach optimizer
    resumes under a fused one (the default on CUDA since the framework picks it) and back, silently,
    and the next step moves the parameters as the unbroken run's does (to the kernels' round-off)."""
    a = _with_adam(make_trainer(), fused=saved)
    train(a, 3)
    m = manager(tmp_path, backend)
    path = m.save(a, {})
    b = _with_adam(make_trainer(seed=1), fused=live)
    with caplog.at_level(logging.INFO, logger="framework"):
        m.load(path, b)
    assert b.optimizer.param_groups[0]["fused"] is live and "hyper-parameters" not in caplog.text
    assert all(s["step"].device.type == "cpu" and s["step"].item() == 3 for s in b.optimizer.state.values())
    torch.manual_seed(7)
    train(a, 1)
    torch.manual_seed(7)
    train(b, 1)
    for p, q in zip(a.model.parameters(), b.model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7)
