"""The fused neighbourhood-attention kernels (recipes/stormscope/fused_natten.py).

On CPU they run under Triton's interpreter: `.ci/run` runs this file with ``TRITON_INTERPRET=1``
(set before Triton is imported; the README's suite, without it, runs only the tests that need no
kernel launch: the fallback, and the kernels' build for a Hopper GPU, which the interpreter never
does). The ``gpu`` tests run them compiled on CUDA.
"""

from __future__ import annotations

import os
import subprocess
import warnings

import pytest
import torch

pytest.importorskip("triton")

from recipes.stormscope import fused_natten, natten  # noqa: E402
from recipes.stormscope.dit import DiT, DiTBlock  # noqa: E402
from recipes.stormscope.natten import dense_neighbourhood_attention, kv_rows_needed  # noqa: E402
from tests.recipes.stormscope.kernel_devices import INTERPRETED, KERNEL_DEVICES

DEVICES = KERNEL_DEVICES
needs_kernels = pytest.mark.skipif(
    not INTERPRETED and not torch.cuda.is_available(), reason="needs CUDA or TRITON_INTERPRET=1 before Triton's import"
)

# (rows, cols, heads, head_dim, kernel): heads of 48 (two products: 32 + 16), 16, 24 and 8 (padded
# to 32 and 16), 64; windows inside the grid, a kernel wider than the grid, a grid narrower than a
# tile, ragged tiles on both axes
CASES = [
    (12, 20, 2, 48, 5),
    (9, 13, 1, 16, 7),
    (10, 11, 1, 24, 31),
    (6, 17, 2, 64, 3),
    (5, 3, 1, 8, 5),
]


def _qkv(shape, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g, dtype=dtype) for _ in range(4)]


def _values_and_grads(fn, q, k, v, dy):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    return (out, *torch.autograd.grad(out, leaves, dy))


def _close(got, want, atol, rtol=0.0):
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a.double().cpu(), b.double().cpu(), atol=atol, rtol=rtol, msg=name)


def _set_fp32_tiles(monkeypatch, tiles: str, device: str) -> None:
    """The float32 tests' tiles; those under 16 queries or keys run only interpreted."""
    parsed = fused_natten.Tiles.parse(tiles)
    if device == "cuda" and min(parsed.qh * parsed.qw, parsed.kh * parsed.kw) < 16:
        pytest.skip("a GPU's matrix products need tiles of 16 queries and 16 keys")
    monkeypatch.setattr(fused_natten, "TILES_FP32", parsed)


@needs_kernels
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
def test_fused_equals_dense_attention_forward_and_backward(device, case):
    rows, cols, heads, dim, kernel = case
    q, k, v, dy = _qkv((2, heads, rows, cols, dim))
    want = _values_and_grads(lambda q, k, v: dense_neighbourhood_attention(q, k, v, kernel), q, k, v, dy)

    def fused(q, k, v):
        return fused_natten.fused_neighbourhood_attention(q, k, v, kernel, grid_rows=rows)

    got = _values_and_grads(fused, *(t.float().to(device) for t in (q, k, v, dy)))
    _close(got, want, atol=2e-5)


@needs_kernels
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "tiles",
    [
        "8x8/8x8", "8x16/8x8", "16x8/4x16", "2x8/8x2", "8x8/8x8/4/2/pad", "8x8/8x8/4/2/tma", "4x8/8x4/4/2/pad/tma",
        "4x4/4x4/4/2/full", "4x4/4x4/4/2/pad/tma/full", "2x4/4x2/4/2/pad/tma/full",
        "4x8/8x4/4/2/atomic", "4x8/8x4/4/2/pad/tma/full/atomic", "4x8/8x4/4/2/r128",
    ],
)  # fmt: skip
def test_every_tile_shape_computes_the_same(device, tiles, monkeypatch):
    # the 16-bit tiles (8 x 8) and others a GPU may measure faster, on ragged grids, heads of 48
    # split (32 + 16) or padded (64), loaded by pointers or through tensor descriptors, tiles inside
    # every window without the window test, dQ added up by the dK/dV kernel (float32 here)
    _set_fp32_tiles(monkeypatch, tiles, device)
    if "tma" in tiles and fused_natten._TensorDescriptor is None:
        pytest.skip("this Triton has no tensor descriptors")
    rows, cols, heads, dim, kernel = 13, 21, 1, 48, 7
    q, k, v, dy = _qkv((1, heads, rows, cols, dim), seed=4)
    want = _values_and_grads(lambda q, k, v: dense_neighbourhood_attention(q, k, v, kernel), q, k, v, dy)

    def fused(q, k, v):
        return fused_natten.fused_neighbourhood_attention(q, k, v, kernel, grid_rows=rows)

    _close(_values_and_grads(fused, *(t.float().to(device) for t in (q, k, v, dy))), want, atol=2e-5)


# The kernels before their loops' integer work was cut (the window test per key, offsets per
# program, the (lse, delta) record): the same arithmetic, so the same bits. Where the checkout has
# no git history (the GPU machine's), FRAMEWORK_KERNELS_BEFORE names a copy of that revision's file.
_BEFORE_THE_INTEGER_CUT = os.environ.get("FRAMEWORK_KERNELS_BEFORE", "e498b67")


def _revision_present(rev: str) -> bool:
    if os.path.isfile(rev):
        return True
    from tests.conftest import REPO

    found = subprocess.run(["git", "cat-file", "-e", f"{rev}^{{commit}}"], cwd=REPO, capture_output=True)
    return found.returncode == 0


@needs_kernels
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tiles", [None, "8x8/8x8/4/2/pad/tma/full"])
def test_the_kernels_compute_what_they_computed_before_a_rewrite_bit_for_bit(device, tiles, monkeypatch):
    # benchmarks/natten.py --fused-at REV loads an earlier revision's kernels beside today's (its
    # ops in a namespace of their own). A rewrite that only moves integer work keeps every bit of
    # the outputs and gradients, on a whole grid with the packed projection and on a band; with
    # the defaults, and with every kernel on descriptor loads and the window test skipped on full
    # tiles (deterministic options only: atomic dQ's sums vary in order on a GPU).
    if not _revision_present(_BEFORE_THE_INTEGER_CUT):
        pytest.skip(f"this checkout lacks {_BEFORE_THE_INTEGER_CUT} (a shallow clone? FRAMEWORK_KERNELS_BEFORE)")
    if tiles and "tma" in tiles and fused_natten._TensorDescriptor is None:
        pytest.skip("this Triton has no tensor descriptors")
    from benchmarks.natten import fused_at

    before = fused_at(_BEFORE_THE_INTEGER_CUT)
    assert before.natten_forward._qualname != fused_natten.natten_forward._qualname  # both registered
    if tiles:
        for module in (before, fused_natten):
            monkeypatch.setattr(module, "TILES", dict.fromkeys(module.TILES, module.Tiles.parse(tiles)))
            monkeypatch.setattr(module, "TILES_FP32", module.Tiles.parse(tiles))
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(1, 13, 21, 3, 2, 48, generator=g).to(device, torch.bfloat16)
    dy = torch.randn(1, 2, 13, 21, 48, generator=g).to(device, torch.bfloat16)

    def packed(module):
        leaf = qkv.clone().requires_grad_()
        out = module.fused_packed_attention(leaf, 7)
        out.backward(dy)
        return out, leaf.grad

    torch.testing.assert_close(packed(fused_natten), packed(before), atol=0, rtol=0)
    q, k, v = (t.float() for t in qkv.permute(3, 0, 4, 1, 2, 5).unbind(0))
    lo, hi = kv_rows_needed(4, 9, 7, 13)

    def band(module):
        return lambda qb, kb, vb: module.fused_neighbourhood_attention(
            qb, kb, vb, 7, q_row_offset=4, kv_row_offset=lo, grid_rows=13
        )

    inputs = (q[:, :, 4:9], k[:, :, lo:hi], v[:, :, lo:hi], dy[:, :, 4:9].float())
    got, want = (_values_and_grads(band(m), *inputs) for m in (fused_natten, before))
    _close(got, want, atol=0)


