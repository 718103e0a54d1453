"""The DiT MLP's bias + GELU op against inductor's kernels for the same work, side by side.

``recipes/stormscope/gelu.py``'s ``bias_gelu`` (one Triton kernel each way, the bias gradient
summed in the backward's) against ``torch.compile`` of ``F.gelu(h + b, approximate="tanh")``
(inductor: a GELU kernel forward; a GELU backward kernel and a column sum for the bias gradient),
on the preset's hidden layer by default: (81920, 3072) bf16, batch 4 of 128 x 160 tokens, 3072
wide. Prints the forward's and the forward + backward's time (median, ms), the ratio, and how
the results differ from eager ``F.gelu``'s. ``--sweep`` also times the backward kernel alone
with other tiles (``ROWSxSTEPxCOLS/WARPS``).

    python benchmarks/mlp_gelu.py                        # on the GPU machine
    python benchmarks/mlp_gelu.py --sweep 64x32x128/4 32x16x128/2 256x16x256/8
    python benchmarks/mlp_gelu.py --device cpu --rows 256 --cols 96 --iters 2   # the code path, on CPU

Absolute times only mean something on a GPU; on CPU (without ``TRITON_INTERPRET=1``) the op runs
its torch formulas.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from recipes.stormscope import gelu  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def median_ms(fn, iters: int, warmup: int, device: torch.device) -> float:
    """Median wall time of ``fn()`` in ms (synchronised on CUDA)."""
    times = []
    for i in range(warmup + iters):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _inductor(h, b):
    return F.gelu(h + b.to(h.dtype), approximate="tanh")


def compare(rows: int, cols: int, dtype: torch.dtype, device: torch.device, iters: int, warmup: int) -> dict:
    """{"inductor"/"op": {"fwd_ms", "fwd_bwd_ms"}, "differ_from_eager": share of outputs, ...}."""
    g = torch.Generator(device="cpu").manual_seed(0)
    h = (2 * torch.randn(rows, cols, generator=g)).to(dtype).to(device).requires_grad_()
    b = torch.randn(cols, generator=g).to(device).requires_grad_()
    dy = torch.randn(rows, cols, generator=g).to(dtype).to(device)
    impls = {"inductor": torch.compile(_inductor), "op": gelu.bias_gelu}
    out: dict = {}
    for name, fn in impls.items():
        fwd = median_ms(lambda: fn(h.detach(), b.detach()), iters, warmup, device)  # noqa: B023
        both = median_ms(lambda: torch.autograd.grad(fn(h, b), (h, b), dy), iters, warmup, device)  # noqa: B023
        out[name] = {"fwd_ms": fwd, "fwd_bwd_ms": both}
    eager = F.gelu(h.detach() + b.detach().to(dtype), approximate="tanh")
    exact = F.gelu(h.detach().double() + b.detach().double(), approximate="tanh")
    for name, fn in impls.items():
        y = fn(h.detach(), b.detach())
        out[name]["differ_from_eager"] = (y != eager).float().mean().item()
        out[name]["max_err"] = (y.double() - exact).abs().max().item()
    return out


def sweep(rows: int, cols: int, dtype: torch.dtype, specs: list[str], iters: int, warmup: int) -> list[tuple]:
    """(spec, ms, TB/s) of the backward kernel alone with each ``ROWSxSTEPxCOLS/WARPS``."""
    device = torch.device("cuda")
    h = torch.randn(rows, cols, device=device).to(dtype)
    dy = torch.randn(rows, cols, device=device).to(dtype)
    b = torch.randn(cols, device=device)
    gh = torch.empty_like(h)
    moved = 3 * h.numel() * h.element_size()  # dy and h read, the gradient written
    out = []
    for spec in specs:
        tiles, _, warps = spec.partition("/")
        bm, rb, bn = (int(x) for x in tiles.split("x"))
        t = (bm, rb, bn, int(warps or 4))
        ms = median_ms(lambda t=t: gelu.launch_backward(dy, h, b, gh, t), iters, warmup, device)
        out.append((spec, ms, moved / ms / 1e9))
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=81920, help="tokens (batch x grid)")
    p.add_argument("--cols", type=int, default=3072, help="the hidden layer's width")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--sweep", nargs="*", default=[], metavar="ROWSxSTEPxCOLS/WARPS", help="backward tiles (CUDA)")
    a = p.parse_args(argv)
    device, dtype = torch.device(a.device), DTYPES[a.dtype]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{name}, torch {torch.__version__}: ({a.rows}, {a.cols}) {a.dtype}, median of {a.iters}")
    r = compare(a.rows, a.cols, dtype, device, a.iters, a.warmup)
    for impl in ("inductor", "op"):
        x = r[impl]
        print(
            f"  {impl:<8} forward {x['fwd_ms']:7.3f} ms   forward + backward (+ bias gradient) "
            f"{x['fwd_bwd_ms']:7.3f} ms"
            f"   differ from eager F.gelu: {x['differ_from_eager']:.2%}, max |error| {x['max_err']:.3g}"
        )
    print(
        f"  op / inductor: forward {r['op']['fwd_ms'] / r['inductor']['fwd_ms']:.3f}x, forward + backward "
        f"{r['op']['fwd_bwd_ms'] / r['inductor']['fwd_bwd_ms']:.3f}x the time"
    )
    if a.sweep:
        if device.type != "cuda":
            p.error("--sweep times the compiled kernel: it needs --device cuda")
        for spec, ms, tbs in sweep(a.rows, a.cols, dtype, a.sweep, a.iters, a.warmup):
            print(f"  backward {spec:<16} {ms:7.3f} ms  {tbs:5.2f} TB/s")


if __name__ == "__main__":
    main()
