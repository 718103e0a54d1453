"""Neighbourhood attention: every implementation equals dense masked attention, bands equal rows."""

from __future__ import annotations

import pytest
import torch

from recipes.stormscope import fused_natten, natten
from recipes.stormscope.natten import (
    _grid_mask,
    block_flags,
    dense_neighbourhood_attention,
    kv_rows_needed,
    neighbourhood_attention,
    reference_neighbourhood_attention,
    window_starts,
)

# (rows, cols, kernel): square, non-square, kernel larger than the grid, rows fewer than the kernel
CASES = [(6, 6, 3), (7, 9, 5), (9, 5, 7), (4, 4, 7), (3, 11, 5), (10, 3, 3)]


def qkv(rows, cols, heads=2, dim=8, batch=2, seed=0, requires_grad=True):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(batch, heads, rows, cols, dim, generator=g, dtype=torch.float64).requires_grad_(requires_grad)
        for _ in range(3)
    ]


def test_window_is_clamped_inward():
    # kernel 5 on 8 positions: the first queries share the window [0, 5), the last [3, 8).
    assert window_starts(torch.arange(8), 5, 8).tolist() == [0, 0, 0, 1, 2, 3, 3, 3]
    # kernel larger than the axis: everybody sees the whole axis
    assert window_starts(torch.arange(3), 7, 3).tolist() == [0, 0, 0]


def test_dense_mask_counts_keys():
    # Every query sees exactly min(k, H) * min(k, W) keys: use v = 1 with uniform scores -> check via counts.
    rows, cols, kernel = 7, 5, 3
    q = torch.zeros(1, 1, rows, cols, 1)
    k = torch.zeros_like(q)
    v = torch.arange(rows * cols, dtype=torch.float32).reshape(1, 1, rows, cols, 1)
    out = dense_neighbourhood_attention(q, k, v, kernel)
    # mean of the clamped window's values at the corner (0, 0): rows 0..2, cols 0..2
    assert out[0, 0, 0, 0, 0].item() == pytest.approx(v[0, 0, :3, :3].mean().item())
    # interior query (3, 2): rows 2..4, cols 1..3
    assert out[0, 0, 3, 2, 0].item() == pytest.approx(v[0, 0, 2:5, 1:4].mean().item())


@pytest.mark.parametrize("rows,cols,kernel", CASES)
def test_reference_equals_dense_forward_and_backward(rows, cols, kernel):
    q, k, v = qkv(rows, cols)
    dense = dense_neighbourhood_attention(q, k, v, kernel)
    g = torch.randn_like(dense)
    dq, dk, dv = torch.autograd.grad(dense, (q, k, v), g)
    for chunk in (1, 2, None):  # several chunkings, including one chunk for everything
        out = reference_neighbourhood_attention(q, k, v, kernel, chunk_rows=chunk)
        torch.testing.assert_close(out, dense)
        for a, b in zip(torch.autograd.grad(out, (q, k, v), g), (dq, dk, dv)):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("rows,cols,kernel", CASES)
def test_auto_on_cpu_equals_dense(rows, cols, kernel):
    q, k, v = qkv(rows, cols)
    torch.testing.assert_close(neighbourhood_attention(q, k, v, kernel), dense_neighbourhood_attention(q, k, v, kernel))


# grids big enough for 8 x 16 token tiles: whole tiles, and padding on both axes
TILED = [(24, 32, 7), (17, 33, 9), (40, 20, 5)]


@pytest.mark.parametrize("rows,cols,kernel", CASES + TILED)
@pytest.mark.parametrize("tiled", [True, False])
def test_flex_equals_dense_forward(rows, cols, kernel, tiled):
    # CPU flex has no backward in torch 2.13: forward only here, backward is covered on GPU.
    q, k, v = (t.detach().float() for t in qkv(rows, cols))
    from recipes.stormscope.natten import flex_neighbourhood_attention

    dense = dense_neighbourhood_attention(q, k, v, kernel)
    for block in (128, 64):  # sparse blocks of 128 tokens (8 x 16 tiles), and of 64 (8 x 8)
        out = flex_neighbourhood_attention(q, k, v, kernel, tiled=tiled, block=block)
        torch.testing.assert_close(out, dense, atol=1e-5, rtol=1e-5, msg=f"block {block}")


