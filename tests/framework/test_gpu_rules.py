"""framework.gpu_rules: CUDA's autocast rules and dropout kernel applied to CPU tensors while the
context is entered, and the CPU's own behaviour back after it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from framework import gpu_rules


def _has(name: str, key: str) -> bool:
    packet, _, overload = name.partition(".")
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{packet}" + (f".{overload}" if overload else ""), key)


@pytest.mark.parametrize("name", [*gpu_rules.FP32, *gpu_rules.FP32_OUTPUT, *gpu_rules.LOW])
def test_every_rule_is_an_op_cuda_autocast_casts_and_cpu_autocast_leaves(name):
    assert _has(name, "AutocastCUDA"), f"{name}: torch's CUDA autocast has no kernel for it (any more)"
    assert not _has(name, "AutocastCPU"), f"{name}: CPU autocast casts it itself now"


@pytest.mark.parametrize("name,at", sorted(gpu_rules.FP32_OUTPUT.items()))
def test_the_dtype_argument_is_where_the_rule_puts_it(name, at):
    args = gpu_rules._op(name)._schema.arguments
    i = next(i for i, a in enumerate(args) if a.name == "dtype")
    assert (None if args[i].kwarg_only else i) == at


def _dtypes():
    torch.manual_seed(0)
    x = torch.randn(2, 8, 4, 4, requires_grad=True)
    w = torch.randn(8, 8, 3, 3, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = F.conv2d(x, w, padding=1)
        g = F.group_norm(y, 2)
        out = {
            "conv": y,
            "group_norm": g,
            "silu after it": F.silu(g),
            "layer_norm": F.layer_norm(y, (4,)),
            "softmax": torch.softmax(y, dim=1),
            "softmax, dtype given": y.softmax(1, dtype=torch.bfloat16),
            "sum": y.sum(),
            "sum over dims": y.sum(dim=(2, 3)),
            "exp": torch.exp(y),
            "pow": y**2,
            "upsample": F.interpolate(y, scale_factor=2),
            "einsum": torch.einsum("bchw,bchw->b", x, x),
        }
    (out["silu after it"].float().sum() + out["softmax"].float().sum()).backward()  # autograd runs through
    assert w.grad is not None and w.grad.dtype == torch.float32
    return {k: v.dtype for k, v in out.items()}, g.detach(), y.detach()


def test_inside_cpu_autocast_casts_as_cuda_autocast_and_outside_as_before():
    bf16, fp32 = torch.bfloat16, torch.float32
    before, *_ = _dtypes()
    with gpu_rules.cuda_rules(bf16):
        inside, g, y = _dtypes()
    after, *_ = _dtypes()
    assert before == after
    assert all(d == bf16 for d in before.values())  # CPU autocast: everything stays in bf16
    expected = dict.fromkeys(inside, fp32) | {"conv": bf16, "softmax, dtype given": bf16, "einsum": bf16}
    assert inside == expected
    assert torch.equal(g, F.group_norm(y.float(), 2))  # the fp32 op on the bf16 input, as CUDA computes it


def test_dropout_takes_the_fused_kernel_and_keeps_a_byte_mask():
    x = torch.randn(64, 64, requires_grad=True)
    torch.manual_seed(3)
    want, mask = torch.native_dropout(x, 0.25, True)
    with gpu_rules.cuda_rules():
        torch.manual_seed(3)
        got = F.dropout(x, 0.25, training=True)
        assert got.grad_fn is not None and "NativeDropout" in type(got.grad_fn).__name__
        assert F.dropout(x, 0.25, training=False) is x and F.dropout(x, 0.0, training=True) is x
    assert mask.dtype == torch.bool and torch.equal(got, want)
    got.sum().backward()
    assert torch.equal(x.grad, mask * (1 / 0.75))
    assert "NativeDropout" not in type(F.dropout(x, 0.25, training=True).grad_fn).__name__  # the CPU's again
