"""Shared helpers of the domain-parallel tests: run a layer whole and split, compare.

Everything here runs inside ranks started by ``tests.multiproc.spawn`` (or on one
process where no communication is needed).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from framework.domain.comm import DomainGroup

TOL = dict(rtol=1e-6, atol=1e-6)  # float64 everywhere: anything above this is a real mismatch


def domain_groups(rank: int) -> list:
    """On 4 spawned ranks: the group of all 4, then this rank's pair ([0, 1] or [2, 3]).

    One spawn checks 4-rank and 2-rank domains (the pair [2, 3] also checks that group
    ranks are mapped to global ranks). Sets the rank up for float64 checks, with one
    thread per rank since 4 ranks share 2 cores.
    """
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    four = dist.new_group([0, 1, 2, 3])
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    return [four, pairs[rank // 2]]


def for_each_group(rank: int, check) -> None:
    """``check(group, size, rank_in_group)`` on 4 ranks, then on 2 (both pairs at once)."""
    for group in domain_groups(rank):
        check(group, dist.get_world_size(group), dist.get_rank(group))
    dist.barrier()


def band(t: torch.Tensor, extents, rank: int, scale: float = 1, dim: int = 2) -> torch.Tensor:
    """Rank ``rank``'s rows of ``t`` when ``extents`` are the rows at the input resolution and
    ``t`` is at ``scale`` times that resolution."""
    start = int(sum(extents[:rank]) * scale)
    return t.narrow(dim, start, int(extents[rank] * scale))


def randomize(module: torch.nn.Module, seed: int, std: float = 0.3) -> torch.nn.Module:
    """Non-trivial parameters (EDM zero-inits some layers, which would hide gradient errors)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * std)
    return module


def summed_grad(p: torch.Tensor, dg: DomainGroup) -> torch.Tensor:
    g = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
    dist.all_reduce(g, group=dg.group)
    return g


def compare_split(
    name: str,
    module: torch.nn.Module,
    dg: DomainGroup,
    x: torch.Tensor,
    *,
    split_fn,
    scale: float = 1,
    args=(),
    kwargs=None,
    seed: int = 0,
    tol=TOL,
) -> None:
    """``module`` on the whole ``x`` against ``split_fn(deepcopy(module), dg)`` on this rank's rows.

    Checks the output rows, the input gradient rows, the gradients of replicated tensor
    arguments (summed over ranks) and every parameter gradient (summed over ranks), for
    the loss ``sum(out * G)`` with a fixed random ``G``. ``scale``: output rows per input row.
    """
    kwargs = kwargs or {}
    ext, r = dg.extents, dg.rank
    where = f"{name}, extents {ext}, rank {r}"

    ref = copy.deepcopy(module)
    xf = x.detach().clone().requires_grad_()
    ref_args = [
        a.detach().clone().requires_grad_() if torch.is_tensor(a) and a.is_floating_point() else a for a in args
    ]
    out = ref(xf, *ref_args, **kwargs)
    gout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=out.dtype)
    (out * gout).sum().backward()

    dom = split_fn(copy.deepcopy(module), dg)
    xl = band(x, ext, r).detach().clone().requires_grad_()
    dom_args = [
        a.detach().clone().requires_grad_() if torch.is_tensor(a) and a.is_floating_point() else a for a in args
    ]
    yl = dom(xl, *dom_args, **kwargs)
    torch.testing.assert_close(yl, band(out, ext, r, scale), **tol, msg=lambda m: f"{where}: output: {m}")
    (yl * band(gout, ext, r, scale)).sum().backward()
    torch.testing.assert_close(xl.grad, band(xf.grad, ext, r), **tol, msg=lambda m: f"{where}: input gradient: {m}")
    for i, (a, b) in enumerate(zip(dom_args, ref_args)):
        if torch.is_tensor(a) and a.requires_grad:
            torch.testing.assert_close(
                summed_grad(a, dg), b.grad, **tol, msg=lambda m: f"{where}: gradient of argument {i}: {m}"
            )
    ref_params = dict(ref.named_parameters())
    dom_params = dict(dom.named_parameters())
    assert dom_params.keys() == ref_params.keys(), where
    for pname, p in dom_params.items():
        want = ref_params[pname].grad
        want = torch.zeros_like(p) if want is None else want
        torch.testing.assert_close(
            summed_grad(p, dg), want, **tol, msg=lambda m: f"{where}: gradient of {pname} (summed over ranks): {m}"
        )
