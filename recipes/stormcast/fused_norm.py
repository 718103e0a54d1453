"""GroupNorm (+ SiLU) as four Triton kernels, for the compiled SongUNet blocks on CUDA.

Why hand-written: inductor writes the normalisation of a channels-last activation as 1-D
kernels over its elements, each element gathering its channel's statistics, weight and bias
anew; these kernels work on tiles of (pixels x channels) and load a channel's coefficients once
per tile. On an H200 (docs/benchmarks.md, runs 8-9) a full-resolution decoder block takes 9.7 ms
instead of 12.4, and the regression step's kernels 208-223 ms instead of 246. Each launch is a
custom op called from Python, four per norm: without CUDA graphs (``trainer.compile_cudagraphs``)
the host's launches set the pace of the step, with them the GPU does (17.76 samples/s against
15.41; 18.62 with the per-size launch geometry of ``GEOMETRY`` and the output norm compiled,
run 10). So the default form ("auto", ``GroupNorm.compiled_form``, ``model.compiled_norm``) picks
these kernels when the compiled blocks replay as CUDA graphs, inductor's form otherwise.

The kernels see only per-(sample, channel) coefficients, so the group logic, the optional
per-(sample, channel) ``shift`` added before the norm (the UNet block's embedding) and the
weight and bias stay small torch operations between them (which a compiled graph fuses):

* ``stats``: per pixel chunk and channel, the mean and the sum of squared deviations (Chan's
  pairwise update, no ``E[x^2] - E[x]^2`` cancellation); the chunks, channels and groups are
  combined exactly in torch.
* ``apply``: ``y = x * a + c`` per channel, optionally SiLU, written in the output dtype.
* ``grad_sums``: per chunk and channel, the sums of ``dy`` and of ``dy * x_hat`` (``dy`` the
  gradient of the norm's output, through the SiLU, recomputed from ``x``).
* ``grad_apply``: ``dx = dy * k_g + x * k_x + k_0`` per channel.

Each is a ``torch.library`` custom op: opaque to inductor (its graphs call it like a library
kernel and cache as usual), traced by dynamo without a break. With ``TRITON_INTERPRET=1`` the
kernels also run on CPU tensors (Triton's interpreter), which is how the CPU tests check them.
Plain PyTorch otherwise: no dependency on ``framework``.
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch
from torch import Tensor

from recipes.stormcast.group_stats import group_moments, input_grad_coefficients, spread

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the compiled blocks keep the PyTorch form
    triton = None


def available(x: torch.Tensor) -> bool:
    """The fused kernels can run on ``x``: Triton is installed, and ``x`` is a 3-D+ float32 or
    half-precision CUDA tensor (or any device under Triton's interpreter)."""
    if triton is None or x.dim() < 3 or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    # (a fake CUDA tensor on a machine without one, as precompilation's discovery may trace, stays off)
    return (x.is_cuda and torch.cuda.is_available()) or os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:

    @triton.jit
    def _silu_and_grad(y):
        s = 1.0 / (1.0 + tl.exp(-y))
        return y * s, s * (1.0 + y * (1.0 - s))

    @triton.jit
    def _tile(ptr, b, ps, cs, pmask, cmask, s_b, s_p, s_c, WIDE: tl.constexpr):
        """Pointers to a (pixels x channels) tile of sample ``b``, and its mask. Offsets within a
        sample in 32 bits unless WIDE (a sample of 2**31 elements or more): 64-bit products per
        element were a large part of the reductions' instructions."""
        if WIDE:
            inner = ps[:, None].to(tl.int64) * s_p + cs[None, :].to(tl.int64) * s_c
        else:
            inner = ps[:, None] * s_p + cs[None, :] * s_c
        return ptr + b.to(tl.int64) * s_b + inner, pmask[:, None] & cmask[None, :]

    @triton.jit
    def _pointwise_tile(C, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
        """This program's sample, pixels and channels (and which channels exist)."""
        b, cs = tl.program_id(1), tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
        return b, tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P), cs, cs < C

    @triton.jit
    def _dropout(v, seed_ptr, b, ps, c0, P, threshold, scale, BLOCK_C: tl.constexpr, WIDE: tl.constexpr):
        """``v`` (a tile of channels ``c0 ..``) through dropout: each value kept with probability
        1 - p, scaled by 1/(1 - p). The mask is philox's, from the call's seed, counted by (pixel,
        group of 8 channels, sample), so every kernel that visits an element draws the same number,
        whatever its tiling (BLOCK_C a power of two >= 8). One philox call gives 8 16-bit numbers,
        one per channel of its group (a call per element cost 8% of the regression step on an H200).
        A value is kept when its number is at least ``threshold`` = p * 2**16, rounded."""
        seed = tl.load(seed_ptr)
        groups = c0 // 8 + tl.arange(0, BLOCK_C // 8)
        if WIDE:
            e = groups[None, :].to(tl.int64) * P + ps[:, None].to(tl.int64)
            lo, hi = (e & 0xFFFFFFFF).to(tl.uint32), (e >> 32).to(tl.uint32)
        else:  # (a sample of fewer than 2**31 elements)
            lo = (groups[None, :] * P + ps[:, None]).to(tl.uint32)
            hi = tl.zeros_like(lo)
        zero = tl.zeros_like(lo)
        r0, r1, r2, r3 = tl.philox(seed, lo, zero + b.to(tl.uint32), hi, zero)
        # channel 8 * group + 2 * k + h gets half h of r_k
        words = tl.interleave(tl.interleave(r0, r2), tl.interleave(r1, r3))
        numbers = tl.interleave(words & 0xFFFF, words >> 16).to(tl.int32)
        return tl.where(numbers >= threshold, v * scale, 0.0)

    @triton.jit
    def gn_fused_stats(
        x_ptr, mean_ptr, m2_ptr, C, P, nchunks, s_b, s_p, s_c,
        ITERS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, WIDE: tl.constexpr,
    ):  # fmt: skip
        pid, b, cb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        cs = cb * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = cs < C
        start = pid * (ITERS * BLOCK_P)
        # sums of deviations from the chunk's first pixel (near the mean: no cancellation), kept
        # per tile element and reduced across the tile once, after the loop
        # (64-bit, once per program: a channel's offset alone can pass 2**31 in an NCHW sample)
        first = b.to(tl.int64) * s_b + start.to(tl.int64) * s_p + cs.to(tl.int64) * s_c
        pivot = tl.load(x_ptr + first, mask=cmask, other=0.0)
        pivot = pivot.to(tl.float32)[None, :]
        acc = tl.zeros([BLOCK_P, BLOCK_C], tl.float32)
        acc2 = tl.zeros([BLOCK_P, BLOCK_C], tl.float32)
        for i in range(ITERS):  # the last chunk's tail is masked off
            ps = start + i * BLOCK_P + tl.arange(0, BLOCK_P)
            ptrs, mask = _tile(x_ptr, b, ps, cs, ps < P, cmask, s_b, s_p, s_c, WIDE)
            d = tl.where(mask, tl.load(ptrs, mask=mask, other=0.0).to(tl.float32) - pivot, 0.0)
            acc += d
            acc2 += d * d
        n = tl.minimum(P - start, ITERS * BLOCK_P).to(tl.float32)
        s1, s2 = tl.sum(acc, 0), tl.sum(acc2, 0)
        out = (b * nchunks + pid) * C + cs
        tl.store(mean_ptr + out, tl.sum(pivot, 0) + s1 / n, mask=cmask)
        tl.store(m2_ptr + out, s2 - s1 * s1 / n, mask=cmask)

    @triton.jit
    def gn_fused_apply(
        x_ptr, a_ptr, c_ptr, y_ptr, C, P, s_b, s_p, s_c, o_b, o_p, o_c, seed_ptr, threshold, scale,
        SILU: tl.constexpr, DROPOUT: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, WIDE: tl.constexpr,
    ):  # fmt: skip
        b, ps, cs, cmask = _pointwise_tile(C, BLOCK_P, BLOCK_C)
        a = tl.load(a_ptr + b * C + cs, mask=cmask, other=0.0)
        c = tl.load(c_ptr + b * C + cs, mask=cmask, other=0.0)
        ptrs, mask = _tile(x_ptr, b, ps, cs, ps < P, cmask, s_b, s_p, s_c, WIDE)
        y = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32) * a[None, :] + c[None, :]
        if SILU:
            y, _ = _silu_and_grad(y)
        if DROPOUT:
            y = _dropout(y, seed_ptr, b, ps, tl.program_id(2) * BLOCK_C, P, threshold, scale, BLOCK_C, WIDE)
        out, _ = _tile(y_ptr, b, ps, cs, ps < P, cmask, o_b, o_p, o_c, WIDE)
        tl.store(out, y.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def gn_fused_grad_sums(
        g_ptr, x_ptr, a_ptr, c_ptr, r_ptr, q_ptr, s1_ptr, s2_ptr, C, P, nchunks,
        g_b, g_p, g_c, s_b, s_p, s_c, seed_ptr, threshold, scale,
        SILU: tl.constexpr, DROPOUT: tl.constexpr, ITERS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
        WIDE: tl.constexpr,
    ):  # fmt: skip
        pid, b, cb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        cs = cb * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = cs < C
        a = tl.load(a_ptr + b * C + cs, mask=cmask, other=0.0)[None, :]
        c = tl.load(c_ptr + b * C + cs, mask=cmask, other=0.0)[None, :]
        r = tl.load(r_ptr + b * C + cs, mask=cmask, other=0.0)[None, :]
        q = tl.load(q_ptr + b * C + cs, mask=cmask, other=0.0)[None, :]
        acc1 = tl.zeros([BLOCK_P, BLOCK_C], tl.float32)
        acc2 = tl.zeros([BLOCK_P, BLOCK_C], tl.float32)
        start = pid * (ITERS * BLOCK_P)
        for i in range(ITERS):  # the last chunk's tail is masked off
            ps = start + i * BLOCK_P + tl.arange(0, BLOCK_P)
            ptrs, mask = _tile(x_ptr, b, ps, cs, ps < P, cmask, s_b, s_p, s_c, WIDE)
            gptrs, _ = _tile(g_ptr, b, ps, cs, ps < P, cmask, g_b, g_p, g_c, WIDE)
            x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(gptrs, mask=mask, other=0.0).to(tl.float32)
            if DROPOUT:
                dy = _dropout(dy, seed_ptr, b, ps, cb * BLOCK_C, P, threshold, scale, BLOCK_C, WIDE)
            if SILU:
                _, ds = _silu_and_grad(x * a + c)
                dy = dy * ds
            acc1 += dy
            acc2 += tl.where(mask, dy * (x * r + q), 0.0)
        out = (b * nchunks + pid) * C + cs
        tl.store(s1_ptr + out, tl.sum(acc1, 0), mask=cmask)
        tl.store(s2_ptr + out, tl.sum(acc2, 0), mask=cmask)

    @triton.jit
    def gn_fused_grad_apply(
        g_ptr, x_ptr, a_ptr, c_ptr, kg_ptr, kx_ptr, k0_ptr, dx_ptr, C, P,
        g_b, g_p, g_c, s_b, s_p, s_c, o_b, o_p, o_c, seed_ptr, threshold, scale,
        SILU: tl.constexpr, DROPOUT: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, WIDE: tl.constexpr,
    ):  # fmt: skip
        b, ps, cs, cmask = _pointwise_tile(C, BLOCK_P, BLOCK_C)
        kg = tl.load(kg_ptr + b * C + cs, mask=cmask, other=0.0)[None, :]
        kx = tl.load(kx_ptr + b * C + cs, mask=cmask, other=0.0)[None, :]
        k0 = tl.load(k0_ptr + b * C + cs, mask=cmask, other=0.0)[None, :]
        ptrs, mask = _tile(x_ptr, b, ps, cs, ps < P, cmask, s_b, s_p, s_c, WIDE)
        gptrs, _ = _tile(g_ptr, b, ps, cs, ps < P, cmask, g_b, g_p, g_c, WIDE)
        x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(gptrs, mask=mask, other=0.0).to(tl.float32)
        if DROPOUT:
            dy = _dropout(dy, seed_ptr, b, ps, tl.program_id(2) * BLOCK_C, P, threshold, scale, BLOCK_C, WIDE)
        if SILU:
            a = tl.load(a_ptr + b * C + cs, mask=cmask, other=0.0)[None, :]
            c = tl.load(c_ptr + b * C + cs, mask=cmask, other=0.0)[None, :]
            _, ds = _silu_and_grad(x * a + c)
            dy = dy * ds
        dx = dy * kg + x * kx + k0
        out, _ = _tile(dx_ptr, b, ps, cs, ps < P, cmask, o_b, o_p, o_c, WIDE)
        tl.store(out, dx.to(dx_ptr.dtype.element_ty), mask=mask)


# -- launch geometry ----------------------------------------------------------------------------

# per kernel, the launch geometry for activations of at least so many pixels per sample:
# (elements per tile, warps per program, programs per SM for the two reductions). The fastest of
# `benchmarks/group_norm.py --sweep` on an H200 (bf16, channels-last, batch 4, each of the
# regression UNet's activations timed alone, replayed as a CUDA graph): the reductions want
# more programs on large activations and fewer on small ones (a setting: ``_chunks`` rounds the
# chunks to powers of two of tiles, so fewer launch), the input gradient four warps.
GEOMETRY: dict[str, tuple[tuple[int, tuple[int, int, int]], ...]] = {
    "stats": ((327680, (4096, 4, 8)), (0, (4096, 4, 4))),
    "apply": ((0, (2048, 4, 8)),),
    "grad_sums": ((81920, (2048, 4, 16)), (0, (4096, 4, 4))),
    "grad_apply": ((0, (2048, 4, 8)),),
}


def geometry(kernel: str, pixels: int) -> tuple[int, int, int]:
    """(elements per tile, warps, programs per SM) of ``kernel`` on ``pixels`` pixels per sample."""
    return next(g for least, g in GEOMETRY[kernel] if pixels >= least)


def _mergeable(t: torch.Tensor) -> bool:
    """``t``'s spatial dims merge into one pixel index: each one's stride is the next one's
    stride times its size."""
    sizes, strides = t.shape[2:], t.stride()[2:]
    return all(s == strides[i + 1] * sizes[i + 1] for i, s in enumerate(strides[:-1]) if sizes[i] > 1)


def _flat(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """``t`` (B, C, *spatial) and its (sample, pixel, channel) strides, the spatial dims merged
    into one pixel index (a copy when its layout does not allow that)."""
    if not _mergeable(t):
        t = t.contiguous()
    return t, (t.stride(0), t.stride(-1) if t.dim() > 2 else 1, t.stride(1))


def _wide(*flat: tuple[torch.Tensor, tuple[int, int, int]]) -> bool:
    """Whether an element of one sample of these ``_flat`` tensors lies 2**31 or more elements
    from the sample's first: the kernels' 64-bit offsets (else 32-bit, fewer instructions)."""
    return any(
        (t.shape[1] - 1) * abs(s_c) + (math.prod(t.shape[2:]) - 1) * abs(s_p) >= 2**31 for t, (_, s_p, s_c) in flat
    )


def _channels_fast(t: torch.Tensor) -> bool:
    """Channels are the contiguous dim of ``_flat(t)`` (channels-last), known without copying
    (a copy ``_flat`` makes is contiguous: channels not fast)."""
    return _mergeable(t) and t.stride(1) == 1


def _blocks(channels: int, channels_fast: bool, elements: int) -> tuple[int, int]:
    """(BLOCK_P, BLOCK_C) for a tile of about ``elements``: wide in channels when they are the
    contiguous dim (channels-last), wide in pixels otherwise."""
    cp = triton.next_power_of_2(channels)
    block_c = max(8, min(cp, 256 if channels_fast else 8))  # >= 8: the dropout's channel groups
    return max(1, elements // block_c), block_c


def _multiprocessors(device: torch.device) -> int:
    # no cache of our own: dynamo folds this call to a constant (it warns on lru_cache, and would
    # guard on a dict filled while tracing), and torch caches the properties anyway
    return torch.cuda.get_device_properties(device).multi_processor_count


def _chunks(x: torch.Tensor, b: int, pixels: int, cblocks: int, block_p: int, per_sm: int) -> tuple[int, int]:
    """(tiles per chunk, chunks) for the reductions: ``per_sm`` programs per SM, and a power of
    two of tiles per chunk (a constant of the kernel: few distinct kernels to compile)."""
    sms = _multiprocessors(x.device) if x.is_cuda else 4
    want = max(1, (per_sm * sms) // (b * cblocks))  # chunks per (sample, channel block)
    iters = triton.next_power_of_2(max(1, pixels // (want * block_p)))
    return iters, math.ceil(pixels / (iters * block_p))


# -- custom ops -------------------------------------------------------------------------------
# Their outputs: partial sums as (B, chunks, C) float32 (combined in torch, deterministically),
# tensors as ``empty_like`` of the input (its memory format).


class _Reduction(NamedTuple):
    """Launch geometry of the two reductions: programs over (chunks, samples, channel blocks)."""

    pixels: int
    block_p: int
    block_c: int
    cblocks: int
    iters: int  # tiles per chunk
    nchunks: int
    warps: int

    @property
    def chunk(self) -> int:  # pixels per chunk
        return self.iters * self.block_p


def _reduction(x: torch.Tensor, kernel: str) -> _Reduction:
    """From ``x``'s sizes and layout alone (no copy: the forward asks again for its chunk size)."""
    b, c = x.shape[:2]
    pixels = math.prod(x.shape[2:])
    elements, warps, per_sm = geometry(kernel, pixels)
    block_p, block_c = _blocks(c, _channels_fast(x), elements)
    cblocks = triton.cdiv(c, block_c)
    iters, nchunks = _chunks(x, b, pixels, cblocks, block_p, per_sm)
    return _Reduction(pixels, block_p, block_c, cblocks, iters, nchunks, warps)


def _partials(x: torch.Tensor, geo: _Reduction) -> tuple[torch.Tensor, torch.Tensor]:
    """Two (B, chunks, C) float32 tensors for a reduction's per-chunk results."""
    part = x.new_empty(x.shape[0], geo.nchunks, x.shape[1], dtype=torch.float32)
    return part, torch.empty_like(part)


def _reduce(kernel, geo: _Reduction, b: int, args: tuple, **constants) -> None:
    """Launch a reduction kernel over (chunks, samples, channel blocks)."""
    grid = (geo.nchunks, b, geo.cblocks)
    kernel[grid](*args, **constants, ITERS=geo.iters, BLOCK_P=geo.block_p, BLOCK_C=geo.block_c, num_warps=geo.warps)


@torch.library.custom_op("stormcast::gn_stats", mutates_args=())
def gn_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per chunk of pixels and channel: the mean and the sum of squared deviations, (B, chunks, C)."""
    g = _reduction(x, "stats")
    b, c = x.shape[:2]
    mean, m2 = _partials(x, g)
    xf, xs = _flat(x)
    _reduce(gn_fused_stats, g, b, (xf, mean, m2, c, g.pixels, g.nchunks, *xs), WIDE=_wide((xf, xs)))
    return mean, m2


@gn_stats.register_fake
def _(x):
    return _partials(x, _reduction(x, "stats"))


def _dropout_args(seed: torch.Tensor | None, p: float, fallback: torch.Tensor) -> dict:
    """The kernels' dropout arguments: the call's seed (a 1-element int64 tensor), the threshold
    for rate ``p`` and the kept values' scale, or none (any pointer stands in for the seed: the
    kernel does not read it)."""
    on = seed is not None and p > 0
    threshold = dropout_threshold(p)
    scale = 2.0**16 / (2**16 - threshold)
    return {"seed_ptr": seed if on else fallback, "threshold": threshold, "scale": scale, "DROPOUT": on}


def dropout_threshold(p: float) -> int:
    """The kernels' 16-bit threshold for rate ``p``: they drop exactly ``threshold / 2**16`` of
    the values on average (``p`` within 2**-17; the kept ones are scaled by the inverse of the
    rest, so the expectation is exact)."""
    return min(round(p * 2**16), 2**16 - 1)


def _pointwise(
    kernel, name: str, out: torch.Tensor, x: torch.Tensor, tensors: tuple, coefficients: tuple, silu: bool, drop: dict
):
    """Launch a pointwise kernel over ``x``'s (pixels x channels) tiles: its arguments are the
    ``tensors`` (flattened, then ``x`` itself), the per-channel ``coefficients``, ``out``, the
    sizes, every tensor's strides in that order, and the dropout arguments ``drop``."""
    flat = [_flat(t) for t in (*tensors, x, out)]
    b, ch = x.shape[:2]
    pixels = math.prod(x.shape[2:])
    elements, warps, _ = geometry(name, pixels)
    block_p, block_c = _blocks(ch, _channels_fast(x), elements)
    grid = (triton.cdiv(pixels, block_p), b, triton.cdiv(ch, block_c))
    strides = [s for _, st in flat for s in st]
    args = [t for t, _ in flat[:-1]] + list(coefficients) + [flat[-1][0], ch, pixels, *strides]
    kernel[grid](*args, **drop, SILU=silu, BLOCK_P=block_p, BLOCK_C=block_c, WIDE=_wide(*flat), num_warps=warps)
    if flat[-1][0].data_ptr() != out.data_ptr():  # out's layout did not flatten: written to a copy
        out.copy_(flat[-1][0])
    return out


def _apply(
    x: Tensor, a: Tensor, c: Tensor, silu: bool, dtype: torch.dtype, seed: Tensor | None = None, p: float = 0.0
) -> Tensor:
    """``x * a + c`` per (sample, channel), then SiLU if asked, then dropout at rate ``p`` drawn
    from ``seed`` if given, in ``dtype``."""
    out = torch.empty_like(x, dtype=dtype)
    return _pointwise(gn_fused_apply, "apply", out, x, (), (a, c), silu, _dropout_args(seed, p, a))


def _apply_fake(x, a, c, silu, dtype, seed=None, p=0.0):
    return torch.empty_like(x, dtype=dtype)


gn_apply = torch.library.custom_op("stormcast::gn_apply", _apply, mutates_args=())
gn_apply.register_fake(_apply_fake)
# The same kernel under a second name, for the norms whose output is recomputed in backward rather
# than kept (``group_norm(..., recompute=True)``): a compiled graph's partitioner tells the two
# apart by name only (the model names it in ``GroupNorm.recomputed_ops``; the framework's compile
# marks its nodes must-recompute).
gn_apply_recomputed = torch.library.custom_op("stormcast::gn_apply_recomputed", _apply, mutates_args=())
gn_apply_recomputed.register_fake(_apply_fake)
RECOMPUTED_OPS = ("stormcast::gn_apply_recomputed",)


@torch.library.custom_op("stormcast::gn_grad_sums", mutates_args=())
def gn_grad_sums(
    g: Tensor, x: Tensor, a: Tensor, c: Tensor, r: Tensor, q: Tensor, silu: bool,
    seed: Tensor | None = None, p: float = 0.0,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Per chunk of pixels and channel: the sums of ``dy`` and of ``dy * (x * r + q)`` (B, chunks, C),
    ``dy`` being ``g`` through the forward's dropout (``seed``, ``p``), then through the SiLU of
    ``x * a + c`` when ``silu``."""
    geo = _reduction(x, "grad_sums")
    gf, gs = _flat(g)
    b, ch = x.shape[:2]
    s1, s2 = _partials(x, geo)
    xf, xs = _flat(x)
    args = (gf, xf, a, c, r, q, s1, s2, ch, geo.pixels, geo.nchunks, *gs, *xs)
    drop = _dropout_args(seed, p, a)
    _reduce(gn_fused_grad_sums, geo, b, args, **drop, SILU=silu, WIDE=_wide((gf, gs), (xf, xs)))
    return s1, s2


@gn_grad_sums.register_fake
def _(g, x, a, c, r, q, silu, seed=None, p=0.0):
    return _partials(x, _reduction(x, "grad_sums"))


@torch.library.custom_op("stormcast::gn_grad_apply", mutates_args=())
def gn_grad_apply(
    g: Tensor, x: Tensor, a: Tensor, c: Tensor, kg: Tensor, kx: Tensor, k0: Tensor, silu: bool,
    seed: Tensor | None = None, p: float = 0.0,
) -> Tensor:  # fmt: skip
    """``dy * kg + x * kx + k0`` per (sample, channel), in ``x``'s dtype and layout (``dy`` as above)."""
    drop = _dropout_args(seed, p, a)
    return _pointwise(gn_fused_grad_apply, "grad_apply", torch.empty_like(x), x, (g,), (a, c, kg, kx, k0), silu, drop)


@gn_grad_apply.register_fake
def _(g, x, a, c, kg, kx, k0, silu, seed=None, p=0.0):
    return torch.empty_like(x)


# -- the differentiable function ------------------------------------------------------------------


def _combine(mean_p: torch.Tensor, m2_p: torch.Tensor, pixels: int, chunk: int):
    """Per-channel mean and variance (B, C) from the chunks' partial moments (Chan's formula)."""
    n = mean_p.shape[1]
    counts = (pixels - torch.arange(n, device=mean_p.device) * chunk).clamp(max=chunk).to(mean_p.dtype)
    counts = counts.reshape(1, n, 1)
    mean = (mean_p * counts).sum(1) / pixels
    m2 = m2_p.sum(1) + (counts * (mean_p - mean[:, None]).square()).sum(1)
    return mean, m2 / pixels


class _FusedGroupNorm(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x, weight, bias, shift, groups: int, eps: float, silu: bool, dtype: torch.dtype, recompute: bool, p: float
    ):
        b, c = x.shape[:2]
        pixels = math.prod(x.shape[2:])
        mean_p, m2_p = gn_stats(x)
        mean_c, var_c = _combine(mean_p, m2_p, pixels, _reduction(x, "stats").chunk)
        if shift is not None:  # a per-(sample, channel) constant moves the mean only
            mean_c = mean_c + shift.float()
        mean_g, var_g = group_moments(mean_c, var_c, groups)
        rstd_g = torch.rsqrt(var_g + eps)
        a, cc = _coefficients(spread(rstd_g, c, 0), _offset(mean_g, shift, c), weight, bias)
        # dropout's seed, drawn from torch's generator (a compiled graph draws it on the device, CUDA
        # graphs included); kept for backward, which draws the same mask from it
        seed = torch.randint(2**62, (1,), device=x.device, dtype=torch.int64) if p > 0 else None
        ctx.save_for_backward(x, weight, bias, shift, mean_c, mean_g, rstd_g, seed)
        ctx.groups, ctx.silu, ctx.p = groups, silu, p
        return (gn_apply_recomputed if recompute else gn_apply)(x, a, cc, silu, dtype, seed, p)

    @staticmethod
    def backward(ctx, gy):
        x, weight, bias, shift, mean_c, mean_g, rstd_g, seed = ctx.saved_tensors
        c, groups = x.shape[1], ctx.groups
        pixels = math.prod(x.shape[2:])
        r, off = spread(rstd_g, c, 0), _offset(mean_g, shift, c)
        a, cc = _coefficients(r, off, weight, bias)
        part1, part2 = gn_grad_sums(gy, x, a, cc, r, off * r, ctx.silu, seed, ctx.p)  # x_hat = x * r + off * r
        s1, t = part1.sum(1), part2.sum(1)  # (B, C): sums of dy and of dy * x_hat
        w = weight.float().reshape(1, c) if weight is not None else torch.ones_like(s1[:1])
        n = (c // groups) * pixels
        kg, kx, k0, ga, gb = input_grad_coefficients(s1, t, w, r, off, groups, n)
        dx = gn_grad_apply(gy, x, a, cc, kg, kx, k0, ctx.silu, seed, ctx.p)
        dw = t.sum(0).to(weight.dtype) if weight is not None and ctx.needs_input_grad[1] else None
        db = s1.sum(0).to(bias.dtype) if bias is not None and ctx.needs_input_grad[2] else None
        dshift = None
        if shift is not None and ctx.needs_input_grad[3]:  # the pixel sums of dx, from the sums above
            sum_xhat = pixels * (mean_c - spread(mean_g, c, 0)) * r
            dshift = (r * (w * s1 - pixels * ga - gb * sum_xhat)).to(shift.dtype)
        return dx, dw, db, dshift, None, None, None, None, None, None


def _offset(mean_g, shift, c: int):
    """(B, C): the shift less the group mean, so that ``x_hat = (x + offset) * rstd``."""
    m = spread(mean_g, c, 0)
    return -m if shift is None else shift.float() - m


def _coefficients(r, off, weight, bias):
    """(B, C) ``a``, ``c`` with ``x_hat * weight + bias == x * a + c``, for ``x_hat = (x + off) * r``."""
    a = r * weight.float().reshape(1, -1) if weight is not None else r
    return a, off * a if bias is None else off * a + bias.float().reshape(1, -1)


def group_norm(
    x: torch.Tensor,
    groups: int,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    *,
    shift: torch.Tensor | None = None,
    silu: bool = False,
    dtype: torch.dtype | None = None,
    recompute: bool = False,
    dropout: float = 0.0,
) -> torch.Tensor:
    """``F.group_norm(x + shift)``, then SiLU if ``silu``, in ``dtype`` (default ``x``'s), by the
    kernels above; statistics and arithmetic in float32. ``shift``: None or (B, C) (any shape
    of B x C elements), added to every pixel of its sample and channel. ``recompute``: the output
    comes from ``gn_apply_recomputed`` (``RECOMPUTED_OPS``), which a compiled graph recomputes in
    backward from ``x`` and the statistics instead of keeping it (one pass over ``x``). ``dropout``:
    ``F.dropout``'s rate, applied after the SiLU inside the same kernel (its mask is drawn again
    from a saved seed in backward and in a recomputation, never kept); its masks are not the ones
    ``F.dropout`` would draw, only drawn alike, at a rate rounded to a multiple of 2**-16."""
    b, c = x.shape[:2]
    if shift is not None:
        shift = shift.reshape(b, c)
    if not 0 <= dropout < 1:
        raise ValueError(f"dropout must be in [0, 1), got {dropout}")
    return _FusedGroupNorm.apply(x, weight, bias, shift, groups, eps, silu, dtype or x.dtype, recompute, float(dropout))
