"""How the StormScope DiT splits over the domain axis (bands of patch rows): its split plan, ``PLAN``.

The DiT keeps its tokens a 2-D grid (B, Hp, Wp, D), so a band of pixel rows that holds whole
patch rows is a band of token rows, and only neighbourhood attention mixes rows:

* ``NeighbourhoodAttention``: project the band at its global patch-row offset (rope at global
  rows), fetch exactly the key/value rows its windows reach from the two neighbouring bands
  (``natten.kv_rows_needed``: ``kernel // 2`` rows for an interior band, more or fewer near a
  grid edge, where windows are clamped inward) with ``comm.halo_rows``, attend in global
  coordinates. The halo's backward sends the key/value gradients to the rows' owners.
* ``PosEmbed2d``: adds the band's rows of the learned table.
* ``PatchEmbed``: local on bands of whole patches (its strided conv is not a general
  row-splittable conv, so the rule answers for it).
* ``DiT``: checks the bands against the patch size, the grid and every attention kernel.
* Everything else (LayerNorm over the hidden dim, MLP, adaLN, timestep embedding, final
  layer, unpatchify, mask pooling, ``Rope2d`` whose caller passes global rows) is per token.
  The EDM preconditioner the diffusion task wraps around the DiT holds no parameters and is
  per pixel: it needs no rule.

Bands are ``DomainGroup.extents`` in pixel rows; at token resolution (``rows`` local token rows)
``dg.extents_like(rows)`` gives every band in token rows, exactly when the extents are
multiples of the patch size (which the DiT rule requires).
"""

from __future__ import annotations

import functools

import torch

from framework.domain.comm import DomainGroup, halo_rows
from framework.domain.splitter import TORCH_PLAN, swap_class
from framework.errors import ConfigError
from recipes.stormscope import dit
from recipes.stormscope.natten import kv_rows_needed


def token_extents(dg: DomainGroup, rows: int) -> list[int]:
    """Every band in token rows, given this rank's ``rows`` token rows (exact, or ConfigError)."""
    own = dg.extents[dg.rank]
    if any(e * rows % own for e in dg.extents):
        raise ConfigError(
            f"domain extents {dg.extents} (pixel rows) do not scale to whole token rows when "
            f"rank {dg.rank} holds {rows}: extents must be multiples of the patch size"
        )
    return dg.extents_like(rows)


@functools.lru_cache(maxsize=256)
def halo_plan(extents: tuple[int, ...], kernel: int) -> tuple[tuple[int, int], ...]:
    """(rows from the previous band, rows from the next band) each band's windows need.

    ``extents``: token rows per band. ConfigError if a band needs rows beyond its immediate
    neighbours (a band thinner than the attention needs).
    """
    grid = sum(extents)
    plan = []
    for r, e in enumerate(extents):
        start = sum(extents[:r])
        lo, hi = kv_rows_needed(start, start + e, kernel, grid)
        top, bottom = start - lo, hi - start - e
        prev = extents[r - 1] if r > 0 else 0
        nxt = extents[r + 1] if r + 1 < len(extents) else 0
        if top > prev or bottom > nxt:
            hint = (
                f"give every band at least kernel // 2 + 1 = {kernel // 2 + 1} patch rows"
                if kernel < grid
                else "a kernel spanning every row splits over at most 2 bands"
            )
            raise ConfigError(
                f"neighbourhood attention with kernel {kernel} on {grid} patch rows cannot be split into bands of "
                f"{list(extents)} patch rows: band {r} (rows [{start}, {start + e})) needs key rows [{lo}, {hi}), "
                f"beyond its neighbours' rows [{start - prev}, {start + e + nxt}); {hint} (use fewer domain ranks "
                "or a smaller kernel)"
            )
        plan.append((top, bottom))
    return tuple(plan)


class _NeighbourhoodAttentionMixin:
    """Neighbourhood attention of this band's queries over its rows plus the neighbours' halo rows."""

    _domain: DomainGroup

    def forward(self, x, out_bias: bool = True):
        dg = self._domain
        ext = token_extents(dg, x.shape[1])
        plan = halo_plan(tuple(ext), self.kernel)
        start = sum(ext[: dg.rank])
        q, k, v = self.project(x, start)  # rope (if any) at global rows, before k leaves its owner
        # k and v in one exchange: (2, B, heads, rows, W, head_dim), rows at dim 3
        k, v = halo_rows(torch.stack((k, v)), plan, dg, dim=3).unbind(0)
        kv_start = start - plan[dg.rank][0]
        return self.attend(q, k, v, q_row_offset=start, kv_row_offset=kv_start, grid_rows=sum(ext), out_bias=out_bias)


class _PosEmbedMixin:
    """The band's rows of the learned (1, Hp, Wp, D) table; ``row_offset`` counts within the band."""

    _domain: DomainGroup

    def forward(self, x, row_offset: int = 0):
        ext = token_extents(self._domain, x.shape[1])
        return super().forward(x, sum(ext[: self._domain.rank]) + row_offset)


def _attention(m: dit.NeighbourhoodAttention, dg: DomainGroup) -> None:
    # Band thickness is checked by the DiT rule (which knows the patch size) and again, from the
    # token rows, on every forward (alike on all ranks, so all refuse before any communication).
    swap_class(m, _NeighbourhoodAttentionMixin, dg)


def _pos_embed(m: dit.PosEmbed2d, dg: DomainGroup) -> None:
    swap_class(m, _PosEmbedMixin, dg)


def _patch_embed(m: dit.PatchEmbed, dg: DomainGroup) -> None:
    conv = m.proj
    p = conv.stride[0]
    if conv.kernel_size[0] != p or conv.padding[0] != 0 or conv.dilation[0] != 1:
        raise ConfigError(
            f"patch embedding conv with kernel {conv.kernel_size}, stride {conv.stride}, padding "
            f"{conv.padding}, dilation {conv.dilation} is not local on bands of patch rows "
            "(supported: kernel = stride, no padding, no dilation)"
        )
    if any(e % p for e in dg.extents):
        raise ConfigError(
            f"domain extents {dg.extents} (pixel rows) must be multiples of patch_size={p}, so "
            "every band holds whole patch rows"
        )


def _dit(m: dit.DiT, dg: DomainGroup) -> None:
    p, rows = m.patch_size, m.img_resolution[0]
    if any(e % p for e in dg.extents):
        raise ConfigError(
            f"domain extents {dg.extents} (pixel rows) must be multiples of patch_size={p}, so "
            "every band holds whole patch rows"
        )
    if sum(dg.extents) != rows:
        raise ConfigError(
            f"domain extents {dg.extents} cover {sum(dg.extents)} pixel rows but the model's grid has {rows}"
        )
    tokens = tuple(e // p for e in dg.extents)
    for kernel in sorted({a.kernel for a in m.modules() if isinstance(a, dit.NeighbourhoodAttention)}):
        halo_plan(tokens, kernel)


PLAN = (
    TORCH_PLAN.extend("dit")
    .rule(dit.DiT, _dit)  # holds mask_token (per token); checks the bands
    .rule(dit.NeighbourhoodAttention, _attention)
    .rule(dit.PosEmbed2d, _pos_embed)
    .rule(dit.PatchEmbed, _patch_embed, subtree=True)
    # Per token (or per sample); Rope2d is parameter-free and its caller passes global rows.
    .local(dit.Rope2d, dit.TimestepEmbed, dit.Mlp, dit.DiTBlock, dit.FinalLayer)
)
