"""Flex neighbourhood attention under kernel options, side by side in one process (GPU).

One attention layer at the StormScope preset's size (batch 4, 16 heads of 48, 128 x 160 tokens in
8 x 16 tiles, kernel 31, bf16), compiled flex with its block mask, forward and backward timed
with CUDA events: flex's default kernel geometry, the options ``recipes/stormscope/natten.py``
sets on Hopper (``_SM90_FLEX_OPTIONS``, inductor's own best), and, with ``--autotune``,
``mode="max-autotune-no-cudagraphs"`` (inductor times its candidates: a minute of compiling).
With ``--block 64`` also sparse blocks of 64 tokens in 8 x 8 tiles (65.9% of the computed scores in
a window at kernel 31, against 56.4%), with the kernel tiles natten gives them (and autotuned, with
``--autotune``). Prints ms per pass, the first call's seconds and the largest difference from the
default's output (for 128-token blocks: the 64-token ones order the tokens otherwise).

    python benchmarks/flex_options.py [--batch 4] [--autotune] [--block 64]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None) -> None:
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    from benchmarks.group_norm import event_ms
    from recipes.stormscope import natten

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--grid", type=int, nargs=2, default=[128, 160], metavar=("ROWS", "COLS"))
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=48)
    ap.add_argument("--kernel", type=int, default=31)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--autotune", action="store_true", help="also time inductor's max-autotune pick")
    ap.add_argument("--block", type=int, choices=[64], help="also time sparse blocks of 64 tokens")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("flex_options.py measures a GPU: no CUDA device here")
    rows, cols = args.grid
    natten.prepare()
    masks = {}
    for block in (128, args.block or 128):  # the token order (tiles) depends on the block size
        tile = natten.tile_shape(rows, cols, block=block)
        masks[block] = natten._block_mask(rows, rows, cols, args.kernel, 0, 0, rows, torch.device("cuda"), tile, block)
    g = torch.Generator(device="cuda").manual_seed(0)
    shape = (args.batch, args.heads, rows * cols, args.head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_() for _ in range(3))
    dy = torch.randn_like(q)
    variants = {
        "default": (None, "default", 128),
        "natten (sm90)": (dict(natten._SM90_FLEX_OPTIONS), "default", 128),
    }
    if args.autotune:
        variants["max-autotune"] = (None, "max-autotune-no-cudagraphs", 128)
    if args.block:
        variants[f"blocks of {args.block}"] = (natten._kernel_options(q, args.block), "default", args.block)
        if args.autotune:
            variants[f"{args.block}, autotuned"] = (None, "max-autotune-no-cudagraphs", args.block)
    reference = None
    print(f"{'options':>14} {'fwd ms':>8} {'bwd ms':>8} {'first s':>8} {'max |diff|':>10}")
    for name, (options, mode, block) in variants.items():
        torch._dynamo.reset()
        fn = torch.compile(flex_attention, dynamic=False, mode=mode)

        def forward(fn=fn, options=options, mask=masks[block]):
            return fn(q, k, v, block_mask=mask, kernel_options=options)

        t0 = time.perf_counter()
        out = forward()
        out.backward(dy)
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        reference = out.detach().float() if reference is None else reference
        diff = float((out.detach().float() - reference).abs().max()) if block == 128 else float("nan")
        fwd = event_ms(forward, args.iters)
        both = event_ms(lambda: forward().backward(dy), args.iters)  # noqa: B023
        print(f"{name:>14} {fwd:8.3f} {both - fwd:8.3f} {first:8.1f} {diff:10.2e}", flush=True)
        row = {"options": name, "fwd_ms": fwd, "bwd_ms": both - fwd, "first_s": first, "max_abs_diff": diff}
        print("RESULT " + json.dumps(row))


if __name__ == "__main__":
    main()
