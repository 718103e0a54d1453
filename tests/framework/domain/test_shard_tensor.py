"""split_extents and ShardTensor (framework/domain/shard_tensor.py) on real gloo ranks."""

from __future__ import annotations

import pytest
import torch

from framework.domain.shard_tensor import ShardSpec, ShardTensor, split_extents
from framework.errors import ConfigError
from tests.framework.domain.helpers import band, for_each_group
from tests.multiproc import spawn

pytestmark = pytest.mark.timeout(300)


# ------------------------------------------------------------------ split_extents

@pytest.mark.parametrize("rows,parts,multiple,expected", [
    (16, 2, 1, [8, 8]),
    (16, 4, 1, [4, 4, 4, 4]),
    (10, 4, 1, [3, 3, 2, 2]),  # uneven: the first ranks take the remainder
    (7, 7, 1, [1] * 7),
    (64, 4, 16, [16, 16, 16, 16]),
    (48, 2, 16, [32, 16]),
    (80, 3, 16, [32, 32, 16]),
    (20, 4, 4, [8, 4, 4, 4]),
    (512, 2, 16, [256, 256]),
    (16, 1, 16, [16]),
])
def test_split_extents(rows, parts, multiple, expected):
    assert split_extents(rows, parts, multiple) == expected


def test_split_extents_are_multiples_as_even_as_possible():
    for multiple in (1, 2, 4, 8, 16):
        for units in range(1, 13):
            rows = units * multiple
            for parts in range(1, units + 1):
                ext = split_extents(rows, parts, multiple)
                assert len(ext) == parts and sum(ext) == rows
                assert all(e > 0 and e % multiple == 0 for e in ext)
                assert max(ext) - min(ext) <= multiple  # as even as the multiple allows
                assert ext == sorted(ext, reverse=True)


def test_rows_not_a_multiple_of_the_downsampling_name_the_numbers():
    with pytest.raises(ConfigError, match=r"data\.grid: 50 rows are not a multiple of 16"):
        split_extents(50, 2, 16)


def test_too_many_ranks_name_the_numbers():
    with pytest.raises(ConfigError, match=r"parallel\.domain: 32 rows cannot be split over 3 domain ranks in "
                                          r"multiples of 16 \(at most 2 ranks\)"):
        split_extents(32, 3, 16)
    with pytest.raises(ConfigError, match=r"5 rows cannot be split over 8 domain ranks .*at most 5"):
        split_extents(5, 8)


# ------------------------------------------------------------------ ShardTensor on ranks

def _check_shard_tensor(group, world, rank):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    where = f"{world} ranks, rank {rank}"
    full = torch.randn(2, 3, 10, 5, generator=torch.Generator().manual_seed(0))
    uneven = {2: [7, 3], 4: [4, 1, 2, 3]}[world]

    # scatter -> full_tensor, default (split_extents) and explicit uneven extents, rows and cols
    for extents, dim, t in [(None, 2, full), (uneven, 2, full), (None, 3, full.transpose(2, 3).contiguous())]:
        st = ShardTensor.scatter(t, group, dim=dim, extents=extents)
        want = extents or split_extents(t.shape[dim], world)
        assert st.spec == ShardSpec("domain", dim, tuple(t.shape), tuple(want)), (where, st.spec)
        assert st.shape == t.shape and st.rank == rank, where
        assert torch.equal(st.local, band(t, want, rank, dim=dim)), where
        assert torch.equal(st.full_tensor(), t), (where, extents, dim)

    # from_local infers every rank's extent
    local = band(full, uneven, rank).clone()
    st = ShardTensor.from_local(local, group)
    assert st.spec.extents == tuple(uneven) and st.spec.global_shape == tuple(full.shape), (where, st.spec)
    assert st.spec.offset(rank) == sum(uneven[:rank])
    assert torch.equal(st.full_tensor(), full), where
    with pytest.raises(ValueError, match="local tensor has"):
        ShardTensor(local[:, :, :0], st.spec, group)

    # full_tensor is differentiable: the adjoint of the gather. Each rank r adds its own loss
    # sum(w_r * full); the objective is their sum, so this rank's rows get sum_r w_r[rows].
    weights = [torch.randn(full.shape, generator=torch.Generator().manual_seed(10 + r)) for r in range(world)]
    for losses in ("every rank", "rank 0 only"):
        x = band(full, uneven, rank).clone().requires_grad_()
        gathered = ShardTensor.from_local(x, group).full_tensor()
        assert torch.equal(gathered.detach(), full)
        scale = 1.0 if losses == "every rank" or rank == 0 else 0.0
        (gathered * weights[rank] * scale).sum().backward()
        want = sum(weights) if losses == "every rank" else weights[0]
        torch.testing.assert_close(x.grad, band(want, uneven, rank), rtol=1e-12, atol=1e-12,
                                   msg=lambda m: f"{where}, loss on {losses}: {m}")

    # to_dtensor / from_dtensor round trip where the extents follow torch.chunk's split
    mesh = DeviceMesh.from_group(group, "cpu", mesh_dim_names=("domain",))
    chunked = {2: [5, 5], 4: [3, 3, 3, 1]}[world]
    st = ShardTensor.scatter(full, group, extents=chunked)
    dt = st.to_dtensor(mesh)
    assert isinstance(dt, DTensor) and dt.placements == (Shard(2),) and dt.shape == full.shape
    assert torch.equal(dt.to_local(), st.local)
    assert torch.equal(dt.full_tensor(), full), where
    back = ShardTensor.from_dtensor(dt)
    assert back.spec == st.spec and torch.equal(back.local, st.local), where
    assert torch.equal(back.full_tensor(), full), where
    theirs = ShardTensor.from_dtensor(distribute_tensor(full, mesh, [Shard(2)]))  # one torch made itself
    assert theirs.spec.extents == tuple(chunked) and torch.equal(theirs.full_tensor(), full), where

    # extents DTensor cannot express: a clear error
    bad = ShardTensor.scatter(full, group, extents=uneven)
    with pytest.raises(ValueError, match=rf"extents \({', '.join(map(str, uneven))}\) do not follow DTensor's "
                                         rf"even split \({', '.join(map(str, chunked))}\)"):
        bad.to_dtensor(mesh)
    with pytest.raises(ValueError, match="is not a Shard"):
        ShardTensor.from_dtensor(distribute_tensor(full, mesh, [Replicate()]))


def _ranks(rank, world):
    for_each_group(rank, _check_shard_tensor)


def test_shard_tensor_on_2_and_4_ranks():
    spawn(_ranks, 4)


def test_shard_tensor_without_a_group_is_the_whole_tensor():
    full = torch.randn(1, 2, 6, 4)
    st = ShardTensor.scatter(full, None)
    assert st.spec.extents == (6,) and st.full_tensor() is st.local and torch.equal(st.local, full)
    assert ShardTensor.from_local(full, None).spec.global_shape == (1, 2, 6, 4)
