"""Differentiable collectives over the domain group: halo exchange, sums, row gathers.

Each forward op has the exact adjoint as its backward, so gradients of a model split
over rows equal those of the whole model.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class DomainGroup:
    """The ranks that split one sample's rows, and every rank's rows at full resolution."""

    def __init__(self, group, extents: list[int]):
        self.group = group
        self.size = len(extents)
        self.rank = dist.get_rank(group) if group is not None else 0
        self.extents = list(extents)
        self.global_ranks = [dist.get_global_rank(group, r) for r in range(self.size)] if group is not None \
            else [0]

    def extents_like(self, local_rows: int) -> list[int]:
        """Every rank's rows at the resolution where this rank holds ``local_rows``."""
        own = self.extents[self.rank]
        return [e * local_rows // own for e in self.extents]

    def offset_like(self, local_rows: int) -> int:
        return sum(self.extents_like(local_rows)[: self.rank])


def _p2p(sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]], dg: DomainGroup):
    ops = [dist.P2POp(dist.isend, t.contiguous(), dg.global_ranks[p], dg.group) for t, p in sends]
    ops += [dist.P2POp(dist.irecv, t, dg.global_ranks[p], dg.group) for t, p in recvs]
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()


class _Halo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, halo: int, dg: DomainGroup, dim: int):
        ctx.halo, ctx.dg, ctx.dim = halo, dg, dim
        n = x.shape[dim]
        prev, nxt = dg.rank - 1, dg.rank + 1
        top_shape = list(x.shape)
        top_shape[dim] = halo
        top = x.new_zeros(top_shape)  # the global boundary: zero rows, as zero padding
        bottom = x.new_zeros(top_shape)
        sends, recvs = [], []
        if prev >= 0:
            sends.append((x.narrow(dim, 0, halo), prev))
            recvs.append((top, prev))
        if nxt < dg.size:
            sends.append((x.narrow(dim, n - halo, halo), nxt))
            recvs.append((bottom, nxt))
        _p2p(sends, recvs, dg)
        return torch.cat([top, x, bottom], dim=dim)

    @staticmethod
    def backward(ctx, g):
        h, dg, dim = ctx.halo, ctx.dg, ctx.dim
        n = g.shape[dim] - 2 * h
        grad = g.narrow(dim, h, n).clone()
        prev, nxt = dg.rank - 1, dg.rank + 1
        from_prev = torch.zeros_like(g.narrow(dim, 0, h))
        from_next = torch.zeros_like(from_prev)
        sends, recvs = [], []
        if prev >= 0:  # my top halo rows were prev's last rows: their gradient goes back
            sends.append((g.narrow(dim, 0, h), prev))
            recvs.append((from_prev, prev))
        if nxt < dg.size:
            sends.append((g.narrow(dim, h + n, h), nxt))
            recvs.append((from_next, nxt))
        _p2p(sends, recvs, dg)
        if prev >= 0:
            grad.narrow(dim, 0, h).add_(from_prev)
        if nxt < dg.size:
            grad.narrow(dim, n - h, h).add_(from_next)
        return grad, None, None, None


def halo_exchange(x: torch.Tensor, halo: int, dg: DomainGroup, dim: int = 2) -> torch.Tensor:
    """``x`` with ``halo`` neighbour rows (zeros at the global edges) on both sides of ``dim``."""
    if halo == 0:
        return x
    if dg.size == 1:  # the whole domain: only the zero edges
        edge = x.new_zeros(*x.shape[:dim], halo, *x.shape[dim + 1:])
        return torch.cat([edge, x, edge], dim)
    thinnest = min(dg.extents_like(x.shape[dim])) if dim == 2 else x.shape[dim]
    if thinnest < halo:  # checked on every rank alike, so all of them stop, none waits
        raise ValueError(f"a domain rank holds {thinnest} rows but the layer needs a halo of {halo}: "
                         "use fewer domain ranks or a larger grid")
    return _Halo.apply(x, halo, dg, dim)


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dg: DomainGroup):
        ctx.dg = dg
        out = x.clone()
        dist.all_reduce(out, group=dg.group)
        return out

    @staticmethod
    def backward(ctx, g):
        # every rank's output is the sum: d(sum)/dx_r collects every rank's gradient
        g = g.clone()
        dist.all_reduce(g, group=ctx.dg.group)
        return g, None


def all_reduce_sum(x: torch.Tensor, dg: DomainGroup) -> torch.Tensor:
    return x if dg.size == 1 else _AllReduceSum.apply(x, dg)


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dg: DomainGroup, dim: int):
        extents = dg.extents_like(x.shape[dim])
        ctx.dg, ctx.dim, ctx.extents = dg, dim, extents
        biggest = max(extents)
        pad_shape = list(x.shape)
        pad_shape[dim] = biggest - x.shape[dim]
        padded = torch.cat([x, x.new_zeros(pad_shape)], dim) if pad_shape[dim] else x.contiguous()
        parts = [torch.empty_like(padded) for _ in range(dg.size)]
        dist.all_gather(parts, padded, group=dg.group)  # gloo needs equal sizes: pad, then trim
        return torch.cat([p.narrow(dim, 0, e) for p, e in zip(parts, extents)], dim)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.dg.group)  # every rank used every rank's rows
        start = sum(ctx.extents[: ctx.dg.rank])
        return g.narrow(ctx.dim, start, ctx.extents[ctx.dg.rank]).contiguous(), None, None


def gather_rows(x: torch.Tensor, dg: DomainGroup, dim: int = 2) -> torch.Tensor:
    """The full tensor along ``dim`` from every rank's rows (uneven extents allowed)."""
    return x if dg.size == 1 else _GatherRows.apply(x, dg, dim)

