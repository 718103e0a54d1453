"""dcp_async in one process: the loop blocks less than a synchronous save, and never for a
mutation of what is being written."""

import time
from types import SimpleNamespace

import pytest
import torch

from framework.checkpoint.dcp import DcpBackend
from framework.checkpoint.dcp_async import AsyncDcpBackend
from framework.checkpoint.manager import CheckpointManager
from framework.config.schema import CheckpointConfig
from framework.distributed.env import DistEnv
from framework.distributed.precision import Precision

pytestmark = [pytest.mark.timeout(300), pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

WIDTH, DEPTH = 1536, 8  # 19 M parameters: 75 MB of weights, 226 MB with Adam's moments


def big_trainer(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return SimpleNamespace(
        model=model,
        optimizer=opt,
        scheduler=sched,
        precision=Precision("fp32", None, False, None),
        step=0,
        run_id="big",
    )


def step(t, m):
    """One training step with the manager's hook; returns the seconds spent in the hook."""
    loss = t.model(torch.randn(32, WIDTH)).pow(2).mean()
    loss.backward()
    t0 = time.perf_counter()
    m.before_optimizer_step()
    waited = time.perf_counter() - t0
    t.optimizer.step()
    t.optimizer.zero_grad(set_to_none=True)
    t.scheduler.step()
    t.step += 1
    return waited


def test_async_blocks_less_than_sync_and_saves_the_state_of_its_step(tmp_path):
    torch.set_num_threads(1)  # leave the second core to the writer, as a GPU job leaves its CPUs
    t = big_trainer()
    sync = CheckpointManager(CheckpointConfig(name="dcp"), DcpBackend(), tmp_path / "sync", DistEnv())
    asyn = CheckpointManager(CheckpointConfig(name="dcp_async"), AsyncDcpBackend(), tmp_path / "async", DistEnv())
    step(t, sync)
    # warm-up saves (first-time allocations of the staging buffers, imports), then measure
    sync.save(t, {})
    asyn.save(t, {})
    asyn.finish()
    step(t, asyn)
    t0 = time.perf_counter()
    sync.save(t, {})
    sync_s = time.perf_counter() - t0

    snapshot = {k: v.clone() for k, v in t.model.state_dict().items()}
    moments = [s["exp_avg"].clone() for s in t.optimizer.state.values()]
    t0 = time.perf_counter()
    path = asyn.save(t, {})
    blocked = time.perf_counter() - t0
    waits = [step(t, asyn) for _ in range(3)]  # training goes on while the save is written
    asyn.finish()
    blocked += sum(waits)
    print(f"sync save {sync_s:.3f} s, async blocked {blocked:.3f} s (save call + waits {waits})")
    assert blocked < 0.5 * sync_s, (blocked, sync_s)

    # What was written is the state at the save, not the state after the steps that followed.
    fresh = big_trainer(seed=1)
    asyn.load(path, fresh)
    assert fresh.step == 2
    for k, v in fresh.model.state_dict().items():
        assert torch.equal(v, snapshot[k]), k
    assert len(fresh.optimizer.state) == len(moments) > 0  # zip below would check nothing otherwise
    for s, expected in zip(fresh.optimizer.state.values(), moments):
        assert torch.equal(s["exp_avg"], expected)
    assert not torch.equal(t.model[0].weight, snapshot["0.weight"])  # training did move on


def test_async_save_at_the_end_is_committed_by_finish(tmp_path):
    t = big_trainer()
    t.model = t.model[:2]
    t.optimizer = torch.optim.Adam(t.model.parameters())
    t.scheduler = torch.optim.lr_scheduler.LambdaLR(t.optimizer, lambda s: 1.0)
    m = CheckpointManager(CheckpointConfig(name="dcp_async"), AsyncDcpBackend(), tmp_path, DistEnv())
    step(t, m)
    path = m.save(t, {})
    assert not path.exists()  # in flight: invisible until written and committed
    m.finish()
    assert (path / "meta.json").is_file() and m.latest() == path
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == [path.name]
