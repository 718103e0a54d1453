"""The DiT block's gated residual sums, and the adaLN LayerNorm after the first, as Triton ops.

Why hand-written: a DiT block adds ``gate * (a + bias)`` to its residual stream twice (``a`` the
attention's projection, then the MLP's fc2), and normalises and modulates the stream after the
first (``LN(x) (1 + scale) + shift``). Compiled, inductor split their backward over six kernels
(``benchmarks/block_lowering.py``): the LayerNorm's backward wrote a float32 copy of the
normalised input and read it back, and every gradient of an adaLN term (``gate``, ``shift``,
``scale``: a sum over the sample's tokens) and of the two output biases (a sum over every token)
read the gradients the pointwise kernels had just written once more; inductor does not fuse a
sum over tokens into a kernel that reduces over channels. Here one kernel each way does a
residual's work: forward ``x1 = x + gate (a + bias)`` (and with the norm ``h = LN(x1) (1 + scale)
+ shift``); backward the LayerNorm's gradient added to the stream's, ``gate`` times that for
``a``, and per block of tokens the float32 column sums that give the gradients of ``bias``,
``gate``, ``shift`` and ``scale`` (a small sum over the blocks finishes them).

* ``gated_residual(x, a, bias, gate)``: ``x + gate (a + bias)``.
* ``residual_norm(x, a, bias, gate, shift, scale, eps)``: ``(x1, h)`` as above.

``x`` and ``a`` are (B, ..., D) token tensors of one sample each along the first axis; ``gate``,
``shift``, ``scale`` one (B, D) row per sample (any shape with B x D elements, e.g. the block's
(B, 1, 1, D) views); ``bias`` (D,). The stream ``x1`` comes out in ``x``'s and ``a``'s promoted dtype
(bf16 under the preset's autocast), rounded once, and the norm reads the rounded ``x1``, as an eager
LayerNorm would; everything else is float32 inside, rounded once to its output's dtype
(``1 + scale`` included, as inductor computes it; eager autocast rounds it to bf16 first).
The backward recomputes ``x1`` and the norm's statistics from ``x`` and ``a`` (saved anyway), so
the ops keep no more for backward than the torch expression does. The sums run in a fixed order:
deterministic.

The ops have registered backwards (no graph break in a compiled block). Where the kernels cannot
run (CPU, float64) torch ops compute the same formulas; under ``TRITON_INTERPRET=1`` the kernels
also run on CPU tensors, as the CPU tests run them.
"""

from __future__ import annotations

import os
import re
from typing import NamedTuple

import torch
from torch import Tensor

from recipes.stormscope.fused_natten import device_of, parse_named_tiles

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch formulas below
    triton = None


class Tiles(NamedTuple):
    """Tokens a program, tokens a step of its loop, warps; written ``ROWSxSTEP/WARPS``."""

    rows: int
    step: int
    warps: int

    @classmethod
    def parse(cls, text: str) -> Tiles:
        m = re.fullmatch(r"(\d+)x(\d+)/(\d+)", text.strip())
        tiles = cls(*(int(v) for v in m.groups())) if m else None
        # (a step and the warps are powers of two, as Triton's ranges and launches need)
        if tiles is None or min(tiles) < 1 or any(v & (v - 1) for v in tiles[1:]):
            raise ValueError(f"residual tiles {text!r}: expected ROWSxSTEP/WARPS, the step and warps powers of 2")
        return cls(*_checked(tiles))

    def __str__(self) -> str:
        return f"{self.rows}x{self.step}/{self.warps}"


# The forward's and the backward's tiles, the fastest of an H100 sweep (``benchmarks/residual_norm.py
# --sweep``, docs/benchmarks.md run 39). Programs of 128 tokens in 8 warps kept too few loads in
# flight (the backward with the norm at 0.4-0.6 TB/s, 2.3x inductor's time); 16 tokens in 2 or 4
# warps run at 1.9-2.2 TB/s. A backward program writes one row of column sums each: (B, T / 16, 4,
# D) float32 partial sums, 63 MB for the preset's 4 x 20480 tokens of 768, which the op then adds
# up (written and read: some 40 us at an H100's bandwidth).
TILES = {"fwd": Tiles(16, 4, 4), "bwd": Tiles(16, 2, 2)}


