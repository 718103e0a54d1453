"""One SongUNet block compiled under inductor variants, side by side (GPU).

The regression preset's compiled step spends most of its non-convolution time in the blocks at
full resolution (512x640, 128 channels), and compiling one block takes seconds where the whole
UNet takes minutes: inductor options are compared here first, then the winners on the whole
model (``benchmarks/scaling.py --variant``). Each variant compiles the block as
``trainer.compile`` does (``framework.train.compile.compile_model``, regional, channels-last on
CUDA), runs forward + backward under bf16 autocast on the paper-size activations of one block
(batch 4), and reports ms per fwd+bwd, the kernel time by kind (torch.profiler), the first
call's compile time, and the output and input-gradient error against the base variant.

    python benchmarks/compile_block.py --block dec0 --variants eager,base,tile,cd --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# name -> (input channels, skip channels, output channels, rows, cols, UNetBlock keywords)
BLOCKS = {
    "enc0": (128, 0, 128, 512, 640, {}),  # an encoder block at full resolution
    "dec0": (128, 128, 128, 512, 640, {}),  # a decoder block at full resolution (concatenates a skip)
    "down1": (128, 0, 128, 512, 640, {"down": True}),
    "enc1": (256, 0, 256, 256, 320, {}),
    "up0": (256, 0, 256, 256, 320, {"up": True}),
}

# name -> (inductor options, compile_model keywords); "eager" runs the block uncompiled
_TILE = {"triton.tile_reductions": True, "triton.prefer_nd_tiling": True}
VARIANTS: dict[str, tuple[dict, dict]] = {
    "base": ({}, {}),
    "tile": (_TILE, {}),
    "nd": ({"triton.prefer_nd_tiling": True}, {}),
    "cd": ({"coordinate_descent_tuning": True}, {}),
    "tile_cd": ({**_TILE, "coordinate_descent_tuning": True}, {}),
    "nosplit": ({"split_reductions": False}, {}),
    "nopersist": ({"triton.persistent_reductions": False}, {}),
    "nomix": ({"triton.mix_order_reduction": False}, {}),
    "multi": ({"triton.multi_kernel": 1}, {}),
    "noautotune": ({"triton.autotune_pointwise": False}, {}),
    "nchw": ({}, {"channels_last": False}),
    "aten_gn": ({}, {"gn": "aten"}),
    "fused_gn": ({}, {"gn": "fused"}),
    "composite_gn": ({}, {"gn": "composite"}),
}


def kernel_kinds(prof, steps: int) -> tuple[dict, list]:
    """ms per step by kernel kind (benchmarks/scaling.py's classes) and the top kernels."""
    from benchmarks.scaling import _KERNEL_KINDS, device_kernels

    kernels = device_kernels(prof)
    per = lambda e: getattr(e, "self_device_time_total", 0) / 1e3 / steps  # noqa: E731
    kinds: dict[str, float] = {}
    for e in kernels:
        kind = next((k for k, keys in _KERNEL_KINDS if any(x in e.key for x in keys)), "other")
        kinds[kind] = round(kinds.get(kind, 0.0) + per(e), 3)
    top = [(round(per(e), 3), e.count // steps, e.key[:140]) for e in sorted(kernels, key=per, reverse=True)[:12]]
    return kinds, top


def run_variant(name: str, args, inputs, grad_out, ref) -> dict:
    import torch

    from framework.train.compile import compile_model
    from recipes.stormcast.layers import UNetBlock, set_compiled_form

    cin, skip_c, cout, rows, cols, kw = BLOCKS[args.block]
    torch._dynamo.reset()
    torch.manual_seed(0)
    block = UNetBlock(cin + skip_c, cout, emb_channels=512, eps=1e-6, **kw).to(args.device)
    model = torch.nn.ModuleList([block])  # a container: find_units picks the block by its class
    opts, kws = VARIANTS.get(name, ({}, {}))  # eager: nothing compiled
    kws = dict(kws)
    set_compiled_form(model, kws.pop("gn", "explicit"))
    out: dict = {"variant": name, "options": opts, **kws}
    try:
        if name != "eager":
            compile_model(model, units=["UNetBlock"], device_type=args.device, options=opts, **kws)
    except Exception as e:  # an option this torch does not know: reported, not fatal
        return {**out, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}

    x, emb, skip = inputs

    def step():
        for t in (x, skip):
            if t is not None:
                t.grad = None
        block.zero_grad(set_to_none=True)
        with torch.autocast(args.device, torch.bfloat16):
            y = block(x, emb, skip)
        y.backward(grad_out)
        return y

    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    try:
        sync()
        t0 = time.perf_counter()
        y = step()
        sync()
        out["first_call_s"] = round(time.perf_counter() - t0, 2)
        for _ in range(3):
            step()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        sync()
        t0 = time.perf_counter()
        for _ in range(args.iters):
            step()
        sync()
        out["ms"] = round(1e3 * (time.perf_counter() - t0) / args.iters, 3)
        out["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else 0.0
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                step()
            sync()
        out["kinds_ms"], out["top"] = kernel_kinds(prof, 3)
        y = step()
        got = (y.float(), x.grad.float())
        if ref is not None:
            out["err"] = [round(float((a - b).norm() / b.norm()), 6) for a, b in zip(got, ref)]
        out["_result"] = got
    except Exception as e:  # noqa: BLE001  one failing variant does not lose the others
        out["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    return out


def main(argv=None) -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--block", choices=sorted(BLOCKS), default="dec0")
    ap.add_argument("--variants", default="eager,base,tile,cd")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke test of the harness")
    ap.add_argument("--scale", type=int, default=1, help="divide the grid by this (a small smoke run)")
    ap.add_argument("--out", type=Path, default=None, help="write the results (JSON) and top kernels here")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("compile_block.py measures a GPU: no CUDA device here (--device cpu: a smoke run)")
    cin, skip_c, cout, rows, cols, kw = BLOCKS[args.block]
    rows, cols = rows // args.scale, cols // args.scale
    g = torch.Generator(device=args.device).manual_seed(1)

    def act(c, r=rows, w=cols):
        t = torch.randn(args.batch, c, r, w, device=args.device, generator=g, dtype=torch.bfloat16)
        return t.contiguous(memory_format=torch.channels_last).requires_grad_()

    x, skip = act(cin), (act(skip_c) if skip_c else None)
    emb = torch.zeros(args.batch, 512, device=args.device)
    orows, ocols = (rows // 2, cols // 2) if kw.get("down") else (rows * 2, cols * 2) if kw.get("up") else (rows, cols)
    grad_out = act(cout, orows, ocols).detach()
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(names) - set(VARIANTS) - {"eager"})
    if unknown:
        ap.error(f"unknown variants {unknown}; known: eager, {', '.join(VARIANTS)}")
    results, ref = [], None
    for name in names:
        r = run_variant(name, args, (x, emb, skip), grad_out, ref)
        got = r.pop("_result", None)
        if ref is None and got is not None:
            ref = got
        results.append(r)
        print(json.dumps(r), file=sys.stderr, flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"block_{args.block}.json").write_text(json.dumps(results, indent=1))
    print(f"block {args.block}: {cin}+{skip_c} -> {cout} at {rows}x{cols}, batch {args.batch}, bf16 autocast")
    print(f"{'variant':>10} {'ms':>8} {'triton':>7} {'conv':>7} {'copy':>6} {'1st s':>6} {'GiB':>5}  err(out, dx)")
    for r in results:
        if "error" in r:
            print(f"{r['variant']:>10}  failed: {r['error']}")
            continue
        k = r["kinds_ms"]
        conv = k.get("conv (cuDNN)", 0) + k.get("layout transpose", 0)
        print(
            f"{r['variant']:>10} {r['ms']:>8.3f} {k.get('triton (inductor)', 0):>7.3f} {conv:>7.3f} "
            f"{k.get('copy/fill', 0):>6.3f} {r['first_call_s']:>6.1f} {r['peak_gib']:>5.1f}  {r.get('err', '-')}"
        )


if __name__ == "__main__":
    main()
