"""The domain group and its differentiable collectives: halo exchange, sums, row gathers.

Each forward op has the exact adjoint as its backward, so gradients of a model split
over rows equal those of the whole model. At the boundaries nothing more is needed: each
rank reads its own rows (``DomainGroup.extents``, ``split_extents``), losses and metrics
are local sums, and ``gather_rows`` gives the whole field where one is wanted (plots).

Two implementations of each collective, with the same values: eager steps use torch.distributed's
p2p and in-place collectives; a step under torch.compile (``trainer.compile``) uses the
functional collectives (``compat.funcol``: a halo exchange is two cyclic permutations of
fixed-size row slabs, sums are functional all-reduces), which dynamo traces without a graph
break and inductor can overlap with compute.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from framework import compat
from framework.errors import ConfigError


def split_extents(rows: int, parts: int, multiple: int = 1) -> list[int]:
    """Rows per rank, each a multiple of ``multiple`` (the model's total down-sampling),
    as even as that allows; the first ranks take the remainder."""
    if rows % multiple:
        raise ConfigError(f"data.grid: {rows} rows are not a multiple of {multiple}, the model's total down-sampling")
    units = rows // multiple
    if units < parts:
        raise ConfigError(
            f"parallel.domain: {rows} rows cannot be split over {parts} domain ranks in "
            f"multiples of {multiple} (at most {units} ranks)"
        )
    base, extra = divmod(units, parts)
    return [(base + (1 if r < extra else 0)) * multiple for r in range(parts)]


class DomainGroup:
    """The ranks that split one sample's rows, and every rank's rows at full resolution."""

    dry = False  # see ``dry_run``

    def __init__(self, group, extents: list[int]):
        self.group = group
        self.size = len(extents)
        self.rank = dist.get_rank(group) if group is not None else 0
        self.extents = list(extents)
        self.global_ranks = [dist.get_global_rank(group, r) for r in range(self.size)] if group is not None else [0]
        self.halos: list[tuple[tuple, int]] = []  # a dry group's record of its halo exchanges

    @classmethod
    def dry_run(cls, extents: list[int], rank: int = 0) -> DomainGroup:
        """Rank ``rank`` of a group that does not exist: collectives move nothing (received rows
        stay zeros, sums stay local), so one process can trace a rank's step with the right
        shapes (framework.plan). ``halos`` records each halo exchange's plan and row count."""
        dg = cls(None, extents)
        dg.rank, dg.dry, dg.global_ranks = rank, True, list(range(len(extents)))
        return dg

    def extents_like(self, local_rows: int) -> list[int]:
        """Every rank's rows at the resolution where this rank holds ``local_rows``."""
        own = self.extents[self.rank]
        return [e * local_rows // own for e in self.extents]

    def offset_like(self, local_rows: int) -> int:
        return sum(self.extents_like(local_rows)[: self.rank])


def _p2p(sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]], dg: DomainGroup):
    if dg.dry:  # nothing to talk to: what would be received is zeros
        for t, _ in recvs:
            t.zero_()
        return
    ops = [dist.P2POp(dist.isend, t.contiguous(), dg.global_ranks[p], dg.group) for t, p in sends]
    ops += [dist.P2POp(dist.irecv, t, dg.global_ranks[p], dg.group) for t, p in recvs]
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()


def _saved(ctx, g):
    """A halo backward's (plan, group, dim, this rank's top and bottom halo rows, its own rows)."""
    top, bottom = ctx.plan[ctx.dg.rank]
    return ctx.plan, ctx.dg, ctx.dim, top, bottom, g.shape[ctx.dim] - top - bottom


