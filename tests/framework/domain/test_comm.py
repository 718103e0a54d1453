"""Differentiable collectives of framework/domain/comm.py on real gloo ranks.

halo_exchange's forward equals slicing the zero-padded full tensor and its backward
equals the single-device gradient (torch.autograd on the full tensor); all_reduce_sum
and gather_rows are checked against their exact adjoints.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from framework.domain.comm import DomainGroup, all_reduce_sum, gather_rows, halo_exchange, halo_rows, split_extents
from framework.errors import ConfigError
from tests.framework.domain.helpers import band, for_each_group
from tests.multiproc import spawn

pytestmark = pytest.mark.timeout(300)

EXACT = dict(rtol=1e-12, atol=1e-12)
HALO_SPLITS = {
    2: {"even": [8, 8], "uneven": [11, 5], "tight": [2, 2]},
    4: {"even": [4, 4, 4, 4], "uneven": [5, 2, 3, 6], "tight": [2, 2, 2, 2]},
}


def _check_halo(group, world, rank):
    for _kind, extents in HALO_SPLITS[world].items():
        dg = DomainGroup(group, extents)
        for halo in (1, 2):
            for dim in (2, 3):
                where = f"{world} ranks {extents}, rank {rank}, halo {halo}, dim {dim}"
                shape = [2, 3, 4, 5]
                shape[dim] = sum(extents)
                full = torch.randn(shape, generator=torch.Generator().manual_seed(halo))
                pad = (0, 0, halo, halo) if dim == 2 else (halo, halo)
                # the reference: every rank's window of the zero-padded tensor, one loss for all
                xf = full.clone().requires_grad_()
                padded = F.pad(xf, pad)
                outs = [padded.narrow(dim, sum(extents[:r]), extents[r] + 2 * halo) for r in range(world)]
                grads = [
                    torch.randn(o.shape, generator=torch.Generator().manual_seed(100 + r)) for r, o in enumerate(outs)
                ]
                sum((o * g).sum() for o, g in zip(outs, grads)).backward()

                xl = band(full, extents, rank, dim=dim).clone().requires_grad_()
                y = halo_exchange(xl, halo, dg, dim=dim)
                assert torch.equal(y, outs[rank].detach()), f"{where}: forward"
                (y * grads[rank]).sum().backward()
                torch.testing.assert_close(
                    xl.grad, band(xf.grad, extents, rank, dim=dim), **EXACT, msg=lambda m: f"{where}: backward: {m}"
                )

    # halo 0 is the identity; a band thinner than the halo is a clear error on every rank
    x = torch.randn(1, 1, 3, 2)
    assert halo_exchange(x, 0, DomainGroup(group, [3] * world)) is x
    with pytest.raises(
        ValueError,
        match=r"a domain rank holds 1 rows but the layer needs a halo of 2: use "
        "fewer domain ranks or a larger grid",
    ):
        halo_exchange(torch.randn(1, 1, 1, 2), 2, DomainGroup(group, [1] * world))


def _check_reductions(group, world, rank):
    dg = DomainGroup(group, [4] * world)
    gen = lambda seed, *shape: torch.randn(*shape, generator=torch.Generator().manual_seed(seed))  # noqa: E731
    xs = [gen(r, 2, 3) for r in range(world)]
    gs = [gen(50 + r, 2, 3) for r in range(world)]
    x = xs[rank].clone().requires_grad_()
    y = all_reduce_sum(x, dg)
    torch.testing.assert_close(y, sum(xs), **EXACT)
    (y * gs[rank]).sum().backward()
    torch.testing.assert_close(x.grad, sum(gs), **EXACT)  # d/dx_r sum_s <G_s, sum_t x_t> = sum_s G_s

    # gather_rows at a coarser level than the extents: rows scale like the local ones
    extents = {2: [12, 4], 4: [8, 4, 4, 4]}[world]
    dg = DomainGroup(group, extents)
    coarse = [e // 4 for e in extents]
    assert dg.extents_like(coarse[rank]) == coarse and dg.offset_like(coarse[rank]) == sum(coarse[:rank])
    full = gen(7, 2, 3, sum(coarse), 5)
    x = band(full, coarse, rank).clone().requires_grad_()
    y = gather_rows(x, dg)
    assert torch.equal(y, full), f"{world} ranks, rank {rank}: gather_rows forward"
    gs = [gen(70 + r, *full.shape) for r in range(world)]
    (y * gs[rank]).sum().backward()
    torch.testing.assert_close(x.grad, band(sum(gs), coarse, rank), **EXACT)
    # columns too
    full = gen(8, 2, 3, 5, sum(coarse))
    x = band(full, coarse, rank, dim=3).clone()
    assert torch.equal(gather_rows(x, dg, dim=3), full)


def _check_traced(group, world, rank):
    """Under torch.compile (one graph, no break) the functional collectives give the eager ones'
    values and gradients, bit for bit: uneven bands, a band thinner than the widest halo, halos
    of other widths per rank (as the DiT's clamped windows ask), along rows and columns."""
    torch._dynamo.reset()
    extents = {2: [7, 2], 4: [5, 2, 3, 6]}[world]
    plans = [((2, 2),) * world, tuple((min(r, 1) * (1 + r % 2), 2 if r < world - 1 else 0) for r in range(world))]
    dg = DomainGroup(group, extents)
    gen = lambda seed, *shape: torch.randn(*shape, generator=torch.Generator().manual_seed(seed))  # noqa: E731
    cases = [(lambda x, p=p, d=d: halo_rows(x, p, dg, dim=d), d) for p in plans for d in (2, 3)]
    cases += [(lambda x: gather_rows(x, dg), 2), (lambda x: all_reduce_sum(x.sum(2), dg), 2)]
    for i, (fn, dim) in enumerate(cases):
        shape = [2, 3, 4, 5]
        shape[dim] = sum(extents)
        x0 = band(gen(i, *shape), extents, rank, dim=dim)
        results = []
        for run in (fn, torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=False)):
            x = x0.clone().requires_grad_()
            y = run(x)
            (y * gen(100 + i + rank, *y.shape)).sum().backward()
            results.append((y.detach(), x.grad))
        (ye, ge), (yc, gc) = results
        assert torch.equal(ye, yc) and torch.equal(ge, gc), f"{world} ranks, rank {rank}, case {i}"


