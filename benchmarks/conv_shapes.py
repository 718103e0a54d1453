"""Every convolution of the StormCast regression UNet, timed alone (GPU).

The compiled regression step spends most of its GPU time in cuDNN (about 120 ms of 215 ms per
step at batch 4). This finds which convolutions run far from the chip's matrix throughput: the
UNet's convolutions are collected from one forward on the meta device (input shape, weight
shape, how many per step), and each one's forward, input gradient and weight gradient are timed
(bf16, channels-last, as the compiled step runs them; cudnn.benchmark on, as ``trainer.compile``
sets it) with CUDA events. The network's first convolution gets no input gradient (its input is
data). ``--pad`` also times the unaligned-channel ones (127 in, 99 out) with their channels padded
to a multiple of 8, where cuDNN's tensor-core kernels want them.

    python benchmarks/conv_shapes.py [--batch 4] [--pad]
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def step_convs(batch: int) -> list[tuple[tuple, tuple, int]]:
    """(input shape, weight shape, calls per step) of the regression UNet's convolutions."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from benchmarks.scaling import PAPER
    from recipes.stormcast.songunet import SongUNet

    seen: Counter = Counter()

    class _Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.convolution.default:
                seen[(tuple(args[0].shape), tuple(args[1].shape))] += 1
            return func(*args, **(kwargs or {}))

    with torch.device("meta"):
        model = SongUNet((512, 640), 127, 99, embedding_type="zero", **{**PAPER, "dropout": 0.0})
        with _Record():
            model(torch.empty(batch, 127, 512, 640))
    return [(x, w, n) for (x, w), n in seen.items()]


def time_conv(x_shape, w_shape, first: bool, iters: int) -> dict:
    """ms of forward, input gradient, weight gradient for one convolution."""
    import torch

    dev = torch.device("cuda")
    cl = torch.channels_last
    x = torch.randn(x_shape, device=dev, dtype=torch.bfloat16).contiguous(memory_format=cl)
    w = torch.randn(w_shape, device=dev, dtype=torch.bfloat16).contiguous(memory_format=cl)
    pad = w_shape[-1] // 2
    y = torch.nn.functional.conv2d(x, w, padding=pad)
    gy = torch.randn_like(y)
    conv = torch.ops.aten.convolution_backward.default

    def fwd():
        torch.nn.functional.conv2d(x, w, padding=pad)

    def dgrad():
        conv(gy, x, w, None, [1, 1], [pad, pad], [1, 1], False, [0, 0], 1, [True, False, False])

    def wgrad():
        conv(gy, x, w, None, [1, 1], [pad, pad], [1, 1], False, [0, 0], 1, [False, True, False])

    from benchmarks.group_norm import event_ms

    # the first convolution's input is data: no input gradient
    return {
        n: 0.0 if n == "dgrad" and first else event_ms(f, iters)
        for n, f in (("fwd", fwd), ("dgrad", dgrad), ("wgrad", wgrad))
    }


def flops(x_shape, w_shape) -> float:
    b, _, h, w = x_shape
    co, ci, kh, kw = w_shape
    return 2.0 * b * h * w * co * ci * kh * kw


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--pad", action="store_true", help="also time the unaligned convolutions padded to 8 channels")
    args = ap.parse_args(argv)

    import torch

    torch.backends.cudnn.benchmark = True
    convs = step_convs(args.batch)
    rows, total_ms, total_tf = [], 0.0, 0.0
    for x_shape, w_shape, n in convs:
        first = x_shape[1] == 127
        t = time_conv(x_shape, w_shape, first, args.iters)
        ms = t["fwd"] + t["dgrad"] + t["wgrad"]
        tf = flops(x_shape, w_shape) * (2 if first else 3)
        rows.append((n * ms, x_shape, w_shape, n, t, tf / ms / 1e9))
        total_ms += n * ms
        total_tf += n * tf
    print(f"{'ms/step':>8} {'calls':>5}  {'input':<22} {'weight':<20} {'fwd':>6} {'dgrad':>6} {'wgrad':>6}  TFLOP/s")
    for step_ms, x_shape, w_shape, n, t, tfs in sorted(rows, key=lambda r: -r[0]):
        print(
            f"{step_ms:8.2f} {n:5d}  {str(x_shape):<22} {str(w_shape):<20} "
            f"{t['fwd']:6.3f} {t['dgrad']:6.3f} {t['wgrad']:6.3f}  {tfs:6.0f}"
        )
    rate = total_tf / total_ms / 1e9
    print(f"all convolutions: {total_ms:.1f} ms per step, {total_tf / 1e12:.1f} TFLOP, {rate:.0f} TFLOP/s")
    if args.pad:
        print("padded to a multiple of 8 channels (the same arithmetic, zero channels added):")
        for x_shape, w_shape, first in (
            ((args.batch, 127, 512, 640), (128, 127, 3, 3), True),
            ((args.batch, 128, 512, 640), (128, 128, 3, 3), True),
            ((args.batch, 128, 512, 640), (99, 128, 3, 3), False),
            ((args.batch, 128, 512, 640), (104, 128, 3, 3), False),
            ((args.batch, 128, 512, 640), (128, 128, 3, 3), False),
        ):
            t = time_conv(x_shape, w_shape, first, args.iters)
            times = " ".join(f"{k} {v:.3f}" for k, v in t.items())
            print(f"  {str(x_shape):<22} {str(w_shape):<20} {times} ms")


if __name__ == "__main__":
    main()
