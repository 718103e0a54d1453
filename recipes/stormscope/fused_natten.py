"""Fused 2-D neighbourhood attention: Triton kernels that read q, k, v where they lie.

Why hand-written: flex_attention runs the DiT's 31 x 31 windows as sparse blocks of a fixed
token order (``natten.flex_neighbourhood_attention``). On an H200 that was 59% of the StormScope
step (docs/benchmarks.md, run 13): heads of 48 are padded to 64 in its products, its mask_mod
decodes each token's tile position with integer division, and q, k, v, the output and their
gradients are copied into and out of the tiled order.

These kernels take (B, heads, rows, cols, head_dim) tensors with any strides (the projection's
own output: no copies), with unit stride along head_dim. Each program owns a 2-D tile of
queries (``QH x QW`` tokens) and loops over 2-D tiles of keys (``KH x KW``) laid from the corner
of the union of its queries' windows, so no block order or block mask exists: a score is kept
when its key lies in its query's clamped window (four comparisons). Heads of 48 are two products,
32 and 16 wide, instead of one padded to 64. Backward is FlashAttention-2's: rowsum(dO * O) per
query first (written beside the query's log-sum-exp, one record each), then one kernel per key
tile for dK and dV (over the query tiles whose windows reach it; each key's window test is the
range of queries that reach it, worked out once) and one per query tile for dQ. Opt-in
(``/atomic`` on its tiles), the dK/dV kernel adds each query tile's share of dQ to a float32
buffer by atomic adds instead (with ``/tma``, the copy engine's bulk reductions), so the scores
and their gradients are computed once, not twice (FlashAttention-3's way); the order of those
additions varies between runs, so torch's deterministic algorithms (``deterministic=true``) keep
two kernels.

Same semantics as ``natten``: NATTEN's clamped windows, bands of rows with global offsets for
domain parallelism (the queries' windows must lie in the key band, which ``natten`` checks).
Softmax scale ``1 / sqrt(head_dim)``, scores and sums in float32, products in the inputs' dtype
(float32 inputs: full-precision products, no TF32).

Each launch is a ``torch.library`` custom op with a registered backward, so a compiled DiT
block traces it without a graph break. With ``TRITON_INTERPRET=1`` the kernels also run on CPU
tensors (Triton's interpreter): the CPU tests check them there.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import re
from typing import NamedTuple

import torch
from torch import Tensor

from framework import gpu_rules

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: natten falls back to the reference implementation
    triton = None
try:
    from triton.tools.tensor_descriptor import TensorDescriptor as _TensorDescriptor
except ImportError:  # (Triton before 3.3, or none): pointer loads only
    _TensorDescriptor = None


def _interpreted() -> bool:
    """Triton's interpreter runs the kernels (as Python, on any device)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def available(q: Tensor) -> bool:
    """The kernels can run on ``q``: Triton is installed and ``q`` is a float32 or half-precision
    CUDA tensor (or any device under Triton's interpreter), or a fake tensor of a trace standing in
    for a CUDA step (``mode=plan``: the ops' fake implementations run, so the trace holds what the
    kernels would, not the reference's intermediates)."""
    if triton is None or q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    if isinstance(q, torch._subclasses.FakeTensor) and gpu_rules.tracing_for_cuda():
        return True
    return (q.is_cuda and torch.cuda.is_available()) or _interpreted()


class Tiles(NamedTuple):
    """One kernel's tiles: queries ``qh x qw`` tokens, keys ``kh x kw``; its warps and stages;
    ``split``: heads whose width is no power of two as two products (48: 32 + 16) rather than one
    padded (48: 64; fewer instructions per tile, more tensor-core work); ``tma``: the loops' tiles
    through tensor descriptors; ``full``: the window test skipped on tiles inside every window of
    the other side's tile, with the tiles laid out to make as many such as they can; ``atomic``
    (the dK/dV kernel's alone): that kernel also adds dQ up, by float32 atomic adds, and no dQ
    kernel runs (except under torch's deterministic algorithms); ``regs``: a cap on each thread's
    registers (ptxas's maxnreg), so that more programs fit on an SM, at the cost of spills."""

    qh: int
    qw: int
    kh: int
    kw: int
    warps: int = 4
    stages: int = 2
    split: bool = True
    tma: bool = False
    full: bool = False
    atomic: bool = False
    regs: int | None = None

    @classmethod
    def parse(cls, text: str) -> Tiles:
        """From ``QHxQW/KHxKW[/warps[/stages]][/pad][/tma][/full][/atomic][/rN]`` (the benchmarks'
        notation; ``pad``: no split; ``rN``: at most N registers a thread)."""
        parts = text.split("/")
        flags = [p for p in parts[2:] if p in ("pad", "tma", "full", "atomic") or re.fullmatch(r"r\d+", p)]
        caps = [int(p[1:]) for p in flags if p[0] == "r"]
        try:
            (qh, qw), (kh, kw) = ([int(x) for x in p.split("x")] for p in parts[:2])
            numbers = [int(x) for x in parts[2 : len(parts) - len(flags)]]
        except ValueError:
            numbers = None
        if (
            numbers is None
            or len(numbers) > 2
            or len(set(flags)) < len(flags)
            or len(caps) > 1
            or not all(16 <= c <= 255 for c in caps)  # (ptxas's range: a thread has at most 255)
            or parts[len(parts) - len(flags) :] != flags
        ):
            form = "QHxQW/KHxKW[/warps[/stages]][/pad][/tma][/full][/atomic][/rN]"
            raise ValueError(f"tiles must read {form}, got {text!r}")
        return cls(
            qh, qw, kh, kw, *numbers,
            split="pad" not in flags, tma="tma" in flags, full="full" in flags, atomic="atomic" in flags,
            regs=caps[0] if caps else None,
        )  # fmt: skip

    def __str__(self) -> str:
        flags = ("" if self.split else "/pad") + ("/tma" if self.tma else "") + ("/full" if self.full else "")
        flags += ("/atomic" if self.atomic else "") + (f"/r{self.regs}" if self.regs else "")
        return f"{self.qh}x{self.qw}/{self.kh}x{self.kw}/{self.warps}/{self.stages}{flags}"


# 16-bit tiles of 8 x 8 tokens: a query tile's windows (kernel 31) span 38 x 38 keys, covered by
# 5 x 5 key tiles; at the preset's 128 x 160 tokens 65.9% of the computed scores are inside a
# window, as with flex's 64-token blocks (8 x 16 tiles: 56.4%). No spills, pipelined loads on
# sm90 (benchmarks/kernel_build.py). The fastest of benchmarks/natten.py --best-tiles on an H200
# (the preset's layer, bf16): the forward with heads padded, TMA loads and the window test
# skipped on full tiles (1.71 ms against 2.01), the backward as they are (/tma and /full slower).
# The dQ kernel capped at 128 registers a thread, four programs an SM: its loop keeps each key's
# offsets within a tile live (computed once, not per tile), which took it from 122 to 137
# registers under Triton 3.9 (torch 2.13), three programs an SM; capped, 126 and no spills. The
# cap costs ptxas's schedule some instructions (loop SASS a thread, Triton 3.9: 435 -> 451; 3.6,
# which needs 128 registers either way: 413 -> 432), still under the 464 and 444 before.
# The dK/dV kernel with three stages: once its loop read each query's statistics as one record
# (fewer integer instructions to hide loads behind), a third stage paid on an H100: the layer
# 6.01 ms against 6.31, the compiled DiT 17.80 samples/s against 17.54 (docs/benchmarks.md, run 25);
# 223 registers under Triton 3.6 and 222 under 3.9, no spills, still two programs an SM.
# The dQ kernel with three stages too (run 26, H100): the compiled DiT 17.75-17.85 samples/s in three
# runs against 17.65-17.67 with two (uncapped three stages: 17.67); 125-126 registers and 48 KiB of
# shared memory, so still four programs an SM, no spills, under Triton 3.6 and 3.9.
# The forward capped at 96 registers (run 42, H100): 106-112 uncapped left four programs an SM,
# capped it takes 94-96 with no spills under Triton 3.6, 3.9 and torch 2.14's, so five fit (40 KiB
# of shared memory each); the same bits out, the layer's forward 1.57 ms against 1.62, the
# compiled DiT 18.57 samples/s against 18.47 (two runs each, alternating).
TILES = {
    "fwd": Tiles(8, 8, 8, 8, split=False, tma=True, full=True, regs=96),
    "dq": Tiles(8, 8, 8, 8, stages=3, regs=128),
    "dkdv": Tiles(8, 8, 8, 8, stages=3),
}
_SHIPPED = dict(TILES)  # (``_tiles`` tells them from a benchmark's own by identity)
# The caps above are Hopper's (sm90: 64 K registers and 228 KiB of shared memory an SM). Before
# Hopper the kernels load through pointers and multiply with mma.sync, which needs more registers:
# built for sm80, sm86 and sm89 (benchmarks/kernel_build.py --arch, the preset's layer), the
# forward capped at 96 spills 140-160 B, 30 local loads and stores a tile in its loop, while shared
# memory alone holds it to 4 programs an SM on sm80 (164 KiB) and 3 on sm86/89 (100 KiB). So there
# a kernel is capped at the most registers that still let shared memory's count of programs fit:
# the forward at 128 on sm80 (5 local accesses a tile) and 168 on sm86/89 (none); dQ stays at 128
# on sm80 (4 programs, 1 local access a tile) and goes uncapped on sm86/89 (2 programs by its 36
# KiB; 168 registers, no spills; capped at 128 it spilled). Derived offline, not timed on those GPUs.
_CAPS_BEFORE_HOPPER = {(8, 0): {"fwd": 128}, (8, 6): {"fwd": 168, "dq": None}, (8, 9): {"fwd": 168, "dq": None}}
# float32 (full-precision products on FMAs, for parity runs): 8 x 8 tiles spill kilobytes of
# registers on sm90; 4 x 8 do not.
TILES_FP32 = Tiles(4, 8, 4, 8)


