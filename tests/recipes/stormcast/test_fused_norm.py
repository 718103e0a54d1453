"""The Triton GroupNorm (+ SiLU) kernels of the compiled SongUNet blocks (recipes/stormcast/fused_norm.py).

On CPU they run under Triton's interpreter: `.ci/run` runs this file with ``TRITON_INTERPRET=1``
(set before Triton is imported; the README's suite, without it, skips them), with the compiled
UNet block test of test_songunet.py in its "fused" form. The ``gpu`` tests run the compiled kernels
on CUDA.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from recipes.stormcast import fused_norm  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1 set before Triton is imported")
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _reference(x, groups, w, b, eps, shift, silu):
    if shift is not None:
        x = x + shift.reshape(*shift.shape, *(1,) * (x.dim() - 2))
    y = F.group_norm(x, groups, w, b, eps)
    return F.silu(y) if silu else y


def _values_and_grads(fn, x, w, b, shift, dy, groups, silu):
    leaves = [t.clone().requires_grad_() for t in (x, w, b) + ((shift,) if shift is not None else ())]
    y = fn(leaves[0], groups, leaves[1], leaves[2], 1e-6, leaves[3] if shift is not None else None, silu)
    return (y, *torch.autograd.grad(y, leaves, dy))


def _fused(x, groups, w, b, eps, shift, silu):
    return fused_norm.group_norm(x, groups, w, b, eps, shift=shift, silu=silu)


def _check_against_float64(device, shape, groups, channels_last, with_shift, silu, dtype=torch.float32):
    """Forward and every gradient of the fused path against F.group_norm in float64, on inputs whose
    mean is far from zero (where E[x^2] - E[x]^2 and uncentred gradient sums would cancel): no worse
    than torch's own kernels in the same dtype, within a small absolute floor."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g, dtype=torch.float64) * 3 + 20
    w, b = (
        torch.randn(shape[1], generator=g, dtype=torch.float64),
        torch.randn(shape[1], generator=g, dtype=torch.float64),
    )
    shift = torch.randn(shape[0], shape[1], generator=g, dtype=torch.float64) if with_shift else None
    dy = torch.randn(*shape, generator=g, dtype=torch.float64)
    ref = _values_and_grads(_reference, x, w, b, shift, dy, groups, silu)

    def cast(t):
        t = None if t is None else t.to(device=device, dtype=dtype)
        return (
            t.contiguous(memory_format=torch.channels_last) if t is not None and t.dim() == 4 and channels_last else t
        )

    args = [cast(t) for t in (x, w, b, shift, dy)]
    got = _values_and_grads(_fused, *args, groups, silu)
    torch_ = _values_and_grads(_reference, *args, groups, silu)
    names = ("y", "dx", "dweight", "dbias", "dshift")
    for name, r, f, t in zip(names, ref, got, torch_):
        r, f, t = r.detach(), f.detach(), t.detach()
        assert f.dtype == dtype and f.shape == r.shape, name
        scale = r.abs().max()
        err_fused = float((f.double().cpu() - r).abs().max() / scale)
        err_torch = float((t.double().cpu() - r).abs().max() / scale)
        assert err_fused <= max(4 * err_torch, 2e-6 if dtype == torch.float32 else 2e-2), (name, err_fused, err_torch)
    if channels_last:  # the output and the input gradient keep the layout: a compiled graph stays channels-last
        assert got[0].is_contiguous(memory_format=torch.channels_last)
        assert got[1].is_contiguous(memory_format=torch.channels_last)


CASES = [  # shape, groups, channels-last, shift, silu
    ((2, 16, 5, 7), 4, True, True, True),
    ((2, 16, 5, 7), 4, False, False, True),
    ((3, 12, 9, 4), 3, True, True, False),
    ((2, 8, 33, 40), 2, True, True, True),  # several chunks per reduction, the last one partial
    ((2, 6, 17), 3, False, True, True),  # 1-D spatial
]


@interpreted
@pytest.mark.parametrize("shape,groups,channels_last,with_shift,silu", CASES)
def test_fused_group_norm_equals_torchs(shape, groups, channels_last, with_shift, silu):
    _check_against_float64("cpu", shape, groups, channels_last, with_shift, silu)


@interpreted
@pytest.mark.parametrize("size", ["large", "small"])
def test_every_geometry_of_the_table_computes_the_same_norm(monkeypatch, size):
    """Each row of ``GEOMETRY`` (chosen by activation size) on inputs small enough for the
    interpreter: the row forced for every size, several chunks per reduction."""
    row = 0 if size == "large" else -1
    forced = {k: ((0, table[row][1]),) for k, table in fused_norm.GEOMETRY.items()}
    monkeypatch.setattr(fused_norm, "GEOMETRY", forced)
    _check_against_float64("cpu", (2, 16, 40, 64), 4, True, True, True)


