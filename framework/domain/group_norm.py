"""GroupNorm over a sample split into bands of rows: one collective forward, one backward.

Each rank holds ``n`` of a group's ``N`` elements (its rows). Forward: every rank computes its
band's count-weighted mean and sum of squared deviations per (sample, group), the ranks gather
them (one all-gather of a ``(2, B, G)`` tensor) and combine them exactly as one pass over the
whole group would (Chan et al.'s pairwise update: no ``E[x^2] - E[x]^2`` cancellation). Backward:
the two per-group sums the input gradient needs (of ``g = dy * weight`` and of ``g * x_hat``) go
in one all-reduce of a ``(2, B, G)`` tensor. The autograd function keeps only the input and the
per-group mean and 1/std for backward, as torch's own GroupNorm does; the weight and bias
gradients are local sums (the data-parallel reduction adds the bands up).

Statistics are computed in at least float32 (float64 stays float64); the output has the input's
dtype. The collectives are framework/domain/comm.py's ``gathered`` and ``summed``: functional
under torch.compile (traced into the graph), torch.distributed's eagerly.
"""

from __future__ import annotations

import torch

from framework.domain.comm import DomainGroup, gathered, summed


class _SplitGroupNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, groups: int, eps: float, dg: DomainGroup):
        b, c = x.shape[:2]
        acc = torch.promote_types(x.dtype, torch.float32)
        xg = x.reshape(b, groups, -1).to(acc)
        # every rank's element count per group, from the bands' rows (the same on every rank); plain
        # numbers, not tensors kept on ctx (which torch 2.11's compiled backward mishandles)
        per_row = (c // groups) * x[0, 0].numel() // x.shape[2]  # a group's elements in one row
        sizes = [per_row * rows for rows in dg.extents_like(x.shape[2])]
        counts = torch.tensor(sizes, dtype=acc, device=x.device).reshape(-1, 1, 1)
        local_mean = xg.mean(-1)
        local_m2 = (xg - local_mean[..., None]).square().sum(-1)
        ctx.functional = torch.compiler.is_compiling()  # the same collectives in both passes
        stats = gathered(torch.stack([local_mean, local_m2]), dg, ctx.functional)  # (size, 2, B, G)
        means, m2s = stats[:, 0], stats[:, 1]
        total = float(sum(sizes))
        mean = (counts * means).sum(0) / total
        var = (m2s.sum(0) + (counts * (means - mean).square()).sum(0)) / total
        rstd = torch.rsqrt(var + eps)
        y = ((xg - mean[..., None]) * rstd[..., None]).reshape(x.shape)
        channels = (1, -1, *[1] * (x.dim() - 2))
        if weight is not None:
            y = y * weight.to(acc).reshape(channels)
        if bias is not None:
            y = y + bias.to(acc).reshape(channels)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.groups, ctx.dg, ctx.total = groups, dg, total
        ctx.bias_dtype = None if bias is None else bias.dtype
        # no ``.to`` when the dtype already fits: torch 2.11's dynamo loses the gradient of an
        # autograd function whose output is such an alias (zeros reach backward)
        return y if y.dtype == x.dtype else y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        groups, dg = ctx.groups, ctx.dg
        b, c = x.shape[:2]
        acc = torch.promote_types(x.dtype, torch.float32)
        shape = (1, -1, *[1] * (x.dim() - 2))
        x_hat = ((x.reshape(b, groups, -1).to(acc) - mean[..., None]) * rstd[..., None]).reshape(x.shape)
        dy = dy.to(acc)
        g = dy * weight.to(acc).reshape(shape) if weight is not None else dy
        gg, xg = g.reshape(b, groups, -1), x_hat.reshape(b, groups, -1)
        sums = summed(torch.stack([gg.sum(-1), (gg * xg).sum(-1)]), dg, ctx.functional)  # (2, B, G): whole group
        dx = rstd[..., None] * (gg - sums[0][..., None] / ctx.total - xg * sums[1][..., None] / ctx.total)
        reduce = [0, *range(2, x.dim())]
        dw = (dy * x_hat).sum(reduce).to(weight.dtype) if weight is not None else None
        db = dy.sum(reduce).to(ctx.bias_dtype) if ctx.bias_dtype is not None else None
        return dx.reshape(x.shape).to(x.dtype), dw, db, None, None, None


def split_group_norm(x, groups: int, weight, bias, eps: float, dg: DomainGroup) -> torch.Tensor:
    """GroupNorm of ``x`` (B, C, rows, ...) whose rows are this rank's band of the sample."""
    return _SplitGroupNorm.apply(x, weight, bias, groups, eps, dg)
