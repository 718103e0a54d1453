"""The DiT MLP's bias and GELU in two matrix products' epilogues (Triton), against cuBLAS plus the ops.

An experiment that lost (docs/benchmarks.md, run 45): with ``gelu.bias_gelu`` the MLP's hidden
layer (81920 tokens x 3072 in bf16 at the StormScope preset, 0.5 GB a block) still makes passes
through memory that no product needs: forward, cuBLAS writes ``h0 = x W1^T`` and the op reads it
and writes ``g = GELU(h0 + b1)``; backward, cuBLAS writes fc2's input gradient ``dG = dY W2`` and
the op reads dG and h0 and writes ``dh`` and b1's gradient. Here fc1's product writes h0 and g
from its accumulator tile, and ``dY W2``'s epilogue reads h0 and writes dh and per-tile column
sums: dG is never stored, h0 never re-read forward. The epilogues apply ``gelu``'s formulas to the
products rounded as they would be stored, so g is ``bias_gelu(h0)`` bit for bit.

Prints, per tile set (``BMxBN/BK/warps/stages[/persistent[/flat]]``; ``fwd=SPEC,bwd=SPEC`` for each
product apart), each product's time against cuBLAS's product plus the op it replaces (median,
ms) and how its results differ from theirs. With K = 768 the epilogue (a 128 x 256 tile's GELU
and two stores) is a large share of a tile's work, and nothing here overlaps it with the next
tile's products (Triton 3.6's warp specialization leaves these loops unpartitioned on sm90): on
H100s the best sets matched cuBLAS and the ops at best (forward 0.98-1.01x, backward 0.92-0.98x).

    python benchmarks/mlp_epilogue.py                       # on the GPU machine, the sets below
    python benchmarks/mlp_epilogue.py --tiles 128x256/64/8/3 fwd=128x256/64/8/3/persistent/flat,bwd=128x128/64/4/2
    TRITON_INTERPRET=1 python benchmarks/mlp_epilogue.py --device cpu   # the code path, float32

Tensor descriptors need sm90 or later (or Triton's interpreter, whose 16-bit products through
descriptors are wrong: float32 there).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.mlp_gelu import median_ms  # noqa: E402
from recipes.stormscope import gelu  # noqa: E402
from recipes.stormscope.fused_natten import _TensorDescriptor, device_of, parse_named_tiles  # noqa: E402
from recipes.stormscope.gelu import triton  # noqa: E402

if triton is not None:
    import triton.language as tl

    from recipes.stormscope.gelu import _D1, _D2, _sigmoid_2z


class GemmTiles(NamedTuple):
    """A product's program: ``bm x bn`` outputs, ``bk`` deep a step, its warps and stages;
    ``persistent``: one program an SM looping over the tiles (else one program a tile); ``flat``
    (persistent only): the loops over tiles and over K as one (``tl.range(flatten=True)``), so the
    pipeliner may load the next tile's operands during this tile's epilogue."""

    bm: int = 128
    bn: int = 256
    bk: int = 64
    warps: int = 8
    stages: int = 3
    persistent: bool = True  # (the fastest of run 45's sets for both products)
    flat: bool = False

    @classmethod
    def parse(cls, text: str) -> GemmTiles:
        """From ``BMxBN/BK/warps/stages[/persistent[/flat]]`` (the benchmarks' notation)."""
        parts = text.split("/")
        try:
            bm, bn = (int(v) for v in parts[0].split("x"))
            bk, warps, stages = (int(v) for v in parts[1:4])
        except ValueError:
            parts = []
        if len(parts) not in (4, 5, 6) or parts[4:] not in ([], ["persistent"], ["persistent", "flat"]):
            raise ValueError(f"GEMM tiles must read BMxBN/BK/warps/stages[/persistent[/flat]], got {text!r}")
        return cls(bm, bn, bk, warps, stages, len(parts) >= 5, len(parts) == 6)

    def __str__(self) -> str:
        flags = ("/persistent" if self.persistent else "") + ("/flat" if self.flat else "")
        return f"{self.bm}x{self.bn}/{self.bk}/{self.warps}/{self.stages}{flags}"


TILES = {"fwd": GemmTiles(), "bwd": GemmTiles()}  # (the names parse_tile_set knows)


def parse_tile_set(text: str) -> dict[str, GemmTiles]:
    """Tiles from ``SPEC`` (both products) or ``fwd=SPEC,bwd=SPEC`` (either; the other takes the
    defaults), SPEC in ``GemmTiles.parse``'s notation: what ``--tiles`` reads."""
    return {**TILES, **parse_named_tiles(text, TILES, GemmTiles.parse)}


_GROUP = 8  # row tiles that walk the columns together (the weight's tiles stay in L2)


if triton is not None:

    @triton.jit
    def _tile_of(t, tiles_m, tiles_n, GROUP: tl.constexpr):
        """Tile ``t``'s (row, column) tile indices: GROUP row tiles walk the columns together."""
        per_group = GROUP * tiles_n
        first = (t // per_group) * GROUP
        size = tl.minimum(tiles_m - first, GROUP)
        return first + (t % per_group) % size, (t % per_group) // size

    @triton.jit
    def _product(a_desc, b_desc, om, on, K, BK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                 TRANS_B: tl.constexpr):  # fmt: skip
        """The float32 (BM, BN) tile at ``om``, ``on`` of A B (A: rows x K; B: K x columns, or
        columns x K with TRANS_B)."""
        acc = tl.zeros([BM, BN], tl.float32)
        for k in range(0, K, BK):
            a = a_desc.load([om, k])
            b = b_desc.load([on, k]).T if TRANS_B else b_desc.load([k, on])
            acc = tl.dot(a, b, acc)
        return acc

    @triton.jit
    def _gelu_forward(a_desc, w_desc, h_desc, g_desc, b_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr,
                      BK: tl.constexpr, GROUP: tl.constexpr, PERSISTENT: tl.constexpr, FLAT: tl.constexpr):  # fmt: skip
        """h0 = A W^T, and g = GELU(h0 + b) from h0 as stored."""
        tiles_m, tiles_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
        step = tl.num_programs(0) if PERSISTENT else tiles_m * tiles_n
        for t in tl.range(tl.program_id(0), tiles_m * tiles_n, step, flatten=FLAT):
            pm, pn = _tile_of(t, tiles_m, tiles_n, GROUP)
            om, on = pm * BM, pn * BN
            h0 = _product(a_desc, w_desc, om, on, K, BK, BM, BN, True).to(h_desc.dtype)
            h_desc.store([om, on], h0)
            cols = on + tl.arange(0, BN)
            x = h0.to(tl.float32) + tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
            g_desc.store([om, on], (x * _sigmoid_2z(x)).to(g_desc.dtype))

    @triton.jit
    def _gelu_backward(dy_desc, w_desc, h_desc, dh_desc, b_ptr, sums_ptr, M, N, K, BM: tl.constexpr,
                       BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr, PERSISTENT: tl.constexpr,
                       FLAT: tl.constexpr):  # fmt: skip
        """dG = dY W (rounded as it would be stored), dh = dG GELU'(h0 + b), and dh's float32 sums
        over each tile's rows (one row of ``sums`` per row tile)."""
        tiles_m, tiles_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
        step = tl.num_programs(0) if PERSISTENT else tiles_m * tiles_n
        for t in tl.range(tl.program_id(0), tiles_m * tiles_n, step, flatten=FLAT):
            pm, pn = _tile_of(t, tiles_m, tiles_n, GROUP)
            om, on = pm * BM, pn * BN
            dg = _product(dy_desc, w_desc, om, on, K, BK, BM, BN, False).to(dh_desc.dtype).to(tl.float32)
            cols = on + tl.arange(0, BN)
            x = h_desc.load([om, on]).to(tl.float32)
            x += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
            s = _sigmoid_2z(x)
            # d/dx x sigmoid(2z) = s + x s (1 - s) 2 sqrt(2/pi) (1 + 3 * 0.044715 x^2), as gelu's
            d = dg * (s + x * s * (1.0 - s) * _D1 * (1.0 + _D2 * x * x))
            dh_desc.store([om, on], d.to(dh_desc.dtype))
            rows = om + tl.arange(0, BM)  # (rows past M load as zeros: their d is zero too)
            sums = tl.sum(tl.where((rows < M)[:, None], d, 0.0), 0)
            tl.store(sums_ptr + pm.to(tl.int64) * N + cols, sums, mask=cols < N)


def _grid(m: int, n: int, tiles: GemmTiles, device: torch.device) -> tuple[int]:
    """One program a tile, or with ``persistent`` one an SM (three under the interpreter, so
    that its programs loop too)."""
    count = triton.cdiv(m, tiles.bm) * triton.cdiv(n, tiles.bn)
    if tiles.persistent:
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 3
        count = min(count, sms)
    return (count,)


def _constants(t: GemmTiles) -> dict:
    return dict(
        BM=t.bm, BN=t.bn, BK=t.bk, GROUP=_GROUP, PERSISTENT=t.persistent, FLAT=t.flat,
        num_warps=t.warps, num_stages=t.stages,
    )  # fmt: skip


def _descriptor(t: Tensor, block) -> object:
    return _TensorDescriptor.from_tensor(t, list(block))


def launch_forward(x: Tensor, w1: Tensor, b1: Tensor, tiles: GemmTiles | None = None) -> tuple[Tensor, Tensor]:
    """(g, h0) for contiguous (rows, C) ``x`` and (N, C) ``w1`` of x's dtype, and ``b1`` (N)."""
    t = tiles or GemmTiles()
    (m, k), n = x.shape, w1.shape[0]
    h0, g = x.new_empty(m, n), x.new_empty(m, n)
    with device_of(x):
        _gelu_forward[_grid(m, n, t, x.device)](
            _descriptor(x, (t.bm, t.bk)), _descriptor(w1, (t.bn, t.bk)), _descriptor(h0, (t.bm, t.bn)),
            _descriptor(g, (t.bm, t.bn)), b1, m, n, k,
            **_constants(t),
        )  # fmt: skip
    return g, h0


def launch_backward(
    dy: Tensor, w2: Tensor, h0: Tensor, b1: Tensor, tiles: GemmTiles | None = None
) -> tuple[Tensor, Tensor]:
    """(dh, b1's gradient in float32) for contiguous (rows, C) ``dy``, (C, N) ``w2`` of dy's
    dtype and (rows, N) ``h0``."""
    t = tiles or GemmTiles()
    (m, k), n = dy.shape, w2.shape[1]
    dh = h0.new_empty(m, n)
    sums = torch.empty(triton.cdiv(m, t.bm), n, device=dy.device, dtype=torch.float32)
    with device_of(dy):
        _gelu_backward[_grid(m, n, t, dy.device)](
            _descriptor(dy, (t.bm, t.bk)), _descriptor(w2, (t.bk, t.bn)), _descriptor(h0, (t.bm, t.bn)),
            _descriptor(dh, (t.bm, t.bn)), b1, sums, m, n, k,
            **_constants(t),
        )  # fmt: skip
    return dh, sums.sum(0)


# run 45's sets on an H100: one program an SM or a tile, 4 or 8 warps, 2-4 stages
SETS = (
    "128x256/64/8/3/persistent",
    "128x256/64/8/3",
    "128x128/64/8/2",
    "128x128/64/4/2",
    "128x128/64/8/3",
    "128x128/64/4/4",
)


def _inputs(rows: int, c: int, n: int, dtype: torch.dtype, device: torch.device) -> dict:
    g = torch.Generator().manual_seed(0)

    def make(*shape, scale=1.0, dt=dtype):
        return (scale * torch.randn(*shape, generator=g)).to(dt).to(device)

    return dict(
        x=make(rows, c), w1=make(n, c, scale=c**-0.5), b1=make(n, scale=0.1, dt=torch.float32),
        w2=make(c, n, scale=n**-0.5), dy=make(rows, c),
    )  # fmt: skip


def compare(sets: list[str], rows: int, c: int, n: int, dtype, device, iters: int, warmup: int) -> dict:
    """{"cublas": {fwd_ms, bwd_ms, fwd_product_ms, bwd_product_ms}, SET: {fwd_ms, bwd_ms, g_is_op,
    h0_err, dh_err, db_err} or {error}} for the forward (fc1's product + bias and GELU) and the backward (dY W2 + the
    GELU's backward and b1's gradient), each tile set against cuBLAS and the ``gelu`` ops."""
    t = _inputs(rows, c, n, dtype, device)
    x, w1, b1, w2, dy = t["x"], t["w1"], t["b1"], t["w2"], t["dy"]
    h_ref = x @ w1.t()
    dh_ref, db_ref = gelu.bias_gelu_backward(dy @ w2, h_ref, b1)
    time = lambda fn: median_ms(fn, iters, warmup, device)  # noqa: E731
    out = {
        "cublas": dict(
            fwd_ms=time(lambda: gelu.bias_gelu(x @ w1.t(), b1)),
            bwd_ms=time(lambda: gelu.bias_gelu_backward(dy @ w2, h_ref, b1)),
            fwd_product_ms=time(lambda: x @ w1.t()),
            bwd_product_ms=time(lambda: dy @ w2),
        )
    }
    for spec in sets:
        tiles = parse_tile_set(spec)
        try:
            g, h0 = launch_forward(x, w1, b1, tiles["fwd"])
            dh, db = launch_backward(dy, w2, h_ref, b1, tiles["bwd"])
        except Exception as e:  # (a set the GPU cannot run, out of shared memory say: the others still run)
            out[spec] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
            continue
        out[spec] = dict(
            fwd_ms=time(lambda tiles=tiles: launch_forward(x, w1, b1, tiles["fwd"])),
            bwd_ms=time(lambda tiles=tiles: launch_backward(dy, w2, h_ref, b1, tiles["bwd"])),
            g_is_op=bool(torch.equal(g, gelu.bias_gelu(h0, b1))),  # the epilogue is the op, bit for bit
            h0_err=(h0.float() - h_ref.float()).abs().max().item(),  # the products' order of sums against cuBLAS'
            dh_err=(dh.float() - dh_ref.float()).abs().max().item(),
            db_err=((db - db_ref).abs().max() / db_ref.abs().max()).item(),
        )
    return out


def _tile_set(text: str) -> str:
    try:
        parse_tile_set(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=81920, help="tokens (batch x grid)")
    p.add_argument("--hidden", type=int, nargs=2, default=[768, 3072], metavar=("C", "N"), help="fc1: C -> N")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--tiles", nargs="+", type=_tile_set, default=list(SETS), metavar="SPEC|fwd=SPEC,bwd=SPEC")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        p.error("on CPU the kernels need Triton's interpreter: TRITON_INTERPRET=1")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows, (c, n) = (a.rows, a.hidden) if device.type == "cuda" else (min(a.rows, 300), (64, 128))
    if device.type == "cpu":  # (the interpreter: small programs, one timing; sets given run as given)
        a.tiles = ["64x64/32/4/2", "64x64/32/4/2/persistent/flat"] if a.tiles == list(SETS) else a.tiles
        a.iters, a.warmup = 1, 0
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (interpreter)"
    print(f"{name}, torch {torch.__version__}: {rows} rows, {c} -> {n}, {dtype}, median of {a.iters}")
    r = compare(a.tiles, rows, c, n, dtype, device, a.iters, a.warmup)
    base, flops = r.pop("cublas"), 2 * rows * c * n
    print(
        f"  cuBLAS + op   forward {base['fwd_ms']:.3f} ms (product {base['fwd_product_ms']:.3f}, "
        f"{flops / base['fwd_product_ms'] / 1e9:.0f} TFLOP/s)   backward {base['bwd_ms']:.3f} ms "
        f"(product {base['bwd_product_ms']:.3f})"
    )
    for spec, x in r.items():
        if "error" in x:
            print(f"  {spec:<28} did not run: {x['error']}")
            continue
        print(
            f"  {spec:<28} forward {x['fwd_ms']:.3f} ms ({base['fwd_ms'] / x['fwd_ms']:.2f}x)   backward "
            f"{x['bwd_ms']:.3f} ms ({base['bwd_ms'] / x['bwd_ms']:.2f}x)   g == bias_gelu(h0): {x['g_is_op']}, "
            f"|h0 - cuBLAS's| {x['h0_err']:.3g}, |dh - the op's| {x['dh_err']:.3g}, b1's gradient {x['db_err']:.2g}"
        )


if __name__ == "__main__":
    main()
