"""Data-parallel scaling at the StormCast paper size: none / ddp / fsdp2 on 1 and 2+ GPUs.

``--model songunet`` (default) is StormCast's regression network (127 -> 99 channels);
``--model dit`` is the StormScope preset DiT (16 x 768, 16 heads, patch 4, 31x31
neighbourhood attention; 28 -> 9 channels: 9 noisy + 9 state + 8 background + 2
invariants in). MFU: model FLOPs per sample over the device's bf16 peak. SongUNet: counted
with FlopCounterMode on one step. DiT: FlopCounterMode cannot see inside flex_attention
(and would count the masked work of other kernels), so its model FLOPs are written out
(``recipes.stormscope.dit.train_flops``).

Runs the framework's own pieces (registry model builder, mesh, sharding policy,
precision policy, Trainer.train_step) on in-memory batches, so the data loader is not
what is measured. One configuration per launch; the driver launches them side by side
and prints ratios:

    python benchmarks/scaling.py --gpus 2            # driver: runs every layout, prints the table
    torchrun --nproc-per-node 2 benchmarks/scaling.py --worker --sharding fsdp2   # one layout

Figures per GPU: samples/s, peak memory, and the bytes of parameters + gradients +
optimizer state each GPU holds (measured from the tensors after a step).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

PAPER = dict(model_channels=128, channel_mult=[1, 2, 2, 2, 2], num_blocks=4, attn_resolutions=[])
DIT_IO = (28, 9)


def build_model(args):
    """(model, (in, out) channels, its config's downsample_factor: the multiple of domain bands)."""
    from framework import registry

    if args.model == "dit":
        from recipes.stormscope.config import DiTConfig

        cfg, io = DiTConfig(attn_impl=args.attn_impl), DIT_IO
    else:
        from recipes.stormcast.config import SongUNetConfig

        cfg, io = SongUNetConfig(**PAPER), (127, 99)
    model = registry.models.build(args.model, cfg, in_channels=io[0], out_channels=io[1],
                                  img_resolution=(args.height, args.width))
    return model, io, cfg.downsample_factor


def _forward(model, x, dit: bool):
    return model(x, x.new_zeros(x.shape[0])) if dit else model(x)  # the DiT also takes the noise level


def _local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def worker(args) -> None:
    import torch

    from framework import registry
    from framework.config.schema import ParallelConfig, PrecisionConfig, ShardingConfig, TrainerConfig
    from framework.distributed import env as dist_env, mesh, precision as precision_mod
    from framework.train.trainer import Trainer
    if args.watchdog:  # a hung worker prints every thread's stack, then exits, instead of going silent
        import faulthandler

        faulthandler.dump_traceback_later(args.watchdog, exit=True)
    registry.load_providers()
    env = dist_env.detect()
    device = dist_env.pick_device(args.device, env)
    cuda = device.type == "cuda"
    with dist_env.process_group(env, device, 600):
        par = ParallelConfig(dp_shard=-1, domain=args.domain)
        topo = mesh.build(mesh.resolve(par, env.world_size), device.type)
        prec = precision_mod.build(PrecisionConfig(name=args.precision), device)
        prec.apply_backend_flags()
        torch.manual_seed(0)
        model, io, factor = build_model(args)
        model = model.to(device)
        plain = model
        rows, weight = args.height, 1.0
        if args.domain > 1:  # split every sample's rows over the domain ranks
            from framework.domain.comm import DomainGroup
            from framework.domain.shard_tensor import split_extents
            from framework.domain.splitter import split

            extents = split_extents(args.height, args.domain, factor)
            dg = DomainGroup(topo.group("domain"), extents)
            model = split(model, dg)
            rows, weight = extents[dg.rank], args.domain * extents[dg.rank] / args.height
        if args.compile:
            from framework.distributed.sharding import find_units

            for _, unit in find_units(model, []):
                unit.compile()
        sharded = registry.sharding.build(args.sharding, model, ShardingConfig(name=args.sharding),
                                          topology=topo, precision=prec, device=device)
        prec.sharded_cast = sharded.mixed_precision
        model = sharded.model
        opt = torch.optim.Adam(model.parameters(), lr=1e-4, fused=cuda)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)

        class Task:  # the regression loss on in-memory tensors
            @staticmethod
            def loss(m, batch):
                return torch.nn.functional.mse_loss(_forward(m, batch["x"], args.model == "dit").float(), batch["y"]) * weight

        t = Trainer(cfg=TrainerConfig(), run=None, env=env, device=device, task=Task(), model=model,
                    optimizer=opt, scheduler=sched, precision=prec, checkpoint=None, sinks=[],
                    run_dir=Path("."), dp_rank=topo.dp_rank, dp_size=topo.dp_size)
        b = args.batch_per_gpu
        batch = {"x": torch.randn(b, io[0], rows, args.width, device=device),
                 "y": torch.randn(b, io[1], rows, args.width, device=device)}
        from framework.train import metrics

        if args.model == "dit":
            from recipes.stormscope.dit import train_flops

            flops = train_flops(plain)
        else:
            _, flops = metrics.count_flops(lambda: t.train_step(batch))  # this rank's share of one step
            flops = flops * env.world_size / (b * topo.dp_size)  # per sample, all ranks
        for i in range(args.warmup):  # step times on stderr tell a slow start (compiling) from a hang
            t0 = time.perf_counter()
            t.train_step(batch)
            print(f"rank {env.rank} warm-up step {i}: {time.perf_counter() - t0:.2f} s", file=sys.stderr, flush=True)
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        sync()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            t.train_step(batch)
        sync()
        dt = (time.perf_counter() - t0) / args.steps
        params = list(model.parameters())
        state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
        # gradients are freed by zero_grad(set_to_none); their size equals the parameters'
        peak = metrics.peak_tflops(device, args.precision)
        sps = b * topo.dp_size / dt
        result = {
            "model": args.model, "tflop_per_sample": flops / 1e12, "tflops": flops * sps / 1e12,
            "mfu": flops * sps / 1e12 / (peak * env.world_size) if peak else None,
            "sharding": args.sharding, "gpus": env.world_size, "precision": args.precision,
            "compile": args.compile, "batch_per_gpu": b, "grid": [args.height, args.width],
            "domain": args.domain, "step_s": dt, "samples_per_s": b * topo.dp_size / dt,
            "samples_per_s_per_gpu": b * topo.dp_size / dt / env.world_size,
            "peak_mem_gib": (torch.cuda.max_memory_allocated(device) if cuda else 0) / 2**30,
            "state_gib": (2 * _local_bytes(params) + _local_bytes(state)) / 2**30,
        }
        if env.is_main:
            print("RESULT " + json.dumps(result), flush=True)