def _ranks(rank, world):
    for_each_group(rank, _check_halo)
    for_each_group(rank, _check_reductions)
    for_each_group(rank, _check_traced)


def test_collectives_on_2_and_4_ranks():
    spawn(_ranks, 4)


def test_one_rank_domain_pads_with_zeros_and_reductions_are_identities():
    dg = DomainGroup(None, [6])
    assert dg.size == 1 and dg.rank == 0 and dg.global_ranks == [0]
    x = torch.randn(2, 3, 6, 4)
    y = halo_exchange(x, 2, dg)
    assert torch.equal(y, F.pad(x, (0, 0, 2, 2)))
    assert all_reduce_sum(x, dg) is x and gather_rows(x, dg) is x


def test_a_dry_group_plays_one_rank_with_the_right_shapes_and_records_its_halos():
    """What framework.plan traces with: no process group, no data moved, shapes as on rank 1."""
    dg = DomainGroup.dry_run([6, 4, 4], rank=1)
    assert dg.dry and dg.rank == 1 and dg.extents_like(2) == [3, 2, 2]
    x = torch.randn(2, 3, 4, 5, requires_grad=True)
    y = halo_exchange(x, 1, dg)
    assert y.shape == (2, 3, 6, 5) and torch.equal(y[:, :, 1:5], x) and not y[:, :, [0, 5]].any()
    assert dg.halos == [(((1, 1),) * 3, 4)]
    assert torch.equal(all_reduce_sum(x, dg), x)
    assert torch.equal(gather_rows(x, dg), F.pad(x, (0, 0, 6, 4)))  # own rows in place, zeros elsewhere
    y.sum().backward()  # the backward sends nothing either
    assert torch.equal(x.grad, torch.ones_like(x))


def test_extents_at_coarser_levels():
    dg = DomainGroup(None, [32, 16, 16])
    for rank, want in enumerate(([8, 4, 4], [8, 4, 4], [8, 4, 4])):
        dg.rank = rank
        local = dg.extents[rank] // 4
        assert dg.extents_like(local) == want and dg.offset_like(local) == sum(want[:rank])


# ------------------------------------------------------------------ split_extents


@pytest.mark.parametrize(
    "rows,parts,multiple,expected",
    [
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
    ],
)
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
    with pytest.raises(
        ConfigError,
        match=r"parallel\.domain: 32 rows cannot be split over 3 domain ranks in "
        r"multiples of 16 \(at most 2 ranks\)",
    ):
        split_extents(32, 3, 16)
    with pytest.raises(ConfigError, match=r"5 rows cannot be split over 8 domain ranks .*at most 5"):
        split_extents(5, 8)
