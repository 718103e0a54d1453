"""Domain-parallel versions of spatial layers, as mixins swapped onto existing modules.

The splitter changes a module's class to ``(Mixin, OriginalClass)`` in place: parameters,
buffers and their names stay, so checkpoints move freely between layouts, and the
original forward still does the work on halo-extended local rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from framework.domain.comm import DomainGroup, gather_rows, halo_exchange
from framework.domain.group_norm import split_group_norm


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
    """GroupNorm whose statistics span the domain group: one all-gather of the bands' per-group
    statistics forward, one all-reduce backward (framework/domain/group_norm.py), and only the
    input kept for backward. Needs ``num_groups``, ``eps``, ``weight``, ``bias`` (as torch's
    GroupNorm has).

    ``forward(x, shift=None, silu=False, dropout=0.0)``, as the model's norm layer is called: a
    per-(sample, channel) ``shift`` added first, SiLU and dropout after. A layer whose
    ``recompute`` attribute is true (the model's choice, per layer) keeps not even its output in
    a compiled training step: the norm and its SiLU run under ``torch.utils.checkpoint``, so
    backward recomputes them from the input (the statistics' all-gather included) where the
    convolution after it would keep the output. Eager steps keep it, as the model's own
    GroupNorm does there (that convolution keeps its input anyway). A dropout runs after the
    checkpoint (a random draw inside it would have to be replayed), so with one the convolution
    keeps the dropout's output and recomputing frees little."""

    _domain: DomainGroup

    def forward(self, x, shift=None, silu=False, dropout=0.0):
        if getattr(self, "recompute", False) and self.training and torch.compiler.is_compiling():
            y = checkpoint(self._split_norm_silu, x, shift, silu, use_reentrant=False)
        else:
            y = self._split_norm_silu(x, shift, silu)
        return F.dropout(y, p=dropout, training=self.training) if dropout else y

    def _split_norm_silu(self, x, shift, silu):
        if shift is not None:  # one value per (sample, channel): (B, C) or (B, C, 1, 1)
            x = x + shift.reshape(*shift.shape[:2], *(1,) * (x.dim() - 2))
        y = split_group_norm(x, self.num_groups, self.weight, self.bias, self.eps, self._domain)
        return F.silu(y) if silu else y


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
