"""The DiT block's gated residual and norm ops (recipes/stormscope/residual.py): formulas, kernels, the block.

The kernels run under Triton's interpreter on CPU when ``TRITON_INTERPRET=1`` is set before
Triton is imported (`.ci/run` runs this file so), compiled on CUDA in the ``gpu`` tests; the
README's suite runs the rest (the torch formulas, which the CPU model uses).
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from recipes.stormscope import residual
from recipes.stormscope.dit import DiTBlock
from tests.recipes.stormscope.kernel_devices import INTERPRETED, KERNEL_DEVICES

EPS = 1e-6


def _inputs(shape, dtype, device="cpu", seed=0):
    """x, a (B, ..., D) in ``dtype``; bias (D,) float32 (float64 with float64); gate, shift, scale:
    (B, 1, .., D) views of one (B, 1, .., 3D) tensor in ``dtype``, as the block's adaLN chunks are."""
    g = torch.Generator().manual_seed(seed)
    b, d = shape[0], shape[-1]
    x, a = (torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).to(device) for _ in range(2))
    bias = torch.randn(d, generator=g, dtype=torch.float64).to(
        torch.float64 if dtype == torch.float64 else torch.float32
    )
    mod = 0.5 * torch.randn(b, *[1] * (len(shape) - 2), 3 * d, generator=g, dtype=torch.float64)
    mod = mod.to(dtype).to(device)
    return x, a, bias.to(device), mod


def _reference(x, a, bias, mod, grads, norm: bool):
    """The torch expression in float64 (autograd's gradients) of float64 copies of the inputs: the
    outputs and the gradients of x, a, bias, mod."""
    leaves = [t.detach().double().cpu().requires_grad_() for t in (x, a, bias, mod)]
    x64, a64, b64, m64 = leaves
    gate, shift, scale = m64.chunk(3, -1)
    x1 = x64 + gate * (a64 + b64)
    outs = (x1, F.layer_norm(x1, x1.shape[-1:], eps=EPS) * (1 + scale) + shift) if norm else (x1,)
    got = torch.autograd.grad(outs, leaves, [g.double().cpu() for g in grads])
    return [o.detach() for o in outs], list(got)


def _op(x, a, bias, mod, norm: bool):
    gate, shift, scale = mod.chunk(3, -1)
    if norm:
        return residual.residual_norm(x, a, bias, gate, shift, scale, EPS)
    return (residual.gated_residual(x, a, bias, gate),)


def _run(x, a, bias, mod, grads, norm: bool):
    leaves = [t.detach().requires_grad_() for t in (x, a, bias, mod)]
    outs = _op(*leaves, norm)
    return [o.detach() for o in outs], list(torch.autograd.grad(outs, leaves, grads))


@pytest.mark.parametrize("norm", [True, False], ids=["residual_norm", "gated_residual"])
def test_the_formulas_are_the_torch_expression_and_its_gradients(norm):
    x, a, bias, mod = _inputs((2, 3, 5, 24), torch.float64)
    grads = [torch.randn_like(x) for _ in range(2 if norm else 1)]
    got = _run(x, a, bias, mod, grads, norm)
    want = _reference(x, a, bias, mod, grads, norm)
    for g, w, name in zip(got[0] + got[1], want[0] + want[1], ["x1", "h"][: len(got[0])] + ["x", "a", "bias", "mod"]):
        torch.testing.assert_close(g, w, atol=1e-12, rtol=1e-12, msg=name)
    # and the hand-written backward is the forward's derivative
    small = [t[:, :1, :2] if t.dim() == 4 and t.shape[1] > 1 else t for t in (x, a)] + [bias, mod]
    leaves = [t.clone().requires_grad_() for t in small]
    assert torch.autograd.gradcheck(lambda *t: _op(*t, norm), leaves)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("norm", [True, False], ids=["residual_norm", "gated_residual"])