def _dropout_check(device, shape, channels_last, recompute, p=0.25, dtype=torch.float32):
    """The fused dropout against F.dropout's arithmetic with the same mask (read off the output:
    the reference output is non-zero almost surely): kept values scaled by 1/(1-p), the input's
    and parameters' gradients those of ``dropout(silu(norm(x + shift)))`` with that mask, about
    ``p`` of the values dropped, a different mask per sample and per call, and the same output and
    gradients again from the same generator state (what a recomputation relies on)."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(*shape, generator=g) * 2 + 5).to(device=device, dtype=dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    w, b = (torch.randn(shape[1], generator=g).to(device) for _ in range(2))
    shift = torch.randn(shape[0], shape[1], generator=g).to(device)
    dy = torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    def run(fn):
        leaves = [t.clone().requires_grad_() for t in (x, w, b, shift)]
        y = fn(*leaves)
        return (y.detach(), *torch.autograd.grad(y, leaves, dy))

    def fused(x, w, b, shift):
        return fused_norm.group_norm(x, 4, w, b, 1e-6, shift=shift, silu=True, recompute=recompute, dropout=p)

    torch.manual_seed(11)
    got = run(fused)
    torch.manual_seed(11)
    again = run(fused)
    other = run(fused)  # the generator moved on: another seed
    keep = got[0] != 0
    ref = run(lambda x, w, b, shift: _reference(x, 4, w, b, 1e-6, shift, True) * keep / (1 - p))
    for name, r, f, a in zip(("y", "dx", "dweight", "dbias", "dshift"), ref, got, again):
        # sums over many pixels (the parameters' and shift's gradients) round off with their terms'
        # scale, not their own: near-zero sums are compared absolutely, against that scale
        atol = 1e-5 * max(1.0, r.abs().max().item())
        torch.testing.assert_close(f, r, rtol=1e-4, atol=atol, msg=lambda m, n=name: f"{n}: {m}")
        assert torch.equal(f, a), name
    dropped = 1 - keep.float().mean().item()
    assert abs(dropped - p) < 0.05, dropped
    # independent draws: channels (up to 8 apart: those of one philox call) and neighbouring
    # pixels agree as often as chance
    chance = p * p + (1 - p) * (1 - p)
    for dim, apart in [(1, d) for d in range(1, 9)] + [(2, 1), (3, 1)]:
        n = keep.shape[dim] - apart
        agree = (keep.narrow(dim, apart, n) == keep.narrow(dim, 0, n)).float().mean().item()
        assert abs(agree - chance) < 0.05, (dim, apart, agree, chance)
    assert not torch.equal(keep, other[0] != 0)
    assert not torch.equal(keep[0], keep[1])  # samples draw their own masks
    if channels_last:
        assert got[0].is_contiguous(memory_format=torch.channels_last)


@interpreted
@pytest.mark.parametrize("channels_last", [True, False], ids=["channels_last", "nchw"])
@pytest.mark.parametrize("recompute", [False, True], ids=["kept", "recomputed"])
def test_fused_dropout_is_a_dropout_of_the_norm_with_one_mask_in_both_passes(channels_last, recompute):
    _dropout_check("cpu", (2, 16, 24, 20), channels_last, recompute)


@interpreted
def test_fused_dropout_draws_the_same_mask_with_64_bit_offsets(monkeypatch):
    """The kernels' 64-bit path (samples of 2**31 elements or more, forced here on a small one, with
    a partial last tile) counts the elements as the 32-bit path does."""
    x = torch.randn(2, 12, 13, 11).contiguous(memory_format=torch.channels_last)
    outs = []
    for wide in (False, True):
        monkeypatch.setattr(fused_norm, "_wide", lambda *flat, w=wide: w)
        torch.manual_seed(5)
        outs.append(fused_norm.group_norm(x, 4, None, None, 1e-6, silu=True, dropout=0.5))
    assert torch.equal(outs[0], outs[1])
    _dropout_check("cpu", (2, 12, 13, 11), True, False)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("recompute", [False, True], ids=["kept", "recomputed"])
def test_fused_dropout_on_gpu(recompute):
    _dropout_check("cuda", (4, 64, 96, 80), True, recompute)


@interpreted
def test_fused_group_norm_takes_any_layout_and_writes_the_asked_dtype():
    """A view whose pixels do not merge into one stride (a crop) is read correctly, and the output
    is written in the dtype asked for (the convolution's, under autocast)."""
    x = torch.randn(2, 8, 12, 10)[:, :, 1:-1, 2:-1]
    assert not x.is_contiguous()
    y = fused_norm.group_norm(x, 2, None, None, 1e-5, silu=True, dtype=torch.bfloat16)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), F.silu(F.group_norm(x, 2, eps=1e-5)), atol=1e-2, rtol=1e-2)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "shape,groups,channels_last,with_shift,silu", CASES + [((4, 256, 64, 80), 32, True, True, True)]
)
def test_fused_group_norm_equals_torchs_on_gpu(shape, groups, channels_last, with_shift, silu, dtype):
    _check_against_float64("cuda", shape, groups, channels_last, with_shift, silu, dtype)


