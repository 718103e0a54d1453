"""Would a hand-scheduled kernel pay for the DiT's attention? The fused forward's algorithm in Gluon.

``recipes/stormscope/fused_natten.py``'s forward, written in Triton's language, cannot keep one
tile's QK^T product in flight while another tile's softmax runs: ``tl.dot`` waits for every
product of a dependent chain before the code after it (docs/benchmarks.md, run 29). Gluon, the
lower-level dialect Triton ships beside it, can (``warpgroup_mma(..., is_async=True)`` and
``warpgroup_mma_wait``), the way FlashAttention-3 overlaps them. This script runs the same
algorithm as ``_fna_forward``'s defaults (8 x 8 query and key tiles, keys from tiles aligned to the
ones inside every window, the window test per axis on partial tiles, heads padded to 64, the
copy engine's loads into a ring of tiles) written in Gluon, as Triton's code runs it (each
product waited for at once; rings of two and of three tiles) and with the next tile's QK^T issued
before this tile's softmax, beside the fused kernel, on the same inputs:

    python benchmarks/gluon_natten.py            # the StormScope preset's layer, bf16, on a Hopper GPU

It checks that the Gluon forward's output equals the fused kernel's to the bit, then prints each
kernel's time (``triton.testing.do_bench``, twice, alternating). Forward only, the whole grid, no
log-sum-exp output: a measurement, not a kernel the recipe runs (docs/benchmarks.md, run 30: on an
H100 the overlap was slower, the plain port 4-5% faster than the fused forward).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.kernel_build import layer_arguments  # noqa: E402
from recipes.stormscope import fused_natten  # noqa: E402

try:
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # no Triton, or one without Gluon's Hopper API
    gluon = None

TILE = 8  # query and key tiles of 8 x 8 tokens, as the fused kernels' 16-bit defaults
PADDED = 64  # heads padded to 64 channels in the products (the fused forward's `pad`)

if gluon is not None:
    # the copy engine's tile load: `async_load` in newer Gluon, `async_copy_global_to_shared` in Triton 3.6
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

    # (Gluon kernels cannot call Triton-language functions: these two restate fused_natten's
    # _window_start and _aligned_origin, whose bits the tests hold these to)
    @gluon.jit
    def _window_start(pos, half, n, span):
        return gl.minimum(gl.maximum(pos - half, 0), n - span)

    @gluon.jit
    def _aligned_origin(lo, first_full, hi, T: gl.constexpr):
        o = lo - (T - (first_full - lo) % T) % T
        return gl.where((o >= 0) & (gl.cdiv(hi - o, T) == gl.cdiv(hi - lo, T)), o, lo)

    @gluon.jit
    def _masked(s, part, key_place, lo, span):
        """``s`` where the key's place in its tile lies in the query's window on one axis."""
        if part:
            s = gl.where((key_place[None, :] - lo[:, None]).to(gl.uint32, bitcast=True) < span, s, -float("inf"))
        return s

    @gluon.jit
    def _load_tile(k_desc, v_desc, k_s, v_s, bars, t, pred, b, h, o_r, o_c, tiles_c, T: gl.constexpr,
                   SLOTS: gl.constexpr):  # fmt: skip
        """Key tile ``t``'s keys and values into ring slot ``t % SLOTS``, through the copy engine."""
        slot = t % SLOTS
        r, c = o_r + (t // tiles_c) * T, o_c + (t % tiles_c) * T
        mbarrier.expect(bars.index(slot), k_desc.block_type.nbytes + v_desc.block_type.nbytes, pred=pred)
        _tma_load(k_desc, [b, h, r, c, 0], bars.index(slot), k_s.index(slot), pred=pred)
        _tma_load(v_desc, [b, h, r, c, 0], bars.index(slot), v_s.index(slot), pred=pred)

    @gluon.jit
    def _keys(k_s, slot):
        """Ring slot ``slot``'s keys as the (channels, keys) operand of Q K^T (64 keys of 64)."""
        return k_s.index(slot).reshape([64, 64]).permute((1, 0))

    @gluon.jit
    def _next_scores(q2, k_s, bars, t, n_tiles, zero, SLOTS: gl.constexpr):
        """Tile t + 1's QK^T, issued once its keys have landed (waited for by the caller)."""
        nxt = (t + 1) % SLOTS
        mbarrier.wait(bars.index(nxt), ((t + 1) // SLOTS) & 1, pred=t + 1 < n_tiles)
        return warpgroup_mma(q2, _keys(k_s, nxt), zero, use_acc=False, is_async=True)

    @gluon.jit
    def natten_forward_kernel(
        q_desc, k_desc, v_desc, o_ptr, R, C, half, span_r, span_c, qk_scale,
        D: gl.constexpr, OVERLAP: gl.constexpr, SLOTS: gl.constexpr,
    ):  # fmt: skip
        T: gl.constexpr = 8
        M: gl.constexpr = 64  # tokens in a tile
        DP: gl.constexpr = 64  # channels in the products (the head, padded)
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        rows_l: gl.constexpr = gl.SliceLayout(1, mma)
        cols_l: gl.constexpr = gl.SliceLayout(0, mma)
        pid, h, b = gl.program_id(0), gl.program_id(1), gl.program_id(2)
        tiles_w = gl.cdiv(C, T)
        r0, c0 = (pid // tiles_w) * T, (pid % tiles_w) * T
        m = gl.arange(0, M, rows_l)
        rows, cols = r0 + m // T, c0 + m % T
        valid = (rows < R) & (cols < C)
        ws_r = _window_start(gl.minimum(rows, R - 1), half, R, span_r)
        ws_c = _window_start(gl.minimum(cols, C - 1), half, C, span_c)
        lo_r, lo_c = _window_start(r0, half, R, span_r), _window_start(c0, half, C, span_c)
        hi_r = _window_start(gl.minimum(r0 + T, R) - 1, half, R, span_r) + span_r
        hi_c = _window_start(gl.minimum(c0 + T, C) - 1, half, C, span_c) + span_c
        o_r, o_c = _aligned_origin(lo_r, hi_r - span_r, hi_r, T), _aligned_origin(lo_c, hi_c - span_c, hi_c, T)
        tiles_c = gl.cdiv(hi_c - o_c, T)
        n_tiles = gl.cdiv(hi_r - o_r, T) * tiles_c
        n = gl.arange(0, M, cols_l)
        n_r, n_c = n // T, n % T

        q_s = gl.allocate_shared_memory(q_desc.dtype, q_desc.block_type.shape, q_desc.layout)
        k_s = gl.allocate_shared_memory(k_desc.dtype, [SLOTS] + k_desc.block_type.shape, k_desc.layout)
        v_s = gl.allocate_shared_memory(v_desc.dtype, [SLOTS] + v_desc.block_type.shape, v_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [SLOTS + 1, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(SLOTS + 1):
            mbarrier.init(bars.index(i), count=1)
        mbarrier.expect(bars.index(SLOTS), q_desc.block_type.nbytes)
        _tma_load(q_desc, [b, h, r0, c0, 0], bars.index(SLOTS), q_s)
        for i in gl.static_range(SLOTS - 1):  # the first tiles' keys and values
            _load_tile(k_desc, v_desc, k_s, v_s, bars, i, i < n_tiles, b, h, o_r, o_c, tiles_c, T, SLOTS)
        mbarrier.wait(bars.index(SLOTS), 0)
        mbarrier.wait(bars.index(0), 0)
        q2 = q_s.reshape([M, DP])
        zero = gl.zeros([M, M], gl.float32, mma)
        s_next = warpgroup_mma(q2, _keys(k_s, 0), zero, use_acc=False, is_async=True)
        acc = gl.zeros([M, DP], gl.float32, mma)
        m_i = gl.full([M], -float("inf"), gl.float32, rows_l)
        l_i = gl.zeros([M], gl.float32, rows_l)
        for t in range(n_tiles):
            # tile t + SLOTS - 1 into the slot tile t - 1 used (its products are done)
            ahead = t + SLOTS - 1
            _load_tile(k_desc, v_desc, k_s, v_s, bars, ahead, ahead < n_tiles, b, h, o_r, o_c, tiles_c, T, SLOTS)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s_next,))
            if OVERLAP:  # the next tile's scores run on the tensor cores while this tile's softmax runs
                s_next = _next_scores(q2, k_s, bars, t, n_tiles, zero, SLOTS)
            r, c = o_r + (t // tiles_c) * T, o_c + (t % tiles_c) * T
            s = _masked(s, (r < hi_r - span_r) | (r + T > lo_r + span_r), n_r, ws_r - r, span_r)
            s = _masked(s, (c < hi_c - span_c) | (c + T > lo_c + span_c), n_c, ws_c - c, span_c)
            m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
            m_use = gl.where(m_new == -float("inf"), 0.0, m_new)
            p = gl.exp2(s * qk_scale - m_use[:, None])
            alpha = gl.exp2(m_i - m_use)
            l_i = l_i * alpha + gl.sum(p, 1)
            v = v_s.index(t % SLOTS).reshape([M, DP])
            acc = warpgroup_mma(gl.convert_layout(p.to(q_desc.dtype), p_layout), v, acc * alpha[:, None])
            m_i = m_new
            if not OVERLAP:  # as Triton's tl.dot: issued here, waited for at the loop's top
                s_next = _next_scores(q2, k_s, bars, t, n_tiles, zero, SLOTS)
        warpgroup_mma_wait(num_outstanding=0, deps=(s_next,))
        d = gl.arange(0, DP, cols_l)
        offs = (((b * gl.num_programs(1) + h) * R + rows) * C + cols).to(gl.int64) * D
        out = (acc / l_i[:, None]).to(q_desc.dtype)
        gl.store(o_ptr + offs[:, None] + d[None, :], out, mask=valid[:, None] & (d[None, :] < D))


def shared_layout():
    """The copy engine's (1, 1, 8, 8, 64) tiles in shared memory, 128-byte swizzled."""
    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=5)


def scalars(shape, kernel: int) -> tuple:
    """(R, C, half, span_r, span_c, qk_scale) for (B, H, R, C, D) inputs."""
    _, _, rows, cols, d = shape
    return rows, cols, kernel // 2, min(kernel, rows), min(kernel, cols), math.log2(math.e) / math.sqrt(d)


def forward(q, k, v, kernel: int, overlap: bool = False, slots: int = 2):
    """Neighbourhood attention over the whole grid of (B, H, R, C, D) views with unit channel
    stride (D <= 64, 16-bit): the output, (B, H, R, C, D) contiguous. ``slots``: key and value
    tiles in the ring, two (the one in use and the next, loading; 40 KiB of shared memory a
    program with the query tile, as the fused forward) or more; ``overlap``: the next tile's
    QK^T issued before this tile's softmax, which needs three (that tile's load must have landed
    when its product is issued early, while the one after it loads; 56 KiB)."""
    if overlap and slots < 3:
        raise ValueError("the overlap needs a ring of 3 key tiles or more")
    b, heads, rows, cols, d = q.shape
    block = [1, 1, TILE, TILE, PADDED]
    descs = [TensorDescriptor(x, list(x.shape), list(x.stride()), block, shared_layout()) for x in (q, k, v)]
    out = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    grid = (triton.cdiv(rows, TILE) * triton.cdiv(cols, TILE), heads, b)
    natten_forward_kernel[grid](*descs, out, *scalars(q.shape, kernel), D=d, OVERLAP=overlap, SLOTS=slots, num_warps=4)
    return out


def build(overlap: bool, slots: int, arch: int = 90, head_dim: int = 48):
    """The kernel compiled for sm``arch`` without a GPU (as benchmarks/kernel_build.py does for
    the fused kernels): what the tests read its schedule and shared memory from."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    desc = f"tensordesc<bf16[1,1,{TILE},{TILE},{PADDED}],{shared_layout()}>"
    names = ("q_desc", "k_desc", "v_desc", "o_ptr", "R", "C", "half", "span_r", "span_c", "qk_scale")
    types = (desc, desc, desc, "*bf16", "i32", "i32", "i32", "i32", "i32", "fp32")
    constants = {"D": head_dim, "OVERLAP": overlap, "SLOTS": slots}
    signature = dict(zip(names, types)) | dict.fromkeys(constants, "constexpr")
    source = GluonASTSource(natten_forward_kernel, signature, constants, {})
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": 4})


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    layer_arguments(p)
    a = p.parse_args(argv)
    if gluon is None or not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        sys.exit("gluon_natten.py: needs a Hopper GPU (sm90) and a Triton with Gluon's Hopper API")

    rows, cols = a.grid
    g = torch.Generator(device="cuda").manual_seed(0)
    shape = (a.batch, rows, cols, 3, a.heads, a.head_dim)  # the DiT's packed projection
    qkv = torch.randn(shape, device="cuda", generator=g).to(torch.bfloat16)
    q, k, v = qkv.permute(3, 0, 4, 1, 2, 5).unbind(0)

    def fused():
        return fused_natten._forward(q, k, v, a.kernel, 0, 0, rows)[0]

    want = fused()
    variants = {
        "Gluon, products waited for at once": (False, 2),
        "Gluon, the same with a 3-tile ring": (False, 3),
        "Gluon, the next tile's QK^T in flight": (True, 3),
    }
    for name, (overlap, slots) in variants.items():
        got = forward(q, k, v, a.kernel, overlap, slots)
        if not torch.equal(got, want):
            sys.exit(f"{name}: differs from the fused kernel by up to {(got - want).abs().max().item():.3g}")
    size = f"{a.batch} x {a.heads} heads of {a.head_dim}, {rows}x{cols} tokens, kernel {a.kernel}"
    print(f"outputs equal to the bit; {size}")
    runs = {"fused (Triton)": fused}
    for name, (overlap, slots) in variants.items():
        runs[name] = lambda overlap=overlap, slots=slots: forward(q, k, v, a.kernel, overlap, slots)
    for _ in range(2):
        for name, fn in runs.items():
            print(f"  {name:<40} {triton.testing.do_bench(fn, warmup=5, rep=100):.3f} ms")


if __name__ == "__main__":
    main()