class _Halo(torch.autograd.Function):
    """``x`` with ``plan[rank][0]`` rows of the previous band above it and ``plan[rank][1]`` rows of
    the next band below it, along ``dim``; rows wanted beyond a global edge are zeros (zero
    padding). The backward returns the halo rows' gradients to their owners."""

    @staticmethod
    def forward(ctx, x, plan, dg: DomainGroup, dim: int):
        ctx.plan, ctx.dg, ctx.dim = plan, dg, dim
        r, n = dg.rank, x.shape[dim]
        top, bottom = plan[r]
        rows = lambda k: x.new_zeros(*x.shape[:dim], k, *x.shape[dim + 1 :])  # noqa: E731
        parts, sends, recvs = [x], [], []
        if top:
            parts.insert(0, rows(top))
            if r > 0:
                recvs.append((parts[0], r - 1))
        if bottom:
            parts.append(rows(bottom))
            if r + 1 < dg.size:
                recvs.append((parts[-1], r + 1))
        if r > 0 and plan[r - 1][1]:  # the previous band's bottom halo is my first rows
            sends.append((x.narrow(dim, 0, plan[r - 1][1]), r - 1))
        if r + 1 < dg.size and plan[r + 1][0]:  # the next band's top halo is my last rows
            sends.append((x.narrow(dim, n - plan[r + 1][0], plan[r + 1][0]), r + 1))
        _p2p(sends, recvs, dg)
        return torch.cat(parts, dim) if len(parts) > 1 else x.clone()

    @staticmethod
    def backward(ctx, g):
        plan, dg, dim, top, bottom, n = _saved(ctx, g)
        r = dg.rank
        grad = g.narrow(dim, top, n).clone()
        sends, recvs = [], []
        if top and r > 0:
            sends.append((g.narrow(dim, 0, top), r - 1))
        if bottom and r + 1 < dg.size:
            sends.append((g.narrow(dim, top + n, bottom), r + 1))
        from_prev = from_next = None
        if r > 0 and plan[r - 1][1]:
            from_prev = grad.new_empty(*grad.shape[:dim], plan[r - 1][1], *grad.shape[dim + 1 :])
            recvs.append((from_prev, r - 1))
        if r + 1 < dg.size and plan[r + 1][0]:
            from_next = grad.new_empty(*grad.shape[:dim], plan[r + 1][0], *grad.shape[dim + 1 :])
            recvs.append((from_next, r + 1))
        _p2p(sends, recvs, dg)
        if from_prev is not None:
            grad.narrow(dim, 0, from_prev.shape[dim]).add_(from_prev)
        if from_next is not None:
            grad.narrow(dim, n - from_next.shape[dim], from_next.shape[dim]).add_(from_next)
        return grad, None, None, None


def _slab(x: torch.Tensor, dim: int, rows: int, last: bool) -> torch.Tensor:
    """``rows`` rows of ``x`` along ``dim``: its last (or first) ones, zero-padded on the far side
    where ``x`` holds fewer (a thin band sends what it has; its neighbour asks no more of it)."""
    n = x.shape[dim]
    part = x.narrow(dim, n - min(rows, n), min(rows, n)) if last else x.narrow(dim, 0, min(rows, n))
    if n >= rows:
        return part
    pad = x.new_zeros(*x.shape[:dim], rows - n, *x.shape[dim + 1 :])
    return torch.cat([pad, part] if last else [part, pad], dim)


def _neighbours(up: torch.Tensor | None, down: torch.Tensor | None, dg: DomainGroup):
    """One functional all-to-all: ``up`` to the next rank, ``down`` to the previous one (every rank
    passes slabs of the same shapes, or None for nobody). Returns (the previous rank's ``up``, the
    next rank's ``down``), None past a global edge. One collective per exchange: ranks cannot
    pair two of them up out of order, whatever order a compiler gives independent ops."""
    r, last = dg.rank, dg.size - 1
    sent, came, parts = [0] * dg.size, [0] * dg.size, []
    if down is not None and r > 0:  # the input is ordered by destination rank
        sent[r - 1] = down.numel()
        parts.append(down.contiguous().flatten())
    if up is not None and r < last:
        sent[r + 1] = up.numel()
        parts.append(up.contiguous().flatten())
    if up is not None and r > 0:  # the output by source rank
        came[r - 1] = up.numel()
    if down is not None and r < last:
        came[r + 1] = down.numel()
    like = up if up is not None else down
    assert like is not None
    got = compat.funcol().all_to_all_single(torch.cat(parts) if parts else like.new_zeros(0), came, sent, dg.group)
    start = came[r - 1] if r > 0 else 0
    from_prev = got.narrow(0, 0, start).view(up.shape) if up is not None and r > 0 else None
    from_next = got.narrow(0, start, came[r + 1]).view(down.shape) if down is not None and r < last else None
    return from_prev, from_next