def test_the_benchmarks_kernels_of_another_revision_load_from_a_copy_of_their_file(tmp_path):
    # The GPU machine's checkout has no git history: --fused-at then names a copy of the file. Its
    # ops are renamed; a file that would call an op through torch.ops (today's, after the rename)
    # is refused, and the runs' list of revisions is not handed to the one-run children.
    from benchmarks.natten import _strip_lists, fused_at

    source = open(fused_natten.__file__).read()
    copy = tmp_path / "fused_natten_then.py"
    copy.write_text(source)
    then = fused_at(str(copy))
    assert then.__file__ != fused_natten.__file__ and then.TILES == fused_natten.TILES
    assert then.natten_forward._qualname.startswith("stormscope_at_") and hasattr(then, "fused_packed_attention")
    calling = tmp_path / "calls_through_torch_ops.py"
    calling.write_text(source + "\n_op = torch.ops.stormscope.natten_forward\n")
    with pytest.raises(ValueError, match="custom ops"):
        fused_at(str(calling))
    argv = ["--device", "cuda", "--fused-at", "HEAD~1", "old.py", "--impls", "fused", "--batch", "4"]
    assert _strip_lists(argv) == ["--device", "cuda", "--batch", "4"]


@needs_kernels
@pytest.mark.parametrize("device", DEVICES)
def test_bands_with_halos_equal_the_rows_of_the_whole_grid(device):
    # What domain parallelism runs: each band's queries over its rows plus the halo rows its
    # windows reach, in global coordinates; edge bands' windows shift inward.
    rows, cols, kernel = 23, 10, 7
    q, k, v, dy = (t.float().to(device) for t in _qkv((1, 2, rows, cols, 48), seed=1))
    whole = _values_and_grads(lambda q, k, v: dense_neighbourhood_attention(q, k, v, kernel), q, k, v, dy)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for a, b in [(0, 5), (5, 13), (13, 23)]:
        lo, hi = kv_rows_needed(a, b, kernel, rows)

        def band(qb, kb, vb):
            return natten.neighbourhood_attention(
                qb, kb, vb, kernel, impl="fused", q_row_offset=a, kv_row_offset=lo, grid_rows=rows
            )

        out, dqb, dkb, dvb = _values_and_grads(band, q[:, :, a:b], k[:, :, lo:hi], v[:, :, lo:hi], dy[:, :, a:b])
        torch.testing.assert_close(out, whole[0][:, :, a:b], atol=2e-5, rtol=0)
        torch.testing.assert_close(dqb, whole[1][:, :, a:b], atol=2e-5, rtol=0)
        dk[:, :, lo:hi] += dkb  # the halo rows' gradients go back to their owners
        dv[:, :, lo:hi] += dvb
    torch.testing.assert_close(dk, whole[2], atol=2e-5, rtol=0)
    torch.testing.assert_close(dv, whole[3], atol=2e-5, rtol=0)


@needs_kernels
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "seed, tiles",
    [
        *((s, None) for s in range(6)), (7, "4x4/2x4/4/2/full"), (9, "4x4/4x4/4/2/full"),
        (11, "4x4/4x4/4/2/full/atomic"), (12, "4x8/4x4/4/2/atomic"), (13, "4x8/8x4/4/2/pad/tma/atomic"),
    ],
)  # fmt: skip
def test_random_bands_of_random_grids_equal_dense_attention(device, seed, tiles, monkeypatch):
    # any grid, kernel (wider than the grid included), band and halo the checks admit; odd seeds
    # take the 64-bit offsets a sample of 2**31 elements would; the /full ones skip the window test
    # on tiles inside every window (small tiles, so that there are such tiles, on a band whose key
    # tiles' corner may move back no further than its first key row); the /atomic ones add dQ up in
    # the dK/dV kernel, at the band's query offsets (with /tma on a GPU, by bulk reductions)
    if tiles:
        _set_fp32_tiles(monkeypatch, tiles, device)
    g = torch.Generator().manual_seed(seed)

    def pick(lo, hi):
        return int(torch.randint(lo, hi + 1, (), generator=g))

    grid_rows, cols, kernel = pick(2, 20), pick(1, 19), 2 * pick(0, 6) + 1
    a = pick(0, grid_rows - 1)
    b = pick(a + 1, grid_rows)
    lo, hi = kv_rows_needed(a, b, kernel, grid_rows)
    lo, hi = pick(0, lo), pick(hi, grid_rows)  # a halo at least as wide as needed
    if seed % 2:
        monkeypatch.setattr(fused_natten, "_wide", lambda *tensors: True)
    q, k, v, dy = _qkv((1, 2, grid_rows, cols, 16), seed=seed)
    band = dict(q_row_offset=a, kv_row_offset=lo, grid_rows=grid_rows)
    want = _values_and_grads(
        lambda q, k, v: dense_neighbourhood_attention(q, k, v, kernel, **band),
        q[:, :, a:b], k[:, :, lo:hi], v[:, :, lo:hi], dy[:, :, a:b],
    )  # fmt: skip

    def fused(q, k, v):
        return fused_natten.fused_neighbourhood_attention(q, k, v, kernel, **band)

    args = (q[:, :, a:b], k[:, :, lo:hi], v[:, :, lo:hi], dy[:, :, a:b])
    _close(_values_and_grads(fused, *(t.float().to(device) for t in args)), want, atol=2e-5)