def parse_tile_set(text: str) -> dict[str, Tiles]:
    """Tiles from ``SPEC`` (both kernels) or ``fwd=SPEC,bwd=SPEC`` (either), SPEC in ``Tiles.parse``'s
    notation: what ``benchmarks/scaling.py --residual-tiles`` reads."""
    return parse_named_tiles(text, TILES, Tiles.parse)


def _kernels_take(*tensors: Tensor) -> bool:
    """The Triton kernels can run on these: non-empty float32 or half-precision CUDA tensors (any
    device under Triton's interpreter)."""
    if triton is None or not tensors[0].numel():
        return False
    if any(t.dtype not in (torch.float32, torch.bfloat16, torch.float16) for t in tensors):
        return False
    return tensors[0].is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:

    @triton.jit
    def _sample_row(b_ptr, gate_ptr, scale_ptr, D, BD: tl.constexpr):
        """This program's sample, the columns, which of them are in range, the sample's row of
        modulation terms (offsets), and the rows every token of it shares (loaded once, not per
        step): bias, gate and ``1 + scale`` (float32)."""
        s = tl.program_id(0)
        cols = tl.arange(0, BD)
        cols_in = cols < D
        mod = s * D + cols
        bias = tl.load(b_ptr + cols, mask=cols_in, other=0.0).to(tl.float32)[None, :]
        gate = tl.load(gate_ptr + mod, mask=cols_in, other=0.0).to(tl.float32)[None, :]
        scale1 = 1.0 + tl.load(scale_ptr + mod, mask=cols_in, other=0.0).to(tl.float32)[None, :]
        return s, cols, cols_in, mod, bias, gate, scale1

    @triton.jit
    def _step(s, i, T, D, cols, cols_in, BM: tl.constexpr, RB: tl.constexpr):
        """Mask and offsets of the ``RB`` tokens from ``i`` of this program's ``BM`` in sample ``s``."""
        t = tl.program_id(1) * BM + i + tl.arange(0, RB)
        mask = (t < T)[:, None] & cols_in[None, :]
        return mask, (s * T + t).to(tl.int64)[:, None] * D + cols[None, :]

    @triton.jit
    def _normalised(x1, cols_in, D, eps):
        """(x1 - mean) rstd per row over the D columns, and rstd (float32)."""
        mean = tl.sum(x1, 1) / D
        xc = tl.where(cols_in[None, :], x1 - mean[:, None], 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, 1) / D + eps)
        return xc * rstd[:, None], rstd

    @triton.jit
    def _residual_fwd(
        x_ptr, a_ptr, b_ptr, gate_ptr, shift_ptr, scale_ptr, x1_ptr, h_ptr, T, D, eps,
        NORM: tl.constexpr, BM: tl.constexpr, RB: tl.constexpr, BD: tl.constexpr,
    ):  # fmt: skip
        """``BM`` tokens of sample ``program_id(0)``, ``RB`` a step: x1 and, with ``NORM``, h."""
        s, cols, cols_in, mod, bias, gate, scale1 = _sample_row(b_ptr, gate_ptr, scale_ptr, D, BD)
        if NORM:
            shift = tl.load(shift_ptr + mod, mask=cols_in, other=0.0).to(tl.float32)[None, :]
        for i in range(0, BM, RB):
            mask, offs = _step(s, i, T, D, cols, cols_in, BM, RB)
            a = tl.load(a_ptr + offs, mask=mask, other=0.0).to(tl.float32) + bias
            x1 = (tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32) + gate * a).to(x1_ptr.dtype.element_ty)
            tl.store(x1_ptr + offs, x1, mask=mask)
            if NORM:  # the norm of the stream as stored
                xhat, _ = _normalised(x1.to(tl.float32), cols_in, D, eps)
                tl.store(h_ptr + offs, (xhat * scale1 + shift).to(h_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _residual_bwd(
        g_ptr, gh_ptr, x_ptr, a_ptr, b_ptr, gate_ptr, scale_ptr, dx_ptr, da_ptr, sums_ptr, T, D, eps,
        NORM: tl.constexpr, BM: tl.constexpr, RB: tl.constexpr, BD: tl.constexpr,
    ):  # fmt: skip
        """Gradients of ``BM`` tokens of sample ``program_id(0)``, ``RB`` a step, for the stream's
        gradient ``g`` and, with ``NORM``, h's ``gh``: the stream's (into ``dx``; without the norm it
        is ``g``) and a's, and one row each of column sums of the stream's gradient, of it times
        ``a + bias`` and, with ``NORM``, of ``gh`` and of ``gh`` times the normalised x1."""
        s, cols, cols_in, mod, bias, gate, scale1 = _sample_row(b_ptr, gate_ptr, scale_ptr, D, BD)
        sum_g = tl.zeros([BD], tl.float32)
        sum_ga = tl.zeros([BD], tl.float32)
        sum_gh = tl.zeros([BD], tl.float32)
        sum_ghx = tl.zeros([BD], tl.float32)
        for i in range(0, BM, RB):
            mask, offs = _step(s, i, T, D, cols, cols_in, BM, RB)
            a = tl.load(a_ptr + offs, mask=mask, other=0.0).to(tl.float32) + bias
            g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            if NORM:
                x1 = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32) + gate * a
                xhat, rstd = _normalised(x1.to(dx_ptr.dtype.element_ty).to(tl.float32), cols_in, D, eps)
                gh = tl.load(gh_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                gx = gh * scale1  # the gradient of the normalised x1
                mean_gx = tl.sum(gx, 1) / D
                mean_gxx = tl.sum(gx * xhat, 1) / D
                g += tl.where(mask, rstd[:, None] * (gx - mean_gx[:, None] - xhat * mean_gxx[:, None]), 0.0)
                tl.store(dx_ptr + offs, g.to(dx_ptr.dtype.element_ty), mask=mask)
                sum_gh += tl.sum(gh, 0)
                # (masked: a padding row's x1 is gate * bias, constant over its channels when either
                # is zero, as at init; with eps = 0 its xhat is NaN, and 0 * NaN is NaN)
                sum_ghx += tl.sum(tl.where(mask, gh * xhat, 0.0), 0)
            tl.store(da_ptr + offs, (g * gate).to(da_ptr.dtype.element_ty), mask=mask)
            sum_g += tl.sum(g, 0)
            sum_ga += tl.sum(g * a, 0)
        row = sums_ptr + ((s * tl.num_programs(1) + tl.program_id(1)) * 4).to(tl.int64) * D + cols
        tl.store(row, sum_g, mask=cols_in)
        tl.store(row + D, sum_ga, mask=cols_in)
        if NORM:
            tl.store(row + 2 * D, sum_gh, mask=cols_in)
            tl.store(row + 3 * D, sum_ghx, mask=cols_in)


def _shape(x: Tensor, mod: Tensor, bias: Tensor) -> tuple[int, int, int]:
    """(samples B, tokens a sample T, channels D) of token tensor ``x``, (B, D) terms ``mod`` and a
    (D,) ``bias`` (checked: the kernels read D of its values whatever its length)."""
    b, d = x.shape[0], x.shape[-1]
    if mod.numel() != b * d:
        raise ValueError(f"a modulation term of {mod.numel()} elements for {b} samples of {d} channels")
    if bias.shape != (d,):
        raise ValueError(f"a bias of shape {tuple(bias.shape)} for {d} channels")
    return b, x.numel() // (b * d) if b * d else 0, d


def _flat(t: Tensor, *shape: int) -> Tensor:
    return t.reshape(shape).contiguous()


def _stream_dtype(x: Tensor, a: Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, a.dtype)


def _float_dtype(*tensors: Tensor) -> torch.dtype:
    """The torch formulas' and the column sums' dtype for an op's inputs: float32, float64 where any
    is float64 (those run the torch formulas)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _checked(tiles: tuple[int, int, int]) -> tuple[int, int, int]:
    bm, rb, _ = tiles
    if bm % rb:  # (else a program's last step runs into the next program's tokens)
        raise ValueError(f"tiles {tiles}: {rb} tokens a step do not divide {bm} tokens a program")
    return tiles


def launch_forward(x, a, bias, gate, shift, scale, eps, norm: bool, tiles=None):
    """The forward kernel: (x1, h), h x1 itself without the norm (``tiles``: ``TILES["fwd"]``'s, read
    at the call, unless given)."""
    b, t, d = _shape(x, gate, bias)
    x1 = torch.empty(x.shape, device=x.device, dtype=_stream_dtype(x, a))
    h = torch.empty_like(x1) if norm else x1
    bm, rb, warps = _checked(tiles or TILES["fwd"])
    mod = [_flat(m, b, d) for m in ((gate, shift, scale) if norm else (gate, gate, gate))]
    with device_of(x):
        _residual_fwd[(b, triton.cdiv(t, bm))](
            _flat(x, b * t, d), _flat(a, b * t, d), bias.contiguous(), *mod, x1, h, t, d, eps,
            NORM=norm, BM=bm, RB=rb, BD=triton.next_power_of_2(d), num_warps=warps,
        )  # fmt: skip
    return x1, h


def launch_backward(g, gh, x, a, bias, gate, scale, eps, tiles=None):
    """The backward kernel: (the stream's gradient, a's, the (B, blocks, 4, D) float32 column sums),
    for ``residual_norm`` (``gh`` h's gradient) or ``gated_residual`` (``gh`` None: the stream's
    gradient is ``g`` and the sums' last two rows are left unwritten). ``tiles``: tokens a program,
    tokens a step, warps (what ``benchmarks/residual_norm.py --sweep`` varies; ``TILES["bwd"]``'s,
    read at the call, unless given)."""
    b, t, d = _shape(a, gate, bias)
    bm, rb, warps = _checked(tiles or TILES["bwd"])
    norm = gh is not None
    blocks = triton.cdiv(t, bm)
    dx = torch.empty(x.shape, device=x.device, dtype=_stream_dtype(x, a)) if norm else g
    da = torch.empty(a.shape, device=a.device, dtype=a.dtype)
    sums = torch.empty(b, blocks, 4, d, device=a.device, dtype=torch.float32)
    g2 = _flat(g, b * t, d)
    with device_of(a):
        _residual_bwd[(b, blocks)](
            g2, _flat(gh, b * t, d) if norm else g2, _flat(x, b * t, d) if norm else g2, _flat(a, b * t, d),
            bias.contiguous(), _flat(gate, b, d), _flat(scale if norm else gate, b, d), dx, da, sums, t, d, eps,
            NORM=norm, BM=bm, RB=rb, BD=triton.next_power_of_2(d), num_warps=warps,
        )  # fmt: skip
    return dx, da, sums


# -- the torch formulas (CPU, float64): the kernels' computation as torch ops -------------------


def _torch_gated(a: Tensor, bias: Tensor, gate: Tensor, dt: torch.dtype) -> tuple[Tensor, Tensor]:
    """(a + bias as (B, T, D), gate as (B, 1, D)) in ``dt`` (``_float_dtype`` of the op's inputs)."""
    b, t, d = _shape(a, gate, bias)
    return a.reshape(b, t, d).to(dt) + bias.to(dt), gate.reshape(b, 1, d).to(dt)


def _torch_stream(x: Tensor, a: Tensor, bias: Tensor, gate: Tensor, dt: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """(x1 rounded to the stream's dtype, a + bias, gate) in ``dt``."""
    ab, gate_f = _torch_gated(a, bias, gate, dt)
    x1 = (x.reshape(ab.shape).to(dt) + gate_f * ab).to(_stream_dtype(x, a)).to(dt)
    return x1, ab, gate_f


def _torch_normalised(x1: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    mean = x1.mean(-1, keepdim=True)
    rstd = torch.rsqrt((x1 - mean).square().mean(-1, keepdim=True) + eps)
    return (x1 - mean) * rstd, rstd


# -- the ops -----------------------------------------------------------------------------------


@torch.library.custom_op("stormscope::gated_residual", mutates_args=())
def gated_residual(x: Tensor, a: Tensor, bias: Tensor, gate: Tensor) -> Tensor:
    """``x + gate (a + bias)``, ``gate`` one row per sample; see the module doc."""
    if _kernels_take(x, a, bias, gate):
        return launch_forward(x, a, bias, gate, None, None, 0.0, norm=False)[0]
    x1, _, _ = _torch_stream(x, a, bias, gate, _float_dtype(x, a, bias, gate))
    return x1.to(_stream_dtype(x, a)).reshape(x.shape)


@gated_residual.register_fake
def _(x, a, bias, gate):
    _shape(x, gate, bias)
    return torch.empty(x.shape, device=x.device, dtype=_stream_dtype(x, a))


@torch.library.custom_op("stormscope::gated_residual_backward", mutates_args=())
def gated_residual_backward(g: Tensor, a: Tensor, bias: Tensor, gate: Tensor) -> tuple[Tensor, Tensor]:
    """(a's gradient, per-sample column sums (B, 2, D; float64 for float64 inputs) of ``g`` and of
    ``g (a + bias)``) for the gradient ``g`` of ``gated_residual`` (whose ``x`` gradient is ``g``)."""
    if _kernels_take(g, a, bias, gate):
        _, da, sums = launch_backward(g, None, None, a, bias, gate, None, 0.0)
        return da, sums[:, :, :2].sum(1)
    ab, gate_f = _torch_gated(a, bias, gate, _float_dtype(g, a, bias, gate))
    gf = g.reshape(ab.shape).to(ab.dtype)
    return (gf * gate_f).to(a.dtype).reshape(a.shape), torch.stack([gf.sum(1), (gf * ab).sum(1)], 1)


@gated_residual_backward.register_fake
def _(g, a, bias, gate):
    b, _, d = _shape(a, gate, bias)
    return torch.empty_like(a, memory_format=torch.contiguous_format), a.new_empty(
        b, 2, d, dtype=_float_dtype(g, a, bias, gate)
    )


@torch.library.custom_op("stormscope::residual_norm", mutates_args=())
def residual_norm(
    x: Tensor, a: Tensor, bias: Tensor, gate: Tensor, shift: Tensor, scale: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """``(x1, h)``: ``x1 = x + gate (a + bias)``, ``h = LayerNorm(x1) (1 + scale) + shift`` (no affine,
    ``eps``); see the module doc."""
    if _kernels_take(x, a, bias, gate, shift, scale):
        return launch_forward(x, a, bias, gate, shift, scale, eps, norm=True)
    x1, _, _ = _torch_stream(x, a, bias, gate, _float_dtype(x, a, bias, gate, shift, scale))
    xhat, _ = _torch_normalised(x1, eps)
    b, _, d = x1.shape
    h = xhat * (1 + scale.reshape(b, 1, d).to(x1.dtype)) + shift.reshape(b, 1, d).to(x1.dtype)
    out = _stream_dtype(x, a)
    return x1.to(out).reshape(x.shape), h.to(out).reshape(x.shape)


@residual_norm.register_fake
def _(x, a, bias, gate, shift, scale, eps):
    _shape(x, gate, bias)
    dtype = _stream_dtype(x, a)
    return torch.empty(x.shape, device=x.device, dtype=dtype), torch.empty(x.shape, device=x.device, dtype=dtype)


@torch.library.custom_op("stormscope::residual_norm_backward", mutates_args=())
def residual_norm_backward(
    g: Tensor, gh: Tensor, x: Tensor, a: Tensor, bias: Tensor, gate: Tensor, scale: Tensor, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """(the stream's gradient, a's, per-sample column sums (B, 4, D; float64 for float64 inputs) of
    the stream's gradient, of it times ``a + bias``, of ``gh`` and of ``gh`` times the normalised x1)
    for the gradients ``g`` of ``residual_norm``'s x1 and ``gh`` of its h."""
    if _kernels_take(g, gh, x, a, bias, gate, scale):
        dx, da, sums = launch_backward(g, gh, x, a, bias, gate, scale, eps)
        return dx, da, sums.sum(1)
    x1, ab, gate_f = _torch_stream(x, a, bias, gate, _float_dtype(g, gh, x, a, bias, gate, scale))
    xhat, rstd = _torch_normalised(x1, eps)
    ghf = gh.reshape(x1.shape).to(x1.dtype)
    gx = ghf * (1 + scale.reshape(gate_f.shape).to(x1.dtype))
    gs = g.reshape(x1.shape).to(x1.dtype)
    gs = gs + rstd * (gx - gx.mean(-1, keepdim=True) - xhat * (gx * xhat).mean(-1, keepdim=True))
    sums = torch.stack([gs.sum(1), (gs * ab).sum(1), ghf.sum(1), (ghf * xhat).sum(1)], 1)
    dx = gs.to(_stream_dtype(x, a)).reshape(x.shape)
    return dx, (gs * gate_f).to(a.dtype).reshape(a.shape), sums


@residual_norm_backward.register_fake
def _(g, gh, x, a, bias, gate, scale, eps):
    b, _, d = _shape(a, gate, bias)
    dx = torch.empty(x.shape, device=x.device, dtype=_stream_dtype(x, a))
    return (
        dx,
        torch.empty_like(a, memory_format=torch.contiguous_format),
        a.new_empty(b, 4, d, dtype=_float_dtype(g, gh, x, a, bias, gate, scale)),
    )


# -- autograd ------------------------------------------------------------------------------------


def _term_grads(sums: Tensor, bias: Tensor, gate: Tensor, terms: list) -> list[Tensor]:
    """From per-sample column sums (B, k, D) [the stream's gradient, times a + bias, then one per
    further term]: bias's gradient (over samples, gate times the stream's gradient's sums), and each
    modulation term's (``terms``: their (shape, dtype), gate's first)."""
    dbias = (gate.reshape(sums[:, 0].shape).to(sums.dtype) * sums[:, 0]).sum(0).to(bias.dtype)
    return [dbias] + [sums[:, i + 1].to(dtype).reshape(shape) for i, (shape, dtype) in enumerate(terms)]


def _setup_gated(ctx, inputs, output):
    _, a, bias, gate = inputs
    ctx.save_for_backward(a, bias, gate)


def _backward_gated(ctx, g):
    a, bias, gate = ctx.saved_tensors
    da, sums = gated_residual_backward(g, a, bias, gate)
    return g, da, *_term_grads(sums, bias, gate, [(gate.shape, gate.dtype)])


def _setup_norm(ctx, inputs, output):
    x, a, bias, gate, shift, scale, eps = inputs
    ctx.save_for_backward(x, a, bias, gate, scale)
    ctx.eps = eps
    ctx.terms = [(t.shape, t.dtype) for t in (gate, shift, scale)]


def _backward_norm(ctx, g, gh):
    x, a, bias, gate, scale = ctx.saved_tensors
    dx, da, sums = residual_norm_backward(g, gh, x, a, bias, gate, scale, ctx.eps)
    return dx, da, *_term_grads(sums, bias, gate, ctx.terms), None


gated_residual.register_autograd(_backward_gated, setup_context=_setup_gated)
residual_norm.register_autograd(_backward_norm, setup_context=_setup_norm)
