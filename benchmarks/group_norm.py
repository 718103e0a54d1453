"""GroupNorm + SiLU on the SongUNet's full-resolution activations, side by side (GPU).

Forward and backward of ``silu(group_norm(x))`` (bf16, channels-last, batch 4), timed with
CUDA events: the Triton kernels of ``recipes/stormcast/fused_norm.py`` against inductor's
kernels for the per-channel form (what the compiled blocks ran before) and torch's eager
kernels. Prints ms per pass and the memory bandwidth it implies from the bytes the pass must
move (forward: read x twice, write y; backward: read x and the gradient twice each, write dx),
and each path's largest error against a float64 reference. ``--sweep`` times the fused
kernels under other tile sizes and warp counts.

    python benchmarks/group_norm.py [--sweep]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPES = {  # name -> (channels, rows, cols): norm0 of a decoder block, of an encoder block, one level down
    "dec0": (256, 512, 640),
    "enc0": (128, 512, 640),
    "enc1": (256, 256, 320),
}


def _time(fn, iters: int) -> float:
    import torch

    for _ in range(2):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def _paths():
    import torch
    import torch.nn.functional as F

    from recipes.stormcast import fused_norm
    from recipes.stormcast.layers import group_norm_by_channel

    def eager(x, w, b):
        return F.silu(F.group_norm(x, 32, w, b, 1e-6))

    def fused(x, w, b):
        return fused_norm.group_norm(x, 32, w, b, 1e-6, silu=True, dtype=torch.bfloat16)

    def per_channel(x, w, b):
        return F.silu(group_norm_by_channel(x, 32, w, b, 1e-6)).to(torch.bfloat16)

    return {"fused": fused, "inductor": torch.compile(per_channel), "eager": eager}


def measure(name: str, batch: int, iters: int) -> list[dict]:
    import torch

    c, rows, cols = SHAPES[name]
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(batch, c, rows, cols, device="cuda", generator=g) * 2 + 3).bfloat16()
    x = x.contiguous(memory_format=torch.channels_last)
    w = torch.randn(c, device="cuda", generator=g) * 0.5 + 1
    b = torch.randn(c, device="cuda", generator=g) * 0.1
    dy = torch.randn(x.shape, device="cuda", generator=g).bfloat16().contiguous(memory_format=torch.channels_last)
    ref_leaves = [t.double().requires_grad_() for t in (x, w, b)]
    ref = torch.nn.functional.silu(torch.nn.functional.group_norm(ref_leaves[0], 32, *ref_leaves[1:], 1e-6))
    ref_grads = torch.autograd.grad(ref, ref_leaves, dy.double())
    nbytes = x.numel() * x.element_size()
    rows_out = []
    for path, fn in _paths().items():
        leaves = [t.clone().requires_grad_() for t in (x, w, b)]
        with torch.autocast("cuda", torch.bfloat16):
            y = fn(*leaves)
        grads = torch.autograd.grad(y, leaves, dy)
        err = [float((a.double() - r).abs().max() / r.abs().max()) for a, r in zip((y, *grads), (ref, *ref_grads))]

        def forward(fn=fn, leaves=leaves):
            with torch.autocast("cuda", torch.bfloat16):
                return fn(*leaves)

        def both(forward=forward, leaves=leaves):
            torch.autograd.grad(forward(), leaves, dy)

        fwd = _time(lambda: forward(), iters)  # noqa: B023
        bwd = _time(both, iters) - fwd
        rows_out.append(
            {
                "shape": name,
                "path": path,
                "fwd_ms": fwd,
                "bwd_ms": bwd,
                "fwd_gbs": 3 * nbytes / fwd / 1e6,
                "bwd_gbs": 5 * nbytes / bwd / 1e6,
                "err": err,
            }
        )
    return rows_out


def sweep(batch: int, iters: int) -> None:
    import torch

    from recipes.stormcast import fused_norm

    c, rows, cols = SHAPES["dec0"]
    x = torch.randn(batch, c, rows, cols, device="cuda").bfloat16().contiguous(memory_format=torch.channels_last)
    w, b = torch.ones(c, device="cuda"), torch.zeros(c, device="cuda")
    dy = torch.randn_like(x)
    nbytes = x.numel() * x.element_size()
    default = dict(fused_norm.TILES)
    print(f"sweep on dec0 {tuple(x.shape)}: one kernel's (tile elements, warps) changed -> fwd, bwd ms (GB/s)")
    candidates = [(e, w) for e in (1024, 2048, 4096, 8192) for w in (4, 8)]
    configs = [(None, None)] + [(k, c) for k in default for c in candidates if c != default[k]]
    for kernel, tile in configs:
        fused_norm.TILES.update(default)
        if kernel is not None:
            fused_norm.TILES[kernel] = tile
        label = "defaults" if kernel is None else f"{kernel:>10} {tile[0]:5d}/{tile[1]}"
        leaves = [t.clone().requires_grad_() for t in (x, w, b)]

        def forward(leaves=leaves):
            return fused_norm.group_norm(*leaves[:1], 32, *leaves[1:], 1e-6, silu=True, dtype=torch.bfloat16)

        try:
            fwd = _time(forward, iters)
            bwd = _time(lambda: torch.autograd.grad(forward(), leaves, dy), iters) - fwd  # noqa: B023
        except Exception as e:  # noqa: BLE001  a tile too large for this GPU: reported, not fatal
            print(f"  {label}  failed: {str(e).splitlines()[0][:100]}")
            continue
        print(f"  {label}  {fwd:7.3f} ({3 * nbytes / fwd / 1e6:5.0f})  {bwd:7.3f} ({5 * nbytes / bwd / 1e6:5.0f})")
    fused_norm.TILES.update(default)


def main(argv=None) -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--shapes", default="dec0,enc0,enc1")
    ap.add_argument("--sweep", action="store_true", help="also time the fused kernels' tile sizes and warps")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("group_norm.py measures a GPU: no CUDA device here")
    print(f"{'shape':>6} {'path':>9} {'fwd ms':>8} {'GB/s':>6} {'bwd ms':>8} {'GB/s':>6}  max rel err (y, dx, dw, db)")
    for name in args.shapes.split(","):
        for r in measure(name, args.batch, args.iters):
            err = ", ".join(f"{e:.1e}" for e in r["err"])
            print(
                f"{r['shape']:>6} {r['path']:>9} {r['fwd_ms']:8.3f} {r['fwd_gbs']:6.0f} "
                f"{r['bwd_ms']:8.3f} {r['bwd_gbs']:6.0f}  {err}",
                flush=True,
            )
    if args.sweep:
        sweep(args.batch, args.iters)


if __name__ == "__main__":
    main()
