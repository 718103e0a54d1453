"""GroupNorm arithmetic on per-(sample, channel) sums, shared by the compiled forms of the
SongUNet's GroupNorm (``layers.group_norm_by_channel`` and the Triton kernels of
``fused_norm``): groups' moments from their channels' moments, and the input gradient's
per-channel coefficients from the backward's two pixel sums.

Plain PyTorch, no dependency on ``framework``.
"""

from __future__ import annotations

import torch


def spread(t: torch.Tensor, c: int, dims: int) -> torch.Tensor:
    """(B, G, 1) or (B, G, C/G) -> (B, C, 1, ...) for broadcasting against (B, C, *spatial)."""
    b = t.shape[0]
    return t.expand(b, t.shape[1], c // t.shape[1]).reshape(b, c, *(1,) * dims)


def group_moments(mean_c: torch.Tensor, var_c: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The groups' means and variances, (B, G, 1), from their channels' (B, C): equal counts, so
    the group mean is its channels' mean and the group variance their variances' mean plus the
    variance of their means."""
    b, c = mean_c.shape
    mc, vc = mean_c.view(b, groups, c // groups), var_c.view(b, groups, c // groups)
    mean = mc.mean(-1, keepdim=True)
    return mean, vc.mean(-1, keepdim=True) + (mc - mean).square().mean(-1, keepdim=True)


def input_grad_coefficients(s1, t, w, rstd, off, groups: int, n: int):
    """``dx = dy * kg + x * kx + k0`` per (sample, channel), for ``y = x_hat * w + b`` with
    ``x_hat = (x + off) * rstd`` (``off``: a shift less the group mean).

    ``s1``, ``t``: (B, C) pixel sums of ``dy`` and of ``dy * x_hat``; ``w``: (1, C) (ones without
    a weight); ``rstd``, ``off``: (B, C); ``n``: elements per group. Returns ``kg, kx, k0`` and
    the group means of ``dx_hat`` and of ``dx_hat * x_hat`` (B, C)."""
    b, c = s1.shape
    ga = spread((w * s1).view(b, groups, -1).sum(-1, keepdim=True) / n, c, 0)
    gb = spread((w * t).view(b, groups, -1).sum(-1, keepdim=True) / n, c, 0)
    kx = -rstd * rstd * gb
    return rstd * w, kx, -rstd * ga + kx * off, ga, gb
