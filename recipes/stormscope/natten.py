"""2-D neighbourhood attention (NATTEN semantics) over a token grid, in plain PyTorch.

Every query at grid position (i, j) attends to a ``kernel x kernel`` window of keys. As in
NATTEN, the window is *clamped* into the grid rather than cropped: near an edge it shifts
inward, so every query sees exactly ``min(kernel, H) x min(kernel, W)`` keys. A kernel at
least as large as an axis means full attention along that axis.

Tensors use the grid layout ``(B, heads, rows, cols, head_dim)``. For domain parallelism
the rows can be a band of a larger grid: ``q`` covers global rows
``[q_row_offset, q_row_offset + Hq)``, ``k``/``v`` cover ``[kv_row_offset, kv_row_offset + Hk)``
of a grid with ``grid_rows`` rows, and windows are computed in global coordinates. A rank
holding its band plus ``kernel // 2`` halo rows from each neighbour thus reproduces the
unsharded rows exactly (see :func:`kv_rows_needed`). Columns are never split.

Implementations, all equal to :func:`dense_neighbourhood_attention` to float tolerance:

* ``"flex"``: ``flex_attention`` with a block mask, so only the blocks a window touches
  are computed (compiled on CUDA; CPU runs eager flex, forward only in torch 2.13).
* ``"reference"``: query rows in chunks, each against only the key rows its windows can
  reach, through ``scaled_dot_product_attention`` with a small additive mask. Memory is
  O(chunk * W * (chunk + kernel) * W) instead of O((H * W) ** 2). Inside
  :func:`shared_masks` (a DiT's forward) every layer reuses the masks of the first: the same
  geometry, made and kept for backward once per forward instead of once per layer.
* ``"fused"``: this recipe's Triton kernels (``fused_natten``): q, k, v read in place (any
  strides), 2-D tiles of queries and keys, the window mask per score, no block mask; CUDA (or
  Triton's interpreter), else the reference with a warning.
* ``"auto"``: fused on CUDA (the fastest: 0.66x flex's time for the preset's layer on an H200),
  flex where Triton cannot take the dtype (head_dim >= 16), else reference.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import warnings

import torch
import torch.nn.functional as F

from framework import gpu_rules
from recipes.stormscope import fused_natten


@functools.cache
def _flex_api():
    """(BlockMask, flex_attention), or None without them. Imported on first use: the import
    pulls in torch's compiler stack, which a process that never runs flex should not load."""
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention
    except ImportError:  # pragma: no cover
        return None
    return BlockMask, flex_attention


IMPLS = ("auto", "flex", "fused", "reference")

# Score elements (batch * heads * queries * keys) one reference chunk may hold: ~512 MiB fp32.
_REFERENCE_SCORE_BUDGET = 1 << 27


def check_kernel(kernel: int) -> None:
    if not isinstance(kernel, int) or kernel < 1 or kernel % 2 == 0:
        raise ValueError(f"neighbourhood attention kernel must be a positive odd integer, got kernel={kernel!r}")


