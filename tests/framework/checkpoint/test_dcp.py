"""DCP checkpoints on real gloo ranks: roundtrips under FSDP2/DDP, channels_last, GradScaler, a crash."""

import json
import os

import pytest
import torch

from tests.framework.checkpoint.common import full_optimizer, full_params, train, trainer
from tests.multiproc import spawn

pytestmark = pytest.mark.timeout(300)


def _topology(world, dp_replicate=1):
    from framework.config.schema import ParallelConfig
    from framework.distributed import mesh

    return mesh.build(mesh.resolve(ParallelConfig(dp_replicate=dp_replicate), world), "cpu")


def _manager(tmp, backend, rank, world, **cfg):
    import torch.distributed as dist

    from framework.checkpoint.dcp import DcpBackend
    from framework.checkpoint.dcp_async import AsyncDcpBackend
    from framework.checkpoint.manager import CheckpointManager
    from framework.config.schema import CheckpointConfig
    from framework.distributed.env import DistEnv

    impl = {"dcp": DcpBackend, "dcp_async": AsyncDcpBackend}[backend]()
    return CheckpointManager(
        CheckpointConfig(name=backend, **cfg), impl, tmp, DistEnv(rank, world, rank, "torchrun"), barrier=dist.barrier
    )


def _same_everywhere(t: torch.Tensor) -> bool:
    """Bit-identical on every rank."""
    import torch.distributed as dist

    mine = t.detach().reshape(-1).contiguous().view(torch.uint8)
    others = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(others, mine)
    return all(torch.equal(mine, o) for o in others)