class _TracedHalo(torch.autograd.Function):
    """``_Halo`` in one functional all-to-all each way. Every rank sends a slab of the plan's
    widest top halo (its last rows) to the next rank and one of the widest bottom halo (its
    first rows) to the previous rank (slabs of one size on every rank, so the receiver knows
    what comes); each keeps the rows it needs."""

    @staticmethod
    def forward(ctx, x, plan, dg: DomainGroup, dim: int):
        ctx.plan, ctx.dg, ctx.dim = plan, dg, dim
        top, bottom = plan[dg.rank]
        tops, bottoms = max(p[0] for p in plan), max(p[1] for p in plan)
        zeros = lambda k: x.new_zeros(*x.shape[:dim], k, *x.shape[dim + 1 :])  # noqa: E731
        above, below = _neighbours(
            _slab(x, dim, tops, last=True) if tops else None,
            _slab(x, dim, bottoms, last=False) if bottoms else None,
            dg,
        )
        parts = [x]
        if top:
            parts.insert(0, above.narrow(dim, tops - top, top) if above is not None else zeros(top))
        if bottom:
            parts.append(below.narrow(dim, 0, bottom) if below is not None else zeros(bottom))
        return torch.cat(parts, dim) if len(parts) > 1 else x.clone()

    @staticmethod
    def backward(ctx, g):
        plan, dg, dim, top, bottom, n = _saved(ctx, g)
        tops, bottoms = max(p[0] for p in plan), max(p[1] for p in plan)
        # my top halo's gradient goes to the previous band (its last rows), my bottom halo's to the
        # next band (its first rows); past a global edge nothing is sent (zero padding)
        to_prev = _slab(g.narrow(dim, 0, top), dim, tops, last=True) if tops else None
        to_next = _slab(g.narrow(dim, top + n, bottom), dim, bottoms, last=False) if bottoms else None
        from_prev, from_next = _neighbours(to_next, to_prev, dg)
        grad = g.narrow(dim, top, n)
        # the previous band's rows first, then the next band's: the eager path's order of the sums
        if from_prev is not None:
            k = min(bottoms, n)
            grad = torch.cat([grad.narrow(dim, 0, k) + from_prev.narrow(dim, 0, k), grad.narrow(dim, k, n - k)], dim)
        if from_next is not None:
            k = min(tops, n)
            grad = torch.cat(
                [grad.narrow(dim, 0, n - k), grad.narrow(dim, n - k, k) + from_next.narrow(dim, tops - k, k)], dim
            )
        return grad.contiguous(), None, None, None


def halo_rows(x: torch.Tensor, plan, dg: DomainGroup, dim: int = 2) -> torch.Tensor:
    """Differentiable halo exchange of any widths: rank r gets ``plan[r] = (above, below)`` rows
    from its neighbours along ``dim`` (zeros beyond the global edges). Every rank must pass the
    same plan, and a neighbour must hold at least the rows asked of it."""
    if not any(map(any, plan)):
        return x
    if dg.dry:
        dg.halos.append((tuple(map(tuple, plan)), x.shape[dim]))
    elif torch.compiler.is_compiling():
        return _TracedHalo.apply(x, tuple(map(tuple, plan)), dg, dim)
    return _Halo.apply(x, tuple(map(tuple, plan)), dg, dim)


