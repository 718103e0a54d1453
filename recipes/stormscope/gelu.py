"""The DiT MLP's bias and GELU: one Triton kernel forward, one backward that also sums the bias gradient.

Why hand-written: compiled, the MLP's first Linear ran with its bias in cuBLAS's epilogue, then
inductor ran the GELU forward, the GELU backward, and the bias gradient as a column sum that
read the backward's 0.5 GB output again (``benchmarks/block_lowering.py``: 0.504 of the block
backward's 5.23 GB); inductor 2.11 does not fuse a column sum over every token into the
pointwise kernel that produces it. Here the first Linear runs without its bias, and
``bias_gelu(h, b)`` adds it in the GELU's kernel; the backward kernel writes the input's gradient
and, per block of rows, its column sums, which a (tiny) sum over the blocks finishes: the
gradient is read by the matrix products only.

Same function as ``nn.GELU(approximate="tanh")`` of ``h + b``: 0.5 x (1 + tanh z) = x sigmoid(2z),
z = sqrt(2 / pi) (x + 0.044715 x^3), computed in float32 from the inputs as they come (h bf16
under autocast, b the float32 parameter) and rounded once to h's dtype. The sigmoid form is one
exp2 and a division where libdevice's accurate tanhf is a few dozen instructions (which made
inductor's GELU kernels compute-bound on an H200, docs/benchmarks.md run 31), and it is the more
accurate of the two for negative x, where 1 + tanh z cancels: about 1.6% of bf16 results differ
from eager ``F.gelu``'s by one unit in the last place (run 31, the same form through inductor;
``benchmarks/mlp_gelu.py`` prints the share for this kernel). The bias gradient sums the float32
gradients before they are rounded, per block of rows in a fixed order: deterministic.

Custom ops with a registered backward, so a compiled block traces them without a graph break.
On CPU (or any tensor the kernels cannot take, float64 say) the same formulas run as torch ops;
with ``TRITON_INTERPRET=1`` the kernels run on CPU tensors too (the CPU tests check them there).
"""

from __future__ import annotations

import math
import os

import torch
from torch import Tensor

from recipes.stormscope.fused_natten import device_of

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch formulas below
    triton = None

_K = math.sqrt(2.0 / math.pi)
_KAPPA = 0.044715
if triton is not None:  # (the kernels read globals only as constexprs)
    # exp(-2z) as exp2(x (C1 + C2 x^2)): C1 = -2 sqrt(2/pi) log2(e), C2 = 0.044715 C1; the
    # derivative's factors 2 sqrt(2/pi) and 3 * 0.044715
    _C1 = tl.constexpr(-2.0 * _K / math.log(2.0))
    _C2 = tl.constexpr(-2.0 * _K / math.log(2.0) * _KAPPA)
    _D1 = tl.constexpr(2.0 * _K)
    _D2 = tl.constexpr(3.0 * _KAPPA)

# The forward's tiles (rows x columns, 8 warps) and the backward's (rows per program, per step
# of its loop, columns; 4 warps): each backward program writes one row of column sums, so the
# sums to finish are (rows / 64, columns), 15.7 MB of float32 for the preset's (81920, 3072)
# hidden layer against the 0.5 GB re-read they replace. On an H100 (docs/benchmarks.md, run 36:
# the sweep `benchmarks/mlp_gelu.py --sweep` now makes) the backward took 0.55 ms at this size (2.7 TB/s), 0.54-0.60 for
# tiles of 32-128 rows, steps of 32, 64-256 columns, 2-8 warps, and 1.22 ms with 256-row programs
# stepping 16 rows (too few loads in flight); the forward 0.36 ms whatever its tiles.
_FWD_ROWS, _FWD_COLS, _FWD_WARPS = 32, 256, 8
_BWD_ROWS, _BWD_STEP, _BWD_COLS, _BWD_WARPS = 64, 32, 128, 4


