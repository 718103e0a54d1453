"""GroupNorm + SiLU on the SongUNet's full-resolution activations, side by side (GPU).

Forward and backward of ``silu(group_norm(x))`` (bf16, channels-last, batch 4), timed with
CUDA events: the Triton kernels of ``recipes/stormcast/fused_norm.py`` against inductor's
kernels for the per-channel form (what the compiled blocks ran before) and torch's eager
kernels. Prints ms per pass and the memory bandwidth it implies from the bytes the pass must
move (forward: read x twice, write y; backward: read x and the gradient twice each, write dx),
and each path's largest error against a float64 reference.

``--kernels`` times each of the four fused kernels alone, replayed as a CUDA graph (what the
compiled step does, so no launch overhead), on every activation shape the regression UNet
normalises, and sums them over the step's norms; ``--sweep`` does the same under other tile
sizes, warp counts and (for the two reductions) programs per SM, and prints the best per
kernel and shape against the current choice.

    python benchmarks/group_norm.py [--kernels] [--sweep]
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


def step_norms() -> dict[tuple[int, int, int], int]:
    """(channels, rows, cols) -> norms per step of the StormCast regression UNet at 512x640
    (``scaling.py``'s model), largest first, from one forward on the meta device. Each runs every
    kernel once; the forward's apply twice where the memory budget recomputes it."""
    from collections import Counter

    import torch

    from benchmarks.scaling import PAPER
    from recipes.stormcast.layers import GroupNorm
    from recipes.stormcast.songunet import SongUNet

    with torch.device("meta"):
        model = SongUNet((512, 640), 127, 99, embedding_type="zero", **{**PAPER, "dropout": 0.0})
        seen: Counter = Counter()
        for m in model.modules():
            if isinstance(m, GroupNorm):
                m.register_forward_pre_hook(lambda _, args: seen.update([tuple(args[0].shape[1:])]))
        model(torch.empty(1, 127, 512, 640))
    return dict(sorted(seen.items(), key=lambda kv: (-kv[0][1] * kv[0][2], -kv[0][0])))


# bytes each kernel must move, in activations: stats reads x; apply reads x, writes y;
# grad_sums reads the gradient and x; grad_apply reads both and writes dx
KERNEL_BYTES = {"stats": 1, "apply": 2, "grad_sums": 2, "grad_apply": 3}


def event_ms(fn, iters: int) -> float:
    """ms per call of ``fn`` over ``iters`` calls after two warm-up calls, timed with CUDA events."""
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

        fwd = event_ms(lambda: forward(), iters)  # noqa: B023
        bwd = event_ms(both, iters) - fwd
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


def _graph_time(fn, iters: int) -> float:
    """ms per call of ``fn``, ``iters`` calls captured in one CUDA graph and replayed: GPU time
    alone, as in a step replayed as CUDA graphs."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile the kernel and warm the allocator outside the capture
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (3 * iters)


def _kernel_calls(shape: tuple[int, int, int], batch: int) -> dict:
    """The four fused kernels as calls on a channels-last bf16 activation of ``shape``."""
    import torch

    from recipes.stormcast import fused_norm as fn

    c, rows, cols = shape
    x = (torch.randn(batch, c, rows, cols, device="cuda") * 2 + 3).bfloat16()
    x = x.contiguous(memory_format=torch.channels_last)
    g = torch.randn_like(x)
    a, cc, r, q, kg, kx, k0 = (torch.rand(batch, c, device="cuda") for _ in range(7))
    return {
        "stats": lambda: fn.gn_stats(x),
        "apply": lambda: fn.gn_apply(x, a, cc, True, torch.bfloat16),
        "grad_sums": lambda: fn.gn_grad_sums(g, x, a, cc, r, q, True),
        "grad_apply": lambda: fn.gn_grad_apply(g, x, a, cc, kg, kx, k0, True),
    }


def kernels(batch: int, iters: int) -> dict:
    """Each kernel's ms on each shape of ``step_norms``, and its total over the step's norms."""
    import torch

    print(f"{'shape':>16} {'norms':>5}  " + "  ".join(f"{k:>17}" for k in KERNEL_BYTES) + "   (ms, GB/s)")
    totals = dict.fromkeys(KERNEL_BYTES, 0.0)
    for shape, count in step_norms().items():
        calls = _kernel_calls(shape, batch)
        nbytes = batch * shape[0] * shape[1] * shape[2] * 2
        cells = []
        for name, call in calls.items():
            ms = _graph_time(call, iters)
            totals[name] += count * ms
            cells.append(f"{ms:8.3f} ({KERNEL_BYTES[name] * nbytes / ms / 1e6:5.0f})")
        print(f"{str(shape):>16} {count:5d}  " + "  ".join(cells), flush=True)
        del calls
        torch.cuda.empty_cache()
    print(
        "per step (ms): " + ", ".join(f"{k} {v:.2f}" for k, v in totals.items()) + f"; all {sum(totals.values()):.2f}"
    )
    return totals


def sweep(batch: int, iters: int) -> None:
    """The fused kernels under other launch geometries, per kernel and shape; the per-step gain
    of the best one on each shape."""
    import torch

    from recipes.stormcast import fused_norm

    chosen = dict(fused_norm.GEOMETRY)
    tiles = [(e, w) for e in (1024, 2048, 4096, 8192) for w in (4, 8)]
    gain = 0.0
    print("sweep: kernel, shape: default ms -> best ms (elements per tile, warps, programs per SM)")
    for shape, count in step_norms().items():
        if shape[1] * shape[2] < 128 * 160:  # the small ones: launch-bound, all geometries alike
            continue
        pixels = shape[1] * shape[2]
        calls = _kernel_calls(shape, batch)
        for name, call in calls.items():
            now = _graph_time(call, iters)
            current = fused_norm.geometry(name, pixels)
            results = {}
            for tile in tiles:
                for pps in (4, 8, 16) if name in ("stats", "grad_sums") else (current[2],):
                    fused_norm.GEOMETRY[name] = ((0, (*tile, pps)),)
                    try:
                        results[(*tile, pps)] = _graph_time(call, iters)
                    except Exception as e:  # noqa: BLE001  a geometry this GPU cannot run: skipped
                        print(f"  {name} {shape} {tile} {pps}: {str(e).splitlines()[0][:80]}")
            fused_norm.GEOMETRY[name] = chosen[name]
            best = min(results, key=results.get)
            gain += count * (now - results[best])
            ranked = "  ".join(f"{k}:{v:.3f}" for k, v in sorted(results.items(), key=lambda kv: kv[1])[:4])
            print(f"  {name:>10} {str(shape):>16}: {now:7.3f} {current} -> {ranked}", flush=True)
        del calls
        torch.cuda.empty_cache()
    print(f"sweep: the best geometry per kernel and shape would save {gain:.2f} ms per step")


def main(argv=None) -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--shapes", default="dec0,enc0,enc1")
    ap.add_argument("--kernels", action="store_true", help="time each fused kernel alone on the step's shapes")
    ap.add_argument("--sweep", action="store_true", help="time the fused kernels' launch geometries per shape")
    ap.add_argument("--skip-paths", action="store_true", help="skip the side-by-side paths table")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("group_norm.py measures a GPU: no CUDA device here")
    if args.kernels:
        kernels(args.batch, args.iters)
    if args.sweep:
        sweep(args.batch, args.iters)
    if args.skip_paths:
        return
    print(f"{'shape':>6} {'path':>9} {'fwd ms':>8} {'GB/s':>6} {'bwd ms':>8} {'GB/s':>6}  max rel err (y, dx, dw, db)")
    for name in args.shapes.split(","):
        for r in measure(name, args.batch, args.iters):
            err = ", ".join(f"{e:.1e}" for e in r["err"])
            print(
                f"{r['shape']:>6} {r['path']:>9} {r['fwd_ms']:8.3f} {r['fwd_gbs']:6.0f} "
                f"{r['bwd_ms']:8.3f} {r['bwd_gbs']:6.0f}  {err}",
                flush=True,
            )


if __name__ == "__main__":
    main()