# -- FSDP2 roundtrip: model, optimizer, scheduler; sync and async --------------------------------
def _fsdp2_roundtrip(rank, world, tmp, backend):
    topo = _topology(world)
    a = trainer(topo, "fsdp2", seed=0)
    m = _manager(tmp, backend, rank, world)
    train(a, 2, m)
    saved_params, saved_opt = full_params(a), full_optimizer(a)
    saved_sched = a.scheduler.state_dict()
    m.save(a, {"seed": 0})
    train(a, 3, m)  # keeps training while an async save writes: the saved state must not move
    m.finish()
    assert [p.name for p in m.complete()] == ["step_00000002"]

    b = trainer(topo, "fsdp2", seed=1)
    b.step = 2
    m.load(m.latest(), b)
    assert b.step == 2 and b.run_id == "run0"
    for k, v in full_params(b).items():
        assert torch.equal(v, saved_params[k]), k
    loaded_opt = full_optimizer(b)
    for fqn, st in saved_opt.items():
        for k, v in st.items():
            assert torch.equal(loaded_opt[fqn][k], v), (fqn, k)
    assert b.scheduler.state_dict() == saved_sched
    assert [g["lr"] for g in b.optimizer.param_groups] == b.scheduler.get_last_lr()

    # Outputs equal after reload, and both continue identically.
    c = trainer(topo, "fsdp2", seed=0)
    train(c, 2)
    x = torch.randn(2, 5, 16, 16, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        assert torch.equal(b.model(x), c.model(x))
    train(b, 2)
    train(c, 2)
    for (k, v), w in zip(full_params(b).items(), full_params(c).values()):
        assert torch.equal(v, w), k


@pytest.mark.parametrize("backend", ["dcp", "dcp_async"])
def test_fsdp2_roundtrip_model_optimizer_scheduler(tmp_path, backend):
    spawn(_fsdp2_roundtrip, 2, tmp_path, backend)


# -- channels_last ---------------------------------------------------------------------------------
def _channels_last(rank, world, tmp):
    topo = _topology(world)
    for i, sharding in enumerate(("ddp", "fsdp2")):
        a = trainer(topo, sharding, seed=0, channels_last=True)
        m = _manager(tmp / sharding, "dcp", rank, world)
        train(a, 2, m, channels_last=True)
        saved = full_params(a)
        m.save(a, {})
        b = trainer(topo, sharding, seed=3, channels_last=True)
        m.load(m.latest(), b)
        loaded = full_params(b)
        for k, v in loaded.items():
            assert torch.equal(v, saved[k]), (sharding, k)
            assert _same_everywhere(v), (sharding, k)
        if sharding == "ddp":  # the live parameters keep their channels_last layout
            assert any(
                p.dim() == 4 and p.is_contiguous(memory_format=torch.channels_last) and not p.is_contiguous()
                for p in b.model.parameters()
            )
        # a DDP (channels_last) checkpoint loads into FSDP2 and back
        if i == 0:
            c = trainer(topo, "fsdp2", seed=4)
            m.load(m.latest(), c)
            for k, v in full_params(c).items():
                assert torch.equal(v, saved[k]), ("ddp -> fsdp2", k)


def test_channels_last_parameters_bit_identical_across_ranks(tmp_path):
    spawn(_channels_last, 2, tmp_path)


# -- GradScaler under FSDP2 with fp16 autocast -----------------------------------------------------
def _grad_scaler(rank, world, tmp):
    topo = _topology(world)
    a = trainer(topo, "fsdp2", seed=0, precision="fp16", init_scale=2.0**12)
    m = _manager(tmp, "dcp", rank, world)
    train(a, 3, m, poison_step=1)  # step 1 overflows: skipped, the scale backs off
    scaler = a.precision.scaler
    assert scaler.get_scale() == 2.0**11
    saved = scaler.state_dict()
    assert saved["_growth_tracker"] == 1
    m.save(a, {})
    b = trainer(topo, "fsdp2", seed=1, precision="fp16", init_scale=2.0**16)
    m.load(m.latest(), b)
    assert b.precision.scaler.state_dict() == saved
    train(a, 2)
    train(b, 2)
    assert b.precision.scaler.state_dict() == a.precision.scaler.state_dict()
    for (k, v), w in zip(full_params(a).items(), full_params(b).values()):
        assert torch.equal(v, w), k


def test_grad_scaler_state_under_fsdp2_fp16(tmp_path):
    spawn(_grad_scaler, 2, tmp_path)


# -- a rank dies in the middle of writing a checkpoint --------------------------------------------
def _crash_mid_save(rank, world, tmp):
    from torch.distributed.checkpoint import FileSystemWriter

    topo = _topology(world)
    a = trainer(topo, "fsdp2", seed=0)
    m = _manager(tmp, "dcp", rank, world)
    train(a, 1, m)
    params = full_params(a)
    m.save(a, {})
    if rank == 0:
        torch.save(params, tmp / "expected.pt")
    train(a, 1, m)
    if rank == 1:

        def die(self, plan, planner):  # half a file, then the process is gone (kill -9 alike)
            with open(os.path.join(self.path, "__1_0.distcp"), "wb") as f:
                f.write(b"\x00" * 100)
            os._exit(9)

        FileSystemWriter.write_data = die
    m.save(a, {})
    raise AssertionError("unreachable: rank 1 died during the save")


def test_crash_during_save_keeps_the_previous_checkpoint(tmp_path):
    from framework.checkpoint.dcp import DcpBackend
    from framework.checkpoint.manager import CheckpointManager
    from framework.config.schema import CheckpointConfig
    from framework.distributed.env import DistEnv
    from framework.errors import DataError

    with pytest.raises(torch.multiprocessing.ProcessExitedException, match="exit code 9"):  # rank 1's os._exit(9)
        spawn(_crash_mid_save, 2, tmp_path, timeout_s=30)
    root = tmp_path / "checkpoints"
    assert (root / ".tmp-step_00000002").is_dir() and not (root / "step_00000002").exists()
    m = CheckpointManager(CheckpointConfig(name="dcp"), DcpBackend(), tmp_path, DistEnv())
    assert m.resume_path().name == "step_00000001"
    # the previous checkpoint loads (here into one process: resharded, rank 1's RNG absent)
    t = trainer(None, "none", seed=5)
    m.load(m.latest(), t)
    expected = torch.load(tmp_path / "expected.pt", weights_only=True)
    for k, v in full_params(t).items():
        assert torch.equal(v, expected[k]), k
    # the partial one, named explicitly, is a one-line error
    with pytest.raises(DataError, match="incomplete or corrupt: no meta.json"):
        CheckpointManager(
            CheckpointConfig(name="dcp", resume=str(root / ".tmp-step_00000002")), DcpBackend(), tmp_path, DistEnv()
        ).resume_path()
    # the next commit sweeps the leftover
    train(t, 1, m)
    m.save(t, {})
    assert sorted(p.name for p in root.iterdir()) == ["step_00000001", "step_00000002"]
    assert json.loads((root / "step_00000002" / "meta.json").read_text())["world_size"] == 1
    with pytest.raises(DataError):
        m.load(root / ".tmp-step_00000002", t)


# -- a save whose collective times out: exit code 5, never 1 ---------------------------------------
def _save_times_out(rank, world, tmp):
    import time

    from torch.distributed.checkpoint import FileSystemWriter

    topo = _topology(world)
    a = trainer(topo, "fsdp2", seed=0)
    m = _manager(tmp, "dcp", rank, world)
    train(a, 1, m)
    if rank == 1:  # a rank hung in its write: rank 0 waits for its result past parallel.timeout_s
        original = FileSystemWriter.write_data

        def slow(self, plan, planner):
            time.sleep(8)
            return original(self, plan, planner)

        FileSystemWriter.write_data = slow
    try:
        m.save(a, {})
        outcome = "saved"
    except Exception as e:  # noqa: BLE001  (recorded for the test to check)
        outcome = f"{type(e).__name__}|{getattr(e, 'exit_code', None)}|{e}"
    (tmp / f"rank{rank}.txt").write_text(outcome)


def test_a_save_whose_collective_times_out_exits_5(tmp_path):
    spawn(_save_times_out, 2, tmp_path, timeout_s=3)
    kind, code, message = (tmp_path / "rank0.txt").read_text().split("|", 2)
    assert kind == "CheckpointSaveCommError" and code == "5", message
    assert message.startswith("saving checkpoint step_00000001 failed: a peer rank died or a collective timed out (")
    assert message.endswith("; the previous checkpoint is intact") and "\n" not in message
    assert not (tmp_path / "checkpoints" / "step_00000001").exists()


# -- verification is shared by the ranks and agreed on ------------------------------------------------
def _verify_together(rank, world, tmp):
    import torch.distributed as dist

    from framework.checkpoint import manifest
    from framework.errors import DataError

    manifest.CHUNK = 4096  # many chunks per file: each rank hashes every other one
    topo = _topology(world)
    a = trainer(topo, "fsdp2", seed=0)
    m = _manager(tmp, "dcp", rank, world)
    train(a, 1, m)
    path = m.save(a, {})
    man = json.loads((path / "manifest.json").read_text())
    items = [(n, i) for n, e in sorted(man["files"].items()) for i in range(len(e["chunks"]))]
    k = next(k for k, (n, _) in enumerate(items) if k % world == 1 and n.endswith(".distcp"))
    name, chunk = items[k]  # a chunk only rank 1 hashes
    if rank == 0:
        f = path / name
        blob = bytearray(f.read_bytes())
        blob[chunk * 4096 + 7] ^= 1
        f.write_bytes(bytes(blob))
    dist.barrier()
    try:
        m.load(path, trainer(topo, "fsdp2", seed=1))
        outcome = "loaded"
    except DataError as e:
        outcome = str(e)
    (tmp / f"rank{rank}.txt").write_text(outcome)


def test_ranks_share_the_verification_and_agree(tmp_path):
    spawn(_verify_together, 2, tmp_path)
    zero, one = (tmp_path / "rank0.txt").read_text(), (tmp_path / "rank1.txt").read_text()
    assert zero == one and "does not match its checksum (bytes " in zero, (zero, one)