def parse_named_tiles(text: str, names, parse) -> dict:
    """Tiles for the kernels ``names`` from ``SPEC`` (all alike) or ``name=SPEC,...`` (any of them),
    each SPEC read by ``parse``."""
    if "=" not in text:
        return dict.fromkeys(names, parse(text))
    out = {}
    for item in text.split(","):
        name, _, spec = item.partition("=")
        if name not in names or name in out:
            expected = ",".join(f"{n}=SPEC" for n in names)
            raise ValueError(f"tile set {text!r}: expected SPEC or {expected}, got {name!r}")
        out[name] = parse(spec)
    return out


def parse_tile_set(text: str) -> dict[str, Tiles]:
    """16-bit tiles for the three kernels from ``SPEC`` (all alike) or ``fwd=SPEC,dq=SPEC,dkdv=SPEC``
    (any of them; the rest keep ``TILES``'), SPEC in ``Tiles.parse``'s notation. What
    ``benchmarks/natten.py --best-tiles`` writes and ``benchmarks/scaling.py --attn-tiles`` reads."""
    return parse_named_tiles(text, TILES, Tiles.parse)


def run_tiles(text: str | None) -> dict[str, Tiles]:
    """A run's tiles (``model.attn_tiles``): the shipped ones where ``text`` is null, else those it
    names over the shipped (``parse_tile_set``'s notation; a GPU's products need 16 queries and 16
    keys a tile). ValueError, naming the problem, for anything else."""
    tiles = {**_SHIPPED, **(parse_tile_set(text) if text else {})}
    for name, t in tiles.items():
        _check_for_gpu(name, t)
    return tiles


def _check_for_gpu(name: str, tiles: Tiles) -> None:
    """Compiled, the kernels' matrix products sum over a tile's queries or keys, and Triton's need
    at least 16 terms (the interpreter takes fewer): ValueError otherwise."""
    if min(tiles.qh * tiles.qw, tiles.kh * tiles.kw) < 16:
        msg = "a GPU needs at least 16 queries and 16 keys per tile"
        raise ValueError(f"fused attention tiles {tiles} ({name}): {msg}")


def use_run_tiles(text: str | None) -> None:
    """Make ``run_tiles(text)`` the tiles this process's kernels launch with (``TILES``)."""
    TILES.update(run_tiles(text))


def format_tile_set(tiles: dict) -> str:
    """``parse_named_tiles``' notation for ``tiles`` (each one's ``str`` its SPEC)."""
    return ",".join(f"{name}={t}" for name, t in tiles.items())


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    """A CUDA device's compute capability (asked once: the kernels' launches ask each call)."""
    return torch.cuda.get_device_capability(device)


def copy_engine(capability: tuple[int, int]) -> bool:
    """A GPU of compute ``capability`` has Hopper's copy engine (TMA): without it the kernels load
    through pointers whatever their tiles ask."""
    return capability[0] >= 9


def tiles_on(name: str, capability: tuple[int, int]) -> Tiles:
    """``TILES[name]`` as a GPU of compute ``capability`` runs it: the shipped tiles with the
    register caps ``_CAPS_BEFORE_HOPPER`` gives that GPU, a benchmark's own tiles as set."""
    tiles = TILES[name]
    caps = _CAPS_BEFORE_HOPPER.get(tuple(capability), {}) if tiles is _SHIPPED[name] else {}
    return tiles._replace(regs=caps[name]) if name in caps else tiles


def _tiles(name: str, q: Tensor) -> Tiles:
    """The tiles kernel ``name`` runs with on ``q`` (``_check_for_gpu``'s, unless interpreted)."""
    if q.dtype == torch.float32:
        tiles = TILES_FP32
    else:
        tiles = tiles_on(name, _capability(q.device)) if q.is_cuda else TILES[name]
    if not _interpreted():
        _check_for_gpu(name, tiles)
    return tiles


def head_split(d: int, split: bool = True) -> tuple[int, int]:
    """``head_dim`` as the widths of two dot products, each a power of two >= 16 (Triton's
    minimum) or zero: 48 -> (32, 16), 64 -> (64, 0), 80 -> (64, 16); widths no such pair sums to
    are padded (24 -> (32, 0), 8 -> (16, 0)), as are all without ``split`` (48 -> (64, 0))."""
    p = 1 << (d.bit_length() - 1)
    rest = d - p
    if rest == 0 or (split and rest >= 16 and rest & (rest - 1) == 0):
        return max(p, 16), rest
    return max(2 * p, 16), 0