def test_blocks_of_64_get_tiles_and_kernel_tiles_that_divide_them():
    """Flex needs its kernel tiles to divide the sparse blocks: 64-token blocks (8 x 8 token tiles)
    get kernel tiles of at most 64 tokens; 128-token blocks keep flex's defaults off Hopper; other
    block sizes are refused (so are 64-token blocks on CUDA off Hopper or with heads of 64+, which
    inductor cannot build a backward for: not testable on CPU)."""
    q = torch.empty(1, 2, 64, 64, 48)
    assert natten.tile_shape(64, 64, block=64) == (8, 8) and natten.tile_shape(64, 64) == (8, 16)
    assert natten.tile_shape(4, 8, block=64) == (1, 8)  # too small a grid: row-major
    options = natten._kernel_options(q, block=64)
    assert options["fwd_BLOCK_M"] == 64 and all(64 % options[k] == 0 for k in options if "BLOCK" in k), options
    assert natten._kernel_options(q) is None  # CPU tensors, 128-token blocks: flex's defaults
    with pytest.raises(ValueError, match="block must be one of"):
        natten._check_block(q, 32)


@pytest.mark.parametrize("head_dim", [16, 48])
def test_flex_in_blocks_of_64_lowers_for_hopper_under_128_tokens(head_dim):
    """Compiled flex on fewer than 128 tokens (the tiny DiT's 9 x 8) in 64-token blocks, lowered by
    inductor for an H200 without one (benchmarks/flex_lowering.py): with natten's kernel options
    every template keeps a candidate. Without ``BACKEND``, torch 2.11-2.13 take flex_decoding for
    the forward, whose 128-query tile no 64-token block is a multiple of, and fail the compile
    with ``NoValidChoicesError`` (as on the H200)."""
    from tests.conftest import benchmark_json

    result = benchmark_json("flex_lowering.py", "--block", 64, "--tokens", 72, "--head-dim", head_dim, "--natten")
    assert result["error"] is None and result["options"]["BACKEND"] == "TRITON", result
    choices = dict(result["choices"])
    assert set(choices) == {"flex_attention", "flex_attention_backward"} and min(choices.values()) >= 1, result


def test_the_auto_block_is_128_off_hopper_and_asks_no_fake_tensor_its_device(monkeypatch):
    """model.attn_block null: 128-token blocks on CPU and for fake tensors (a step traced on a
    machine without the GPU must not query one); 64 on Hopper (GPU-marked test below)."""
    from framework import compat

    q = torch.empty(1, 2, 8, 8, 48, dtype=torch.bfloat16)
    assert natten.auto_block(q) == 128

    def no_query(_):
        raise AssertionError("queried the device")

    monkeypatch.setattr(natten, "_hopper", no_query)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU machine: the fake check decides
    with compat.fake_mode():
        assert natten.auto_block(torch.empty(1, 2, 8, 8, 48, dtype=torch.bfloat16, device="cuda")) == 128


def test_a_block_size_this_gpu_cannot_take_falls_back_to_128_token_flex_not_the_reference(monkeypatch):
    """model.attn_block=64 where flex cannot build such blocks (off Hopper, heads of 64+): flex in
    128-token blocks, with one warning, rather than the far slower reference attention."""
    used = []
    monkeypatch.setattr(natten, "_block_runs", lambda q, block: block == 128)
    monkeypatch.setattr(natten, "flex_neighbourhood_attention", lambda *a, block, **k: used.append(block) or a[0])
    monkeypatch.setattr(natten, "reference_neighbourhood_attention", None)  # a fallback would fail here
    monkeypatch.setattr(natten, "_warned", set())
    q, k, v = qkv(8, 8, requires_grad=False)
    with pytest.warns(UserWarning, match="flex blocks of 64 tokens need Hopper and heads under 64; using 128"):
        natten.neighbourhood_attention(q, k, v, 3, impl="flex", block=64)
    natten.neighbourhood_attention(q, k, v, 3, impl="flex", block=64)  # (warned once)
    natten.neighbourhood_attention(q, k, v, 3, impl="flex", block=None)
    assert used == [128, 128, None]
    with pytest.raises(ValueError, match="block must be one of"):
        natten._check_block(q, 32)