def test_every_kernel_has_a_geometry_for_every_size():
    """The launch geometries are tables by size: each kernel's thresholds fall to 0 (every
    activation gets one) and its tiles are powers of two (Triton's block sizes)."""
    assert set(fused_norm.GEOMETRY) == {"stats", "apply", "grad_sums", "grad_apply"}
    for name, table in fused_norm.GEOMETRY.items():
        thresholds = [least for least, _ in table]
        assert thresholds == sorted(thresholds, reverse=True) and thresholds[-1] == 0, name
        for least, (elements, warps, per_sm) in table:
            assert elements & (elements - 1) == 0 and warps in (1, 2, 4, 8, 16) and per_sm >= 1, (name, least)
            assert fused_norm.geometry(name, least) == (elements, warps, per_sm)
    # the sizes the sweep measured apart: the reductions take fewer programs on small activations
    assert fused_norm.geometry("grad_sums", 512 * 640)[2] > fused_norm.geometry("grad_sums", 128 * 160)[2]
    assert fused_norm.geometry("stats", 512 * 640)[2] > fused_norm.geometry("stats", 256 * 320)[2]


def test_offsets_are_64_bit_only_where_a_sample_spans_2_31_elements():
    """The kernels address within a sample in 32 bits (fewer instructions per element) unless one of
    their tensors' samples reaches 2**31 elements from its start; shapes and strides alone decide."""

    def flat(shape, memory_format=torch.contiguous_format):
        return fused_norm._flat(torch.empty(shape, device="meta").contiguous(memory_format=memory_format))

    assert not fused_norm._wide(flat((4, 256, 512, 640)))  # the regression UNet's largest: 2**26
    assert not fused_norm._wide(flat((1, 2**15, 2**8, 2**8), torch.channels_last))  # last offset 2**31 - 1
    assert fused_norm._wide(flat((1, 2**15, 2**8, 2**8 + 1)))
    assert fused_norm._wide(flat((1, 2**15, 2**8, 2**8 + 1), torch.channels_last))
    assert fused_norm._wide(flat((1, 2, 3)), flat((1, 2**16, 2**15 + 1)))  # any of the tensors


@interpreted
def test_the_64_bit_offsets_compute_the_same_norm(monkeypatch):
    """The WIDE form of every kernel (forced here: a real one needs a 4 GiB sample) equals torch's."""
    monkeypatch.setattr(fused_norm, "_wide", lambda *flat: True)
    _check_against_float64("cpu", (2, 16, 5, 7), 4, True, True, True)


@interpreted
def test_a_sample_spanning_2_31_elements_is_addressed_in_64_bits():
    """An NCHW sample whose channels lie 2**20 elements apart (2049 channels: the last one 2**31
    elements in): statistics equal torch's, the first pixel of every channel (the reductions'
    pivot) included. A view over an 8 GiB buffer of which only the viewed pages are touched."""
    c, w, stride = 2049, 16, 2**20
    try:
        store = torch.empty(stride * c + w)
    except RuntimeError as e:  # a machine that refuses to reserve that much address space
        pytest.skip(f"no 8 GiB buffer here: {e}")
    x = store.as_strided((1, c, 1, w), (stride * c, stride, w, 1))
    x.copy_(torch.randn(1, c, 1, w, generator=torch.Generator().manual_seed(0)) + 5.0)
    assert fused_norm._wide(fused_norm._flat(x))
    mean_p, m2_p = fused_norm.gn_stats(x)
    mean, var = fused_norm._combine(mean_p, m2_p, w, fused_norm._reduction(x, "stats").chunk)
    torch.testing.assert_close(mean, x.mean((2, 3)))
    torch.testing.assert_close(var, x.var((2, 3), unbiased=False))