@needs_kernels
@pytest.mark.parametrize("device", DEVICES)
def test_reads_the_projections_views_in_place_and_writes_heads_merged(device):
    # q, k, v as the DiT makes them: strided views of one (B, rows, cols, 3, heads, d) projection
    b, rows, cols, heads, dim = 2, 11, 14, 3, 48
    qkv = torch.randn(b, rows, cols, 3, heads, dim, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    dy = torch.randn(b, heads, rows, cols, dim, dtype=torch.float64)
    leaf = qkv.float().to(device).requires_grad_()
    q, k, v = leaf.permute(3, 0, 4, 1, 2, 5)
    assert not q.is_contiguous()
    out = fused_natten.fused_neighbourhood_attention(q, k, v, 5, grid_rows=rows)
    assert out.permute(0, 2, 3, 1, 4).is_contiguous()  # heads merge for the output projection without a copy
    (grad,) = torch.autograd.grad(out, leaf, dy.float().to(device))
    ref_leaf = qkv.clone().requires_grad_()
    ref = dense_neighbourhood_attention(*ref_leaf.permute(3, 0, 4, 1, 2, 5), 5)
    (ref_grad,) = torch.autograd.grad(ref, ref_leaf, dy)
    torch.testing.assert_close(out.double().cpu(), ref, atol=2e-5, rtol=0)
    torch.testing.assert_close(grad.double().cpu(), ref_grad, atol=2e-5, rtol=0)


class _Ops(torch.utils._python_dispatch.TorchDispatchMode):
    """The ops dispatched while active (a custom op counts once: its insides run below the mode)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@needs_kernels
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tiles", ["8x8/8x8/4/2", "8x8/8x8/4/2/atomic", "4x8/8x4/4/2/pad/tma/full"])
def test_the_packed_projection_computes_what_its_views_do_and_hands_back_one_gradient(device, tiles, monkeypatch):
    """The DiT's projection (B, rows, cols, 3, heads, d) whole: the output of the q, k, v views'
    op, bit for bit (the same kernels read the same memory), and its gradient written by the
    kernels in place, where the views' three gradients are stacked into it by another op. Also
    with dQ by atomic adds (into the float32 gradient's dQ view itself), and with the tiles
    loaded through tensor descriptors (k and v views start heads x d elements into the buffer)."""
    _set_fp32_tiles(monkeypatch, tiles, device)
    launched: list = []
    monkeypatch.setattr(fused_natten, "_fna_backward_dq", _Counted(fused_natten._fna_backward_dq, launched))
    b, rows, cols, heads, dim = 2, 9, 12, 2, 48
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(b, rows, cols, 3, heads, dim, generator=g).to(device)
    dy = torch.randn(b, heads, rows, cols, dim, generator=g).to(device)
    results, backward_ops = [], []
    for packed in (False, True):
        leaf = qkv.clone().requires_grad_()
        if packed:
            out = natten.packed_neighbourhood_attention(leaf, 5)
        else:
            out = fused_natten.fused_neighbourhood_attention(*leaf.permute(3, 0, 4, 1, 2, 5), 5, grid_rows=rows)
        with _Ops() as seen:
            (grad,) = torch.autograd.grad(out, leaf, dy)
        results.append((out, grad))
        assembling = ("aten.stack", "aten.cat", "aten.copy", "stormscope")
        backward_ops.append([op for op in seen.ops if op.startswith(assembling)])
    (want, want_grad), (got, got_grad) = results
    atomic = "atomic" in tiles
    assert launched == ([] if atomic else ["_fna_backward_dq"] * 2)  # (the dK/dV kernel adds dQ)
    assert torch.equal(got, want)
    if atomic:  # (float32 atomic adds: the order, hence the last bits, may vary on a GPU)
        torch.testing.assert_close(got_grad, want_grad, rtol=1e-6, atol=1e-7)
    else:
        assert torch.equal(got_grad, want_grad)
    want_out = dense_neighbourhood_attention(*qkv.double().permute(3, 0, 4, 1, 2, 5), 5)
    torch.testing.assert_close(got.double(), want_out, atol=2e-5, rtol=0)
    assert "aten.stack" in backward_ops[0], backward_ops[0]  # the views' gradients, assembled
    assert backward_ops[1] == ["stormscope.natten_packed_backward"], backward_ops[1]


def test_a_packed_projection_of_another_shape_is_refused_by_name():
    expected = r"expected qkv as \(B, rows, cols, 3, heads, head_dim\); got \(2, 4, 4, 2, 8\)"
    with pytest.raises(ValueError, match=expected):
        natten.packed_neighbourhood_attention(torch.zeros(2, 4, 4, 2, 8), 3)


@needs_kernels
@pytest.mark.parametrize("device", DEVICES)
def test_the_packed_ops_fake_and_autograd_registrations_pass_torchs_checks(device):
    """torch.library.opcheck on both ops: schema, fake (meta) implementation, autograd
    registration and the op's behaviour under dynamo agree with what the op computes."""
    g = torch.Generator().manual_seed(4)
    qkv = torch.randn(1, 6, 7, 3, 2, 16, generator=g).to(device).requires_grad_()
    bias = torch.randn(3 * 2 * 16, generator=g).to(device).requires_grad_()
    torch.library.opcheck(fused_natten.natten_packed_forward, (qkv, None, 3))
    torch.library.opcheck(fused_natten.natten_packed_forward, (qkv, bias, 3))
    out, lse = fused_natten.natten_packed_forward(qkv.detach(), None, 3)
    grad = torch.randn(out.shape, generator=g).to(device)
    for sums in (False, True):
        torch.library.opcheck(fused_natten.natten_packed_backward, (grad, qkv.detach(), out, lse, 3, sums))


@needs_kernels
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tiles", ["8x8/8x8/4/2", "8x8/8x8/4/2/atomic", "4x8/8x4/4/2/pad/tma/full"])
def test_the_projection_bias_learns_from_the_kernels_column_sums(device, tiles, monkeypatch):
    """A bias added to the projection detached and handed to the op gets autograd's gradient of
    the bias added as usual (the sum over tokens of qkv's gradient), from the backward kernels'
    per-program sums; on a ragged grid (padding queries and keys in the edge tiles, and with /full
    tiles inside every window that skip the window test), with dQ by atomic adds too."""
    _set_fp32_tiles(monkeypatch, tiles, device)
    b, rows, cols, heads, dim = 2, 9, 13, 2, 48
    g = torch.Generator().manual_seed(5)
    base = torch.randn(b, rows, cols, 3, heads, dim, generator=g).to(device)
    bias0 = torch.randn(3, heads, dim, generator=g).to(device)
    dy = torch.randn(b, heads, rows, cols, dim, generator=g).to(device)
    grads = []
    for packed in (False, True):
        x, bias = base.clone().requires_grad_(), bias0.clone().reshape(-1).requires_grad_()
        if packed:
            out = natten.packed_neighbourhood_attention(x + bias.detach().view(3, heads, dim), 5, bias)
        else:
            qkv = x + bias.view(3, heads, dim)
            out = fused_natten.fused_neighbourhood_attention(*qkv.permute(3, 0, 4, 1, 2, 5), 5, grid_rows=rows)
        grads.append(torch.autograd.grad(out, (x, bias), dy))
    (want_x, want_b), (got_x, got_b) = grads
    torch.testing.assert_close(got_x, want_x, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got_b, want_b, rtol=1e-5, atol=1e-5)
    assert got_b.abs().max() > 1  # (a gradient, not zeros)
    with pytest.raises(ValueError, match="a bias of 95 values for a projection of 288"):
        natten.packed_neighbourhood_attention(base, 5, bias0.reshape(-1)[:95])


@needs_kernels
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("atomic", [False, True], ids=["dq-kernel", "atomic-dq"])
def test_half_precision_is_as_close_as_sdpa_in_the_same_dtype(device, dtype, atomic, monkeypatch):
    # products in the inputs' dtype, softmax and sums in float32: about as far from the float64
    # truth as torch's own attention on the same rounded inputs (fp16 on CPU: 0.4-1.1e-3 each);
    # dQ summed in float32 by atomic adds, then rounded once, is no further
    if device == "cpu" and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter (3.9) multiplies bfloat16 tiles wrongly in tl.dot; the GPU runs this")
    monkeypatch.setitem(fused_natten.TILES, "dkdv", fused_natten.TILES["dkdv"]._replace(atomic=atomic))
    rows, cols, heads, dim, kernel = 12, 20, 2, 48, 7
    q, k, v, dy = (t.to(dtype).double() for t in _qkv((2, heads, rows, cols, dim), seed=3))
    truth = _values_and_grads(lambda q, k, v: dense_neighbourhood_attention(q, k, v, kernel), q, k, v, dy)
    low = [t.to(device=device, dtype=dtype) for t in (q, k, v, dy)]
    got = _values_and_grads(
        lambda q, k, v: fused_natten.fused_neighbourhood_attention(q, k, v, kernel, grid_rows=rows), *low
    )
    sdpa = _values_and_grads(lambda q, k, v: dense_neighbourhood_attention(q, k, v, kernel), *low)
    for name, a, s, t in zip(("out", "dq", "dk", "dv"), got, sdpa, truth):
        assert a.dtype == dtype
        err, err_sdpa = ((x.double().cpu() - t).abs().max().item() for x in (a, s))
        assert err <= 1.5 * err_sdpa + 1e-4, f"{name}: {err:.2e} against SDPA's {err_sdpa:.2e}"


class _Counted:
    """Stands in for a kernel: ``kernel[grid](...)`` launches it and notes its name."""

    def __init__(self, kernel, launched: list):
        self.kernel, self.launched = kernel, launched

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.launched.append(self.kernel.__name__)
            return self.kernel[grid](*args, **kw)

        return launch


@needs_kernels
@pytest.mark.parametrize("device", DEVICES)
def test_atomic_dq_is_one_backward_kernel_and_deterministic_algorithms_keep_two(device, monkeypatch):
    # /atomic on the dK/dV tiles: no dQ kernel, the same gradients; under torch's deterministic
    # algorithms (deterministic=true), whose results must not vary by run, the dQ kernel again
    _set_fp32_tiles(monkeypatch, "4x8/8x4/4/2/atomic", device)
    launched: list = []
    for name in ("_fna_delta", "_fna_backward_dq", "_fna_backward_dkdv"):
        monkeypatch.setattr(fused_natten, name, _Counted(getattr(fused_natten, name), launched))
    rows, cols, heads, dim, kernel = 11, 14, 2, 48, 5
    q, k, v, dy = _qkv((1, heads, rows, cols, dim), seed=6)
    want = _values_and_grads(lambda q, k, v: dense_neighbourhood_attention(q, k, v, kernel), q, k, v, dy)

    def fused(q, k, v):
        return fused_natten.fused_neighbourhood_attention(q, k, v, kernel, grid_rows=rows)

    args = [t.float().to(device) for t in (q, k, v, dy)]
    atomic = _values_and_grads(fused, *args)
    assert launched == ["_fna_delta", "_fna_backward_dkdv"]  # (rowsum(dO * O) first, in a kernel of its own)
    assert atomic[1].dtype == torch.float32 and atomic[1].stride() == atomic[2].stride()  # token-major
    _close(atomic, want, atol=2e-5)
    launched.clear()
    torch.use_deterministic_algorithms(True)
    try:
        two = _values_and_grads(fused, *args)
    finally:
        torch.use_deterministic_algorithms(False)
    assert launched == ["_fna_backward_dq", "_fna_backward_dkdv"]  # (rowsum(dO * O) in the dQ kernel)
    _close(two, want, atol=2e-5)


@needs_kernels
@pytest.mark.parametrize("device", DEVICES)
def test_a_dit_block_on_the_kernels_trains_as_on_the_reference_its_qkv_bias_included(device):
    # On the fused kernels the block adds qkv's bias detached and its gradient comes from the
    # attention backward's column sums: every gradient as with the reference attention
    torch.manual_seed(0)
    blocks = [DiTBlock(96, 2, 4.0, 5, rope=False, impl=impl).to(device) for impl in ("reference", "fused")]
    with torch.no_grad():
        for p in blocks[0].parameters():
            p.add_(torch.randn_like(p) * 0.05)
    blocks[1].load_state_dict(blocks[0].state_dict())
    x = torch.randn(2, 9, 12, 96, device=device, requires_grad=True)
    c = torch.randn(2, 96, device=device)
    (want, want_grads), (got, got_grads) = (
        (out, torch.autograd.grad(out.square().sum(), [x, *b.parameters()])) for b in blocks for out in [b(x, c)]
    )
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    names = ["x", *(n for n, _ in blocks[0].named_parameters())]
    for name, a, b in zip(names, got_grads, want_grads):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=name)
    assert want_grads[names.index("attn.qkv.bias")].abs().max() > 0.1  # (a gradient to compare)


@needs_kernels
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend, rope", [("aot_eager", False), ("inductor", False), ("inductor", True)])
def test_a_compiled_dit_block_has_no_graph_break_and_computes_the_same(device, backend, rope):
    # The kernels are custom ops with a registered backward: dynamo traces a whole DiT block
    # (what trainer.compile compiles; projection, kernels, output projection, MLP) as one graph,
    # forward and backward, where flex's block-mask builder breaks it (test_dit.py); inductor
    # lays out the ops' inputs and outputs by their fake implementations.
    torch.manual_seed(0)
    block = DiTBlock(96, 2, 4.0, 5, rope=rope, impl="fused").to(device)
    with torch.no_grad():
        for p in block.parameters():  # off adaLN-zero's init, so that the attention counts
            p.add_(torch.randn_like(p) * 0.05)
    x = torch.randn(2, 9, 12, 96, device=device, requires_grad=True)
    c = torch.randn(2, 96, device=device)
    eager_out = block(x, c)
    eager_grads = torch.autograd.grad(eager_out.square().sum(), [x, *block.parameters()])
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, backend=backend)  # a graph break raises
    out = compiled(x, c)
    grads = torch.autograd.grad(out.square().sum(), [x, *block.parameters()])
    # (inductor reassociates the float32 sums of the weight gradients: ~1e-5 off on sums of ~0.1)
    tol = dict(atol=1e-4, rtol=1e-4) if backend == "inductor" else {}
    torch.testing.assert_close(out, eager_out, **tol)
    for a, b in zip(grads, eager_grads):
        torch.testing.assert_close(a, b, **tol)
    if not rope:  # the bands' path (project, then attend) still hands q, k, v over as views, compiled too
        q, _, _ = torch.compile(block.attn.project, backend="aot_eager")(x)
        assert q._base is not None


