"""How the SongUNet's layers split over the domain axis (rows): its split plan, ``PLAN``.

Like torchtitan's per-model parallelize step: the model file stays plain PyTorch; this
module builds the plan that tells the framework's splitter what each layer needs, and the
model's registry entry names it (``split_plan=PLAN``). The EDM preconditioner a diffusion
task wraps around the net needs no rule: it holds no parameters and its arithmetic is per
pixel (its ``sigma_data`` buffer is per channel).
"""

from __future__ import annotations

import torch

from framework.domain.comm import DomainGroup
from framework.domain.layers import GroupNormMixin, HaloMixin, RowSliceMixin, gathered_attention
from framework.domain.splitter import TORCH_PLAN, swap_class
from framework.errors import ConfigError
from recipes.stormcast import layers


def _conv(m: layers.Conv2d, dg: DomainGroup) -> None:
    r = m.weight.shape[-1] // 2 if m.weight is not None else 0
    f = m.resample_filter
    if f is not None and tuple(f.shape[-2:]) != (2, 2):
        raise ConfigError(
            f"splitter: resample_filter of size {tuple(f.shape[-2:])} is not supported over the domain axis; use [1, 1]"
        )
    if m.down:  # [1,1] stride 2 is local on even-aligned rows; the conv then needs r rows
        halo = (2 * r, r)
    elif m.up:
        rows_in = (r + 1) // 2
        halo = (rows_in, 2 * rows_in)
    else:
        halo = (r, r)
    swap_class(m, HaloMixin, dg, _halo=halo)


class _AttentionMixin:
    """The UNet block's attention with keys/values gathered over the domain group."""

    def forward(self, x):
        b, c, h, w = x.shape
        heads = self.num_heads
        qkv = self.qkv(self.norm(x)).reshape(b, heads, c // heads, 3, h, w)
        q, k, v = qkv.unbind(3)
        return self.proj(gathered_attention(q, k, v, self._domain).reshape(b, c, h, w))


def _attention(m: layers.Attention, dg: DomainGroup) -> None:
    swap_class(m, _AttentionMixin, dg)


def _group_norm(m: layers.GroupNorm, dg: DomainGroup) -> None:
    swap_class(m, GroupNormMixin, dg)


def _pos_embed(m: layers.AdditivePosEmbed, dg: DomainGroup) -> None:
    swap_class(m, RowSliceMixin, dg)


def _unet_block(m: layers.UNetBlock, dg: DomainGroup) -> None:
    if m.dropout > 0 and torch.are_deterministic_algorithms_enabled():
        raise ConfigError(
            "splitter: dropout > 0 with deterministic=true is not supported over the domain "
            "axis yet (per-pixel draws are not keyed by global position)"
        )


PLAN = (
    TORCH_PLAN.extend("songunet")
    .rule(layers.Conv2d, _conv)
    .rule(layers.Attention, _attention)
    .rule(layers.GroupNorm, _group_norm)
    .rule(layers.AdditivePosEmbed, _pos_embed)
    .rule(layers.UNetBlock, _unet_block)  # its own ops are pointwise; its children split
    .local(layers.Linear, layers.PositionalEmbedding)
)  # pointwise