@pytest.mark.gpu
def test_the_auto_block_on_cuda_is_64_on_hopper_for_small_16_bit_heads_and_computes_the_same():
    """Where null picks 64-token blocks (Hopper, 16-bit heads under 64), the attention equals the
    one in 128-token blocks, gradients included; elsewhere it picks 128."""
    from recipes.stormscope.natten import flex_neighbourhood_attention

    q, k, v = (t.detach().to("cuda", torch.bfloat16).requires_grad_() for t in qkv(40, 36, dim=16))
    hopper = torch.cuda.get_device_capability() == (9, 0)
    assert natten.auto_block(q) == (64 if hopper else 128)
    assert natten.auto_block(q.float()) == 128 and natten.auto_block(q.new_empty(1, 1, 8, 8, 64)) == 128
    g = torch.randn_like(q)
    outs = []
    for block in (None, 128):
        out = flex_neighbourhood_attention(q, k, v, 9, block=block)
        outs.append((out, *torch.autograd.grad(out, (q, k, v), g)))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)


def test_auto_stays_on_the_reference_on_cpu_even_where_triton_would_interpret_the_kernels(monkeypatch):
    """The interpreter runs the fused kernels on CPU (the CPU tests use it), slowly: ``auto`` must
    never pick it for a CPU run."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q = torch.empty(1, 2, 8, 8, 16)
    if fused_natten.triton is not None:
        assert fused_natten.available(q)
    assert natten.resolved_impl("auto", q) == natten.resolved_impl("auto", q.bfloat16()) == "reference"
    assert natten.resolved_impl("fused", q) == "fused"


@pytest.mark.gpu
def test_auto_is_the_fused_kernels_on_cuda_and_flex_where_triton_cannot_take_the_dtype():
    q = torch.empty(1, 2, 8, 8, 16, device="cuda")
    assert natten.resolved_impl("auto", q) == natten.resolved_impl("auto", q.bfloat16()) == "fused"
    assert natten.resolved_impl("auto", q.double()) == "flex"
    assert natten.resolved_impl("auto", q[..., :8].double()) == "reference"  # flex needs heads of 16
    assert natten.resolved_impl("auto", q.cpu()) == "reference"


def test_a_plan_for_a_gpu_traces_the_fused_kernels_ops_not_the_reference():
    """mode=plan traces the step on fake CPU tensors as the planned GPU would run it: where Triton
    is installed, ``auto`` resolves to the fused kernels there too (their ops' fake outputs), so
    the plan holds the attention's output and log-sum-exp, not the chunked reference's scores (a
    compiled DiT at the preset's size: 41.2 GiB planned instead of 44.9, 35.4 measured)."""
    pytest.importorskip("triton")
    from framework import gpu_rules, plan, registry
    from framework.cli import compose
    from framework.config.validate import validate

    registry.load_providers()

    def activations(impl, device="cuda"):
        r = validate(compose(["recipe=tiny_stormscope", "precision=bf16", f"model.attn_impl={impl}"]))
        return plan.build(r, plan.configured(r, 1), plan.Machine(1, 1, None, device=device)).activations

    auto, fused, reference = activations("auto"), activations("fused"), activations("reference")
    assert auto == fused < reference, (auto, fused, reference)
    assert activations("auto", device="cpu") == activations("reference", device="cpu")  # a CPU runs the reference
    fake = torch._subclasses.FakeTensorMode().from_tensor(torch.empty(1, 2, 4, 4, 8))
    assert natten.resolved_impl("auto", fake) == "reference"  # only inside the plan's CUDA trace
    with gpu_rules.cuda_rules():
        assert natten.resolved_impl("auto", fake) == "fused"
    assert not gpu_rules.tracing_for_cuda()


def test_a_fake_tensor_trace_leaves_no_block_mask_in_the_cache():
    """Steps traced on fake tensors (mode=plan, precompilation's discovery) must not cache a mask
    of fake tensors for real steps to read, nor launch the compiled kernel on fake pointers: on
    CUDA either was an illegal memory access."""
    from framework import compat
    from recipes.stormscope.natten import flex_neighbourhood_attention

    rows, cols, kernel = 17, 33, 9
    q, k, v = (t.detach().float() for t in qkv(rows, cols))
    natten._block_mask.cache_clear()
    with compat.fake_mode() as fake:
        out = flex_neighbourhood_attention(*(fake.from_tensor(t) for t in (q, k, v)), kernel)
        assert isinstance(out, torch._subclasses.FakeTensor) and out.shape == q.shape
        # a fake CUDA tensor (no GPU needed) gets eager flex, not the compiled kernel
        assert natten._flex_for(torch.empty(1, device="cuda")) is natten._flex_api()[1]
    assert natten._block_mask.cache_info().currsize == 0
    torch.testing.assert_close(
        flex_neighbourhood_attention(q, k, v, kernel),
        dense_neighbourhood_attention(q, k, v, kernel),
        atol=1e-5,
        rtol=1e-5,
    )
    assert natten._block_mask.cache_info().currsize == 1


@pytest.mark.parametrize("rows,cols,kernel", TILED)
def test_tiled_order_round_trips_and_is_used_on_big_grids(rows, cols, kernel):
    x = qkv(rows, cols, requires_grad=False)[0]
    tile = natten.tile_shape(rows, cols)
    assert tile == natten._TILE
    flat = natten.to_tiles(x, tile)
    assert flat.shape[2] % (tile[0] * tile[1]) == 0
    assert torch.equal(flat[:, :, : tile[1]], x[:, :, 0, : tile[1]])  # the first tile's first row
    assert torch.equal(natten.from_tiles(flat, tile, rows, cols), x)


@pytest.mark.skipif(torch.cuda.is_available(), reason="flex has a backward on CUDA")
def test_flex_falls_back_where_it_cannot_run(monkeypatch):
    import recipes.stormscope.natten as natten

    monkeypatch.setattr(natten, "_warned", set())
    q, k, v = (t.detach().float().requires_grad_() for t in qkv(5, 6))
    with pytest.warns(UserWarning, match="reference"):  # CPU flex has no backward: reference takes over
        out = neighbourhood_attention(q, k, v, 3, impl="flex")
    torch.testing.assert_close(out, dense_neighbourhood_attention(q, k, v, 3))
    out.sum().backward()
    assert q.grad is not None


@pytest.mark.parametrize("kernel", [2, 4, 0, -3])
def test_even_kernel_raises(kernel):
    q, k, v = qkv(4, 4)
    with pytest.raises(ValueError, match=f"kernel={kernel}"):
        neighbourhood_attention(q, k, v, kernel)


def test_unknown_impl_raises():
    q, k, v = qkv(4, 4)
    with pytest.raises(ValueError, match="impl"):
        neighbourhood_attention(q, k, v, 3, impl="natten")


def split_rows(n, parts):
    """Uneven bands: sizes differ by at most one, larger ones first."""
    base, extra = divmod(n, parts)
    bounds, start = [], 0
    for p in range(parts):
        stop = start + base + (p < extra)
        bounds.append((start, stop))
        start = stop
    return bounds


@pytest.mark.parametrize(
    "rows,cols,kernel,parts", [(12, 5, 5, 3), (13, 4, 5, 3), (10, 7, 3, 4), (17, 6, 7, 4), (9, 9, 5, 2)]
)
@pytest.mark.parametrize("impl", ["reference", "auto"])
def test_band_with_halo_equals_rows_of_full(rows, cols, kernel, parts, impl):
    q, k, v = qkv(rows, cols)
    full = dense_neighbourhood_attention(q, k, v, kernel)
    g = torch.randn_like(full)
    full_grads = torch.autograd.grad(full, (q, k, v), g)
    halo = kernel // 2
    grads = [torch.zeros_like(t) for t in (q, k, v)]
    for a, b in split_rows(rows, parts):  # first, middle(s), last band
        lo, hi = max(0, a - halo), min(rows, b + halo)  # what a halo exchange delivers
        out = neighbourhood_attention(
            q[:, :, a:b],
            k[:, :, lo:hi],
            v[:, :, lo:hi],
            kernel,
            impl=impl,
            q_row_offset=a,
            kv_row_offset=lo,
            grid_rows=rows,
        )
        torch.testing.assert_close(out, full[:, :, a:b])
        # the band's grads, scattered back, must sum to the full grads (halo grads go to the owner)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), g[:, :, a:b])
        for acc, d in zip(grads, (dq, dk, dv)):
            acc += d
    for a, b in zip(grads, full_grads):
        torch.testing.assert_close(a, b)


def test_band_too_little_halo_raises():
    q, k, v = qkv(12, 4)
    with pytest.raises(ValueError, match=r"need key rows \[2, 10\).*cover rows \[3, 11\)"):
        neighbourhood_attention(
            q[:, :, 4:8], k[:, :, 3:11], v[:, :, 3:11], 5, q_row_offset=4, kv_row_offset=3, grid_rows=12
        )


def test_kv_rows_needed_at_edges():
    # interior: kernel // 2 either side; at the top the window shifts down, so more rows below
    assert kv_rows_needed(4, 8, 5, 12) == (2, 10)
    assert kv_rows_needed(0, 1, 5, 12) == (0, 5)
    assert kv_rows_needed(11, 12, 5, 12) == (7, 12)
    assert kv_rows_needed(0, 3, 9, 5) == (0, 5)  # kernel beyond the grid: all rows


# (q rows, k rows, cols, kernel, q offset, kv offset, grid rows): whole grids, bands with halos,
# lengths that are and are not multiples of the block, a kernel wider than the columns
BANDS = [
    (8, 8, 12, 5, 0, 0, 8),
    (4, 7, 20, 5, 4, 1, 8),
    (16, 20, 40, 7, 16, 13, 40),
    (10, 13, 33, 7, 10, 7, 30),
    (6, 6, 3, 9, 0, 0, 6),
    (5, 9, 16, 5, 0, 0, 20),
]


@pytest.mark.parametrize("hq,hk,w,kernel,qo,ko,grid", BANDS)
@pytest.mark.parametrize("budget", [1 << 24, 1])  # one pass, and one query block per pass
def test_block_flags_classify_every_block_of_the_token_mask(hq, hk, w, kernel, qo, ko, grid, budget, monkeypatch):
    monkeypatch.setattr(natten, "_BLOCK_SCAN_BUDGET", budget)
    block = 16
    m = _grid_mask(torch.arange(hq) + qo, torch.arange(hk) + ko, w, kernel, grid, "cpu")
    nq, nk = -(-hq * w // block), -(-hk * w // block)
    padded = torch.zeros(nq * block, nk * block, dtype=torch.bool)  # past the ends counts as masked
    padded[: hq * w, : hk * w] = m
    seen = padded.view(nq, block, nk, block).sum((1, 3))
    partial, full = block_flags(hq, hk, w, kernel, qo, ko, grid, "cpu", block=block)
    assert torch.equal(full, seen == block * block)
    assert torch.equal(partial, (seen > 0) & (seen < block * block))
    if kernel >= max(w, grid):  # full attention: every whole block is full
        assert full[0, 0]


def test_block_mask_equals_torchs_create_block_mask():
    from torch.nn.attention.flex_attention import create_block_mask

    hq, hk, w, kernel, qo, ko, grid = 24, 31, 40, 7, 24, 21, 64  # 960 x 1240 tokens: ragged 8 x 10 blocks
    kr, r = min(kernel, grid), kernel // 2

    def mask_mod(b, h, qi, ki):
        rs = (qi // w + qo - r).clamp(0, grid - kr)
        cs = (qi % w - r).clamp(0, w - kernel)
        return (ki // w + ko >= rs) & (ki // w + ko < rs + kr) & (ki % w >= cs) & (ki % w < cs + kernel)

    want = create_block_mask(mask_mod, None, None, hq * w, hk * w, device="cpu")
    got = natten._block_mask(hq, hk, w, kernel, qo, ko, grid, torch.device("cpu"), (1, w))
    assert got.seq_lengths == want.seq_lengths
    assert_same_blocks(got, want)


def assert_same_blocks(got, want):
    for name in (
        "kv_num_blocks",
        "kv_indices",
        "full_kv_num_blocks",
        "full_kv_indices",
        "q_num_blocks",
        "q_indices",
        "full_q_num_blocks",
        "full_q_indices",
    ):
        assert torch.equal(getattr(got, name), getattr(want, name)), name


@pytest.mark.parametrize("hq,hk,w,kernel,qo,ko,grid", BANDS)
@pytest.mark.parametrize("tile", [(2, 8), (4, 4)])
def test_tiled_block_flags_equal_create_block_mask_of_the_tiled_mask_mod(hq, hk, w, kernel, qo, ko, grid, tile):
    # The mask_mod is checked against dense attention by the flex tests; here block_flags must
    # classify its blocks exactly, padding keys included.
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask

    block = tile[0] * tile[1]
    mask_mod = natten.mask_mod_for(hk, w, kernel, qo, ko, grid, tile)
    lengths = [len(natten._positions(n, w, tile, "cpu")[0]) for n in (hq, hk)]
    want = create_block_mask(mask_mod, None, None, *lengths, device="cpu", BLOCK_SIZE=block)
    partial, full = block_flags(hq, hk, w, kernel, qo, ko, grid, "cpu", block=block, tile=tile)
    got = BlockMask.from_kv_blocks(
        *natten._ordered(partial),
        *natten._ordered(full),
        BLOCK_SIZE=block,
        mask_mod=mask_mod,
        seq_lengths=tuple(lengths),
    )
    assert_same_blocks(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("rows,cols,kernel", [(12, 20, 5), (9, 7, 7), (4, 30, 9), (32, 40, 31)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flex_cuda_equals_dense_forward_and_backward(rows, cols, kernel, dtype):
    q, k, v = (t.detach().to("cuda", dtype).requires_grad_() for t in qkv(rows, cols, dim=16))
    dense = dense_neighbourhood_attention(q, k, v, kernel)
    g = torch.randn_like(dense)
    want = torch.autograd.grad(dense, (q, k, v), g)
    out = neighbourhood_attention(q, k, v, kernel, impl="flex")
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out, dense, **tol)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), want):
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flex_cuda_in_blocks_of_64_equals_dense_forward_and_backward(dtype):
    """Sparse blocks of 64 tokens in 8 x 8 tiles, with their kernel tiles (benchmarks/flex_options.py
    --block 64 measures them): the same attention, gradients included."""
    from recipes.stormscope.natten import flex_neighbourhood_attention

    q, k, v = (t.detach().to("cuda", dtype).requires_grad_() for t in qkv(40, 36, dim=16))
    dense = dense_neighbourhood_attention(q, k, v, 9)
    g = torch.randn_like(dense)
    want = torch.autograd.grad(dense, (q, k, v), g)
    out = flex_neighbourhood_attention(q, k, v, 9, block=64)
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out, dense, **tol)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), want):
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.gpu
def test_flex_cuda_band_with_halo_equals_rows_of_full():
    q, k, v = (t.detach().to("cuda", torch.float32) for t in qkv(23, 20, dim=16))
    full = dense_neighbourhood_attention(q, k, v, 7)
    for a, b in split_rows(23, 3):
        lo, hi = max(0, a - 3), min(23, b + 3)
        out = neighbourhood_attention(
            q[:, :, a:b], k[:, :, lo:hi], v[:, :, lo:hi], 7, impl="flex", q_row_offset=a, kv_row_offset=lo, grid_rows=23
        )
        torch.testing.assert_close(out, full[:, :, a:b], atol=1e-4, rtol=1e-4)


def test_calls_inside_shared_masks_reuse_one_mask_per_chunk_geometry(monkeypatch):
    """A DiT's forward (natten.shared_masks) makes each chunk's mask once for all its layers, and
    keeps it for backward once; the values are those of separate masks."""
    made = []
    grid_mask = natten._grid_mask
    monkeypatch.setattr(natten, "_grid_mask", lambda *a: (made.append(a), grid_mask(*a))[1])
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 12, 8, 4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    alone = natten.reference_neighbourhood_attention(q, k, v, 5)
    per_call = len(made)
    assert per_call > 1  # several chunks
    with natten.shared_masks():
        first = natten.reference_neighbourhood_attention(q, k, v, 5)
        second = natten.reference_neighbourhood_attention(q, k, v, 5)
    assert len(made) == 2 * per_call  # the second layer made none
    assert torch.equal(first, alone) and torch.equal(second, alone)
    (first + second).sum().backward()  # the shared masks serve both backwards
    with natten.shared_masks():
        natten.reference_neighbourhood_attention(q, k, v, 5)
    assert len(made) == 3 * per_call  # a new forward, new masks
