"""The DiT block's gated residual and norm ops against inductor's kernels for the same work, side by side.

``recipes/stormscope/residual.py``'s ``residual_norm`` (``x1 = x + gate (a + bias)``, ``h =
LN(x1) (1 + scale) + shift``) and ``gated_residual`` (``x + gate (a + bias)``), one Triton kernel
each way whose backward also sums the gradients of ``bias``, ``gate``, ``shift`` and ``scale``,
against ``torch.compile`` of the same expressions in torch (what ``model.residual_impl=torch``
compiles to), on the preset's token grid by default: 4 samples of 128 x 160 tokens, 768 wide,
bf16, the modulation terms bf16 and the bias float32 as under autocast. Prints each one's forward
and forward + backward time (median, ms), the ratios, and the largest difference from a float64
evaluation. ``--sweep`` also times the four kernels alone (each op's forward and backward, the
backward with the sum of its per-program column sums) with other tiles (``ROWSxSTEP/WARPS``:
tokens a program, tokens a step of its loop, warps).

    python benchmarks/residual_norm.py                          # on the GPU machine
    python benchmarks/residual_norm.py --sweep 16x2/2 16x4/4 32x2/2 64x2/4 128x2/8
    python benchmarks/residual_norm.py --device cpu --tokens 64 --width 48 --iters 2   # the code path, on CPU

Absolute times only mean something on a GPU; on CPU (without ``TRITON_INTERPRET=1``) the ops run
their torch formulas.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.mlp_gelu import DTYPES, median_ms  # noqa: E402
from recipes.stormscope import residual  # noqa: E402

EPS = 1e-6


def _torch_gated(x, a, bias, gate):
    return x + gate * (a + bias.to(a.dtype))


def _torch_residual_norm(x, a, bias, gate, shift, scale):
    x1 = _torch_gated(x, a, bias, gate)
    return x1, (F.layer_norm(x1.float(), x1.shape[-1:], eps=EPS) * (1 + scale) + shift).to(x1.dtype)


def _op_residual_norm(x, a, bias, gate, shift, scale):
    return residual.residual_norm(x, a, bias, gate, shift, scale, EPS)


def inputs(samples: int, tokens: int, width: int, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """x, a (samples, tokens, width) in ``dtype``, bias (width,) float32, gate, shift, scale
    (samples, 1, width) in ``dtype``; all requiring gradients."""
    g = torch.Generator(device="cpu").manual_seed(0)
    x, a = (torch.randn(samples, tokens, width, generator=g) for _ in range(2))
    bias = torch.randn(width, generator=g)
    mods = [0.5 * torch.randn(samples, 1, width, generator=g) for _ in range(3)]
    out = [x.to(dtype), a.to(dtype), bias, *(m.to(dtype) for m in mods)]
    return [t.to(device).requires_grad_() for t in out]


def compare(samples: int, tokens: int, width: int, dtype, device, iters: int, warmup: int) -> dict:
    """{"residual_norm"/"gated_residual": {"inductor"/"op": {"fwd_ms", "fwd_bwd_ms", "max_err"}}}."""
    ins = inputs(samples, tokens, width, dtype, device)
    cases = {
        "residual_norm": (ins, _torch_residual_norm, _op_residual_norm),
        "gated_residual": (ins[:4], _torch_gated, residual.gated_residual),
    }
    out: dict = {}
    for case, (args, eager, op) in cases.items():
        exact = eager(*(t.detach().double() for t in args))
        exact = exact if isinstance(exact, tuple) else (exact,)
        grads = [torch.randn_like(e).to(dtype) for e in exact]
        out[case] = {}
        for name, fn in (("inductor", torch.compile(eager)), ("op", op)):
            fwd = median_ms(lambda: fn(*(t.detach() for t in args)), iters, warmup, device)  # noqa: B023

            def both(fn=fn, args=args):
                y = fn(*args)
                return torch.autograd.grad(y if isinstance(y, tuple) else (y,), args, grads)

            ms = median_ms(both, iters, warmup, device)
            y = fn(*(t.detach() for t in args))
            y = y if isinstance(y, tuple) else (y,)
            err = max((p.double() - q).abs().max().item() for p, q in zip(y, exact))
            out[case][name] = {"fwd_ms": fwd, "fwd_bwd_ms": ms, "max_err": err}
    return out


def sweep(samples: int, tokens: int, width: int, dtype, specs: list[str], iters: int, warmup: int) -> list[tuple]:
    """(spec, {kernel: (ms, TB/s)}) for each ``ROWSxSTEP/WARPS``: the four ops alone (each one's
    forward and backward, as the model calls them) with those tiles in ``residual.TILES``, the
    backward with the sum of its column sums (TB/s: the token tensors' bytes, not the sums')."""
    if not specs:
        return []
    x, a, bias, gate, shift, scale = (t.detach() for t in inputs(samples, tokens, width, dtype, torch.device("cuda")))
    g, gh = torch.randn_like(x), torch.randn_like(x)
    size = x.numel() * x.element_size()
    ops = {  # name: (tensors read and written, the call)
        "norm fwd": (4, lambda: residual.residual_norm(x, a, bias, gate, shift, scale, EPS)),
        # (the backward ops add up their kernels' per-program column sums: at 16 tokens a program
        # 63 MB of float32 at the preset's size)
        "norm bwd": (6, lambda: residual.residual_norm_backward(g, gh, x, a, bias, gate, scale, EPS)),
        "gated fwd": (3, lambda: residual.gated_residual(x, a, bias, gate)),
        "gated bwd": (3, lambda: residual.gated_residual_backward(g, a, bias, gate)),
    }
    out = []
    saved = dict(residual.TILES)
    try:
        for spec in specs:
            residual.TILES.update(dict.fromkeys(residual.TILES, residual.Tiles.parse(spec)))
            times = {}
            for name, (tensors, call) in ops.items():
                ms = median_ms(call, iters, warmup, x.device)
                times[name] = (ms, tensors * size / ms / 1e9)
            out.append((spec, times))
    finally:
        residual.TILES.update(saved)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--tokens", type=int, default=128 * 160, help="tokens a sample")
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--sweep", nargs="*", default=[], metavar="ROWSxSTEP/WARPS", help="tiles of the four kernels (CUDA)")
    a = p.parse_args(argv)
    if a.sweep and a.device != "cuda":
        p.error("--sweep times the compiled kernel: it needs --device cuda")
    device, dtype = torch.device(a.device), DTYPES[a.dtype]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    shape = f"{a.samples} x {a.tokens} tokens of {a.width}, {a.dtype}"
    print(f"{name}, torch {torch.__version__}: {shape}, median of {a.iters}")
    for case, r in compare(a.samples, a.tokens, a.width, dtype, device, a.iters, a.warmup).items():
        for impl in ("inductor", "op"):
            x = r[impl]
            print(
                f"  {case:<15} {impl:<8} forward {x['fwd_ms']:7.3f} ms   forward + backward {x['fwd_bwd_ms']:7.3f} ms"
                f"   max |error| {x['max_err']:.3g}"
            )
        print(
            f"  {case:<15} op / inductor: forward {r['op']['fwd_ms'] / r['inductor']['fwd_ms']:.3f}x, forward + "
            f"backward {r['op']['fwd_bwd_ms'] / r['inductor']['fwd_bwd_ms']:.3f}x the time"
        )
    for spec, times in sweep(a.samples, a.tokens, a.width, dtype, a.sweep, a.iters, a.warmup):
        print(f"  {spec:<10}" + "".join(f"  {k} {ms:6.3f} ms {tbs:4.2f} TB/s" for k, (ms, tbs) in times.items()))


if __name__ == "__main__":
    main()