def _kernels_take(h: Tensor) -> bool:
    """The Triton kernels can run on ``h``: a non-empty float32 or half-precision CUDA tensor (any
    device under Triton's interpreter)."""
    if triton is None or h.dtype not in (torch.float32, torch.bfloat16, torch.float16) or not h.numel():
        return False
    return h.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:

    @triton.jit
    def _sigmoid_2z(x):
        """sigmoid(2z) of float32 ``x`` (``x (C1 + C2 x^2)`` is -2z in log2 units); 0 or 1 where
        exp2 overflows or underflows, so x sigmoid(2z) is exact at either end."""
        return 1.0 / (1.0 + tl.exp2(x * (_C1 + _C2 * x * x)))

    @triton.jit
    def _bias_gelu_fwd(h_ptr, b_ptr, a_ptr, M, N, BM: tl.constexpr, BN: tl.constexpr):
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        mask = (rows < M)[:, None] & (cols < N)[None, :]
        offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
        x = tl.load(h_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        x += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        tl.store(a_ptr + offs, (x * _sigmoid_2z(x)).to(a_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _bias_gelu_bwd(
        g_ptr, h_ptr, b_ptr, gh_ptr, sums_ptr, M, N, BM: tl.constexpr, RB: tl.constexpr, BN: tl.constexpr
    ):
        """The input's gradient of ``BM`` rows and ``BN`` columns, ``RB`` rows a step, and its column
        sums over those rows (one row of ``sums``)."""
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        in_cols = cols < N
        bias = tl.load(b_ptr + cols, mask=in_cols, other=0.0).to(tl.float32)[None, :]
        acc = tl.zeros([BN], tl.float32)
        for i in range(0, BM, RB):
            rows = tl.program_id(0) * BM + i + tl.arange(0, RB)
            mask = (rows < M)[:, None] & in_cols[None, :]
            offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
            x = tl.load(h_ptr + offs, mask=mask, other=0.0).to(tl.float32) + bias
            g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            s = _sigmoid_2z(x)
            # d/dx x sigmoid(2z) = s + x s (1 - s) 2 sqrt(2/pi) (1 + 3 * 0.044715 x^2)
            d = g * (s + x * s * (1.0 - s) * _D1 * (1.0 + _D2 * x * x))
            tl.store(gh_ptr + offs, d.to(gh_ptr.dtype.element_ty), mask=mask)
            acc += tl.sum(tl.where(mask, d, 0.0), 0)
        tl.store(sums_ptr + tl.program_id(0).to(tl.int64) * N + cols, acc, mask=in_cols)


def _check_bias(h: Tensor, b: Tensor) -> None:
    """``b`` one value per channel of ``h`` (the kernels read that many whatever its length)."""
    if b.shape != h.shape[-1:]:
        raise ValueError(f"a bias of shape {tuple(b.shape)} for {h.shape[-1]} channels")


def _x_and_sigmoid_2z(h: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """The torch formulas' x = h + b and sigmoid(2z), in float32 (float64 for float64 inputs)."""
    dt = torch.float64 if h.dtype == torch.float64 else torch.float32
    x = h.to(dt) + b.to(dt)
    return x, torch.sigmoid(2.0 * _K * (x + _KAPPA * x * x * x))


@torch.library.custom_op("stormscope::bias_gelu", mutates_args=())
def bias_gelu(h: Tensor, b: Tensor) -> Tensor:
    """GELU(tanh) of ``h + b`` (``b`` over the last axis), in h's dtype; see the module doc."""
    _check_bias(h, b)
    if not _kernels_take(h):  # (contiguous, as the kernel's output and the fake say)
        x, s = _x_and_sigmoid_2z(h, b)
        return (x * s).to(h.dtype).contiguous()
    h2 = h.reshape(-1, h.shape[-1]).contiguous()
    m, n = h2.shape
    a = torch.empty_like(h2)
    grid = (triton.cdiv(m, _FWD_ROWS), triton.cdiv(n, _FWD_COLS))
    with device_of(h):
        _bias_gelu_fwd[grid](h2, b.contiguous(), a, m, n, BM=_FWD_ROWS, BN=_FWD_COLS, num_warps=_FWD_WARPS)
    return a.view(h.shape)


@bias_gelu.register_fake
def _(h: Tensor, b: Tensor) -> Tensor:
    _check_bias(h, b)
    return torch.empty_like(h, memory_format=torch.contiguous_format)


@torch.library.custom_op("stormscope::bias_gelu_backward", mutates_args=())
def bias_gelu_backward(grad: Tensor, h: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """(gradient of ``h`` in h's dtype, of ``b`` in b's) for ``grad`` of ``bias_gelu(h, b)``."""
    _check_bias(h, b)
    if not _kernels_take(h):
        x, s = _x_and_sigmoid_2z(h, b)
        d = grad.to(x.dtype) * (s + x * s * (1.0 - s) * (2.0 * _K) * (1.0 + 3.0 * _KAPPA * x * x))
        return d.to(h.dtype).contiguous(), d.reshape(-1, h.shape[-1]).sum(0).to(b.dtype)
    h2 = h.reshape(-1, h.shape[-1]).contiguous()
    gh = torch.empty_like(h2)
    sums = launch_backward(grad.reshape(h2.shape).contiguous(), h2, b.contiguous(), gh)
    return gh.view(h.shape), sums.sum(0).to(b.dtype)


def launch_backward(
    grad: Tensor, h: Tensor, b: Tensor, gh: Tensor, tiles=(_BWD_ROWS, _BWD_STEP, _BWD_COLS, _BWD_WARPS)
) -> Tensor:
    """The backward kernel on contiguous (rows, columns) ``grad`` and ``h``, writing ``gh``; returns
    its per-block column sums. ``tiles``: rows a program, rows a step, columns, warps (what
    ``benchmarks/mlp_gelu.py --sweep`` varies)."""
    m, n = h.shape
    bm, rb, bn, warps = tiles
    if bm % rb:  # (else a program's last step runs into the next program's rows, summed twice)
        raise ValueError(f"tiles {tiles}: {rb} rows a step do not divide {bm} rows a program")
    sums = torch.empty(triton.cdiv(m, bm), n, device=h.device, dtype=torch.float32)
    with device_of(h):
        _bias_gelu_bwd[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
            grad, h, b, gh, sums, m, n, BM=bm, RB=rb, BN=bn, num_warps=warps
        )
    return sums


@bias_gelu_backward.register_fake
def _(grad: Tensor, h: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    _check_bias(h, b)
    return torch.empty_like(h, memory_format=torch.contiguous_format), torch.empty_like(b)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad):
    h, b = ctx.saved_tensors
    return bias_gelu_backward(grad, h, b)


bias_gelu.register_autograd(_backward, setup_context=_setup_context)
