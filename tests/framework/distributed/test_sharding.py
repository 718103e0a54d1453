"""Sharding policies on real gloo ranks reproduce the single-device forward and gradients."""

import time

import pytest
import torch

from tests.multiproc import spawn

pytestmark = pytest.mark.timeout(300)

BATCH = 4


def _model():
    from recipes.stormcast.songunet import SongUNet

    torch.manual_seed(0)
    m = SongUNet(
        (16, 16),
        5,
        3,
        model_channels=8,
        channel_mult=[1, 2],
        num_blocks=1,
        attn_resolutions=[8],
        dropout=0.0,
        embedding_type="zero",
    )
    for p in m.parameters():  # the zero-initialised output conv would hide gradient errors
        torch.nn.init.normal_(p, std=0.05)
    return m


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, 5, 16, 16, generator=g), torch.randn(BATCH, 3, 16, 16, generator=g)


def _reference():
    m = _model()
    x, y = _data()
    out = m(x)
    torch.nn.functional.mse_loss(out, y).backward()
    norm = torch.nn.utils.clip_grad_norm_(m.parameters(), 1e9)
    return out.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}, float(norm)


def _check(rank, world, sharding, dp_replicate, channels_last):
    from framework.config.schema import ParallelConfig, PrecisionConfig, ShardingConfig
    from framework.distributed import mesh, precision
    from framework.distributed import sharding as policies

    ref_out, ref_grads, ref_norm = _reference()
    degrees = mesh.resolve(ParallelConfig(dp_replicate=dp_replicate), world)
    topo = mesh.build(degrees, "cpu")
    model = _model()
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
        assert not all(p.is_contiguous() for p in model.parameters())
    prec = precision.build(PrecisionConfig(name="fp32"), torch.device("cpu"))
    sharded = policies.__dict__[sharding](
        model, ShardingConfig(name=sharding), topology=topo, precision=prec, device=torch.device("cpu")
    )
    if sharding == "fsdp2":
        assert any("block" in u for u in sharded.units) and sharded.units[-1].startswith("<root>")
    x, y = _data()
    per = BATCH // topo.dp_size
    sl = slice(topo.dp_rank * per, (topo.dp_rank + 1) * per)
    xs = x[sl].contiguous(memory_format=torch.channels_last) if channels_last else x[sl]
    out = sharded.model(xs)
    torch.testing.assert_close(out, ref_out[sl], rtol=1e-5, atol=1e-6)
    torch.nn.functional.mse_loss(out, y[sl]).backward()
    norm = torch.nn.utils.clip_grad_norm_(sharded.model.parameters(), 1e9)
    norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    assert abs(norm - ref_norm) <= 1e-5 * ref_norm
    names = {n.replace("module.", "").replace("_orig_mod.", ""): p for n, p in sharded.model.named_parameters()}
    assert set(names) == set(ref_grads)
    for n, p in names.items():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        torch.testing.assert_close(g, ref_grads[n], rtol=1e-4, atol=1e-6, msg=f"gradient of {n}")


@pytest.mark.parametrize(
    "sharding,world,dp_replicate,channels_last",
    [
        ("fsdp2", 2, 1, False),
        ("fsdp2", 2, 1, True),  # channels_last weights are made contiguous before fully_shard
        ("ddp", 2, 1, False),
        ("fsdp2", 4, 2, True),  # HSDP: 2 replicas x 2 shards
    ],
)
def test_policy_matches_single_device(sharding, world, dp_replicate, channels_last):
    spawn(_check, world, sharding, dp_replicate, channels_last)


def _hang(rank, world, timeout_s):
    import torch.distributed as dist

    from framework.distributed.env import DistEnv
    from framework.runtime import _dist_message, is_comm_failure

    if rank == 1:
        time.sleep(timeout_s + 5)  # a hung rank: never joins the collective
        return
    t0 = time.monotonic()
    with pytest.raises((dist.DistError, RuntimeError)) as info:
        dist.all_reduce(torch.ones(1))
    assert time.monotonic() - t0 < timeout_s + 4
    assert is_comm_failure(info.value)
    msg = _dist_message(info.value, DistEnv(0, 2, 0, "torchrun"), timeout_s)
    assert "timed out after 3 s (parallel.timeout_s)" in msg, msg


def test_hung_rank_makes_others_fail_with_a_timeout_not_hang():
    spawn(_hang, 2, 3, timeout_s=3)


def test_units_default_to_repeated_blocks_and_can_be_named():
    from framework.distributed.sharding import find_units
    from framework.errors import ConfigError

    m = _model()
    units = find_units(m, [])
    assert units and all(type(u).__name__ == "UNetBlock" for _, u in units)
    assert len(units) == sum(1 for x in m.modules() if type(x).__name__ == "UNetBlock")
    with pytest.raises(ConfigError, match=r"sharding.units: no module of class \['Nope'\]"):
        find_units(m, ["Nope"])