@needs_kernels
@pytest.mark.parametrize("device", DEVICES)
def test_dit_with_fused_attention_trains_like_the_reference(device):
    def model(impl):
        torch.manual_seed(0)
        m = DiT((16, 24), 3, 2, patch_size=2, hidden_size=64, depth=2, num_heads=2, attn_kernel=5, attn_impl=impl)
        with torch.no_grad():
            for p in m.parameters():  # off the zero init, so that every gradient is non-zero
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
        return m.to(device)

    g = torch.Generator().manual_seed(0)
    x, t = torch.randn(2, 3, 16, 24, generator=g).to(device), torch.randn(2, generator=g).to(device)
    outs = []
    for impl in ("fused", "reference"):
        m = model(impl)
        out = m(x, t)
        out.square().mean().backward()
        outs.append((out, {n: p.grad for n, p in m.named_parameters()}))
    torch.testing.assert_close(outs[0][0], outs[1][0], atol=1e-5, rtol=1e-4)
    for name, grad in outs[0][1].items():
        torch.testing.assert_close(grad, outs[1][1][name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.skipif(INTERPRETED, reason="the interpreter runs the kernels on CPU")
def test_fused_on_cpu_falls_back_to_the_reference_with_a_warning():
    q, k, v, _ = (t.float() for t in _qkv((1, 2, 7, 9, 16)))
    natten._warned.discard("fused-fallback")
    with pytest.warns(UserWarning, match="fused neighbourhood attention unavailable"):
        out = natten.neighbourhood_attention(q, k, v, 5, impl="fused")
    torch.testing.assert_close(out, natten.reference_neighbourhood_attention(q, k, v, 5))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        natten.neighbourhood_attention(q, k, v, 5, impl="fused")


@needs_kernels
@pytest.mark.parametrize("device", DEVICES)
def test_inputs_of_any_strides_and_a_saved_lse_in_another_layout(device):
    # q, k, v whose head_dim is strided (copied for the kernels), the zero-stride gradient of a
    # sum, and saved tensors that come back repacked (a saved-tensor hook, as save_on_cpu): the
    # backward must index the lse it gets, and its delta, alike
    rows, cols, kernel = 9, 11, 5
    wide_q, wide_k, wide_v, _ = (t.float().to(device) for t in _qkv((2, 2, rows, cols, 96), seed=5))
    leaves = [t.requires_grad_() for t in (wide_q, wide_k, wide_v)]
    q, k, v = (t[..., ::2] for t in leaves)  # head_dim 48 with stride 2
    assert q.stride(-1) == 2
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.contiguous().clone(), lambda t: t):
        out = fused_natten.fused_neighbourhood_attention(q, k, v, kernel, grid_rows=rows)
    got = (out, *torch.autograd.grad(out.sum(), leaves))
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref = dense_neighbourhood_attention(*(t[..., ::2] for t in ref_leaves), kernel)
    want = (ref, *torch.autograd.grad(ref.sum(), ref_leaves))
    _close(got, want, atol=2e-5)


@needs_kernels
@pytest.mark.parametrize("device", DEVICES)
def test_the_log_sum_exp_output_is_not_differentiable(device):
    q, k, v, _ = (t.float().to(device).requires_grad_() for t in _qkv((1, 1, 4, 4, 16)))
    out, lse = fused_natten.natten_forward(q, k, v, 3, 0, 0, 4)
    assert out.requires_grad and not lse.requires_grad


def test_offsets_turn_64_bit_where_a_sample_reaches_2_31_elements():
    small = torch.empty((2, 16, 128, 160, 48), device="meta")
    assert not fused_natten._wide(small)
    rows = 2**31 // (160 * 48 * 16) + 1  # rows of one (sample, head) slice past 2**31 elements
    big = torch.empty((1, 16, rows, 160, 48), device="meta")
    assert not fused_natten._wide(big[:, :, :2])  # (a slice's own extent counts, not its storage's)
    tall = torch.empty((1, 1, rows * 16, 160, 48), device="meta")
    assert fused_natten._wide(tall)


def test_mixed_dtypes_are_refused_by_name():
    q, k, v, _ = (t.float() for t in _qkv((1, 1, 4, 4, 16)))
    with pytest.raises(ValueError, match="one dtype for q, k, v; got torch.float32, torch.bfloat16"):
        fused_natten.fused_neighbourhood_attention(q, k.bfloat16(), v, 3, grid_rows=4)


@pytest.mark.parametrize("dim, split", [(48, (32, 16)), (64, (64, 0)), (80, (64, 16)), (96, (64, 32)),
                                        (16, (16, 0)), (8, (16, 0)), (24, (32, 0)), (112, (128, 0)),
                                        (3, (16, 0)), (6, (16, 0)), (1, (16, 0))])  # fmt: skip
def test_heads_split_into_products_triton_can_take(dim, split):
    assert fused_natten.head_split(dim) == split
    d0, d1 = split
    assert d0 >= 16 and d0 & (d0 - 1) == 0 and (d1 == 0 or (d1 >= 16 and d1 & (d1 - 1) == 0))
    assert d0 + d1 >= dim
    padded = fused_natten.head_split(dim, split=False)
    assert padded[1] == 0 and padded[0] >= dim and padded[0] & (padded[0] - 1) == 0


def test_tiles_read_the_benchmarks_notation_and_name_what_is_wrong():
    assert fused_natten.Tiles.parse("8x16/8x8/8/3/pad") == fused_natten.Tiles(8, 16, 8, 8, 8, 3, split=False)
    assert fused_natten.Tiles.parse("8x8/8x8/atomic/full") == fused_natten.Tiles(8, 8, 8, 8, full=True, atomic=True)
    assert str(fused_natten.Tiles(8, 8, 8, 8, tma=True, atomic=True)) == "8x8/8x8/4/2/tma/atomic"
    assert str(fused_natten.Tiles.parse("8x16/8x8/8/3/pad/tma")) == "8x16/8x8/8/3/pad/tma"
    assert fused_natten.Tiles.parse("4x8/4x8") == fused_natten.Tiles(4, 8, 4, 8)
    assert fused_natten.Tiles.parse("4x8/4x8/tma") == fused_natten.Tiles(4, 8, 4, 8, tma=True)
    assert fused_natten.Tiles.parse("4x8/4x8/4/3/full/pad") == fused_natten.Tiles(4, 8, 4, 8, 4, 3, False, full=True)
    assert str(fused_natten.Tiles(8, 8, 8, 8, full=True)) == "8x8/8x8/4/2/full"
    assert fused_natten.Tiles.parse("8x8/8x8/4/2/atomic/r168") == fused_natten.Tiles(8, 8, 8, 8, atomic=True, regs=168)
    assert str(fused_natten.Tiles.parse("8x8/8x8/r168/tma")) == "8x8/8x8/4/2/tma/r168"
    bad_ones = ("8x8", "8x8/8", "8x8/8x8/4/3/x", "8x8/8x8/four", "8x8/8x8/tma/4", "8x8/8x8/4/2/1", "8x8/8x8/full/full")
    for bad in (*bad_ones, "8x8/8x8/atomic/4", "8x8/8x8/r168/r160", "8x8/8x8/r", "8x8/8x8/r0", "8x8/8x8/r256"):
        with pytest.raises(ValueError, match=f"QHxQW/KHxKW.*got '{bad}'"):
            fused_natten.Tiles.parse(bad)


def test_a_tile_set_names_each_kernels_tiles_and_what_is_wrong():
    """The notation the benchmarks hand on: the tiles natten.py --best-tiles found fastest, read back
    by scaling.py --attn-tiles."""
    every = fused_natten.parse_tile_set("8x8/8x8/4/3/pad")
    assert set(every) == set(fused_natten.TILES) and set(every.values()) == {
        fused_natten.Tiles(8, 8, 8, 8, 4, 3, False)
    }
    some = fused_natten.parse_tile_set("fwd=8x8/8x8/4/2/pad/tma,dkdv=16x8/8x8/8/2")
    assert some == {
        "fwd": fused_natten.Tiles(8, 8, 8, 8, 4, 2, False, True),
        "dkdv": fused_natten.Tiles(16, 8, 8, 8, 8),
    }
    assert fused_natten.parse_tile_set(fused_natten.format_tile_set(some)) == some
    for bad, what in (("bwd=8x8/8x8", "got 'bwd'"), ("fwd=8x8/8x8,fwd=8x8/8x8", "got 'fwd'"), ("dq=8x8", "got '8x8'")):
        with pytest.raises(ValueError, match=what):
            fused_natten.parse_tile_set(bad)


def test_the_benchmark_keeps_the_fastest_forward_and_backward_tiles_apart(tmp_path):
    """benchmarks/natten.py --best-tiles: the forward's tiles from the fastest forward, the
    backward kernels' from the fastest remainder; scaling.py --attn-tiles @FILE reads them."""
    from benchmarks import natten as bench
    from benchmarks import scaling

    results = {  # name -> (forward+backward s, peak bytes, forward s)
        "flex": (1.0, 0, 0.1),
        "fused": (9.0, 0, 3.0),  # the defaults: slowest on both counts
        "fused:8x8/8x8/4/3/pad": (5.0, 0, 1.0),  # fastest forward (backward 4.0)
        "fused:16x8/8x8/8/2/tma": (6.0, 0, 3.0),  # fastest backward (3.0)
    }
    best = bench.best_tiles(results)
    assert best == {
        "fwd": fused_natten.Tiles(8, 8, 8, 8, 4, 3, False),
        "dq": fused_natten.Tiles(16, 8, 8, 8, 8, 2, tma=True),
        "dkdv": fused_natten.Tiles(16, 8, 8, 8, 8, 2, tma=True),
    }
    assert bench.best_tiles({"flex": (1.0, 0, 0.1)}) is None
    # a variant naming one kernel's tiles runs the others' defaults: here the fastest backward
    atomic = bench.tile_variant("dkdv=8x8/8x8/atomic")
    assert atomic == "dkdv=8x8/8x8/4/2/atomic"
    assert bench.best_tiles({**results, f"fused:{atomic}": (4.5, 0, 2.0)}) == {
        **best,
        "dq": fused_natten.TILES["dq"],
        "dkdv": fused_natten.Tiles(8, 8, 8, 8, atomic=True),
    }
    with pytest.raises(Exception, match="got 'bwd'"):
        bench.tile_variant("bwd=8x8/8x8")
    path = tmp_path / "tiles"
    path.write_text(fused_natten.format_tile_set(best) + "\n")
    assert fused_natten.parse_tile_set(scaling._tile_set("fused_natten")(f"@{path}")) == best
    with pytest.raises(Exception, match="got 'bwd'"):
        scaling._tile_set("fused_natten")("bwd=8x8/8x8")


@pytest.mark.skipif(fused_natten._TensorDescriptor is None, reason="this Triton has no tensor descriptors")
def test_tensor_descriptors_only_where_asked_and_aligned():
    tma = fused_natten.Tiles(8, 8, 8, 8, tma=True)
    x = torch.zeros(2, 2, 6, 10, 48, dtype=torch.bfloat16)
    assert fused_natten._use_tma(tma, x, x[:, :, 2:])  # rows of 960 bytes: aligned
    assert not fused_natten._use_tma(fused_natten.Tiles(8, 8, 8, 8), x)  # not asked
    odd = torch.zeros(2, 2, 6, 10, 44, dtype=torch.bfloat16)
    assert not fused_natten._use_tma(tma, odd)  # 88-byte token stride
    shifted = torch.zeros(2 * 2 * 6 * 10 * 48 + 4, dtype=torch.bfloat16)[4:].view(2, 2, 6, 10, 48)
    assert not fused_natten._use_tma(tma, shifted)  # base 8 bytes past 16-byte alignment


def _ptxas_ships() -> bool:
    import triton

    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    return any(os.path.exists(os.path.join(bin_dir, n)) for n in ("ptxas", "ptxas-blackwell"))


@pytest.mark.skipif(INTERPRETED, reason="the interpreter's kernels are Python functions, not Triton's")
@pytest.mark.skipif(not _ptxas_ships(), reason="this Triton ships no ptxas")
@pytest.mark.parametrize(
    "dtype, tiles",
    [
        (torch.bfloat16, None),
        (torch.float32, None),
        (torch.bfloat16, "8x8/8x8/4/2"),
        (torch.bfloat16, "8x8/8x8/4/2/pad/tma/full"),
    ],
)
def test_the_kernels_build_for_hopper_with_pipelined_loads_and_bf16_on_tensor_cores(dtype, tiles):
    # The interpreter never compiles a kernel: this builds the StormScope layer's three launches
    # for sm90 as the JIT would on an H200 (benchmarks/kernel_build.py), on any machine: the
    # defaults, and the variant loading through tensor descriptors (the interpreter's descriptors
    # are plain Python) with the window test skipped on tiles inside every window, a branch in
    # the loop the pipeliner must keep its loads through, and that shortens the loop's path.
    from benchmarks import kernel_build

    asked = tiles and fused_natten.Tiles.parse(tiles)
    calls = kernel_build.launches((128, 160), 16, 48, 31, 4, dtype, asked)
    names = [c[0].__name__ for c in calls]
    assert names == ["_fna_forward", "_fna_backward_dq", "_fna_backward_dkdv"]  # (dQ's kernel sums delta)
    for (kernel, _, args, kw), name in zip(calls, ("fwd", "dq", "dkdv")):
        # None: the defaults, per kernel (the forward's loads through descriptors, skipping on full tiles)
        t = asked or (fused_natten.TILES_FP32 if dtype == torch.float32 else fused_natten.TILES[name])
        r = kernel_build.report(kernel, args, kw, 90)
        loads = r["tma_loads"] if t.tma else r["async_loads"]
        assert loads > 0 and r["spill_bytes"] == 0, r  # K/V (or Q/dO) loads pipelined
        assert not r["wgmma_serialized"], r  # (the bias's column sums once did that to dK/dV's loop)
        assert r["loop_local_accesses"] in (0, None), r  # (None: this Triton ships no nvdisasm)
        if dtype == torch.bfloat16:
            assert r["tensor_core"] == "wgmma", r
        if t.full:  # a branch per axis skips its window test: shorter paths (5-10% each at 8 x 8)
            one, none = r["one_axis_instructions_per_score"], r["full_tile_instructions_per_score"]
            assert none < 0.95 * one < 0.95**2 * r["instructions_per_score"], r
        else:
            assert r["full_tile_instructions_per_score"] == r["instructions_per_score"], r
            assert r["one_axis_instructions_per_score"] is None, r


@pytest.mark.skipif(INTERPRETED, reason="the interpreter's kernels are Python functions, not Triton's")
@pytest.mark.skipif(not _ptxas_ships(), reason="this Triton ships no ptxas")
def test_the_bias_sums_leave_the_backward_loops_as_they_are():
    # The packed path's backward kernels also sum their stored tiles for qkv's bias; the views'
    # (rope, bands) do not. Summed from the accumulators, that serialised dK/dV's warp-group
    # products (ptxas C7515) and lengthened its loop by 8%: the loops must stay as they are (but
    # for ptxas's register allocation: 2 instructions of 444 under Triton 3.8).
    from benchmarks import kernel_build

    packed, views = (
        kernel_build.launches((128, 160), 16, 48, 31, 4, torch.bfloat16, packed=p)[-2:] for p in (True, False)
    )
    for (kernel, _, args, kw), (_, _, v_args, v_kw) in zip(packed, views):
        assert kw["SUMS"] and not v_kw["SUMS"]
        with_sums, without = (kernel_build.report(kernel, a, k, 90) for a, k in ((args, kw), (v_args, v_kw)))
        for r in (with_sums, without):
            assert r["spill_bytes"] == 0 and not r["wgmma_serialized"], r
        assert with_sums["loop_sass"] <= 1.01 * without["loop_sass"], (with_sums, without)


@pytest.mark.skipif(INTERPRETED, reason="the interpreter's kernels are Python functions, not Triton's")
@pytest.mark.skipif(not _ptxas_ships(), reason="this Triton ships no ptxas")
def test_the_backward_loops_read_each_querys_statistics_once_and_the_caps_keep_the_programs_an_sm():
    # The dK/dV kernel's loop needs each query's lse and delta. Loaded from two tensors in the layout
    # of the (keys, queries) scores, Triton 3.6 (torch 2.11's) copied them 4 bytes at a time for
    # every thread that uses them: 32 copies a thread and tile, and their addresses (ncu on an H100:
    # 38 of the loop's 754 instructions, 350 of them integer). As one (lse, delta) record they are
    # one copy a thread; the dQ kernel's cap keeps it at 128 registers (four programs an SM), the
    # forward's at 96 with no spills and under 45 KiB of shared memory (five programs an SM of
    # 64 K registers and 228 KiB: docs/benchmarks.md, run 42).
    from benchmarks import kernel_build

    calls = kernel_build.launches((128, 160), 16, 48, 31, 4, torch.bfloat16)
    fwd, _, fwd_args, fwd_kw = calls[0]
    r = kernel_build.report(fwd, fwd_args, fwd_kw, 90)
    programs = min(kernel_build.programs_an_sm(r, fwd_kw["num_warps"], 90))
    assert fwd.__name__ == "_fna_forward" and programs >= 5 and r["spill_bytes"] == 0, r
    (dq, _, dq_args, dq_kw), (dkdv, _, args, kw) = calls[-2:]
    r = kernel_build.report(dkdv, args, kw, 90)
    assert dkdv.__name__ == "_fna_backward_dkdv" and r["narrow_copies"] <= kw["num_stages"], r
    r = kernel_build.report(dq, dq_args, dq_kw, 90)
    assert dq.__name__ == "_fna_backward_dq" and r["registers"] <= 128 and r["spill_bytes"] == 0, r


def test_the_shipped_tiles_take_each_gpus_caps_and_a_benchmarks_own_stay_as_set(monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode

    capability = (8, 6)
    monkeypatch.setattr(fused_natten, "_capability", lambda device: capability)
    with FakeTensorMode():  # a CUDA tensor on any machine
        q = torch.empty(1, 2, 8, 8, 48, dtype=torch.bfloat16, device="cuda")
    assert fused_natten._tiles("fwd", q).regs == 168 and fused_natten._tiles("dq", q).regs is None
    assert fused_natten._tiles("dkdv", q) is fused_natten.TILES["dkdv"]
    assert fused_natten._tiles("fwd", q)._replace(regs=96) == fused_natten.TILES["fwd"]  # only the cap moved
    capability = (9, 0)
    assert all(fused_natten._tiles(n, q) is fused_natten.TILES[n] for n in fused_natten.TILES)
    capability = (8, 0)
    assert fused_natten._tiles("fwd", q).regs == 128 and fused_natten._tiles("dq", q).regs == 128
    cpu = torch.empty(q.shape, dtype=q.dtype)  # (the interpreter's: no GPU to fit)
    assert fused_natten._tiles("fwd", cpu) is fused_natten.TILES["fwd"]
    own = fused_natten.Tiles.parse(str(fused_natten.TILES["fwd"]))  # equal to the shipped, but set by a benchmark
    monkeypatch.setitem(fused_natten.TILES, "fwd", own)
    assert fused_natten._tiles("fwd", q) is own


@pytest.mark.skipif(INTERPRETED, reason="the interpreter's kernels are Python functions, not Triton's")
@pytest.mark.skipif(not _ptxas_ships(), reason="this Triton ships no ptxas")
@pytest.mark.parametrize("arch", [80, 86, 89, 90])
def test_each_gpus_register_caps_let_its_shared_memory_fill_the_sm_without_spilling_in_the_loops(arch):
    # Hopper's caps (forward 96, dQ 128) made the forward spill 30 local loads and stores a tile
    # before Hopper (mma.sync, loads by pointers), where shared memory alone holds it to 4 programs
    # an SM (sm80) or 3 (sm86/89): each GPU's caps keep what its shared memory allows, no fewer
    # programs, and at most a few local accesses in the loop (fused_natten._CAPS_BEFORE_HOPPER).
    from benchmarks import kernel_build

    calls = kernel_build.launches((128, 160), 16, 48, 31, 4, torch.bfloat16, arch=arch)
    capped = [c for c in calls if c[0].__name__ in ("_fna_forward", "_fna_backward_dq")]
    assert len(capped) == 2 and all(not kw["TMA"] for _, _, _, kw in calls) == (arch < 90)
    for kernel, _, args, kw in capped:
        r = kernel_build.report(kernel, args, kw, arch)
        by_registers, by_shared = kernel_build.programs_an_sm(r, kw["num_warps"], arch)
        assert by_registers >= by_shared and r["loop_local_accesses"] <= 5, (arch, r)


@pytest.mark.skipif(INTERPRETED, reason="the interpreter's kernels are Python functions, not Triton's")
@pytest.mark.skipif(not _ptxas_ships(), reason="this Triton ships no ptxas")
@pytest.mark.parametrize("tiles", [None, "8x8/8x8/4/2/pad/tma/full"])
def test_the_kernels_with_64_bit_offsets_build_for_hopper(tiles, monkeypatch):
    # Samples of 2**31 elements or more take 64-bit element offsets (a static branch the
    # interpreter runs as Python, where a compiled kernel's branches must agree on their types)
    from benchmarks import kernel_build

    monkeypatch.setattr(fused_natten, "_wide", lambda *tensors: True)
    calls = kernel_build.launches((24, 40), 2, 48, 7, 1, torch.bfloat16, tiles and fused_natten.Tiles.parse(tiles))
    assert all(kw["WIDE"] for _, _, _, kw in calls)
    for kernel, _, args, kw in calls:
        r = kernel_build.report(kernel, args, kw, 90)
        assert r["tensor_core"] == ("none" if kernel.__name__ == kernel_build.DELTA else "wgmma"), r


@pytest.mark.skipif(INTERPRETED, reason="the interpreter's kernels are Python functions, not Triton's")
@pytest.mark.skipif(not _ptxas_ships(), reason="this Triton ships no ptxas")
@pytest.mark.parametrize("tiles", [None, "8x8/8x8/4/2/pad/tma/full/atomic"])
def test_the_loops_carry_their_tiles_corner_and_divide_nothing(tiles):
    # A loop that worked out its tile's row and column from the tile's number divided by the tiles
    # a row, a runtime value: in SASS a division in software, about 25 instructions a tile (the
    # layer 7.5% slower on an H100, docs/benchmarks.md run 35). Built for sm90, no main loop
    # divides, with the defaults and with every option that changes the loops.
    from benchmarks import kernel_build

    calls = kernel_build.launches((128, 160), 16, 48, 31, 4, torch.bfloat16, tiles and fused_natten.Tiles.parse(tiles))
    for kernel, _, args, kw in calls:
        if kernel.__name__ == kernel_build.DELTA:
            continue
        r = kernel_build.report(kernel, args, kw, 90)
        if r["loop_sass"] is None:
            pytest.skip("this Triton ships no nvdisasm")
        assert r["loop_sass"] > 100 and r["loop_divisions"] == 0, r


@pytest.mark.skipif(INTERPRETED, reason="the interpreter's kernels are Python functions, not Triton's")
@pytest.mark.skipif(not _ptxas_ships(), reason="this Triton ships no ptxas")
def test_a_register_cap_reaches_the_build():
    # /r168: the dK/dV kernel's 226 registers a thread fit 2 programs of 4 warps on an SM, 168 fit
    # 3; what spills is reported, and where (the benchmark measures whether occupancy wins)
    from benchmarks import kernel_build

    calls = kernel_build.launches(
        (128, 160), 16, 48, 31, 4, torch.bfloat16, fused_natten.Tiles.parse("8x8/8x8/4/2/r168")
    )
    kernel, _, args, kw = calls[-1]
    assert kernel.__name__ == "_fna_backward_dkdv" and kw["maxnreg"] == 168
    r = kernel_build.report(kernel, args, kw, 90)
    assert r["registers"] <= 168 and r["maxnreg"] == 168 and r["tensor_core"] == "wgmma", r
    _, _, args, kw = kernel_build.launches((128, 160), 16, 48, 31, 4, torch.bfloat16)[-1]
    assert "maxnreg" not in kw and kernel_build.report(kernel, args, kw, 90)["registers"] > 168


@pytest.mark.skipif(INTERPRETED, reason="the interpreter's kernels are Python functions, not Triton's")
@pytest.mark.skipif(not _ptxas_ships(), reason="this Triton ships no ptxas")
@pytest.mark.parametrize(
    "wide, tiles", [(False, "8x8/8x8/4/2/atomic"), (True, "8x8/8x8/4/2/atomic"), (False, "8x8/8x8/4/2/pad/tma/atomic")]
)
def test_the_atomic_backward_builds_for_hopper_as_one_kernel(wide, tiles, monkeypatch):
    # /atomic: the backward is the dK/dV kernel alone, adding dQ up by float32 reductions in
    # global memory (each thread's, or with /tma the copy engine's bulk reductions of the tile),
    # still pipelined, on tensor cores, without spills (its dQ share is one more accumulator tile),
    # after the delta kernel
    from benchmarks import kernel_build

    monkeypatch.setattr(fused_natten, "_wide", lambda *tensors: wide)
    tiles = fused_natten.Tiles.parse(tiles)
    calls = kernel_build.launches((128, 160), 16, 48, 31, 4, torch.bfloat16, tiles)
    assert [c[0].__name__ for c in calls] == ["_fna_forward", kernel_build.DELTA, "_fna_backward_dkdv"]
    # the backward's rowsum(dO * O), without a dQ kernel to sum it: in registers, from 16-bit loads
    kernel, _, args, kw = calls[1]
    r = kernel_build.report(kernel, args, kw, 90)
    assert r["spill_bytes"] == 0 and r["instructions_per_score"] is None and r["tensor_core"] == "none", r
    kernel, _, args, kw = calls[2]
    assert kw["ATOMIC"] and kw["WIDE"] == wide and kw["DQ_TMA"] == tiles.tma
    r = kernel_build.report(kernel, args, kw, 90)
    assert r["spill_bytes"] == 0 and r["tensor_core"] == "wgmma", r
    assert (r["bulk_reductions"] > 0 and r["atomics"] == 0) if tiles.tma else (r["atomics"] > 0), r
    assert (r["tma_loads"] if tiles.tma else r["async_loads"]) > 0, r


@pytest.mark.skipif(INTERPRETED, reason="the interpreter runs tiles of any size")
def test_tiles_under_16_queries_or_keys_are_refused_before_a_compiled_launch(monkeypatch):
    monkeypatch.setitem(fused_natten.TILES, "fwd", fused_natten.Tiles.parse("2x4/4x4"))
    q = torch.zeros(1, 1, 8, 8, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"tiles 2x4/4x4/4/2 \(fwd\): a GPU needs at least 16 queries and 16 keys"):
        fused_natten.natten_forward(q, q, q, 3, 0, 0, 8)


def test_the_full_tiles_share_is_the_interior_of_the_windows():
    """benchmarks/kernel_build.py's estimate of the tiles that skip the window test: with 8 x 8
    tiles and windows of 31, 3 x 3 of the 5 x 5 key tiles around a query tile lie inside all its
    windows once the tiles are aligned to where that interior begins (2 x 2 from the union's
    corner), the same for the query tiles around a key tile; more at the grid's clamped edges."""
    from benchmarks.kernel_build import full_axis_shares, full_tile_share

    tiles = fused_natten.Tiles.parse("8x8/8x8/4/2/full")
    for backward in (False, True):
        assert full_tile_share((2048, 2048), 31, tiles, backward) == pytest.approx(9 / 25, abs=0.005)
        # 3 of 5 on each axis: a tile tests one axis only in 2 x (3/5 x 2/5) of cases
        assert full_axis_shares((2048, 2048), 31, tiles, backward) == pytest.approx((3 / 5, 3 / 5), abs=0.005)
        assert 9 / 25 < full_tile_share((128, 160), 31, tiles, backward) < 0.45
        assert full_tile_share((128, 160), 31, fused_natten.Tiles(8, 8, 8, 8), backward) == 0
        assert full_tile_share((128, 160), 7, tiles, backward) == 0  # windows narrower than two tiles


def _split_fused(rank, world):
    """The domain-split DiT on the fused kernels (float32) against the whole model, on bands whose
    halos differ in width (a thin first band), gradients sent back to the rows' owners."""
    from framework.domain.comm import DomainGroup
    from tests.framework.domain.helpers import compare_split, randomize
    from tests.recipes.stormscope.test_parallelize import SPLITS, _dit, _inputs, split

    warnings.filterwarnings("error", message="fused neighbourhood attention unavailable")  # no fallback
    assert fused_natten.available(torch.zeros(1, 1, 1))
    torch.set_num_threads(1)
    # one block: the halos, masks and gradients' return are each block's, and the interpreter
    # takes about 30 s a block on 2 cores
    kw = dict(num_heads=2, attn_kernel=7, pos_embed="rope", attn_impl="fused", depth=1)
    model = randomize(_dit(**kw), seed=5, std=0.2)
    x, args = _inputs(kw, seed=15)
    dg = DomainGroup(torch.distributed.group.WORLD, SPLITS[2]["thin first band"])
    # float32: the summed parameter gradients reach 66 here, so round-off of a few 1e-5 lands on
    # their small entries (the rounding depends on the CPU's vector width); a wrong halo or mask is
    # off by 1e-2 and more
    compare_split("fused DiT", model, dg, x, split_fn=split, args=args, seed=5, tol=dict(rtol=1e-4, atol=1e-4))


@pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1 (on GPUs the gpu tests train it on 2 ranks)")
def test_a_domain_split_dit_on_the_fused_kernels_matches_the_whole_one():
    from tests.multiproc import spawn

    spawn(_split_fused, 2)