def launch(sharding: str, gpus: int, args, domain: int = 1) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}",
           str(Path(__file__).resolve()), "--worker", "--sharding", sharding, "--precision", args.precision,
           "--batch-per-gpu", str(args.batch_per_gpu), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--height", str(args.height), "--width", str(args.width), "--domain", str(domain),
           "--device", args.device, "--model", args.model, "--attn-impl", args.attn_impl,
           "--watchdog", str(args.watchdog)] + \
        (["--compile"] if args.compile else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    err = proc.stderr.splitlines()
    start = next((i for i, ln in enumerate(err) if ln.startswith("Traceback")), max(0, len(err) - 15))
    raise SystemExit(f"{sharding} on {gpus} GPU(s) failed:\n" + "\n".join(err[start:start + 40]))


def _pct(x) -> str:
    return f"{100 * x:.1f}%" if x is not None else "-"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--sharding", default="none")
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--batch-per-gpu", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--height", type=int, default=512)
    ap.add_argument("--width", type=int, default=640)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke test of the harness")
    ap.add_argument("--domain", type=int, default=1, help="worker: domain ranks per sample")
    ap.add_argument("--mode", choices=["dp", "domain"], default="dp",
                    help="dp: none/ddp/fsdp2 scaling; domain: one sample split over the GPUs")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    ap.add_argument("--model", choices=["songunet", "dit"], default="songunet")
    ap.add_argument("--attn-impl", default="auto", help="dit: auto | flex | reference")
    ap.add_argument("--watchdog", type=float, default=0,
                    help="worker: after this many seconds print every thread's stack and exit (0: off)")
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.mode == "domain":
        return domain_table(args)
    runs = [launch("none", 1, args), launch("fsdp2", 1, args)]
    if args.gpus > 1:
        runs += [launch("ddp", args.gpus, args), launch("fsdp2", args.gpus, args)]
    base = runs[0]
    print(f"{args.model}, {args.height}x{args.width}, batch {args.batch_per_gpu}/GPU, {args.precision}, "
          f"{base['tflop_per_sample']:.2f} TFLOP/sample")
    print(f"{'layout':>8} {'gpus':>4} {'samples/s':>10} {'/GPU':>7} {'xbase':>6} {'peak GiB/GPU':>12} "
          f"{'p+g+opt GiB/GPU':>15} {'MFU':>6}")
    for r in runs:
        print(f"{r['sharding']:>8} {r['gpus']:>4} {r['samples_per_s']:>10.2f} {r['samples_per_s_per_gpu']:>7.2f} "
              f"{r['samples_per_s'] / base['samples_per_s']:>6.2f} {r['peak_mem_gib']:>12.1f} {r['state_gib']:>15.3f} "
              f"{_pct(r['mfu']):>6}")
    if args.gpus > 1:
        ddp, fsdp = runs[2], runs[3]
        print(f"fsdp2 x{args.gpus} throughput / none x1: {fsdp['samples_per_s'] / base['samples_per_s']:.2f} "
              f"(target >= {0.95 * args.gpus:.1f})")
        print(f"fsdp2 / ddp params+grads+optimizer per GPU: {fsdp['state_gib'] / ddp['state_gib']:.2f} "
              f"(target <= 0.55)")
    if args.out:
        args.out.write_text(json.dumps(runs, indent=1))


def domain_table(args) -> None:
    """One sample split over the GPUs (fsdp2 over the flattened axis) against one GPU."""
    runs = [launch("none", 1, args), launch("fsdp2", args.gpus, args, domain=args.gpus),
            launch("ddp", args.gpus, args, domain=args.gpus)]
    base = runs[0]
    print(f"{args.model}, grid {args.height}x{args.width}, batch {args.batch_per_gpu}, {args.precision}")
    print(f"{'layout':>14} {'gpus':>4} {'s/step':>8} {'speed-up':>9} {'peak GiB/GPU':>12} {'x mem':>6} {'MFU':>6}")
    for r in runs:
        name = f"{r['sharding']}+domain{r['domain']}" if r["domain"] > 1 else r["sharding"]
        print(f"{name:>14} {r['gpus']:>4} {r['step_s']:>8.3f} {base['step_s'] / r['step_s']:>9.2f} "
              f"{r['peak_mem_gib']:>12.1f} {r['peak_mem_gib'] / max(base['peak_mem_gib'], 1e-9):>6.2f} "
              f"{_pct(r['mfu']):>6}")
    if args.out:
        args.out.write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