def window_starts(pos: torch.Tensor, kernel: int, n: int) -> torch.Tensor:
    """First key index of each query's window along an axis of length ``n`` (clamped inward)."""
    k = min(kernel, n)
    return (pos - kernel // 2).clamp(0, n - k)


def kv_rows_needed(q_start: int, q_stop: int, kernel: int, grid_rows: int) -> tuple[int, int]:
    """Global key rows ``[start, stop)`` that the windows of query rows ``[q_start, q_stop)`` touch.

    Window starts grow monotonically with the query row, so the first and last query rows bound
    the range. Interior bands need ``kernel // 2`` rows either side; a band touching a grid edge
    may need more on the other side (its windows shift inward), which is why the first and last
    band of a split should hold at least ``kernel // 2 + 1`` rows.
    """
    check_kernel(kernel)
    k = min(kernel, grid_rows)

    def start(pos: int) -> int:  # window_starts on a plain int: no tensor, so no graph break when compiled
        return min(max(pos - kernel // 2, 0), grid_rows - k)

    return start(q_start), start(q_stop - 1) + k


def _axis_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, kernel: int, n: int) -> torch.Tensor:
    """(len(q_pos), len(k_pos)) bool: key position inside the query's clamped window."""
    start = window_starts(q_pos, kernel, n)[:, None]
    return (k_pos[None, :] >= start) & (k_pos[None, :] < start + min(kernel, n))


def _grid_mask(q_rows, k_rows, cols, kernel, grid_rows, device) -> torch.Tensor:
    """Boolean (len(q_rows) * W, len(k_rows) * W) mask over flattened row-major tokens."""
    rows = _axis_mask(q_rows.to(device), k_rows.to(device), kernel, grid_rows)
    c = torch.arange(cols, device=device)
    col = _axis_mask(c, c, kernel, cols)
    return (rows[:, None, :, None] & col[None, :, None, :]).reshape(len(q_rows) * cols, len(k_rows) * cols)


def _check_band(q, k, v, kernel, q_row_offset, kv_row_offset, grid_rows) -> int:
    check_kernel(kernel)
    if q.dim() != 5 or k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3:] != k.shape[3:]:
        raise ValueError(
            f"expected q, k, v as (B, heads, rows, cols, head_dim) with equal B, heads, cols "
            f"and head_dim; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    hq, hk = q.shape[2], k.shape[2]
    if grid_rows is None:
        grid_rows = hq
    if q_row_offset < 0 or q_row_offset + hq > grid_rows:
        raise ValueError(f"query rows [{q_row_offset}, {q_row_offset + hq}) lie outside the grid of {grid_rows} rows")
    lo, hi = kv_rows_needed(q_row_offset, q_row_offset + hq, kernel, grid_rows)
    if lo < kv_row_offset or hi > kv_row_offset + hk:
        raise ValueError(
            f"query rows [{q_row_offset}, {q_row_offset + hq}) with kernel={kernel} on a {grid_rows}-row grid need "
            f"key rows [{lo}, {hi}), but k/v cover rows [{kv_row_offset}, {kv_row_offset + hk}); "
            f"pass more halo rows"
        )
    return grid_rows


def dense_neighbourhood_attention(
    q, k, v, kernel: int, *, q_row_offset: int = 0, kv_row_offset: int = 0, grid_rows: int | None = None
) -> torch.Tensor:
    """The definition: a full (Hq*W, Hk*W) boolean neighbourhood mask into SDPA. For tests/benchmarks."""
    grid_rows = _check_band(q, k, v, kernel, q_row_offset, kv_row_offset, grid_rows)
    b, h, hq, w, d = q.shape
    hk = k.shape[2]
    mask = _grid_mask(
        torch.arange(q_row_offset, q_row_offset + hq),
        torch.arange(kv_row_offset, kv_row_offset + hk),
        w,
        kernel,
        grid_rows,
        q.device,
    )
    out = F.scaled_dot_product_attention(
        q.reshape(b, h, hq * w, d), k.reshape(b, h, hk * w, d), v.reshape(b, h, hk * w, d), attn_mask=mask
    )
    return out.reshape(b, h, hq, w, d)


_MASKS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("natten_masks", default=None)


@contextlib.contextmanager
def shared_masks():
    """Within: reference attention calls share each chunk geometry's mask (one per forward)."""
    token = _MASKS.set({})
    try:
        yield
    finally:
        _MASKS.reset(token)


def _chunk_mask(g0: int, g1: int, lo: int, hi: int, w: int, kernel: int, grid_rows: int, like: torch.Tensor):
    """The additive (0 / -inf) mask of query rows [g0, g1) over key rows [lo, hi), in the dtype SDPA
    computes in (autocast's, where on: a mask in another dtype would be cast, a copy per call)."""
    dtype = torch.get_autocast_dtype(like.device.type) if torch.is_autocast_enabled(like.device.type) else like.dtype
    cache = None if torch.compiler.is_compiling() else _MASKS.get()
    key = (g0, g1, lo, hi, w, kernel, grid_rows, dtype, like.device)
    if cache is not None and key in cache:
        return cache[key]
    allowed = _grid_mask(torch.arange(g0, g1), torch.arange(lo, hi), w, kernel, grid_rows, like.device)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=like.device).masked_fill_(~allowed, float("-inf"))
    if cache is not None:
        cache[key] = mask
    return mask


def reference_neighbourhood_attention(
    q,
    k,
    v,
    kernel: int,
    *,
    q_row_offset: int = 0,
    kv_row_offset: int = 0,
    grid_rows: int | None = None,
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """Chunked exact neighbourhood attention: each chunk of query rows sees only the key rows it can reach."""
    grid_rows = _check_band(q, k, v, kernel, q_row_offset, kv_row_offset, grid_rows)
    b, h, hq, w, d = q.shape
    kr = min(kernel, grid_rows)
    if chunk_rows is None:
        # A chunk of n query rows scores against n + kernel - 1 key rows, so total work grows with
        # n + kernel - 1: half a kernel keeps the waste at ~1.5x with few SDPA calls, and the
        # score budget bounds memory on wide grids.
        chunk_rows = min(kr // 2 + 1, _REFERENCE_SCORE_BUDGET // max(1, b * h * w * w * 2 * kr))
    chunk_rows = max(1, min(hq, chunk_rows))
    outs = []
    # split, not slicing, for q: its backward is one concatenation instead of a full-size zero
    # gradient per chunk (k/v slabs overlap, so they must be sliced).
    for r0, qc in zip(range(0, hq, chunk_rows), q.split(chunk_rows, dim=2)):
        r1 = r0 + qc.shape[2]
        g0, g1 = q_row_offset + r0, q_row_offset + r1
        lo, hi = kv_rows_needed(g0, g1, kernel, grid_rows)
        mask = _chunk_mask(g0, g1, lo, hi, w, kernel, grid_rows, q)
        ks = k[:, :, lo - kv_row_offset : hi - kv_row_offset].reshape(b, h, (hi - lo) * w, d)
        vs = v[:, :, lo - kv_row_offset : hi - kv_row_offset].reshape(b, h, (hi - lo) * w, d)
        o = F.scaled_dot_product_attention(qc.reshape(b, h, (r1 - r0) * w, d), ks, vs, attn_mask=mask)
        outs.append(o.reshape(b, h, r1 - r0, w, d))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


# Flex's sparse block size (tokens per query and key block), as create_block_mask's default.
_FLEX_BLOCK = 128
# 2-D token tile that fills one flex block. In row-major order a 128-token block is under one
# row of a wide grid, so a query block's windows reach ~kernel rows of whole-row key blocks;
# an 8 x 16 tile reaches (8 + kernel - 1) x (16 + kernel - 1) tokens: ~2x fewer key blocks
# at kernel 31.
_TILE = (8, 16)
# Tiles of the other block size flex_options.py can measure: at kernel 31 on 128 x 160 tokens,
# 8 x 8 tiles of 64 tokens put 65.9% of the computed scores inside a window instead of 56.4%
# (a query tile's windows cover (8 + 30) x (8 + 30) tokens), at the cost of smaller kernel tiles.
_TILES = {128: _TILE, 64: (8, 8)}
# Token-mask elements one step of the block classification may hold (bool): 16 MiB.
_BLOCK_SCAN_BUDGET = 1 << 24


def tile_shape(rows: int, w: int, tiled: bool = True, block: int = _FLEX_BLOCK) -> tuple[int, int]:
    """Token tile of the flattened order: the tile of ``block`` tokens (``_TILES``) where the grid
    holds several flex blocks and is wide enough, else (1, w), which is plain row-major order."""
    th, tw = _TILES[block]
    return (th, tw) if tiled and w >= tw and rows * w > 2 * block else (1, w)


def _padded(rows: int, w: int, tile: tuple[int, int]) -> tuple[int, int]:
    """Rows and columns rounded up to whole tiles."""
    th, tw = tile
    return -(-rows // th) * th, -(-w // tw) * tw


def _positions(rows: int, w: int, tile: tuple[int, int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, col) of every position of the tiled order: tiles row-major, tokens row-major in a
    tile; rows and columns padded up to whole tiles."""
    rp, wp = _padded(rows, w, tile)
    return _tile_rc(torch.arange(rp * wp, device=device), tile, wp // tile[1])


def _tile_rc(idx, tile: tuple[int, int], tiles_per_row: int):
    """Tiled flattened index -> (row, col); the same arithmetic serves tensors and flex's mask_mod."""
    th, tw = tile
    t, e = idx // (th * tw), idx % (th * tw)
    return (t // tiles_per_row) * th + e // tw, (t % tiles_per_row) * tw + e % tw


def to_tiles(x: torch.Tensor, tile: tuple[int, int]) -> torch.Tensor:
    """(B, heads, rows, W, d) -> (B, heads, tokens, d) in the tiled order (zero padding)."""
    th, tw = tile
    b, h, rows, w, d = x.shape
    if tile == (1, w):
        return x.reshape(b, h, rows * w, d)
    rp, wp = _padded(rows, w, tile)
    x = F.pad(x, (0, 0, 0, wp - w, 0, rp - rows))
    return x.view(b, h, rp // th, th, wp // tw, tw, d).transpose(3, 4).reshape(b, h, rp * wp, d)


def from_tiles(x: torch.Tensor, tile: tuple[int, int], rows: int, w: int) -> torch.Tensor:
    """Inverse of :func:`to_tiles`, cropping the padding."""
    th, tw = tile
    b, h, _, d = x.shape
    if tile == (1, w):
        return x.reshape(b, h, rows, w, d)
    rp, wp = _padded(rows, w, tile)
    x = x.view(b, h, rp // th, wp // tw, th, tw, d).transpose(3, 4).reshape(b, h, rp, wp, d)
    return x[:, :, :rows, :w]


def _ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(count, indices) of the True key blocks per query block, True ones first, as flex expects."""
    counts = dense.sum(-1, dtype=torch.int32)
    indices = torch.argsort(dense.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return counts[None, None], indices[None, None]


def block_flags(
    hq: int,
    hk: int,
    w: int,
    kernel: int,
    q_row_offset: int,
    kv_row_offset: int,
    grid_rows: int,
    device,
    block: int = _FLEX_BLOCK,
    tile: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial, full): bool (query blocks, key blocks) of the band's token mask in the tiled
    order (``tile``; default row-major).

    A block pair is *full* when every query in it sees every key in it (flex then skips the
    mask there), *partial* when some do. The token mask factorises into a row mask and a column
    mask, so it is evaluated a few query blocks at a time in plain tensor ops: exact, bounded
    memory, and nothing to compile. Padding keys and blocks past the sequence ends count as
    masked, so a ragged last block is never full (as in ``create_block_mask``).
    """
    tile = tile or (1, w)
    qr, qc = _positions(hq, w, tile, device)
    kr, kc = _positions(hk, w, tile, device)
    q_len, kv_len = len(qr), len(kr)
    nq, nk = -(-q_len // block), -(-kv_len // block)
    (hq_pad, wp), hk_pad = _padded(hq, w, tile), _padded(hk, w, tile)[0]
    rows = _axis_mask(
        torch.arange(hq_pad, device=device) + q_row_offset,
        torch.arange(hk_pad, device=device) + kv_row_offset,
        kernel,
        grid_rows,
    )
    c = torch.arange(wp, device=device)
    cols = _axis_mask(c, c, kernel, w)
    k_valid = (kr < hk) & (kc < w)
    partial = torch.zeros(nq, nk, dtype=torch.bool, device=device)
    full = torch.zeros_like(partial)
    step = max(1, _BLOCK_SCAN_BUDGET // (block * nk * block))
    for b0 in range(0, nq, step):
        b1 = min(nq, b0 + step)
        qt = slice(b0 * block, min(b1 * block, q_len))
        m = rows[qr[qt]][:, kr] & cols[qc[qt]][:, kc] & k_valid
        m = F.pad(m, (0, nk * block - kv_len, 0, (b1 - b0) * block - m.shape[0]))
        seen = m.view(b1 - b0, block, nk, block).sum((1, 3))
        full[b0:b1] = seen == block * block
        partial[b0:b1] = (seen > 0) & ~full[b0:b1]
    return partial, full


def mask_mod_for(
    hk: int, w: int, kernel: int, q_row_offset: int, kv_row_offset: int, grid_rows: int, tile: tuple[int, int]
):
    """flex mask_mod of the band in the tiled order; the same clamped-window rule as _axis_mask."""
    kr, kc, r = min(kernel, grid_rows), min(kernel, w), kernel // 2
    per_row = -(-w // tile[1])  # tiles per row of the padded grid

    def mask_mod(b, h, q_idx, kv_idx):
        qi, qj = _tile_rc(q_idx, tile, per_row)
        ki, kj = _tile_rc(kv_idx, tile, per_row)
        real = (ki < hk) & (kj < w)  # not padding
        rs = (qi + q_row_offset - r).clamp(0, grid_rows - kr)
        cs = (qj - r).clamp(0, w - kc)
        ki = ki + kv_row_offset
        return real & (ki >= rs) & (ki < rs + kr) & (kj >= cs) & (kj < cs + kc)

    return mask_mod


@functools.lru_cache(maxsize=64)
def _block_mask(
    hq: int,
    hk: int,
    w: int,
    kernel: int,
    q_row_offset: int,
    kv_row_offset: int,
    grid_rows: int,
    device: torch.device,
    tile: tuple[int, int],
    block: int = _FLEX_BLOCK,
):
    """Flex block mask for one band geometry (``block`` tokens per sparse block), cached per geometry.

    Built from :func:`block_flags` rather than ``create_block_mask``: compiling that (the only
    fast way at 20k tokens) stalled for minutes in ptxas under torchrun on 2 H200s, and eager it
    materialises the whole (Q, KV) mask at once. The mask_mod is still needed: flex applies it
    inside partial blocks.
    """
    partial, full = block_flags(
        hq, hk, w, kernel, q_row_offset, kv_row_offset, grid_rows, device, block=block, tile=tile
    )
    lengths = tuple(r * c for r, c in (_padded(hq, w, tile), _padded(hk, w, tile)))
    return _flex_api()[0].from_kv_blocks(
        *_ordered(partial),
        *_ordered(full),
        BLOCK_SIZE=block,
        seq_lengths=lengths,
        mask_mod=mask_mod_for(hk, w, kernel, q_row_offset, kv_row_offset, grid_rows, tile),
    )


_EAGER_BLOCK_MASK = None  # _block_mask under torch.compiler.disable, made by prepare()


def prepare() -> None:
    """Make the block-mask builder run eagerly inside a compiled step: built once per geometry
    (the cache), not traced into every compiled step. Called when an attention module is built,
    outside any compile, and not at import: ``torch.compiler.disable`` imports dynamo (4.7 s),
    which every run paid through the registry before."""
    global _EAGER_BLOCK_MASK
    if _EAGER_BLOCK_MASK is None:
        _EAGER_BLOCK_MASK = torch.compiler.disable(_block_mask)


@functools.cache
def _compiled_flex():
    # One compiled callable shared by all calls; CUDA only (compiling on CPU costs ~20 s and CPU
    # flex has no backward anyway).
    return torch.compile(_flex_api()[1], dynamic=False)


# Flex's kernel geometry on Hopper (sm90) for 16-bit heads of 48: the fastest of inductor's own
# candidates (mode="max-autotune") at the StormScope preset's size (bf16, batch 4, 16 heads of
# 48, 128 x 160 tokens, kernel 31) on an H200: forward 3.63 ms instead of 4.23, backward 9.88
# instead of 11.01 per layer (benchmarks/flex_options.py). Fixed here rather than autotuned at
# run time, which cost a minute of the first step. Other head sizes and GPUs (not measured)
# keep flex's defaults.
_SM90_FLEX_OPTIONS = {
    "fwd_BLOCK_M": 128,
    "fwd_BLOCK_N": 64,
    "fwd_num_warps": 4,
    "fwd_num_stages": 3,
    "bwd_BLOCK_M1": 32,
    "bwd_BLOCK_N1": 64,
    "bwd_BLOCK_M2": 64,
    "bwd_BLOCK_N2": 32,
    "bwd_num_warps": 4,
    "bwd_num_stages": 3,
}


def _kernel_options(q: torch.Tensor, block: int = _FLEX_BLOCK) -> dict | None:
    """Kernel options for compiled flex on ``q``'s GPU (None: flex's defaults). Sparse blocks of
    64 tokens get kernel tiles of at most 64 tokens (flex's tiles must divide its blocks)."""
    tuned = q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] == 48 and _hopper(q)
    options = dict(_SM90_FLEX_OPTIONS) if tuned else None
    if block == 64:  # the Hopper table's warps and stages, with tiles that divide the blocks
        return {**(options or {}), **_TILES_OF_64}
    return options


def _hopper(q: torch.Tensor) -> bool:
    """``q`` is on an sm90 GPU (H100, H200)."""
    if q.device.type != "cuda":
        return False
    props = torch.cuda.get_device_properties(q.device)  # (dynamo folds this one to a constant)
    return (props.major, props.minor) == (9, 0)


# Kernel tiles for sparse blocks of 64 tokens: the Hopper table's backward, a 64-query forward.
# BACKEND: flex_attention's kernel, never flex_decoding's. Inductor (torch 2.11-2.13) lowers a
# forward of under 128 queries to flex_decoding, whose query tile is the next power of two of the
# query count (65-127 queries: 128), which no 64-token block is a multiple of, so every candidate
# is dropped ("NoValidChoicesError: No choices exist for backend"; the tiny DiT's 9 x 8 tokens).
_TILES_OF_64 = {
    "fwd_BLOCK_M": 64,
    "fwd_BLOCK_N": 64,
    "bwd_BLOCK_M1": 32,
    "bwd_BLOCK_N1": 64,
    "bwd_BLOCK_M2": 64,
    "bwd_BLOCK_N2": 32,
    "BACKEND": "TRITON",
}


def _block_runs(q: torch.Tensor, block: int) -> bool:
    """Flex can build sparse blocks of ``block`` tokens for ``q``. Of 64 tokens on CUDA only on
    Hopper with heads under 64: inductor (torch 2.11-2.14) drops every backward candidate whose
    default tiles do not divide the blocks before it applies the tiles asked for, and its defaults
    elsewhere are 128 wide."""
    if block == _FLEX_BLOCK or q.device.type != "cuda" or isinstance(q, torch._subclasses.FakeTensor):
        return True
    return _hopper(q) and q.shape[-1] < 64


def _check_block(q: torch.Tensor, block: int) -> None:
    """Refuses a block size flex is not set up for, or cannot build here (``_block_runs``)."""
    if block not in _TILES:
        raise ValueError(f"flex neighbourhood attention: block must be one of {sorted(_TILES)}, got {block!r}")
    if not _block_runs(q, block):
        props = torch.cuda.get_device_properties(q.device)
        raise NotImplementedError(
            f"flex in blocks of {block} tokens needs a Hopper GPU (sm90) and heads of fewer than 64 "
            f"(here sm{props.major}{props.minor}, heads of {q.shape[-1]})"
        )


BLOCKS = (None, *sorted(_TILES))  # model.attn_block: None picks (``auto_block``)


def auto_block(q: torch.Tensor) -> int:
    """Flex's sparse block where ``model.attn_block`` is null: 64 tokens (8 x 8 tiles) for 16-bit
    heads under 64 on Hopper, where it is the faster (StormScope's layer on an H200: forward 3.14
    instead of 3.63 ms, backward 7.21 instead of 9.78, benchmarks/flex_options.py --block 64),
    else 128 (where 64 is refused or not measured)."""
    if q.device.type != "cuda" or isinstance(q, torch._subclasses.FakeTensor) or not torch.cuda.is_available():
        return _FLEX_BLOCK
    return 64 if q.dtype in (torch.bfloat16, torch.float16) and _block_runs(q, 64) else _FLEX_BLOCK


def _flex_for(q: torch.Tensor):
    """flex_attention compiled for CUDA tensors; eager on CPU and for fake tensors (see above)."""
    if q.device.type == "cuda" and not isinstance(q, torch._subclasses.FakeTensor):
        return _compiled_flex()
    return _flex_api()[1]


def flex_neighbourhood_attention(
    q,
    k,
    v,
    kernel: int,
    *,
    q_row_offset: int = 0,
    kv_row_offset: int = 0,
    grid_rows: int | None = None,
    tiled: bool = True,
    block: int | None = _FLEX_BLOCK,
) -> torch.Tensor:
    """flex_attention over the flattened tokens (tiles of ``block`` tokens: 8 x 16 for 128, 8 x 8
    for 64, None: ``auto_block``; row-major with ``tiled=False`` or on small grids), skipping
    blocks no window touches."""
    if _flex_api() is None:
        raise NotImplementedError("this torch has no torch.nn.attention.flex_attention")
    grid_rows = _check_band(q, k, v, kernel, q_row_offset, kv_row_offset, grid_rows)
    block = auto_block(q) if block is None else block
    _check_block(q, block)
    hq, w, hk = q.shape[2], q.shape[3], k.shape[2]
    tile = tile_shape(max(hq, hk), w, tiled, block)
    prepare()  # a no-op after the first call (an attention module's construction makes it)
    assert _EAGER_BLOCK_MASK is not None
    qt, kt, vt = to_tiles(q, tile), to_tiles(k, tile), to_tiles(v, tile)
    geometry = (hq, hk, w, kernel, q_row_offset, kv_row_offset, grid_rows, q.device, tile, block)
    # A step traced on fake tensors (framework.plan, precompilation's discovery) must neither cache
    # a mask of fake tensors, which real steps would then read, nor run the compiled kernel, which
    # would launch on a fake tensor's pointers: both an illegal memory access on CUDA. Eager flex
    # gives the output's shape there.
    fake = isinstance(q, torch._subclasses.FakeTensor)
    mask = _block_mask.__wrapped__(*geometry) if fake else _EAGER_BLOCK_MASK(*geometry)
    fn = _flex_for(q)
    compiling = torch.compiler.is_compiling()  # eager flex traced into a compiled block
    # kernel options for compiled flex only: the compiled callable above, or flex traced here
    options = _kernel_options(q, block) if compiling or fn is not _flex_api()[1] else None
    if compiling:  # (dynamo cannot trace catch_warnings: the rest would run eager)
        out = fn(qt, kt, vt, block_mask=mask, kernel_options=options)
    else:
        with warnings.catch_warnings():  # eager (CPU) flex warns that it is not compiled: that is the point here
            warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
            out = fn(qt, kt, vt, block_mask=mask, kernel_options=options)
    return from_tiles(out, tile, hq, w)


_warned: set[str] = set()  # what _warn_once has said, by key


def _warn_once(message: str, key: str | None = None) -> None:
    """Warn once per ``key`` (default: the message itself)."""
    if (key or message) not in _warned:
        _warned.add(key or message)
        warnings.warn(message, stacklevel=3)


def _counting_flops() -> bool:
    if torch.compiler.is_compiling():  # compiled steps never run under a dispatch mode (train.compile)
        return False
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return any(type(m).__name__ == "_FlopCounterMode" for m in _get_current_dispatch_mode_stack())


def flex_supported(q: torch.Tensor) -> bool:
    """Whether flex runs for q: compiled flex needs head_dim >= 16 (torch 2.11-2.13 Triton kernels)."""
    return _flex_api() is not None and (q.device.type != "cuda" or q.shape[-1] >= 16)


def resolved_impl(impl: str, q: torch.Tensor) -> str:
    """The implementation ``impl`` means for ``q``: "auto" resolved, and "reference" where FLOPs are
    being counted (FlopCounterMode cannot trace flex's higher-order op nor see into the fused
    kernels: it counts the same math)."""
    if impl not in IMPLS:
        raise ValueError(f"neighbourhood attention impl must be one of {IMPLS}, got impl={impl!r}")
    if impl == "auto":
        if (q.is_cuda or gpu_rules.tracing_for_cuda()) and fused_natten.available(q):
            impl = "fused"
        elif q.is_cuda and flex_supported(q):
            impl = "flex"
        else:
            impl = "reference"
    return "reference" if impl != "reference" and _counting_flops() else impl


def takes_packed(impl: str, qkv: torch.Tensor) -> bool:
    """Whether ``impl`` runs the fused kernels on this (B, rows, cols, 3, heads, d) projection,
    which then take it whole (``packed_neighbourhood_attention``)."""
    return resolved_impl(impl, qkv) == "fused" and fused_natten.available(qkv)


def packed_neighbourhood_attention(qkv: torch.Tensor, kernel: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Neighbourhood attention over the whole grid of the q, k, v in ``qkv`` (B, rows, cols, 3,
    heads, d), as the projection leaves it, on the fused kernels (``takes_packed``): the output
    is ``neighbourhood_attention``'s, and backward writes the projection's gradient as one tensor
    (no pass stacking dQ, dK and dV into it). ``bias``: the projection's bias (3 x heads x d
    values), added to ``qkv`` detached; its gradient comes from the attention's backward kernels,
    which sum the projection's gradient on the way (no pass over it of its own)."""
    check_kernel(kernel)
    if qkv.dim() != 6 or qkv.shape[3] != 3:
        raise ValueError(f"expected qkv as (B, rows, cols, 3, heads, head_dim); got {tuple(qkv.shape)}")
    if bias is not None and bias.numel() != qkv.shape[3:].numel():
        raise ValueError(f"a bias of {bias.numel()} values for a projection of {qkv.shape[3:].numel()}")
    return fused_natten.fused_packed_attention(qkv, kernel, bias)


def neighbourhood_attention(
    q,
    k,
    v,
    kernel: int,
    *,
    impl: str = "auto",
    q_row_offset: int = 0,
    kv_row_offset: int = 0,
    grid_rows: int | None = None,
    block: int | None = None,
) -> torch.Tensor:
    """Neighbourhood attention of ``q`` (B, heads, Hq, W, d) over ``k``/``v`` (B, heads, Hk, W, d).

    ``impl``: "auto" (fused on CUDA, else reference), "flex" (falls back to
    reference, with a warning, where flex cannot run: backward on CPU, head_dim < 16 on CUDA),
    "fused" (likewise where Triton cannot run: CPU without its interpreter) or "reference".
    ``block``: flex's sparse block in tokens (64 or 128; None: ``auto_block``).
    """
    band = dict(q_row_offset=q_row_offset, kv_row_offset=kv_row_offset, grid_rows=grid_rows)
    impl = resolved_impl(impl, q)
    if impl == "fused":
        if fused_natten.available(q):
            grid_rows = _check_band(q, k, v, kernel, q_row_offset, kv_row_offset, grid_rows)
            return fused_natten.fused_neighbourhood_attention(
                q, k, v, kernel, q_row_offset=q_row_offset, kv_row_offset=kv_row_offset, grid_rows=grid_rows
            )
        _warn_once(
            "fused neighbourhood attention unavailable (it needs Triton and a CUDA tensor); "
            "using the reference implementation",
            key="fused-fallback",
        )
    if impl == "flex":
        try:
            if not flex_supported(q):
                raise NotImplementedError(f"flex needs head_dim >= 16 on CUDA, got {q.shape[-1]}")
            if block is not None and block in _TILES and not _block_runs(q, block):
                # a size asked for (model.attn_block) that this GPU cannot take: flex's 128-token
                # blocks, not the far slower reference
                _warn_once(f"flex blocks of {block} tokens need Hopper and heads under 64; using {_FLEX_BLOCK}")
                block = _FLEX_BLOCK
            return flex_neighbourhood_attention(q, k, v, kernel, block=block, **band)
        except NotImplementedError as e:
            message = f"flex neighbourhood attention unavailable ({e}); using the reference implementation"
            _warn_once(message, key="fallback")
    return reference_neighbourhood_attention(q, k, v, kernel, **band)
