"""The framework's domain-parallel layers (framework/domain/layers.py) and the torch plan's
rules (``TORCH_PLAN``: nn.Conv2d, nn.GroupNorm) against their single-device twins on gloo ranks.

Outputs, input gradients and parameter gradients summed over the domain ranks match to
1e-6 in float64 (and 1e-5 in float32) for even and uneven row splits on 2 and 4 ranks.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from framework.domain.comm import DomainGroup
from framework.domain.layers import GroupNormMixin, RowSliceMixin, gathered_attention
from framework.domain.splitter import TORCH_PLAN, swap_class
from framework.domain.splitter import split as split_by
from tests.framework.domain.helpers import band, compare_split, for_each_group, randomize
from tests.multiproc import spawn

pytestmark = pytest.mark.timeout(300)


def split(model, dg):
    """Split by the torch plan."""
    return split_by(model, dg, TORCH_PLAN)


H, W, B = 16, 5, 2
SPLITS = {
    2: {"even": [8, 8], "uneven": [11, 5], "thin": [14, 2]},
    4: {"even": [4, 4, 4, 4], "uneven": [6, 2, 5, 3], "thin": [2, 2, 2, 10]},
}


class Field(nn.Module):
    """A learned (1, C, H, W) field added to the input (what RowSliceMixin needs)."""

    def __init__(self, c, rows):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(1, c, rows, W))

    def forward(self, x):
        return x + self.weight


def _row_slice(m, dg):
    swap_class(m, RowSliceMixin, dg)
    return m


DTYPES = ((torch.float64, dict(rtol=1e-6, atol=1e-6)), (torch.float32, dict(rtol=1e-5, atol=1e-5)))


def _torch_cases():
    """(name, factory, input channels)."""
    return [
        ("nn.Conv2d 3x3", lambda: nn.Conv2d(4, 6, 3, padding=1), 4),
        ("nn.Conv2d 1x1", lambda: nn.Conv2d(4, 6, 1), 4),
        ("nn.Conv2d 5x5 (halo 2)", lambda: nn.Conv2d(4, 6, 5, padding=2), 4),
        ("nn.Conv2d 3x1 no bias", lambda: nn.Conv2d(4, 6, (3, 1), padding=(1, 0), bias=False), 4),
        ("nn.Conv2d 3x3 grouped", lambda: nn.Conv2d(4, 6, 3, padding=1, groups=2), 4),
        ("nn.GroupNorm", lambda: nn.GroupNorm(2, 8, eps=1e-6), 8),
        ("nn.GroupNorm without affine", lambda: nn.GroupNorm(4, 8, affine=False), 8),
        (
            "nn.Sequential conv-GN-SiLU-conv",
            lambda: nn.Sequential(
                nn.Conv2d(4, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.SiLU(), nn.Conv2d(8, 4, 3, padding=1)
            ),
            4,
        ),
    ]


def _check_layers(group, world, rank):
    for kind, extents in SPLITS[world].items():
        dg = DomainGroup(group, extents)
        for i, (name, make, cin) in enumerate(_torch_cases()):
            for dtype, tol in DTYPES[: 2 if kind == "uneven" else 1]:  # float32 on one split (time)
                if kind == "thin" and name == "nn.Conv2d 5x5 (halo 2)" and min(extents) < 2:
                    continue
                torch.manual_seed(i)
                module = randomize(make(), seed=i).to(dtype)
                x = torch.randn(B, cin, H, W, generator=torch.Generator().manual_seed(10 + i)).to(dtype)
                compare_split(f"{name} {dtype}", module, dg, x, split_fn=split, seed=i, tol=tol)

        # RowSliceMixin at full resolution and at a 2x coarser level (offsets scale)
        torch.manual_seed(0)
        compare_split("RowSliceMixin", Field(3, H), dg, torch.randn(B, 3, H, W), split_fn=_row_slice)
        if all(e % 2 == 0 for e in extents):
            coarse = torch.randn(B, 3, H // 2, W, generator=torch.Generator().manual_seed(3))
            ref = Field(3, H // 2)
            dom = _row_slice(copy.deepcopy(ref), dg)
            half = [e // 2 for e in extents]
            torch.testing.assert_close(dom(band(coarse, half, rank)), band(ref(coarse), half, rank), rtol=0, atol=0)

        _check_gathered_attention(dg, world, rank)


def _check_gathered_attention(dg, world, rank):
    """Local queries over gathered keys/values equal attention over every pixel."""
    extents = dg.extents
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(B, 2, 3, H, W, generator=g) for _ in range(3))
    gouts = [torch.randn(B, 2, 3, e, W, generator=torch.Generator().manual_seed(20 + r)) for r, e in enumerate(extents)]
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    flat = lambda t: t.reshape(B, 2, 3, -1).transpose(-1, -2)  # noqa: E731
    ref = F.scaled_dot_product_attention(*map(flat, full)).transpose(-1, -2).reshape(B, 2, 3, H, W)
    (ref * torch.cat(gouts, dim=3)).sum().backward()

    local = [band(t, extents, rank, dim=3).clone().requires_grad_() for t in (q, k, v)]
    out = gathered_attention(*local, dg)
    where = f"gathered_attention {extents}, rank {rank}"
    torch.testing.assert_close(
        out, band(ref, extents, rank, dim=3), rtol=1e-10, atol=1e-10, msg=lambda m: f"{where}: output: {m}"
    )
    (out * gouts[rank]).sum().backward()
    for name, a, b in zip("qkv", local, full):
        torch.testing.assert_close(
            a.grad,
            band(b.grad, extents, rank, dim=3),
            rtol=1e-10,
            atol=1e-10,
            msg=lambda m: f"{where}: gradient of {name}: {m}",
        )


def _ranks(rank, world):
    for_each_group(rank, _check_layers)


def test_torch_layers_and_mixins_on_2_and_4_ranks():
    spawn(_ranks, 4)


def test_group_norm_mixin_keeps_float64_precision():
    dg = DomainGroup(None, [H])  # one rank: no communication, only the layer's arithmetic
    ref = nn.GroupNorm(2, 8, eps=1e-6).double()
    dom = copy.deepcopy(ref)
    swap_class(dom, GroupNormMixin, dg)
    x = torch.randn(B, 8, H, W, dtype=torch.float64) * 3 + 300  # raw physical units (e.g. kelvin)
    torch.testing.assert_close(dom(x), ref(x), rtol=1e-10, atol=1e-10)
    assert dom(x).dtype == torch.float64


class _ConvNormConv(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.norm = nn.Conv2d(4, 8, 3, padding=1), nn.GroupNorm(2, 8)
        self.conv2 = nn.Conv2d(8, 4, 3, padding=1)

    def forward(self, x):
        return self.conv2(self.norm(self.conv1(x), silu=True))


def _kept_and_grads(net, x, compiled: bool):
    """(elements of the distinct activations kept for backward, the input's and parameters' gradients)."""
    torch._dynamo.reset()
    net.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    saved = {}

    def pack(t):
        if t.dim() == 4 and t.shape[2:] == x.shape[2:]:  # activations, not weights or statistics
            saved[t.untyped_storage().data_ptr()] = t.numel()
        return t

    run = torch.compile(net, backend="aot_eager", fullgraph=True) if compiled else net
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = run(x)
    y.square().sum().backward()
    return sum(saved.values()), [x.grad] + [p.grad for p in net.parameters()]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_split_norm_marked_recompute_keeps_only_its_input_when_compiled(compiled):
    """A split GroupNorm whose layer asks for recompute (``recompute = True``, as the SongUNet's
    ``recompute_norm_levels`` set) keeps neither its output nor its SiLU's in a compiled step (the
    convolution after it would keep that): backward recomputes them, with the same gradients. An
    eager step keeps what it kept."""
    net = randomize(_ConvNormConv(), seed=2)
    swap_class(net.norm, GroupNormMixin, DomainGroup(None, [H]))
    x = torch.randn(B, 4, H, W)
    kept, want = _kept_and_grads(net, x, compiled)
    net.norm.recompute = True
    recomputed, got = _kept_and_grads(net, x, compiled)
    torch._dynamo.reset()
    image = B * H * W
    if compiled:  # the input, conv1's output (the norm's input); not the norm's nor the SiLU's output
        assert recomputed == (4 + 8) * image < kept, (kept, recomputed)
    else:
        assert recomputed == kept, (kept, recomputed)
    for a, b in zip(want, got):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def _group_norm_traffic(rank, world):
    """One collective forward and one backward per split GroupNorm, and only the input (plus the
    per-group statistics) kept for backward: what torch's own GroupNorm keeps."""
    import torch.distributed as dist

    calls = []
    real = {name: getattr(dist, name) for name in ("all_gather_into_tensor", "all_reduce")}
    for name, fn in real.items():
        setattr(dist, name, lambda *a, _n=name, _f=fn, **k: (calls.append(_n), _f(*a, **k))[1])
    try:
        extents = [11, 5]
        dg = DomainGroup(dist.group.WORLD, extents)
        norm = randomize(nn.GroupNorm(4, 16, eps=1e-6), seed=1)
        swap_class(norm, GroupNormMixin, dg)
        x = torch.randn(B, 16, extents[rank], W, dtype=torch.bfloat16, requires_grad=True)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.append(t), t)[1], lambda t: t):
            y = norm(x)
        assert calls == ["all_gather_into_tensor"], calls
        assert y.dtype == torch.bfloat16
        kept = sum(t.numel() * t.element_size() for t in saved if t is not norm.weight)
        assert kept <= x.numel() * x.element_size() + 2 * B * 4 * 4, (kept, [tuple(t.shape) for t in saved])
        y.float().square().sum().backward()
        assert calls == ["all_gather_into_tensor", "all_reduce"], calls
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)


def test_split_group_norm_makes_one_collective_each_way_and_keeps_only_its_input():
    spawn(_group_norm_traffic, 2)
