"""The DiT MLP's bias + GELU op (recipes/stormscope/gelu.py): its formulas, its kernels, the MLP on it.

The kernels run under Triton's interpreter on CPU when ``TRITON_INTERPRET=1`` is set before
Triton is imported (`.ci/run` runs this file so), compiled on CUDA in the ``gpu`` tests; the
README's suite runs the rest (the torch formulas, which the CPU model uses).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from recipes.stormscope import gelu
from recipes.stormscope.dit import Mlp
from tests.recipes.stormscope.kernel_devices import INTERPRETED, KERNEL_DEVICES


def _inputs(shape, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    h = (3 * torch.randn(*shape, generator=g, dtype=torch.float64)).to(dtype).to(device)
    b = torch.randn(shape[-1], generator=g, dtype=torch.float64).to(device)
    grad = torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).to(device)
    return h, b, grad


def _reference(h, b, grad):
    """F.gelu(approximate="tanh") of h + b in float64 and its gradients (autograd's)."""
    h64 = h.double().cpu().requires_grad_()
    b64 = b.double().cpu().requires_grad_()
    y = F.gelu(h64 + b64, approximate="tanh")
    gh, gb = torch.autograd.grad(y, (h64, b64), grad.double().cpu())
    return y.detach(), gh, gb


def test_the_formulas_are_gelu_tanh_of_the_sum_and_its_gradients():
    h, b, grad = _inputs((4, 5, 24), torch.float64)
    b = b.requires_grad_()
    h = h.requires_grad_()
    y = gelu.bias_gelu(h, b)
    gh, gb = torch.autograd.grad(y, (h, b), grad)
    want = _reference(h, b, grad)
    for got, ref, name in zip((y, gh, gb), want, ("value", "grad h", "grad b")):
        torch.testing.assert_close(got, ref, atol=1e-12, rtol=1e-12, msg=name)
    # and the hand-written derivative is the formula's (not just close to the tanh form's)
    assert torch.autograd.gradcheck(gelu.bias_gelu, (h.detach()[:2, :2].requires_grad_(), b))


def test_the_mlp_is_fc1_gelu_tanh_fc2_with_the_same_parameters():
    torch.manual_seed(0)
    mlp = Mlp(16, 4.0).double()
    ref = torch.nn.Sequential(mlp.fc1, torch.nn.GELU(approximate="tanh"), mlp.fc2)
    assert [n for n, _ in mlp.named_parameters()] == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    x = torch.randn(2, 3, 5, 16, dtype=torch.float64)
    dy = torch.randn(2, 3, 5, 16, dtype=torch.float64)
    grads = []
    for m in (mlp, ref):
        y = m(x)
        grads.append((y, *torch.autograd.grad(y, list(mlp.parameters()), dy)))
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("shape", [(600, 300), (3, 7, 40)])  # several row blocks, ragged tiles; fewer rows than one
def test_the_kernels_compute_the_formulas_in_float32(device, shape):
    h, b, grad = _inputs(shape, torch.float32, device)
    assert gelu._kernels_take(h)
    y = gelu.bias_gelu(h, b.float())
    gh, gb = gelu.bias_gelu_backward(grad, h, b.float())
    want = _reference(h, b.float(), grad)
    for got, ref, name in zip((y, gh, gb), want, ("value", "grad h", "grad b")):
        assert got.dtype == torch.float32, name
        torch.testing.assert_close(got.double().cpu(), ref, atol=2e-5, rtol=2e-5, msg=name)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs_are_computed_in_float32_and_rounded_once(device, dtype):
    """16-bit inputs give the float32 results of the same values rounded to 16 bits (to nearest,
    once), and the same float32 bias gradient: the sums add the float32 gradients."""
    if device == "cpu" and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter truncates float32 to bfloat16 instead of rounding it")
    h, b, grad = _inputs((300, 260), dtype, device)
    b = b.float()
    y = gelu.bias_gelu(h, b)
    gh, gb = gelu.bias_gelu_backward(grad, h, b)
    assert (y.dtype, gh.dtype, gb.dtype) == (dtype, dtype, torch.float32)
    y32 = gelu.bias_gelu(h.float(), b)
    gh32, gb32 = gelu.bias_gelu_backward(grad.float(), h.float(), b)
    assert torch.equal(y, y32.to(dtype))
    assert torch.equal(gh, gh32.to(dtype))
    assert torch.equal(gb, gb32)
    # (and the float32 results are the formulas': test_the_kernels_compute_the_formulas_in_float32)
    torch.testing.assert_close(gb.double().cpu(), _reference(h, b, grad)[2], atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_other_backward_tiles_compute_the_same_gradient(device):
    """``launch_backward``'s tiles (what benchmarks/mlp_gelu.py --sweep varies) change the blocks of
    the column sums, not the gradient."""
    h, b, grad = _inputs((200, 300), torch.float32, device, seed=1)
    b = b.float()
    want_gh, want_gb = gelu.bias_gelu_backward(grad, h, b)
    gh = torch.empty_like(h)
    sums = gelu.launch_backward(grad, h, b, gh, (32, 16, 64, 2))
    assert sums.shape == (7, 300)
    assert torch.equal(gh, want_gh)
    torch.testing.assert_close(sums.sum(0), want_gb, atol=1e-4, rtol=1e-5)
    with pytest.raises(ValueError, match=r"tiles \(32, 64, 64, 2\): 64 rows a step do not divide 32"):
        gelu.launch_backward(grad, h, b, gh, (32, 64, 64, 2))  # (a program's steps would overlap the next's)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_the_bias_gradient_is_the_same_bits_every_time(device):
    h, b, grad = _inputs((1000, 96), torch.bfloat16, device, seed=3)
    first = gelu.bias_gelu_backward(grad, h, b.float())
    again = gelu.bias_gelu_backward(grad, h, b.float())
    assert all(torch.equal(x, y) for x, y in zip(first, again))


def test_a_strided_input_compiles_as_it_runs_eagerly():
    # the op's output is contiguous on every path, as its fake says (inductor checks the strides)
    torch._dynamo.reset()
    h, b = torch.randn(40, 7), torch.randn(40)
    leaf = h.t().requires_grad_()  # (7, 40), strides (1, 7)
    compiled = torch.compile(gelu.bias_gelu, fullgraph=True)
    y = compiled(leaf, b)
    torch.testing.assert_close(y, gelu.bias_gelu(leaf, b))
    assert y.is_contiguous()
    y.sum().backward()
    assert leaf.grad.shape == (7, 40)


def test_a_bias_of_another_length_is_refused():
    # (on CPU the torch formulas; under TRITON_INTERPRET=1 the kernels)
    h, b, grad = _inputs((6, 8), torch.float32)
    with pytest.raises(ValueError, match=r"a bias of shape \(5,\) for 8 channels"):
        gelu.bias_gelu(h, b[:5].float())
    with pytest.raises(ValueError, match=r"a bias of shape \(5,\) for 8 channels"):
        gelu.bias_gelu_backward(grad, h, b[:5].float())


def test_a_compiled_mlp_calls_the_ops_without_a_graph_break():
    torch._dynamo.reset()
    mlp = Mlp(8, 4.0)
    counts = torch._dynamo.utils.counters
    counts.clear()
    compiled = torch.compile(mlp, backend="aot_eager", fullgraph=True)
    x = torch.randn(2, 4, 8, requires_grad=True)
    y = compiled(x)
    y.sum().backward()
    torch.testing.assert_close(y, mlp(x))
    assert not counts["graph_break"]


@pytest.mark.skipif(INTERPRETED, reason="the interpreter's kernels are Python functions, not Triton's")
def test_the_kernels_build_for_hopper_without_spills(monkeypatch):
    """The interpreter never compiles a kernel (it took module globals a compiled kernel refuses):
    both launches, as the op makes them at the preset's size, built for sm90 on any machine."""
    pytest.importorskip("triton")
    from benchmarks import kernel_build

    calls: list = []
    for name in ("_bias_gelu_fwd", "_bias_gelu_bwd"):
        monkeypatch.setattr(gelu, name, kernel_build._Recorder(getattr(gelu, name), calls))
    monkeypatch.setattr(gelu, "_kernels_take", lambda h: True)
    h = torch.empty(81920, 3072, dtype=torch.bfloat16)
    b = torch.empty(3072)
    gelu.bias_gelu(h, b)
    gelu.bias_gelu_backward(torch.empty_like(h), h, b)
    assert [c[0].__name__ for c in calls] == ["_bias_gelu_fwd", "_bias_gelu_bwd"]
    for kernel, _, args, kw in calls:
        r = kernel_build.report(kernel, args, kw, 90)
        assert r["spill_bytes"] == 0 and r["registers"] <= 128, r
