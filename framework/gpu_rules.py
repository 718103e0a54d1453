"""CUDA's autocast rules and dropout kernel on the CPU's code path, for tracing a GPU step where
there is no GPU.

``mode=plan`` traces a training step on fake CPU tensors (framework/plan.py). Under bf16/fp16
autocast the CPU and CUDA cast different ops: CUDA keeps GroupNorm, LayerNorm, softmax, sums,
``exp``/``log``/``pow`` and up-sampling in fp32 and computes ``einsum``/``mv``/``addmv`` in the
low dtype, where CPU autocast leaves all of these alone. For a GroupNorm-heavy UNet that is the
difference between bf16 and fp32 GroupNorm/SiLU activations: a third of the step's memory.

:func:`cuda_rules` registers, for as long as it is entered, CPU autocast kernels that apply
CUDA's policy to the ops whose CUDA autocast kernel has no CPU counterpart (the table below,
from torch's ``autocast_mode.h``; ``tests/framework/test_gpu_rules.py`` checks every name
against the dispatcher of the installed torch). Ops both devices cast (convolutions, linear,
matmul, the losses) keep the CPU's kernel. It also routes ``dropout`` to the fused kernel CUDA
takes (``native_dropout``: a 1-byte mask kept for backward, where the CPU's composite keeps a
float mask the size of the activation: an eighth of a UNet's step at dropout 0.1).
Leaving the context removes the kernels again.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

# CUDA's autocast policy for the ops that CPU autocast does not touch (torch 2.11-2.14).
FP32 = (  # inputs cast to fp32
    "acos",
    "asin",
    "cosh",
    "erfinv",
    "exp",
    "expm1",
    "log",
    "log10",
    "log2",
    "log1p",
    "reciprocal",
    "rsqrt",
    "sinh",
    "tan",
    "pow.Tensor_Scalar",
    "pow.Tensor_Tensor",
    "pow.Scalar",
    "softplus",
    "layer_norm",
    "native_layer_norm",
    "group_norm",
    "cosine_similarity",
    "dist",
    "renorm",
    "logsumexp",
    "upsample_nearest1d",
    "upsample_nearest2d",
    "upsample_nearest3d",
    "upsample_linear1d",
    "upsample_bilinear2d",
    "upsample_trilinear3d",
    "upsample_bicubic2d",
)
FP32_OUTPUT = {  # inputs kept, computed with dtype=float32 unless a dtype is given: the index of
    # a positional ``dtype`` argument, None where it is keyword-only
    "softmax.int": 2,
    "log_softmax.int": 2,
    "sum": None,
    "sum.dim_IntList": None,
    "cumsum": None,
    "cumprod": None,
    "linalg_vector_norm": None,
}
LOW = ("addmv", "addr", "einsum", "mv", "chain_matmul", "linalg_multi_dot")  # cast to the low dtype


def _floating(t: Any) -> bool:
    import torch

    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64


def _cast(x: Any, dtype) -> Any:
    if _floating(x):
        return x.to(dtype)
    if isinstance(x, (list, tuple)):
        return type(x)(_cast(y, dtype) for y in x)
    return x


def _op(name: str):
    import torch

    packet, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, packet), overload or "default")


def _kernel(op, policy: str, low, dtype_at: int | None = None):
    import torch

    def kernel(*args, **kwargs):
        if policy == "fp32":
            args, kwargs = _cast(args, torch.float32), {k: _cast(v, torch.float32) for k, v in kwargs.items()}
        elif policy == "low":
            args, kwargs = _cast(args, low), {k: _cast(v, low) for k, v in kwargs.items()}
        elif args and _floating(args[0]):  # fp32_output: CUDA looks at the first argument only
            if dtype_at is None or len(args) <= dtype_at:
                kwargs["dtype"] = kwargs.get("dtype") or torch.float32
            elif args[dtype_at] is None:
                args = (*args[:dtype_at], torch.float32, *args[dtype_at + 1 :])
        with torch.autocast("cpu", enabled=False):  # below autocast, as CUDA's kernels redispatch
            return op(*args, **kwargs)

    return kernel


def _dropout(input, p: float, train: bool):
    import torch

    if train and 0 < p < 1 and input.numel() > 0:  # CUDA's condition for its fused kernel
        return torch.ops.aten.native_dropout(input, p, train)[0]
    return input if not train or p == 0 else input * 0  # p == 1 (all dropped); eval: identity


_TRACING_FOR_CUDA = [False]


def tracing_for_cuda() -> bool:
    """Whether a CPU trace on fake tensors stands in for a CUDA step (inside ``cuda_rules``): where
    a model picks its kernels by device, it may pick CUDA's, whose fake implementations (a custom
    op's ``register_fake``) then give the trace what the GPU's kernels would allocate."""
    return _TRACING_FOR_CUDA[0]


@contextlib.contextmanager
def cuda_rules(low_dtype=None) -> Iterator[None]:
    """Inside: CPU tensors take CUDA's dropout kernel and, with ``low_dtype`` (bf16/fp16), CPU
    autocast casts as CUDA autocast would; ``tracing_for_cuda()`` is true."""
    import torch

    lib = torch.library.Library("aten", "IMPL")
    outer = _TRACING_FOR_CUDA[0]
    _TRACING_FOR_CUDA[0] = True
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "overriding a previously registered kernel": the point
            lib.impl("dropout", _dropout, "AutogradCPU")  # before autograd: native_dropout has its own
            if low_dtype is None:
                yield
                return
            for name in FP32:
                lib.impl(name, _kernel(_op(name), "fp32", low_dtype), "AutocastCPU")
            for name, at in FP32_OUTPUT.items():
                lib.impl(name, _kernel(_op(name), "fp32_output", low_dtype, at), "AutocastCPU")
            for name in LOW:
                lib.impl(name, _kernel(_op(name), "low", low_dtype), "AutocastCPU")
        yield
    finally:
        _TRACING_FOR_CUDA[0] = outer
        del lib  # its finalizer deregisters the kernels: the CPU's own autocast (or none) is back