@pytest.mark.parametrize("shape", [(3, 300, 48), (2, 5, 7, 100)])  # several token blocks, ragged; D no power of 2
def test_the_kernels_compute_the_formulas_in_float32(device, norm, shape):
    x, a, bias, mod = _inputs(shape, torch.float32, device)
    assert residual._kernels_take(x, a, bias, mod)
    grads = [torch.randn_like(x) for _ in range(2 if norm else 1)]
    got = _run(x, a, bias, mod, grads, norm)
    want = _reference(x, a, bias, mod, grads, norm)
    for g, w, name in zip(got[0] + got[1], want[0] + want[1], ["x1", "h"][: len(got[0])] + ["x", "a", "bias", "mod"]):
        assert g.dtype == (torch.float32), name
        torch.testing.assert_close(g.double().cpu(), w, atol=1e-4, rtol=1e-5, msg=name)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_streams_are_rounded_once_and_normalised_as_stored(device, dtype):
    """16-bit inputs: the stream x1 is the float32 sum rounded once; h and the stream's gradient are
    the float32 kernels' results for that rounded stream, rounded once (equal bits), and the shift and
    scale gradients sum the same float32 values in the same order (equal bits)."""
    if device == "cpu" and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter truncates float32 to bfloat16 instead of rounding it")
    x, a, bias, mod = _inputs((2, 200, 96), dtype, device)
    grads = [torch.randn_like(x) for _ in range(2)]
    (x1, h), (gx, ga, gb, gm) = _run(x, a, bias, mod, grads, True)
    assert (x1.dtype, h.dtype, gx.dtype, ga.dtype, gb.dtype, gm.dtype) == (dtype,) * 4 + (torch.float32, dtype)
    gate = mod.chunk(3, -1)[0].float()
    ulp = torch.finfo(dtype).eps
    tiny = torch.finfo(dtype).smallest_normal * ulp  # the spacing of subnormals
    torch.testing.assert_close(x1.float(), x.float() + gate * (a.float() + bias), atol=tiny, rtol=ulp)
    # float32 copies whose stream is x1 itself (gate zero): the same kernels without the rounding
    mod32 = mod.float().clone()
    mod32[..., : x.shape[-1]] = 0
    zeros = torch.zeros_like(x1, dtype=torch.float32)
    (_, h32), (gx32, _, _, gm32) = _run(
        x1.float(), zeros, torch.zeros_like(bias), mod32, [g.float() for g in grads], True
    )
    assert torch.equal(h, h32.to(dtype))
    assert torch.equal(gx, gx32.to(dtype))
    assert torch.equal(gm[..., x.shape[-1] :], gm32[..., x.shape[-1] :].to(dtype))  # shift, scale


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_other_backward_tiles_compute_the_same_gradients(device, monkeypatch):
    """``launch_backward``'s tiles (what benchmarks/residual_norm.py --sweep varies) change the
    blocks of the column sums, not the gradients."""
    x, a, bias, mod = _inputs((2, 300, 48), torch.float32, device, seed=1)
    gate, _, scale = mod.chunk(3, -1)
    g, gh = torch.randn_like(x), torch.randn_like(x)
    want = residual.launch_backward(g, gh, x, a, bias, gate, scale, EPS, (128, 2, 8))
    got = residual.launch_backward(g, gh, x, a, bias, gate, scale, EPS, (32, 4, 2))
    assert want[2].shape == (2, 3, 4, 48) and got[2].shape == (2, 10, 4, 48)
    default = residual.launch_backward(g, gh, x, a, bias, gate, scale, EPS)
    torch.testing.assert_close(default[1], want[1], atol=1e-6, rtol=1e-6)
    # the ops' tiles are read at each call (what benchmarks/scaling.py --residual-tiles sets)
    monkeypatch.setitem(residual.TILES, "bwd", residual.Tiles.parse("32x4/2"))
    assert residual.launch_backward(g, gh, x, a, bias, gate, scale, EPS)[2].shape == (2, 10, 4, 48)
    torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got[1], want[1], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got[2].sum(1), want[2].sum(1), atol=1e-4, rtol=1e-5)