def halo_exchange(x: torch.Tensor, halo: int, dg: DomainGroup, dim: int = 2) -> torch.Tensor:
    """``x`` with ``halo`` neighbour rows (zeros at the global edges) on both sides of ``dim``."""
    if halo == 0:
        return x
    thinnest = min(dg.extents_like(x.shape[dim])) if dim == 2 else x.shape[dim]
    if dg.size > 1 and thinnest < halo:  # checked on every rank alike, so all of them stop, none waits
        raise ValueError(
            f"a domain rank holds {thinnest} rows but the layer needs a halo of {halo}: "
            "use fewer domain ranks or a larger grid"
        )
    return halo_rows(x, ((halo, halo),) * dg.size, dg, dim)


# -- sums and gathers: plain collectives (also inside other autograd functions), then differentiable
def summed(t: torch.Tensor, dg: DomainGroup, functional: bool) -> torch.Tensor:
    """A new tensor: ``t`` summed over the domain group (a dry group or one rank: a copy of ``t``).
    ``functional``: the traced form (a step under torch.compile). Not differentiable."""
    if dg.dry or dg.size == 1:
        return t.clone()
    if functional:
        return compat.funcol().all_reduce(t, "sum", dg.group)
    out = t.clone()
    dist.all_reduce(out, group=dg.group)
    return out


def gathered(t: torch.Tensor, dg: DomainGroup, functional: bool) -> torch.Tensor:
    """(size, *t.shape): every rank's ``t`` (equal shapes; a dry group: zeros for the others).
    Gathered along a new dim 0: torch 2.11's functional all-gather re-chunks any other dim in code
    dynamo will not trace. Not differentiable."""
    if dg.dry or dg.size == 1:
        return torch.stack([t if r == dg.rank else torch.zeros_like(t) for r in range(dg.size)])
    if functional:
        return compat.funcol().all_gather_tensor(t.contiguous().unsqueeze(0), 0, dg.group)
    out = t.new_empty(dg.size, *t.shape)
    dist.all_gather_into_tensor(out, t.contiguous().unsqueeze(0), group=dg.group)
    return out


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dg: DomainGroup):
        # decided here for both passes: torch 2.11 traces a compiled backward outside is_compiling()
        ctx.dg, ctx.functional = dg, torch.compiler.is_compiling()
        return summed(x, dg, ctx.functional)

    @staticmethod
    def backward(ctx, g):
        # every rank's output is the sum: d(sum)/dx_r collects every rank's gradient
        return summed(g, ctx.dg, ctx.functional), None


def all_reduce_sum(x: torch.Tensor, dg: DomainGroup) -> torch.Tensor:
    return x if dg.size == 1 else _AllReduceSum.apply(x, dg)


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dg: DomainGroup, dim: int):
        extents = dg.extents_like(x.shape[dim])
        ctx.dg, ctx.dim, ctx.extents, ctx.functional = dg, dim, extents, torch.compiler.is_compiling()
        padded = _slab(x, dim, max(extents), last=False)  # equal sizes: pad, gather, then trim
        whole = gathered(padded, dg, ctx.functional)
        return torch.cat([whole[r].narrow(dim, 0, e) for r, e in enumerate(extents)], dim)

    @staticmethod
    def backward(ctx, g):
        g = summed(g.contiguous(), ctx.dg, ctx.functional)  # every rank used every rank's rows
        start = sum(ctx.extents[: ctx.dg.rank])
        return g.narrow(ctx.dim, start, ctx.extents[ctx.dg.rank]).contiguous(), None, None


def gather_rows(x: torch.Tensor, dg: DomainGroup, dim: int = 2) -> torch.Tensor:
    """The full tensor along ``dim`` from every rank's rows (uneven extents allowed)."""
    return x if dg.size == 1 else _GatherRows.apply(x, dg, dim)
