"""Domain-parallel versions of spatial layers, as mixins swapped onto existing modules.

The splitter changes a module's class to ``(Mixin, OriginalClass)`` in place: parameters,
buffers and their names stay, so checkpoints move freely between layouts, and the
original forward still does the work on halo-extended local rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from framework.domain.comm import DomainGroup, gather_rows, gather_stack, halo_exchange


class HaloMixin:
    """A stride-preserving local layer: pad rows with neighbours' halo, run, crop.

    ``_halo = (rows_in, rows_out)``: halo rows fetched at the input resolution and rows
    dropped from each side of the output (they saw the halo's own fake edge).
    """

    _domain: DomainGroup
    _halo: tuple[int, int]

    def forward(self, x, *args, **kwargs):
        rows_in, crop = self._halo
        if rows_in == 0:
            return super().forward(x, *args, **kwargs)
        y = super().forward(halo_exchange(x, rows_in, self._domain), *args, **kwargs)
        return y.narrow(2, crop, y.shape[2] - 2 * crop)


class GroupNormMixin:
    """GroupNorm with statistics over the whole domain: one collective per call.

    Each rank takes the mean and variance of its rows (fp32), the ranks exchange them
    (one small all-gather) and combine them exactly (Chan et al.'s parallel variance),
    as accurate as a two-pass variance. Needs ``num_groups``, ``eps``, ``weight``,
    ``bias`` (as torch's GroupNorm has).
    """

    _domain: DomainGroup

    def forward(self, x):
        dg = self._domain
        b, g = x.shape[0], self.num_groups
        xf = x.to(torch.promote_types(x.dtype, torch.float32)).reshape(b, g, -1)  # fp32 at least
        var_l, mean_l = torch.var_mean(xf, dim=-1, correction=0)
        every = gather_stack(torch.stack([mean_l, var_l]), dg)  # (ranks, 2, b, g)
        n = torch.tensor(dg.extents_like(x.shape[2]), dtype=xf.dtype, device=x.device)[:, None, None]
        total = n.sum()
        mean = (n * every[:, 0]).sum(0) / total
        var = (n * (every[:, 1] + (every[:, 0] - mean) ** 2)).sum(0) / total
        y = ((xf - mean[..., None]) * torch.rsqrt(var + self.eps)[..., None]).reshape(x.shape).to(x.dtype)
        w = self.weight.to(x.dtype).reshape(1, -1, 1, 1) if self.weight is not None else 1
        bias = self.bias.to(x.dtype).reshape(1, -1, 1, 1) if self.bias is not None else 0
        return y * w + bias


class RowSliceMixin:
    """A spatial parameter of shape (1, C, H, W) added to the input: use this rank's rows.

    Needs ``weight``; the forward adds the local band of it.
    """

    _domain: DomainGroup

    def forward(self, x):
        rows = x.shape[2]
        band = self.weight.narrow(2, self._domain.offset_like(rows), rows)
        return x + band.to(x.dtype)


def gathered_attention(q, k, v, dg: DomainGroup):
    """Attention of local queries over every rank's keys/values.

    q, k, v: (B, heads, head_dim, rows, cols). Keys and values are gathered along rows
    (their gradients summed back); tokens keep the single-device row-major order.
    Returns (B, heads, head_dim, rows, cols).
    """
    b, h, d, rows, cols = q.shape
    k, v = gather_rows(k, dg, dim=3), gather_rows(v, dg, dim=3)
    flat = lambda t: t.reshape(b, h, d, -1).transpose(-1, -2)  # noqa: E731
    a = F.scaled_dot_product_attention(flat(q), flat(k), flat(v))
    return a.transpose(-1, -2).reshape(b, h, d, rows, cols)
