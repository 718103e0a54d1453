"""The Heun sampler's state in float64 against float32: speed, memory and how far the samples differ.

``infer.sampler_dtype`` picks the dtype of the sampler's state (the noisy field and the Heun
updates); the denoising network computes in float32 (or bf16 under autocast) either way, since
the EDM preconditioner casts its input. This runs both side by side on the StormCast diffusion
network (SongUNet 128 x [1,2,2,2,2], 4 blocks, positional noise embedding, additive positional
embedding; 99 noisy + 99 state + 99 regression + 2 invariant channels in, 99 out), random
weights and conditions, the same latents and churn draws for both dtypes:

    python benchmarks/sampler_dtype.py --device cuda                       # 512x640, 18 steps, fp32 net
    python benchmarks/sampler_dtype.py --device cuda --precision bf16
    python benchmarks/sampler_dtype.py --height 64 --width 64 --channels 32 --steps 4   # a CPU check

Prints seconds per sample, peak memory and the difference of the float32 samples from the
float64 ones (max and RMS, also relative to the samples' own standard deviation).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def build(args, device):
    import torch

    from framework import registry
    from recipes.stormcast.config import SongUNetConfig
    from recipes.weather import edm

    cfg = SongUNetConfig(
        model_channels=args.channels,
        channel_mult=[1, 2, 2, 2, 2],
        num_blocks=args.blocks,
        attn_resolutions=[],
        embedding_type="positional",
        additive_pos_embed=True,
    )
    torch.manual_seed(0)
    net = registry.models.build(
        "songunet", cfg, in_channels=99 * 3 + 2, out_channels=99, img_resolution=(args.height, args.width)
    )
    return edm.EDMPrecond(net, sigma_data=0.5).to(device).eval()


def sample(model, cond, latents, churn, args, dtype, device):
    import torch

    from recipes.weather import edm

    autocast = (
        torch.autocast(device.type, dtype=torch.bfloat16) if args.precision == "bf16" else contextlib.nullcontext()
    )
    with torch.no_grad(), autocast:
        return edm.heun_sample(
            lambda x, s: model(x, s, cond),
            latents,
            num_steps=args.steps,
            s_churn=args.churn,
            noise=lambda i: churn[i],
            dtype=dtype,
        ).float()


def timed(fn, device, repeats: int):
    import torch

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()  # warm-up (cuDNN algorithms, allocator)
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        sync()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return out, sorted(times)[len(times) // 2], peak


def main(argv=None) -> None:
    import torch

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--height", type=int, default=512)
    p.add_argument("--width", type=int, default=640)
    p.add_argument("--channels", type=int, default=128, help="model_channels (128: the paper's)")
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--members", type=int, default=1, help="samples per network call")
    p.add_argument("--steps", type=int, default=18)
    p.add_argument("--churn", type=float, default=0.0, help="S_churn (0: deterministic, StormCast's)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="the network's compute dtype")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False

    model = build(args, device)
    g = torch.Generator(device="cpu").manual_seed(1)
    shape = (args.members, 99, args.height, args.width)
    cond = torch.randn((args.members, 99 * 2 + 2, args.height, args.width), generator=g).to(device)
    latents = torch.randn(shape, generator=g).to(device)
    churn = [torch.randn(shape, generator=g).to(device) for _ in range(args.steps)] if args.churn else []

    runs = {}
    for name, dtype in (("float64", torch.float64), ("float32", torch.float32)):
        out, s, peak = timed(lambda: sample(model, cond, latents, churn, args, dtype, device), device, args.repeats)
        runs[name] = {"s_per_sample": s / args.members, "peak_gib": peak, "out": out}
    ref, f32 = runs["float64"]["out"].double(), runs["float32"]["out"].double()
    diff = f32 - ref
    std = ref.std().item()
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "grid": [args.height, args.width],
        "precision": args.precision,
        "steps": args.steps,
        "members": args.members,
        **{f"{n}_s_per_sample": r["s_per_sample"] for n, r in runs.items()},
        **{f"{n}_peak_gib": r["peak_gib"] for n, r in runs.items()},
        "float32_speedup": runs["float64"]["s_per_sample"] / runs["float32"]["s_per_sample"],
        "max_abs_diff": diff.abs().max().item(),
        "rms_diff": diff.pow(2).mean().sqrt().item(),
        "sample_std": std,
    }
    print(
        f"sampler state dtype, {result['device']}, torch {result['torch']}, {args.height}x{args.width}, "
        f"{args.steps} Heun steps, network {args.precision}, {args.members} member(s) per call"
    )
    print(f"{'dtype':>8} {'s/sample':>9} {'peak GiB':>9}")
    for n, r in runs.items():
        peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
        print(f"{n:>8} {r['s_per_sample']:>9.3f} {peak:>9}")
    print(
        f"float32 / float64 speed: {result['float32_speedup']:.3f}x; float32 - float64: max "
        f"{result['max_abs_diff']:.3g}, RMS {result['rms_diff']:.3g} ({result['rms_diff'] / std:.2e} of the "
        f"samples' std {std:.3g})"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