def test_tiles_are_written_rows_x_step_over_warps_and_checked():
    tiles = residual.parse_tile_set("fwd=32x4/4,bwd=16x2/2")
    assert tiles == {"fwd": residual.Tiles(32, 4, 4), "bwd": residual.Tiles(16, 2, 2)}
    assert [str(t) for t in tiles.values()] == ["32x4/4", "16x2/2"]
    assert residual.parse_tile_set("64x2/4") == dict.fromkeys(("fwd", "bwd"), residual.Tiles(64, 2, 4))
    for bad, message in [
        ("16x2", "expected ROWSxSTEP/WARPS"),
        ("16x3/2", "the step and warps powers of 2"),
        ("16x2/3", "the step and warps powers of 2"),
        ("0x2/2", "expected ROWSxSTEP/WARPS"),
        ("8x16/2", "16 tokens a step do not divide 8 tokens a program"),
        ("bwd=16x2/2,bwd=8x2/2", "expected SPEC or fwd=SPEC,bwd=SPEC, got 'bwd'"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            residual.parse_tile_set(bad)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_the_gradients_are_the_same_bits_every_time(device):
    x, a, bias, mod = _inputs((2, 500, 64), torch.bfloat16, device, seed=3)
    grads = [torch.randn_like(x) for _ in range(2)]
    first, again = (_run(x, a, bias, mod, grads, True)[1] for _ in range(2))
    assert all(torch.equal(p, q) for p, q in zip(first, again))


def test_a_compiled_block_calls_the_ops_without_a_graph_break():
    torch._dynamo.reset()
    torch.manual_seed(0)
    block = DiTBlock(16, 2, 4.0, 3, rope=False, impl="reference", residual_impl="fused")
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.2)
    counts = torch._dynamo.utils.counters
    counts.clear()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(block, backend=backend, fullgraph=True)
    x, c = torch.randn(2, 4, 5, 16, requires_grad=True), torch.randn(2, 16)
    y = compiled(x, c)
    y.sum().backward()
    torch.testing.assert_close(y, block(x, c))
    assert not counts["graph_break"] and len(graphs) == 1
    called = {str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"}
    assert {"stormscope.residual_norm.default", "stormscope.gated_residual.default"} <= called, called


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_padding_tokens_of_a_constant_stream_leave_the_sums_finite_at_eps_0(device):
    # A program's padding rows (tokens past the sample's) have x1 = gate * bias, constant over the
    # channels where bias is zero (as at init): with eps = 0 their normalised x1 is 0 * inf
    x, a, bias, mod = _inputs((2, 130, 24), torch.float32, device, seed=4)
    bias.zero_()
    gate, shift, scale = mod.chunk(3, -1)
    leaves = [t.detach().requires_grad_() for t in (x, a, bias, gate, shift, scale)]
    x1, h = residual.residual_norm(*leaves, 0.0)
    (x1.sum() + h.square().sum()).backward()
    for t in leaves:
        assert torch.isfinite(t.grad).all()


def test_a_float64_stream_is_computed_in_float64_whatever_the_other_inputs():
    x, a, bias, mod = _inputs((2, 3, 8), torch.float32)
    x = x.double() + 1e-10  # below float32's resolution at these magnitudes
    gate, shift, scale = mod.chunk(3, -1)
    want = x + gate.double() * (a.double() + bias.double())
    assert torch.equal(residual.gated_residual(x, a, bias, gate), want)
    x1, _ = residual.residual_norm(x, a, bias, gate, shift, scale, EPS)
    assert x1.dtype == torch.float64 and torch.equal(x1, want)
    dx, _, sums = residual.residual_norm_backward(x, x, x, a, bias, gate, scale, EPS)
    assert dx.dtype == sums.dtype == torch.float64


def test_an_empty_batch_gives_empty_outputs_and_gradients():
    x, a, bias, mod = _inputs((0, 4, 8), torch.float32)
    gate, shift, scale = mod.chunk(3, -1)
    leaves = [t.detach().requires_grad_() for t in (x, a, bias, gate, shift, scale)]
    x1, h = residual.residual_norm(*leaves, EPS)
    y = residual.gated_residual(h, x1, leaves[2], leaves[3])
    assert x1.shape == h.shape == y.shape == (0, 4, 8)
    y.sum().backward()
    assert leaves[2].grad.shape == (8,) and not leaves[2].grad.any()


def test_a_bias_of_another_length_is_refused_before_a_kernel_reads_past_it():
    # (on CPU the torch formulas; under TRITON_INTERPRET=1 the kernels)
    x, a, bias, mod = _inputs((2, 3, 8), torch.float32)
    gate, shift, scale = mod.chunk(3, -1)
    for wrong in (bias[:5], bias[:, None]):
        with pytest.raises(ValueError, match=re.escape(f"a bias of shape {tuple(wrong.shape)} for 8 channels")):
            residual.gated_residual(x, a, wrong, gate)
        with pytest.raises(ValueError, match=r"a bias of shape .* for 8 channels"):
            residual.residual_norm(x, a, wrong, gate, shift, scale, EPS)


def test_backward_tiles_whose_step_does_not_divide_a_program_are_refused():
    x, a, bias, mod = _inputs((1, 300, 8), torch.float32)
    gate, _, scale = mod.chunk(3, -1)
    with pytest.raises(ValueError, match=r"tiles \(128, 3, 8\): 3 tokens a step do not divide 128"):
        residual.launch_backward(x, x, x, a, bias, gate, scale, EPS, tiles=(128, 3, 8))


@pytest.mark.skipif(INTERPRETED, reason="the interpreter's kernels are Python functions, not Triton's")
def test_the_kernels_build_for_hopper_without_spills(monkeypatch):
    """The interpreter never compiles a kernel: the four launches, as the ops make them at the
    preset's size, built for sm90 on any machine."""
    pytest.importorskip("triton")
    from benchmarks import kernel_build

    calls: list = []
    for name in ("_residual_fwd", "_residual_bwd"):
        monkeypatch.setattr(residual, name, kernel_build._Recorder(getattr(residual, name), calls))
    monkeypatch.setattr(residual, "_kernels_take", lambda *t: True)
    x = torch.empty(4, 128, 160, 768, dtype=torch.bfloat16)
    bias, m = torch.empty(768), torch.empty(4, 1, 1, 768, dtype=torch.bfloat16)
    residual.residual_norm(x, x, bias, m, m, m, EPS)
    residual.gated_residual(x, x, bias, m)
    residual.residual_norm_backward(x, x, x, x, bias, m, m, EPS)
    residual.gated_residual_backward(x, x, bias, m)
    assert [(c[0].__name__, c[3]["NORM"]) for c in calls] == [
        ("_residual_fwd", True),
        ("_residual_fwd", False),
        ("_residual_bwd", True),
        ("_residual_bwd", False),
    ]
    for kernel, _, args, kw in calls:
        r = kernel_build.report(kernel, args, kw, 90)
        # (the backward with the norm takes 255 registers at 2 tokens a step in 2 warps, the tiles
        # an H100 ran fastest: no spills is the bound that matters)
        assert r["spill_bytes"] == 0, (kernel.__name__, kw["NORM"], r)