if triton is not None:

    @triton.jit
    def _window_start(pos, half, n, span):
        """First index of the clamped window around ``pos`` on an axis of ``n`` (``span`` wide)."""
        return tl.minimum(tl.maximum(pos - half, 0), n - span)

    @triton.jit
    def _first_query(key, half, span):
        """The first position whose window reaches ``key`` (windows start monotonically)."""
        reach = key - span + 1
        return tl.where(reach <= 0, 0, reach + half)

    @triton.jit
    def _last_query(key, half, n, span):
        """The last position whose window reaches ``key``."""
        return tl.where(key >= n - span, n - 1, key + half)

    @triton.jit
    def _offsets(rows, cols, s_r, s_c, WIDE: tl.constexpr):
        """Element offsets of the tokens at ``rows``, ``cols`` (64-bit if WIDE)."""
        if WIDE:  # (one return: a compiled kernel's branches must agree on its type)
            rows, cols = rows.to(tl.int64), cols.to(tl.int64)
        return rows * s_r + cols * s_c

    @triton.jit
    def _records(stats_ptr, b, h, st_b, st_h):
        """Where sample ``b``'s, head ``h``'s (lse, delta) records begin (``_stats``; strides in
        records). A record at offset ``o`` lies at element ``2 * o``: written so, Triton knows each is
        8-byte aligned and loads both of its values at once."""
        return stats_ptr + 2 * (b.to(tl.int64) * st_b + h.to(tl.int64) * st_h)

    @triton.jit
    def _load(base, offs, valid, D: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr):
        """A (tokens, head_dim) tile as its two column blocks (the second is the first when D1 == 0)."""
        offs = offs[:, None]
        d0 = tl.arange(0, D0)
        if D0 > D:  # padded head
            x0 = tl.load(base + offs + d0[None, :], mask=valid[:, None] & (d0[None, :] < D), other=0.0)
        else:
            x0 = tl.load(base + offs + d0[None, :], mask=valid[:, None], other=0.0)
        if D1 > 0:
            d1 = D0 + tl.arange(0, D1)
            x1 = tl.load(base + offs + d1[None, :], mask=valid[:, None], other=0.0)
        else:
            x1 = x0
        return x0, x1

    @triton.jit
    def _tile(
        src, src1, b, h, r, c, inner, valid, s_b, s_h, s_r, s_c,
        D: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, TH: tl.constexpr, TW: tl.constexpr,
        TMA: tl.constexpr, WIDE: tl.constexpr,
    ):  # fmt: skip
        """The (TH * TW, head_dim) tile of tokens from corner ``r``, ``c`` of sample ``b``, head
        ``h``, as two column blocks. With TMA, ``src`` and ``src1`` are tensor descriptors (blocks
        of D0 and D1 columns): the copy engine computes the addresses and fills what lies outside
        the tensor with zeros (tokens outside the windows, never scored); else ``src`` is the
        tensor's pointer, loaded where ``valid``, at the corner's offset plus ``inner`` (each
        token's offset within a tile, ``_offsets`` of its row and column in the tile: computed
        once per program, not per tile)."""
        if TMA:  # (an if/else: Triton compiles what follows a return in a static branch)
            x0 = src.load([b, h, r, c, 0]).reshape([TH * TW, D0])
            if D1 > 0:
                x1 = src1.load([b, h, r, c, D0]).reshape([TH * TW, D1])
            else:
                x1 = x0
        else:
            base = src + b.to(tl.int64) * s_b + h.to(tl.int64) * s_h + _offsets(r, c, s_r, s_c, WIDE)
            x0, x1 = _load(base, inner, valid, D, D0, D1)
        return x0, x1

    @triton.jit
    def _accumulators(M: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr):
        """Float32 zeros for a (M, head_dim) result's two column blocks (the second unused, and D0
        wide, when D1 == 0)."""
        return tl.zeros([M, D0], tl.float32), tl.zeros([M, D1 if D1 > 0 else D0], tl.float32)

    @triton.jit
    def _key_places(sk_r, sk_c, sv_r, sv_c, KH: tl.constexpr, KW: tl.constexpr, WIDE: tl.constexpr):
        """Each key's row and column in a ``KH x KW`` tile, and its offsets there in k and in v
        (``_tile``'s ``inner``): once per program, for the forward's and dQ's loops over key tiles."""
        n = tl.arange(0, KH * KW)
        n_r, n_c = n // KW, n % KW
        return n_r, n_c, _offsets(n_r, n_c, sk_r, sk_c, WIDE), _offsets(n_r, n_c, sv_r, sv_c, WIDE)

    @triton.jit
    def _keys_and_values(
        r, c, hi_r, hi_c, kv_off, b, h, k_src, k_src1, v_src, v_src1, n_r, n_c, k_inner, v_inner,
        sk_b, sk_h, sk_r, sk_c, sv_b, sv_h, sv_r, sv_c,
        D: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
        TMA: tl.constexpr, WIDE: tl.constexpr,
    ):  # fmt: skip
        """k and v (two column blocks each) of the key tile from global row ``r``, column ``c`` of a
        query tile's windows, whose union ends at ``hi_r``, ``hi_c``; ``n_r``, ``n_c``: each key's
        row and column in the tile, ``k_inner``, ``v_inner``: its offsets there (``_tile``)."""
        k_in = (n_r < hi_r - r) & (n_c < hi_c - c)  # the union's keys lie in the band (natten checks)
        k0, k1 = _tile(
            k_src, k_src1, b, h, r - kv_off, c, k_inner, k_in, sk_b, sk_h, sk_r, sk_c, D, D0, D1, KH, KW, TMA, WIDE
        )
        v0, v1 = _tile(
            v_src, v_src1, b, h, r - kv_off, c, v_inner, k_in, sv_b, sv_h, sv_r, sv_c, D, D0, D1, KH, KW, TMA, WIDE
        )
        return k0, k1, v0, v1

    @triton.jit
    def _store(base, offs, valid, x0, x1, D: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, ADD: tl.constexpr):
        """A (tokens, head_dim) tile from its two column blocks (``x1`` unused when D1 == 0);
        ADD: added where it lies by float32 atomic adds instead (relaxed order: only the sum is
        read, after the kernel)."""
        offs = offs[:, None]
        d0 = tl.arange(0, D0)
        mask0 = valid[:, None]
        if D0 > D:
            mask0 = mask0 & (d0[None, :] < D)
        _put(base + offs + d0[None, :], x0, mask0, ADD)
        if D1 > 0:
            _put(base + offs + D0 + tl.arange(0, D1)[None, :], x1, valid[:, None], ADD)

    @triton.jit
    def _put(ptr, x, mask, ADD: tl.constexpr):
        if ADD:
            tl.atomic_add(ptr, x, mask=mask, sem="relaxed")
        else:
            tl.store(ptr, x.to(ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _column_sums(ptr, base, offs, valid, D: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr):
        """Store at ``ptr`` the float32 sums over the ``valid`` tokens of the (tokens, head_dim) tile
        this program has just stored at ``base`` + ``offs`` (``_store``'s): its share of the projection
        bias's gradient. Read back (from L2) rather than summed from the float32 accumulators: any
        instruction on those after the loop made ptxas serialize the loop's warp-group products
        (its advisory C7515; 8% more instructions in the dK/dV loop). (A padding token's row is
        never stored, and loads as zeros: in registers it need not be, as a tile inside every
        window skips the window test that zeroes a padding key's scores.)"""
        tl.debug_barrier()  # every thread's stores of the tile before any thread's loads
        x0, x1 = _load(base, offs, valid, D, D0, D1)
        d0 = tl.arange(0, D0)
        tl.store(ptr + d0, tl.sum(x0.to(tl.float32), 0), mask=d0 < D)
        if D1 > 0:
            tl.store(ptr + D0 + tl.arange(0, D1), tl.sum(x1.to(tl.float32), 0))

    @triton.jit
    def _products(a0, a1, b0, b1, D1: tl.constexpr, PRECISION: tl.constexpr):
        """a @ b.T over the head dimension, from the two column blocks."""
        s = tl.dot(a0, tl.trans(b0), input_precision=PRECISION)
        if D1 > 0:
            s += tl.dot(a1, tl.trans(b1), input_precision=PRECISION)
        return s

    @triton.jit
    def _within(x, lo, n):
        """Whether ``x`` lies in ``[lo, lo + n)`` (broadcast): one unsigned comparison."""
        return (x - lo).to(tl.uint32, bitcast=True) < n

    @triton.jit
    def _windowed(s, fill, part_r, part_c, lo_r, lo_c, x_r, x_c, len_r, len_c):
        """``s`` where (x_r, x_c) lies in ``[lo_r, lo_r + len_r) x [lo_c, lo_c + len_c)`` (broadcast),
        else ``fill``: a key in a query's window, or a query among those whose windows reach a key.
        Each axis is tested only where its flag says some pair may fall outside it (a tile partial
        on one axis, most of them, skips the other's test). At head_dim 48 a score's mask costs about
        as much as its products, so every instruction here counts (the callers hoist all they can)."""
        if part_r:
            s = tl.where(_within(x_r, lo_r, len_r), s, fill)
        if part_c:
            s = tl.where(_within(x_c, lo_c, len_c), s, fill)
        return s

    @triton.jit
    def _aligned_origin(lo, first_full, hi, floor, T: tl.constexpr):
        """Where ``T``-wide tiles over ``[lo, hi)`` start: ``lo``, or up to ``T - 1`` before it (never
        below ``floor``, the first row or column in memory) so that a tile starts at ``first_full``,
        where the positions inside every window begin; not where that would take one more tile."""
        o = lo - (T - (first_full - lo) % T) % T
        return tl.where((o >= floor) & (tl.cdiv(hi - o, T) == tl.cdiv(hi - lo, T)), o, lo)

    @triton.jit
    def _tile_count(lo_r, hi_r, lo_c, hi_c, TH: tl.constexpr, TW: tl.constexpr):
        """(tiles, the column where each row of tiles ends) of ``TH x TW`` tiles covering
        ``[lo_r, hi_r) x [lo_c, hi_c)`` from its corner."""
        tiles_c = tl.cdiv(hi_c - lo_c, TW)
        return tl.cdiv(hi_r - lo_r, TH) * tiles_c, lo_c + tiles_c * TW

    @triton.jit
    def _next_tile(r, c, lo_c, end_c, KH: tl.constexpr, KW: tl.constexpr):
        """The tile after the one from row ``r``, column ``c`` of a region tiled row-major, whose
        rows of tiles span columns ``[lo_c, end_c)``: one flat loop rather than two nested ones,
        for the pipeliner. The loop carries its tile's corner: a corner worked out from the tile's
        number divides by the tiles a row (a runtime value: 25 instructions a tile in SASS)."""
        c = c + KW
        wrap = c >= end_c
        return tl.where(wrap, r + KH, r), tl.where(wrap, lo_c, c)

    @triton.jit
    def _query_tile(hq, w, q_off, grid_rows, half, span_r, span_c, QH: tl.constexpr, QW: tl.constexpr):
        """This program's sample, head and query tile: local rows, columns, which exist, each
        query's window start (global row, column; padding queries take the nearest real one's) and
        the union of the windows ``[lo_r, hi_r) x [lo_c, hi_c)`` (global). Programs run tiles
        fastest, then heads, then samples (grid axes 0, 1, 2)."""
        tiles_w = tl.cdiv(w, QW)
        r0, c0 = (tl.program_id(0) // tiles_w) * QH, (tl.program_id(0) % tiles_w) * QW
        m = tl.arange(0, QH * QW)
        rows, cols = r0 + m // QW, c0 + m % QW
        valid = (rows < hq) & (cols < w)
        ws_r = _window_start(tl.minimum(rows, hq - 1) + q_off, half, grid_rows, span_r)
        ws_c = _window_start(tl.minimum(cols, w - 1), half, w, span_c)
        lo_r = _window_start(r0 + q_off, half, grid_rows, span_r)
        hi_r = _window_start(tl.minimum(r0 + QH, hq) - 1 + q_off, half, grid_rows, span_r) + span_r
        lo_c = _window_start(c0, half, w, span_c)
        hi_c = _window_start(tl.minimum(c0 + QW, w) - 1, half, w, span_c) + span_c
        return tl.program_id(2), tl.program_id(1), rows, cols, valid, ws_r, ws_c, lo_r, hi_r, lo_c, hi_c

    @triton.jit
    def _key_origin(lo_r, hi_r, lo_c, hi_c, kv_off, span_r, span_c, KH: tl.constexpr, KW: tl.constexpr,
                    FULL: tl.constexpr):  # fmt: skip
        """Where a query tile's key tiles start: the corner of its windows' union, or with FULL
        aligned to where the keys inside all its windows begin (the last query's window start)."""
        if FULL:
            return (
                _aligned_origin(lo_r, hi_r - span_r, hi_r, kv_off, KH),
                _aligned_origin(lo_c, hi_c - span_c, hi_c, 0, KW),
            )
        return lo_r, lo_c

    @triton.jit
    def _key_tile_partial(r, c, lo_r, hi_r, lo_c, hi_c, span_r, span_c,
                          KH: tl.constexpr, KW: tl.constexpr, FULL: tl.constexpr):  # fmt: skip
        """Whether the key tile from ``r``, ``c`` needs the window test on rows, on columns: some key
        lies outside some window of the query tile on that axis (windows ``[lo, lo + span)`` to
        ``[hi - span, hi)``, starting monotonically). Without FULL, both (constants: no branch)."""
        if FULL:
            return (r < hi_r - span_r) | (r + KH > lo_r + span_r), (c < hi_c - span_c) | (c + KW > lo_c + span_c)
        return True, True

    @triton.jit
    def _query_tile_partial(r, c, a_r, b_r, a_c, b_c, QH: tl.constexpr, QW: tl.constexpr, FULL: tl.constexpr):
        """Whether the query tile at local ``r``, ``c`` needs the window test on rows, on columns: some
        query lies outside ``[a_r, b_r]``, ``[a_c, b_c]``, those whose windows hold the whole key tile
        on that axis. Without FULL, both."""
        if FULL:
            return (r < a_r) | (r + QH - 1 > b_r), (c < a_c) | (c + QW - 1 > b_c)
        return True, True

    @triton.jit
    def _fna_forward(
        q_ptr, k_src, k_src1, v_src, v_src1, o_ptr, lse_ptr,
        sq_b, sq_h, sq_r, sq_c, sk_b, sk_h, sk_r, sk_c, sv_b, sv_h, sv_r, sv_c,
        so_b, so_h, so_r, so_c, sl_b, sl_h, sl_r, sl_c,
        hq, w, q_off, kv_off, grid_rows, half, span_r, span_c, qk_scale,
        D: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, QH: tl.constexpr, QW: tl.constexpr,
        KH: tl.constexpr, KW: tl.constexpr, PRECISION: tl.constexpr, WIDE: tl.constexpr, TMA: tl.constexpr,
        FULL: tl.constexpr,
    ):  # fmt: skip
        b, h, rows, cols, valid, ws_r, ws_c, lo_r, hi_r, lo_c, hi_c = _query_tile(
            hq, w, q_off, grid_rows, half, span_r, span_c, QH, QW
        )
        o_r, o_c = _key_origin(lo_r, hi_r, lo_c, hi_c, kv_off, span_r, span_c, KH, KW, FULL)
        q_base = q_ptr + b.to(tl.int64) * sq_b + h.to(tl.int64) * sq_h
        q0, q1 = _load(q_base, _offsets(rows, cols, sq_r, sq_c, WIDE), valid, D, D0, D1)
        m_i = tl.full([QH * QW], float("-inf"), tl.float32)
        l_i = tl.zeros([QH * QW], tl.float32)
        acc0, acc1 = _accumulators(QH * QW, D0, D1)
        n_r, n_c, k_inner, v_inner = _key_places(sk_r, sk_c, sv_r, sv_c, KH, KW, WIDE)
        key_tiles, end_c = _tile_count(o_r, hi_r, o_c, hi_c, KH, KW)
        r, c = o_r, o_c
        for _ in range(0, key_tiles):
            k0, k1, v0, v1 = _keys_and_values(
                r, c, hi_r, hi_c, kv_off, b, h, k_src, k_src1, v_src, v_src1, n_r, n_c, k_inner, v_inner,
                sk_b, sk_h, sk_r, sk_c, sv_b, sv_h, sv_r, sv_c, D, D0, D1, KH, KW, TMA, WIDE,
            )  # fmt: skip
            s = _products(q0, q1, k0, k1, D1, PRECISION)  # unscaled: the scale joins exp2's argument
            part_r, part_c = _key_tile_partial(r, c, lo_r, hi_r, lo_c, hi_c, span_r, span_c, KH, KW, FULL)
            # (the key at tile place n_r, n_c is in the window from ws_r - r, ws_c - c of the tile)
            s = _windowed(s, float("-inf"), part_r, part_c, (ws_r - r)[:, None], (ws_c - c)[:, None],
                          n_r[None, :], n_c[None, :], span_r, span_c)  # fmt: skip
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)  # log2 units
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key of this tile yet
            p = tl.exp2(s * qk_scale - m_use[:, None])
            alpha = tl.exp2(m_i - m_use)
            l_i = l_i * alpha + tl.sum(p, 1)
            p = p.to(v0.dtype)
            acc0 = acc0 * alpha[:, None] + tl.dot(p, v0, input_precision=PRECISION)
            if D1 > 0:
                acc1 = acc1 * alpha[:, None] + tl.dot(p, v1, input_precision=PRECISION)
            m_i = m_new
            r, c = _next_tile(r, c, o_c, end_c, KH, KW)
        o_base = o_ptr + b.to(tl.int64) * so_b + h.to(tl.int64) * so_h
        inv = 1.0 / l_i
        o_offs = _offsets(rows, cols, so_r, so_c, WIDE)
        _store(o_base, o_offs, valid, acc0 * inv[:, None], acc1 * inv[:, None], D, D0, D1, False)
        l_offs = b.to(tl.int64) * sl_b + h.to(tl.int64) * sl_h + _offsets(rows, cols, sl_r, sl_c, WIDE)
        tl.store(lse_ptr + l_offs, m_i + tl.log2(l_i), mask=valid)

    @triton.jit
    def _statistics(
        do_ptr, o_ptr, lse_ptr, stats_ptr, b, h, rows, cols, valid, sd_b, sd_h, sd_r, sd_c,
        so_b, so_h, so_r, so_c, sl_b, sl_h, sl_r, sl_c, st_b, st_h, st_r, st_c,
        D: tl.constexpr, DP: tl.constexpr, WIDE: tl.constexpr,
    ):  # fmt: skip
        """The (lse, delta) records of the queries at ``rows``, ``cols`` (where ``valid``); returns
        (lse, delta). delta = rowsum(dO * O) in float32 from the 16-bit values, over the head
        padded to DP in one sum (the same order in either kernel that calls this)."""
        d = tl.arange(0, DP)
        mask = valid[:, None] & (d[None, :] < D)
        do_offs = _offsets(rows, cols, sd_r, sd_c, WIDE)[:, None] + d[None, :]
        do = tl.load(do_ptr + b.to(tl.int64) * sd_b + h.to(tl.int64) * sd_h + do_offs, mask=mask, other=0.0)
        o_offs = _offsets(rows, cols, so_r, so_c, WIDE)[:, None] + d[None, :]
        o = tl.load(o_ptr + b.to(tl.int64) * so_b + h.to(tl.int64) * so_h + o_offs, mask=mask, other=0.0)
        delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
        l_offs = b.to(tl.int64) * sl_b + h.to(tl.int64) * sl_h + _offsets(rows, cols, sl_r, sl_c, WIDE)
        lse = tl.load(lse_ptr + l_offs, mask=valid, other=0.0)
        rec = _records(stats_ptr, b, h, st_b, st_h) + 2 * _offsets(rows, cols, st_r, st_c, WIDE)
        tl.store(rec, lse, mask=valid)
        tl.store(rec + 1, delta, mask=valid)
        return lse, delta

    @triton.jit
    def _fna_delta(
        do_ptr, o_ptr, lse_ptr, stats_ptr, sd_b, sd_h, sd_r, sd_c, so_b, so_h, so_r, so_c, sl_b, sl_h, sl_r, sl_c,
        st_b, st_h, st_r, st_c, hq, w, D: tl.constexpr, DP: tl.constexpr, T: tl.constexpr, WIDE: tl.constexpr,
    ):  # fmt: skip
        """delta = rowsum(dO * O) of T queries of one sample and head, summed in float32 from dO
        and O as they lie (in eager torch that was float32 copies of both, their product and a
        sum: four passes over 16-bit tensors of the layer's size, 1 ms a layer on an H100),
        written with the query's lse as one (lse, delta) record (``_stats``)."""
        n = tl.program_id(0) * T + tl.arange(0, T)
        b, h = tl.program_id(2), tl.program_id(1)
        _statistics(
            do_ptr, o_ptr, lse_ptr, stats_ptr, b, h, n // w, n % w, n < hq * w, sd_b, sd_h, sd_r, sd_c,
            so_b, so_h, so_r, so_c, sl_b, sl_h, sl_r, sl_c, st_b, st_h, st_r, st_c, D, DP, WIDE,
        )  # fmt: skip

    @triton.jit
    def _fna_backward_dq(
        q_ptr, k_src, k_src1, v_src, v_src1, do_ptr, o_ptr, lse_ptr, stats_ptr, dq_ptr, sums_ptr,
        sq_b, sq_h, sq_r, sq_c, sk_b, sk_h, sk_r, sk_c, sv_b, sv_h, sv_r, sv_c,
        sd_b, sd_h, sd_r, sd_c, so_b, so_h, so_r, so_c, sl_b, sl_h, sl_r, sl_c,
        st_b, st_h, st_r, st_c, sg_b, sg_h, sg_r, sg_c,
        hq, w, q_off, kv_off, grid_rows, half, span_r, span_c, qk_scale, sm_scale,
        D: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, QH: tl.constexpr, QW: tl.constexpr,
        KH: tl.constexpr, KW: tl.constexpr, PRECISION: tl.constexpr, WIDE: tl.constexpr, TMA: tl.constexpr,
        FULL: tl.constexpr, DP: tl.constexpr, SUMS: tl.constexpr,
    ):  # fmt: skip
        """dQ of one query tile: the forward's loop, recomputing the probabilities from the lse.
        First its queries' (lse, delta) records, as ``_fna_delta`` writes them (the dK/dV kernel,
        launched after this one, reads them): a prologue on what this program reads anyway,
        instead of a kernel's pass over dO and O that divided by the grid's width per token.
        With SUMS also the tile's column sums, at ``sums_ptr`` (B, heads, tiles, D) (``_column_sums``)."""
        b, h, rows, cols, valid, ws_r, ws_c, lo_r, hi_r, lo_c, hi_c = _query_tile(
            hq, w, q_off, grid_rows, half, span_r, span_c, QH, QW
        )
        bh_q = b.to(tl.int64) * sq_b + h.to(tl.int64) * sq_h
        q0, q1 = _load(q_ptr + bh_q, _offsets(rows, cols, sq_r, sq_c, WIDE), valid, D, D0, D1)
        do_base = do_ptr + b.to(tl.int64) * sd_b + h.to(tl.int64) * sd_h
        do0, do1 = _load(do_base, _offsets(rows, cols, sd_r, sd_c, WIDE), valid, D, D0, D1)
        lse, delta = _statistics(
            do_ptr, o_ptr, lse_ptr, stats_ptr, b, h, rows, cols, valid, sd_b, sd_h, sd_r, sd_c,
            so_b, so_h, so_r, so_c, sl_b, sl_h, sl_r, sl_c, st_b, st_h, st_r, st_c, D, DP, WIDE,
        )  # fmt: skip
        dq0, dq1 = _accumulators(QH * QW, D0, D1)
        o_r, o_c = _key_origin(lo_r, hi_r, lo_c, hi_c, kv_off, span_r, span_c, KH, KW, FULL)
        n_r, n_c, k_inner, v_inner = _key_places(sk_r, sk_c, sv_r, sv_c, KH, KW, WIDE)
        key_tiles, end_c = _tile_count(o_r, hi_r, o_c, hi_c, KH, KW)
        r, c = o_r, o_c
        for _ in range(0, key_tiles):
            k0, k1, v0, v1 = _keys_and_values(
                r, c, hi_r, hi_c, kv_off, b, h, k_src, k_src1, v_src, v_src1, n_r, n_c, k_inner, v_inner,
                sk_b, sk_h, sk_r, sk_c, sv_b, sv_h, sv_r, sv_c, D, D0, D1, KH, KW, TMA, WIDE,
            )  # fmt: skip
            s = _products(q0, q1, k0, k1, D1, PRECISION)
            # (padding queries' rows are never stored and reach no other row)
            p = tl.exp2(s * qk_scale - lse[:, None])
            part_r, part_c = _key_tile_partial(r, c, lo_r, hi_r, lo_c, hi_c, span_r, span_c, KH, KW, FULL)
            p = _windowed(p, 0.0, part_r, part_c, (ws_r - r)[:, None], (ws_c - c)[:, None],
                          n_r[None, :], n_c[None, :], span_r, span_c)  # fmt: skip
            dp = _products(do0, do1, v0, v1, D1, PRECISION)
            ds = (p * (dp - delta[:, None])).to(k0.dtype)
            dq0 += tl.dot(ds, k0, input_precision=PRECISION)
            if D1 > 0:
                dq1 += tl.dot(ds, k1, input_precision=PRECISION)
            r, c = _next_tile(r, c, o_c, end_c, KH, KW)
        dq_base = dq_ptr + b.to(tl.int64) * sg_b + h.to(tl.int64) * sg_h
        offs = _offsets(rows, cols, sg_r, sg_c, WIDE)
        _store(dq_base, offs, valid, dq0 * sm_scale, dq1 * sm_scale, D, D0, D1, False)
        if SUMS:
            tile = (b * tl.num_programs(1) + h).to(tl.int64) * tl.num_programs(0) + tl.program_id(0)
            _column_sums(sums_ptr + tile * D, dq_base, offs, valid, D, D0, D1)

    @triton.jit
    def _fna_backward_dkdv(
        q_src, q_src1, k_ptr, v_ptr, do_src, do_src1, stats_ptr, dk_ptr, dv_ptr, dq_src, dq_src1, sums_ptr,
        sq_b, sq_h, sq_r, sq_c, sk_b, sk_h, sk_r, sk_c, sv_b, sv_h, sv_r, sv_c,
        sd_b, sd_h, sd_r, sd_c, st_b, st_h, st_r, st_c, sg_b, sg_h, sg_r, sg_c, sdq_b, sdq_h, sdq_r, sdq_c,
        hq, hk, w, q_off, kv_off, grid_rows, half, span_r, span_c, qk_scale, sm_scale,
        D: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, QH: tl.constexpr, QW: tl.constexpr,
        KH: tl.constexpr, KW: tl.constexpr, PRECISION: tl.constexpr, WIDE: tl.constexpr, TMA: tl.constexpr,
        FULL: tl.constexpr, ATOMIC: tl.constexpr, DQ_TMA: tl.constexpr, SUMS: tl.constexpr,
    ):  # fmt: skip
        """dK and dV of one key tile (local rows of the band), over the band's query tiles whose
        windows reach it; scores computed transposed, (keys, queries). dK and dV share strides.
        With ATOMIC, each query tile's share of dQ is also added to dQ (float32, zeroed): by the
        copy engine's bulk reductions through ``dq_src``/``dq_src1`` (descriptors) with DQ_TMA,
        else by each thread's atomic adds through the pointer ``dq_src``. With SUMS also the column
        sums of dK and of dV, at ``sums_ptr`` (B, heads, tiles, 2, D) (``_column_sums``)."""
        b, h = tl.program_id(2), tl.program_id(1)
        tiles_w = tl.cdiv(w, KW)
        r0, c0 = (tl.program_id(0) // tiles_w) * KH, (tl.program_id(0) % tiles_w) * KW
        n = tl.arange(0, KH * KW)
        k_rows, k_c = r0 + n // KW, c0 + n % KW
        k_valid = (k_rows < hk) & (k_c < w)
        k_r = k_rows + kv_off  # global
        k_base = k_ptr + b.to(tl.int64) * sk_b + h.to(tl.int64) * sk_h
        v_base = v_ptr + b.to(tl.int64) * sv_b + h.to(tl.int64) * sv_h
        k0, k1 = _load(k_base, _offsets(k_rows, k_c, sk_r, sk_c, WIDE), k_valid, D, D0, D1)
        v0, v1 = _load(v_base, _offsets(k_rows, k_c, sv_r, sv_c, WIDE), k_valid, D, D0, D1)
        # the queries (local rows of the query band) whose windows reach a key of this tile
        lo_r = tl.maximum(_first_query(r0 + kv_off, half, span_r) - q_off, 0)
        hi_r = tl.minimum(_last_query(tl.minimum(r0 + KH, hk) - 1 + kv_off, half, grid_rows, span_r) - q_off + 1, hq)
        lo_c = _first_query(c0, half, span_c)
        hi_c = _last_query(tl.minimum(c0 + KW, w) - 1, half, w, span_c) + 1
        dk0, dk1 = _accumulators(KH * KW, D0, D1)
        dv0, dv1 = _accumulators(KH * KW, D0, D1)
        m = tl.arange(0, QH * QW)
        m_r, m_c = m // QW, m % QW  # each query's place in its tile, and its offsets there:
        q_inner, do_inner = _offsets(m_r, m_c, sq_r, sq_c, WIDE), _offsets(m_r, m_c, sd_r, sd_c, WIDE)
        l_inner = _offsets(m_r, m_c, st_r, st_c, WIDE)
        dq_inner = _offsets(m_r, m_c, sdq_r, sdq_c, WIDE)  # (/atomic's adds; unused otherwise)
        records = _records(stats_ptr, b, h, st_b, st_h)
        # each key's queries, those whose windows hold it: local rows [qf_r, qf_r + qn_r), columns
        # [qf_c, qf_c + qn_c) (windows start monotonically). Per key, not per query and tile: the
        # window test of a score is then two subtractions and two comparisons. (Padding keys get
        # none: their k and v load as zeros and their dK, dV are never stored, so this is only
        # insurance against a score of theirs reaching a sum.)
        first_r = _first_query(k_r, half, span_r)  # global rows
        qn_r = tl.where(k_valid, _last_query(k_r, half, grid_rows, span_r) - first_r + 1, 0)
        qf_r = first_r - q_off  # local rows of the query band
        qf_c = _first_query(k_c, half, span_c)
        qn_c = _last_query(k_c, half, w, span_c) - qf_c + 1
        # the queries whose windows hold the whole key tile, [a_r, b_r] x [a_c, b_c] (local rows):
        # from the first whose window reaches its last key to the last whose window reaches its first
        a_r = _first_query(tl.minimum(r0 + KH, hk) - 1 + kv_off, half, span_r) - q_off
        b_r = _last_query(r0 + kv_off, half, grid_rows, span_r) - q_off
        a_c = _first_query(tl.minimum(c0 + KW, w) - 1, half, span_c)
        b_c = _last_query(c0, half, w, span_c)
        if FULL:
            lo_r = _aligned_origin(lo_r, a_r, hi_r, 0, QH)
            lo_c = _aligned_origin(lo_c, a_c, hi_c, 0, QW)
        query_tiles, end_c = _tile_count(lo_r, hi_r, lo_c, hi_c, QH, QW)
        if ATOMIC and not DQ_TMA:  # the threads' adds: this sample's and head's dQ pointer
            dq_src = dq_src + b.to(tl.int64) * sdq_b + h.to(tl.int64) * sdq_h
        r, c = lo_r, lo_c
        for _ in range(0, query_tiles):
            q_in = (m_r < hi_r - r) & (m_c < hi_c - c)
            # (with TMA, tokens of the query band past the range load: their windows miss the tile)
            q0, q1 = _tile(
                q_src, q_src1, b, h, r, c, q_inner, q_in, sq_b, sq_h, sq_r, sq_c, D, D0, D1, QH, QW, TMA, WIDE
            )
            do0, do1 = _tile(
                do_src, do_src1, b, h, r, c, do_inner, q_in, sd_b, sd_h, sd_r, sd_c, D, D0, D1, QH, QW, TMA, WIDE
            )
            rec = records + 2 * (_offsets(r, c, st_r, st_c, WIDE) + l_inner)
            both = tl.load(rec[:, None] + tl.arange(0, 2)[None, :], mask=q_in[:, None], other=0.0)
            lse, delta = tl.split(both)  # (one 8-byte load a query: half the loads, and their addresses)
            # (queries not loaded are zeros with lse = delta = 0: they add nothing, window or not)
            s = _products(k0, k1, q0, q1, D1, PRECISION)  # (keys, queries)
            p = tl.exp2(s * qk_scale - lse[None, :])
            part_r, part_c = _query_tile_partial(r, c, a_r, b_r, a_c, b_c, QH, QW, FULL)
            p = _windowed(p, 0.0, part_r, part_c, (qf_r - r)[:, None], (qf_c - c)[:, None],
                          m_r[None, :], m_c[None, :], qn_r[:, None], qn_c[:, None])  # fmt: skip
            dp = _products(v0, v1, do0, do1, D1, PRECISION)
            ds = (p * (dp - delta[None, :])).to(q0.dtype)
            p = p.to(do0.dtype)
            dv0 += tl.dot(p, do0, input_precision=PRECISION)
            dk0 += tl.dot(ds, q0, input_precision=PRECISION)
            if D1 > 0:
                dv1 += tl.dot(p, do1, input_precision=PRECISION)
                dk1 += tl.dot(ds, q1, input_precision=PRECISION)
            if ATOMIC:  # (queries outside the range: masked; their ds is zero anyway)
                ds_t = tl.trans(ds)
                dq0 = tl.dot(ds_t, k0, input_precision=PRECISION) * sm_scale
                if D1 > 0:
                    dq1 = tl.dot(ds_t, k1, input_precision=PRECISION) * sm_scale
                else:
                    dq1 = dq0
                if DQ_TMA:  # (rows past the band are dropped by the copy engine; the rest add 0)
                    dq_src.atomic_add([b, h, r, c, 0], dq0.reshape([1, 1, QH, QW, D0]))
                    if D1 > 0:
                        dq_src1.atomic_add([b, h, r, c, D0], dq1.reshape([1, 1, QH, QW, D1]))
                else:
                    _store(dq_src + _offsets(r, c, sdq_r, sdq_c, WIDE), dq_inner, q_in, dq0, dq1, D, D0, D1, True)
            r, c = _next_tile(r, c, lo_c, end_c, QH, QW)
        offs = _offsets(k_rows, k_c, sg_r, sg_c, WIDE)
        bh_g = b.to(tl.int64) * sg_b + h.to(tl.int64) * sg_h
        _store(dk_ptr + bh_g, offs, k_valid, dk0 * sm_scale, dk1 * sm_scale, D, D0, D1, False)
        _store(dv_ptr + bh_g, offs, k_valid, dv0, dv1, D, D0, D1, False)
        if SUMS:
            tile = (b * tl.num_programs(1) + h).to(tl.int64) * tl.num_programs(0) + tl.program_id(0)
            _column_sums(sums_ptr + 2 * tile * D, dk_ptr + bh_g, offs, k_valid, D, D0, D1)
            _column_sums(sums_ptr + (2 * tile + 1) * D, dv_ptr + bh_g, offs, k_valid, D, D0, D1)


# -- launches -------------------------------------------------------------------------------------


class _Geometry(NamedTuple):
    """The kernels' scalar arguments for one band."""

    heads: int
    hq: int
    hk: int
    w: int
    q_off: int
    kv_off: int
    grid_rows: int
    half: int
    span_r: int
    span_c: int


def _geometry(q: Tensor, k: Tensor, kernel: int, q_off: int, kv_off: int, grid_rows: int) -> _Geometry:
    _, heads, hq, w, _ = q.shape
    spans = min(kernel, grid_rows), min(kernel, w)
    return _Geometry(heads, hq, k.shape[2], w, q_off, kv_off, grid_rows, kernel // 2, *spans)


def _unit_head_stride(x: Tensor) -> Tensor:
    """``x`` itself when its head_dim is contiguous (the kernels' loads need it), else a copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _strides(x: Tensor) -> tuple[int, int, int, int]:
    """Strides of a (B, heads, rows, cols[, d]) tensor along batch, head, row, column."""
    return tuple(x.stride()[:4])  # type: ignore[return-value]


def _token_major(like: Tensor, rows: int, dtype: torch.dtype | None = None) -> Tensor:
    """A (B, heads, rows, W, d) tensor stored as (B, rows, W, heads, d): the layout in which the
    DiT merges heads for its output projection (a free reshape there)."""
    b, heads, _, w, d = like.shape
    return like.new_empty((b, rows, w, heads, d), dtype=dtype).permute(0, 3, 1, 2, 4)


def _row_stats(like: Tensor, rows: int) -> Tensor:
    """Float32 (B, heads, rows, W) per query (lse, delta), stored token-major like the output."""
    b, heads, _, w, _ = like.shape
    return like.new_empty((b, rows, w, heads), dtype=torch.float32).permute(0, 3, 1, 2)


def _forward_outputs(q: Tensor) -> tuple[Tensor, Tensor]:
    """The forward's out and lse for ``q``'s queries: the launch and the fake implementations
    allocate them here, so the layouts inductor plans by and the kernels write agree."""
    return _token_major(q, q.shape[2]), _row_stats(q, q.shape[2])


def _gradients(q: Tensor, k: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """dQ, dK, dV as ``natten_backward`` returns them (and its fake implementation says)."""
    return _token_major(q, q.shape[2]), _token_major(k, k.shape[2]), _token_major(k, k.shape[2])


def _wide(*tensors: Tensor) -> bool:
    """Some tensor's offsets within one (sample, head) reach 2**31: 64-bit offsets."""
    return any(sum((n - 1) * s for n, s in zip(t.shape[2:], t.stride()[2:])) >= 2**31 for t in tensors)


def _constants(q: Tensor, tiles: Tiles) -> dict:
    d = q.shape[-1]
    d0, d1 = head_split(d, tiles.split)
    return dict(
        D=d, D0=d0, D1=d1, QH=tiles.qh, QW=tiles.qw, KH=tiles.kh, KW=tiles.kw,
        PRECISION="ieee" if q.dtype == torch.float32 else None, FULL=tiles.full,
        num_warps=tiles.warps, num_stages=tiles.stages, **({"maxnreg": tiles.regs} if tiles.regs else {}),
    )  # fmt: skip


def _use_tma(tiles: Tiles, *tensors: Tensor) -> bool:
    """Load ``tensors``' tiles through tensor descriptors (Hopper's copy engine)? Where ``tiles``
    ask, Triton has host descriptors and each tensor meets TMA's alignment (16-byte base and
    strides); otherwise by pointers."""
    if not tiles.tma or _TensorDescriptor is None:
        return False
    if tensors[0].is_cuda and not copy_engine(_capability(tensors[0].device)):
        return False
    return all(_tma_aligned(t) for t in tensors)


def _tma_aligned(t: Tensor) -> bool:
    """16-byte base and strides, none zero (an expanded gradient has zero strides)."""
    return t.data_ptr() % 16 == 0 and all(s > 0 and s * t.element_size() % 16 == 0 for s in t.stride()[:-1])


def _sources(t: Tensor, th: int, tw: int, tiles: Tiles, tma: bool) -> tuple:
    """What a kernel reads ``t``'s (th x tw)-token tiles from: two descriptors (the head's two
    column blocks) with TMA, else the tensor twice (its pointer; the second unused)."""
    if not tma:
        return t, t
    d0, d1 = head_split(t.shape[-1], tiles.split)
    shape, strides = list(t.shape), list(t.stride())
    # (a zero-width second block would be refused: D1 == 0 never reads it, so the first stands in)
    return tuple(_TensorDescriptor(t, shape, strides, [1, 1, th, tw, w]) for w in (d0, d1 or d0))


def _atomic_dq(tiles: Tiles) -> bool:
    """dQ by the dK/dV kernel's atomic adds: where its tiles ask and torch's deterministic
    algorithms are off (the order of float32 additions, hence dQ's last bits, varies by run)."""
    return tiles.atomic and not torch.are_deterministic_algorithms_enabled()


def device_of(t: Tensor):
    """Triton launches on the current CUDA device: make it ``t``'s."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _scales(d: int) -> tuple[float, float]:
    """(softmax scale, the same in log2 units for exp2)."""
    sm_scale = 1.0 / math.sqrt(d)
    return sm_scale, sm_scale * math.log2(math.e)


@torch.library.custom_op("stormscope::natten_forward", mutates_args=())
def natten_forward(
    q: Tensor, k: Tensor, v: Tensor, kernel: int, q_row_offset: int, kv_row_offset: int, grid_rows: int
) -> tuple[Tensor, Tensor]:
    """The attention output (B, heads, Hq, W, d), stored token-major, and the float32 log2-sum-exp
    of each query's scores (B, heads, Hq, W)."""
    q, k, v = (_unit_head_stride(t) for t in (q, k, v))
    return _forward(q, k, v, kernel, q_row_offset, kv_row_offset, grid_rows)


def _forward(q: Tensor, k: Tensor, v: Tensor, kernel: int, q_row_offset: int, kv_row_offset: int, grid_rows: int):
    """The forward kernel's launch (``natten_forward``'s, and the packed op's)."""
    g = _geometry(q, k, kernel, q_row_offset, kv_row_offset, grid_rows)
    out, lse = _forward_outputs(q)
    tiles = _tiles("fwd", q)
    b = q.shape[0]
    grid = (triton.cdiv(g.hq, tiles.qh) * triton.cdiv(g.w, tiles.qw), g.heads, b)
    _, qk_scale = _scales(q.shape[-1])
    tma = _use_tma(tiles, k, v)
    sources = (*_sources(k, tiles.kh, tiles.kw, tiles, tma), *_sources(v, tiles.kh, tiles.kw, tiles, tma))
    with device_of(q):
        _fna_forward[grid](
            q, *sources, out, lse, *_strides(q), *_strides(k), *_strides(v), *_strides(out), *_strides(lse),
            g.hq, g.w, g.q_off, g.kv_off, g.grid_rows, g.half, g.span_r, g.span_c, qk_scale,
            WIDE=_wide(q, k, v, out), TMA=tma, **_constants(q, tiles),
        )  # fmt: skip
    return out, lse


@natten_forward.register_fake
def _(q, k, v, kernel, q_row_offset, kv_row_offset, grid_rows):
    return _forward_outputs(q)


# Queries per program of the delta kernel: a (64, 64) tile of each input, 8 KiB in 16 bits.
_DELTA_TOKENS = 64


def _stats(like: Tensor) -> Tensor:
    """Float32 (B, heads, Hq, W, 2): each query's (lse, delta) as one record, stored token-major.
    The dK/dV kernel reads both for every query tile of its loop; as one 8-byte load each, not two
    loads from two tensors, its loop issues 16 fewer loads a thread (and their address arithmetic)."""
    b, heads, hq, w, _ = like.shape
    return like.new_empty((b, hq, w, heads, 2), dtype=torch.float32).permute(0, 3, 1, 2, 4)


def _record_strides(stats: Tensor) -> tuple[int, int, int, int]:
    """``stats``' strides along batch, head, row, column, in records (``_records``)."""
    return tuple(s // 2 for s in stats.stride()[:4])  # type: ignore[return-value]


def _padded_head(x: Tensor) -> int:
    """The head dimension rounded up to a power of two (at least 16): ``_statistics``' block."""
    return max(16, triton.next_power_of_2(x.shape[-1]))


def _row_sums(grad: Tensor, out: Tensor, lse: Tensor, stats: Tensor, wide: bool) -> None:
    """delta = rowsum(dO * O) in float32, written into ``stats`` (``_stats``) beside each query's
    lse (read with lse's strides: lse may come back from a saved-tensor hook in another layout
    than the forward made); ``wide``: 64-bit offsets (the backward's choice, which covers all)."""
    b, heads, hq, w, d = grad.shape
    grid = (triton.cdiv(hq * w, _DELTA_TOKENS), heads, b)
    with device_of(grad):
        _fna_delta[grid](
            grad, out, lse, stats, *_strides(grad), *_strides(out), *_strides(lse), *_record_strides(stats), hq, w,
            D=d, DP=_padded_head(grad), T=_DELTA_TOKENS, WIDE=wide,
        )  # fmt: skip


@torch.library.custom_op("stormscope::natten_backward", mutates_args=())
def natten_backward(
    grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    kernel: int, q_row_offset: int, kv_row_offset: int, grid_rows: int,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """dQ, dK, dV (stored token-major) from the output's gradient and the forward's out and lse."""
    grad, q, k, v, out = (_unit_head_stride(t) for t in (grad, q, k, v, out))
    dq, dk, dv = _gradients(q, k)
    _backward_into(dq, dk, dv, grad, q, k, v, out, lse, kernel, q_row_offset, kv_row_offset, grid_rows)
    return dq, dk, dv


def _backward_into(
    dq_out: Tensor, dk: Tensor, dv: Tensor, grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    kernel: int, q_row_offset: int, kv_row_offset: int, grid_rows: int, sums: Tensor | None = None,
) -> None:  # fmt: skip
    """The backward kernels' launches, writing dQ, dK, dV into the tensors given (of q's and k's
    shapes, any strides with a unit head stride; dK and dV with the same strides), and with
    ``sums`` (float32, (3, heads, d)) the sums over tokens of dQ, dK and dV into it: the kernels
    sum each tile they store, a row of partial sums a program, added up here."""
    g = _geometry(q, k, kernel, q_row_offset, kv_row_offset, grid_rows)
    dkdv_tiles = _tiles("dkdv", q)
    atomic = _atomic_dq(dkdv_tiles)
    # (atomic: dQ is summed in float32, into the given tensor where it is float32, else in a
    # token-major buffer copied out after)
    if atomic:
        dq = dq_out.zero_() if dq_out.dtype == torch.float32 else _token_major(q, g.hq, torch.float32).zero_()
    else:
        dq = dq_out
    b = q.shape[0]
    sm_scale, qk_scale = _scales(q.shape[-1])
    scalars = (g.hq, g.w, g.q_off, g.kv_off, g.grid_rows, g.half, g.span_r, g.span_c, qk_scale, sm_scale)
    stats = _stats(grad)
    inputs = (*_strides(q), *_strides(k), *_strides(v), *_strides(grad))
    common = (*inputs, *_record_strides(stats))
    wide = _wide(grad, q, k, v, out, dq, dk, lse, stats)
    d = q.shape[-1]
    if atomic:  # (no dQ kernel to sum rowsum(dO * O) on the way: a kernel of its own)
        _row_sums(grad, out, lse, stats, wide)
    else:
        tiles = _tiles("dq", q)
        grid = (triton.cdiv(g.hq, tiles.qh) * triton.cdiv(g.w, tiles.qw), g.heads, b)
        tma = _use_tma(tiles, k, v)
        sources = (*_sources(k, tiles.kh, tiles.kw, tiles, tma), *_sources(v, tiles.kh, tiles.kw, tiles, tma))
        q_sums = stats if sums is None else q.new_empty((b, g.heads, grid[0], d), dtype=torch.float32)
        with device_of(q):
            _fna_backward_dq[grid](
                q, *sources, grad, out, lse, stats, dq, q_sums, *inputs, *_strides(out), *_strides(lse),
                *_record_strides(stats), *_strides(dq), *scalars, WIDE=wide, TMA=tma, DP=_padded_head(q),
                SUMS=sums is not None, **_constants(q, tiles),
            )  # fmt: skip
    tiles = dkdv_tiles
    grid = (triton.cdiv(g.hk, tiles.kh) * triton.cdiv(g.w, tiles.kw), g.heads, b)
    # (without sums the kernels take ``stats`` where the partial sums would go, and write nothing there)
    kv_sums = stats if sums is None else q.new_empty((b, g.heads, grid[0], 2, d), dtype=torch.float32)
    tma = _use_tma(tiles, q, grad)
    q_sources, grad_sources = (_sources(t, tiles.qh, tiles.qw, tiles, tma) for t in (q, grad))
    # dQ's shares through the copy engine's bulk reductions where the loads go through it too (the
    # interpreter has no descriptor reductions: its threads add)
    dq_tma = atomic and tma and not _interpreted() and _tma_aligned(dq)
    with device_of(q):
        _fna_backward_dkdv[grid](
            *q_sources, k, v, *grad_sources, stats, dk, dv, *_sources(dq, tiles.qh, tiles.qw, tiles, dq_tma), kv_sums,
            *common, *_strides(dk), *_strides(dq), scalars[0], g.hk, *scalars[1:],
            WIDE=wide, TMA=tma, ATOMIC=atomic, DQ_TMA=dq_tma, SUMS=sums is not None, **_constants(q, tiles),
        )  # fmt: skip
    if dq is not dq_out:
        dq_out.copy_(dq)
    if sums is not None:  # (atomic: dQ is whole only now, and summed here)
        sums[0] = dq.sum((0, 2, 3), dtype=torch.float32) if atomic else q_sums.sum((0, 2))
        sums[1:] = kv_sums.sum((0, 2)).transpose(0, 1)


@natten_backward.register_fake
def _(grad, q, k, v, out, lse, kernel, q_row_offset, kv_row_offset, grid_rows):
    return _gradients(q, k)


def _setup_context(ctx, inputs, output):
    q, k, v, kernel, q_row_offset, kv_row_offset, grid_rows = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)  # (an output for backward's use, not a function of the inputs to train)
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.band = (kernel, q_row_offset, kv_row_offset, grid_rows)


def _backward(ctx, grad, _grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = natten_backward(grad, q, k, v, out, lse, *ctx.band)
    return dq, dk, dv, None, None, None, None


natten_forward.register_autograd(_backward, setup_context=_setup_context)


# -- the projection whole: (B, rows, cols, 3, heads, d) in, its gradient out in one tensor ----------


def _heads(qkv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v (B, heads, rows, cols, d) of a (B, rows, cols, 3, heads, d) projection: views."""
    q, k, v = qkv.permute(3, 0, 4, 1, 2, 5).unbind(0)
    return q, k, v


@torch.library.custom_op("stormscope::natten_packed_forward", mutates_args=())
def natten_packed_forward(qkv: Tensor, bias: Tensor | None, kernel: int) -> tuple[Tensor, Tensor]:
    """``natten_forward`` of the q, k, v a (B, rows, cols, 3, heads, d) projection holds, over
    its whole grid: what the kernels read and compute is the same, but the backward below hands
    back the projection's gradient as one tensor, where three would be stacked into it by one
    more pass over 3 x the layer's activations (3.9 ms of the DiT preset's step on an H100).

    ``bias``: the projection's bias (3 x heads x d), already in ``qkv`` (the product's epilogue
    added it, detached) and not read here: its gradient, the sum over tokens of qkv's, comes from
    this op's backward, whose kernels sum what they hold (no pass over the projection's gradient
    of its own: 0.38 GB a DiT block at the preset's size)."""
    qkv = _unit_head_stride(qkv)
    return _forward(*_heads(qkv), kernel, 0, 0, qkv.shape[1])


@natten_packed_forward.register_fake
def _(qkv, bias, kernel):
    return _forward_outputs(_heads(qkv)[0])


@torch.library.custom_op("stormscope::natten_packed_backward", mutates_args=())
def natten_packed_backward(
    grad: Tensor, qkv: Tensor, out: Tensor, lse: Tensor, kernel: int, sums: bool
) -> tuple[Tensor, Tensor]:
    """The projection's gradient (B, rows, cols, 3, heads, d): the kernels write dQ, dK and dV
    into their places in it; with ``sums``, also its sums over tokens (3, heads, d; float32), else
    an empty tensor."""
    grad, qkv, out = (_unit_head_stride(t) for t in (grad, qkv, out))
    dqkv = qkv.new_empty(qkv.shape)
    col = qkv.new_empty(qkv.shape[3:] if sums else (0,), dtype=torch.float32)
    _backward_into(*_heads(dqkv), grad, *_heads(qkv), out, lse, kernel, 0, 0, qkv.shape[1], col if sums else None)
    return dqkv, col


@natten_packed_backward.register_fake
def _(grad, qkv, out, lse, kernel, sums):
    return qkv.new_empty(qkv.shape), qkv.new_empty(qkv.shape[3:] if sums else (0,), dtype=torch.float32)


def _setup_packed(ctx, inputs, output):
    qkv, bias, kernel = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(qkv, out, lse)
    ctx.kernel = kernel
    ctx.bias = None if bias is None else (bias.shape, bias.dtype)


def _backward_packed(ctx, grad, _grad_lse):
    qkv, out, lse = ctx.saved_tensors
    sums = ctx.bias is not None and ctx.needs_input_grad[1]
    dqkv, col = natten_packed_backward(grad, qkv, out, lse, ctx.kernel, sums)
    return dqkv, col.reshape(ctx.bias[0]).to(ctx.bias[1]) if sums else None, None


natten_packed_forward.register_autograd(_backward_packed, setup_context=_setup_packed)


def fused_neighbourhood_attention(
    q: Tensor, k: Tensor, v: Tensor, kernel: int, *, q_row_offset: int = 0, kv_row_offset: int = 0, grid_rows: int
) -> Tensor:
    """Neighbourhood attention of ``q`` over ``k``/``v`` (checked by the caller, ``natten``): the
    output (B, heads, Hq, W, d), stored as (B, Hq, W, heads, d)."""
    if not q.dtype == k.dtype == v.dtype:
        dtypes = f"{q.dtype}, {k.dtype}, {v.dtype}"
        raise ValueError(f"fused neighbourhood attention needs one dtype for q, k, v; got {dtypes}")
    return natten_forward(q, k, v, kernel, q_row_offset, kv_row_offset, grid_rows)[0]


def fused_packed_attention(qkv: Tensor, kernel: int, bias: Tensor | None = None) -> Tensor:
    """Neighbourhood attention over the whole grid of the q, k, v in one (B, rows, cols, 3, heads,
    d) projection (checked by the caller, ``natten``): the output as above, and in backward the
    projection's gradient as one tensor; with ``bias`` (the projection's, added to ``qkv``
    detached) its gradient too (``natten_packed_forward``)."""
    return natten_packed_forward(qkv, bias, kernel)[0]
