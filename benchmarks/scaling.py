"""Data-parallel scaling at the StormCast paper size: none / ddp / fsdp2 on 1 and 2+ GPUs.

``--model songunet`` (default) is StormCast's regression network (127 -> 99 channels);
``--model dit`` is the StormScope preset DiT (16 x 768, 16 heads, patch 4, 31x31
neighbourhood attention; 28 -> 9 channels: 9 noisy + 9 state + 8 background + 2
invariants in). MFU: model FLOPs per sample over the device's bf16 peak. SongUNet: counted
with FlopCounterMode on one sample's forward and backward, on a copy of the model built on
the meta device (no memory, no GPU time; a domain layout's halo work is not model FLOPs).
DiT: FlopCounterMode cannot see inside flex_attention (and would count the masked work of
other kernels), so its model FLOPs are written out (``recipes.stormscope.dit.train_flops``).

Runs the framework's own pieces (registry model builder, mesh, sharding policy,
precision policy, Trainer.train_step) on in-memory batches, so the data loader is not
what is measured. One configuration per launch; the driver launches them side by side
and prints ratios:

    python benchmarks/scaling.py --gpus 2            # driver: runs every layout, prints the table
    torchrun --nproc-per-node 2 benchmarks/scaling.py --worker --sharding fsdp2   # one layout

Figures per GPU: samples/s, peak memory (allocated, and reserved by the allocator: with CUDA
graphs only the latter sees the graphs' pool, and the table leaves the former out), and the
bytes of parameters + gradients + optimizer state each GPU holds (measured from the tensors
after a step). After the warm-up the
allocator's cache is emptied and one untimed step allocates again, so "reserved" is what the
steady step holds; "warm-up" is the peak before that (the first steps, cuDNN's algorithm
search).

Eager and compiled side by side: the driver runs every layout both ways (``--modes``);
``--compile`` in a worker is ``trainer.compile=true`` (``framework.train.compile``). The first
step compiles, and its wall time is reported as the first-step (compile) time.

    python benchmarks/scaling.py --gpus 1 --layouts none         # eager and compiled, one GPU
    python benchmarks/scaling.py --worker --compile --profile out/   # + a kernel-time table

Variants side by side: ``--compare`` runs the first layout and mode once per variant (driver
options as ``key=value[,key=value]``, without the dashes), alternating over ``--rounds`` so that
a drift of the card's clock reaches them all alike, and prints each against the first:

    python benchmarks/scaling.py --gpus 1 --layouts none --model dit --modes compiled --rounds 2 \
        --compare residual-impl=torch residual-impl=fused mlp-impl=torch
    python benchmarks/scaling.py --gpus 1 --layouts none --model dit --modes compiled --rounds 2 \
        --compare residual-tiles=fwd=16x4/4,bwd=16x2/2 residual-tiles=32x2/2   # a tile set's commas are its own

``--profile DIR`` writes per run the kernel time by kind and the top kernels
(``profile_<run>.txt``), every kernel (``kernels_<run>.tsv``), a trace and the host's time.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
# this checkout's recipes, also where the package is not installed (no entry points: a GPU
# machine running the checkout); the workers inherit it
os.environ.setdefault(
    "FRAMEWORK_RECIPES", "recipes.weather.registry,recipes.stormcast.registry,recipes.stormscope.registry"
)

# the regression preset's network (recipe=stormcast), dropout 0.1 included (runs 1-14 of
# docs/benchmarks.md measured it without: --dropout 0)
PAPER = dict(model_channels=128, channel_mult=[1, 2, 2, 2, 2], num_blocks=4, attn_resolutions=[], dropout=0.1)
# the diffusion stage's denoiser (recipe=stormcast_diffusion_fast): 99 noisy channels plus the
# conditions [state 99, regression 99, invariants 2] in, 99 out; noise-level and positional embeddings
DIFFUSION = dict(PAPER, embedding_type="positional", additive_pos_embed=True, dropout=0.1)
DIFFUSION_IO = (299, 99)
DIT_IO = (28, 9)


def build_model(args):
    """(model, (in, out) channels, its config's downsample_factor: the multiple of domain bands)."""
    from framework import registry

    if args.model == "dit":
        from recipes.stormscope.config import DiTConfig

        if args.residual_tiles:
            from recipes.stormscope import residual

            residual.TILES.update(residual.parse_tile_set(args.residual_tiles))
        impls = dict(attn_impl=args.attn_impl, mlp_impl=args.mlp_impl, residual_impl=args.residual_impl)
        cfg, io = DiTConfig(attn_block=args.attn_block, attn_tiles=args.attn_tiles, **impls), DIT_IO
    elif args.model == "diffusion":
        from recipes.stormcast.config import SongUNetConfig
        from recipes.weather.edm import EDMPrecond

        cfg, io = SongUNetConfig(**{**DIFFUSION, **_dropout(args)}), DIFFUSION_IO
        net = registry.models.build(
            "songunet", cfg, in_channels=io[0], out_channels=io[1], img_resolution=(args.height, args.width)
        )
        return EDMPrecond(net, sigma_data=0.5), io, cfg.downsample_factor
    else:
        from recipes.stormcast.config import SongUNetConfig

        cfg, io = SongUNetConfig(**{**PAPER, **_dropout(args)}), (127, 99)
    model = registry.models.build(
        args.model, cfg, in_channels=io[0], out_channels=io[1], img_resolution=(args.height, args.width)
    )
    return model, io, cfg.downsample_factor


def _tile_set(module: str):
    """--attn-tiles (``fused_natten``'s) or --residual-tiles (``residual``'s): checked here, passed on
    to the workers in the same notation; ``@FILE`` reads it from a file."""

    def check(text: str) -> str:
        import importlib

        from recipes.stormscope.fused_natten import format_tile_set

        parse = importlib.import_module(f"recipes.stormscope.{module}").parse_tile_set
        try:
            return format_tile_set(parse(Path(text[1:]).read_text().strip() if text.startswith("@") else text))
        except (OSError, ValueError) as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return check


def _dropout(args) -> dict:
    return {} if args.dropout is None else {"dropout": args.dropout}


def _loss(model, batch, kind: str):
    """The benchmark's training loss: regression MSE, or EDM's weighted denoising loss."""
    x, y = batch["x"], batch["y"]
    if kind == "diffusion":  # x: the conditions, y: the target; sigma and noise fixed per batch
        from recipes.weather.edm import edm_loss

        return edm_loss(model, y, batch["sigma"], batch["noise"], x).mean()
    out = model(x, x.new_zeros(x.shape[0])) if kind == "dit" else model(x)  # the DiT also takes the noise level
    from recipes.weather.task import mse_loss

    return mse_loss(out, y)  # the regression task's


def model_flops(args, plain, x_ch: int, io) -> float:
    """Training FLOPs of one sample of the whole grid (forward + backward): the model's FLOPs,
    which MFU divides by (a domain layout's halo work is not counted). The SongUNets are counted
    under FlopCounterMode on a copy built on the meta device, so counting needs no GPU memory:
    an eager step of the preset's batch does not fit an 80 GB card."""
    if args.model == "dit":
        from recipes.stormscope.dit import train_flops

        return train_flops(plain)
    import torch

    from framework.train import metrics

    with torch.device("meta"):
        model = build_model(args)[0]
        one = {"x": torch.empty(1, x_ch, args.height, args.width), "y": torch.empty(1, io[1], args.height, args.width)}
        if args.model == "diffusion":
            one.update(sigma=torch.ones(1), noise=torch.empty_like(one["y"]))
    return float(metrics.count_flops(lambda: _loss(model, one, args.model).backward())[1])


def _local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


# the recipe whose compile settings each model's compiled runs take (the preset as it ships), by
# model and whether the run is bf16 (the *_fast presets) or not
PRESETS = {
    ("songunet", True): "stormcast_fast",
    ("songunet", False): "stormcast",
    ("diffusion", True): "stormcast_diffusion_fast",
    ("diffusion", False): "stormcast_diffusion",
    ("dit", True): "stormscope",
    ("dit", False): "stormscope",
}


def preset_compile(args, device_type: str, degrees) -> dict:
    """The compile settings of the preset of ``args.model`` at ``args.precision`` (``PRESETS``),
    composed from its recipe: the memory budget, CUDA graphs (null resolved as the runtime
    resolves it for the layout the run applies: ``plan.effective``, so one GPU is ``none``) and
    the norm levels recomputed, as ``--variant`` keys (which override them)."""
    from framework.config.compose import compose
    from framework.plan import effective
    from framework.train.compile import cudagraphs_wanted

    cfg = compose([f"recipe={PRESETS[args.model, args.precision == 'bf16']}"])
    sharding = effective(args.sharding, degrees)
    cudagraphs = cudagraphs_wanted(cfg.trainer.compile_cudagraphs, device_type, sharding, args.domain)
    levels = "+".join(str(v) for v in cfg.model.get("recompute_norm_levels", []))
    return {"memory_budget": cfg.trainer.compile_memory_budget, "cudagraphs": cudagraphs, "norm_levels": levels}


def _variant(text: str) -> dict:
    """``key=value,...`` -> compile_model keyword arguments (ints/bools/None parsed); ``opt.NAME=v``
    is inductor option NAME (e.g. ``opt.triton.autotune_pointwise=0``), ``gn=explicit|fused|composite|aten`` the
    compiled GroupNorm's form, ``norm_levels=1+2`` the SongUNet's ``recompute_norm_levels``."""
    out: dict = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        k, _, v = item.partition("=")
        val = {"none": None, "true": True, "false": False}.get(v.lower(), int(v) if v.isdigit() else v)
        if k.startswith("opt."):
            out.setdefault("options", {})[k[4:]] = bool(val) if val in (0, 1) and isinstance(val, int) else val
            continue
        flag = k in ("channels_last", "cudnn_benchmark", "dynamic", "cudagraphs")
        out[k] = bool(val) if flag and isinstance(val, int) else val
    return out


_KERNEL_KINDS = (  # first match wins: Triton kernels are named by the ops they fuse ("transpose", "conv"),
    # cuDNN's transposes live in its namespace, its convolutions are "implicit_gemm"s
    ("attention", ("flash", "fmha", "attention", "_fna_")),  # _fna_: the DiT's fused neighbourhood kernels
    ("group norm (fused Triton)", ("gn_fused",)),
    ("MLP bias + GELU (fused Triton)", ("_bias_gelu",)),  # the DiT's (recipes/stormscope/gelu.py)
    ("residuals + norm (fused Triton)", ("_residual_",)),  # the DiT's (recipes/stormscope/residual.py)
    ("triton (inductor)", ("triton",)),
    ("layout transpose", ("nchwToNhwc", "nhwcToNchw", "nchw2nhwc", "nhwc2nchw", "transpose")),
    ("conv (cuDNN)", ("conv", "xmma", "cudnn", "implicit", "wgrad", "dgrad", "fprop", "cutlass")),
    ("matmul", ("gemm", "nvjet", "cublas")),
    ("group norm (aten)", ("group_norm", "GroupNorm", "Welford", "welford")),
    ("optimizer", ("multi_tensor", "adam", "Adam")),
    ("nccl", ("nccl",)),
    ("copy/fill", ("copy", "Memcpy", "Memset", "fill")),
    ("elementwise/reduce (aten)", ("elementwise", "vectorized", "unrolled", "reduce", "Reduce")),
)


def kernel_kind(name: str) -> str:
    """The profile table's row for a kernel name (``_KERNEL_KINDS``' first match, else "other")."""
    return next((k for k, keys in _KERNEL_KINDS if any(x in name for x in keys)), "other")


def device_kernels(prof) -> list:
    """The profile's GPU kernels, without the "## Call CompiledFxGraph ... ##" ranges that torch
    2.11 also puts on the device timeline around each compiled graph (they span its kernels, and
    counted as kernels they doubled the busy time)."""
    import torch

    events = prof.key_averages()
    ranges = ("## ", "Optimizer.")  # CPU ranges mirrored on the device timeline (e.g. "Optimizer.step#Adam.step")
    return [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and not e.key.startswith(ranges)]


def _copy_origins(prof, steps: int) -> list:
    """Where the copy kernels (aten's direct_copy: casts, .contiguous(), layout changes) come
    from: each one's chain of enclosing CPU ops (innermost first) with its input shapes."""
    origins: dict[str, list] = {}
    for ev in prof.events():
        copies = [k for k in ev.kernels if "copy" in k.name and "triton" not in k.name]
        if not copies or any(c.kernels for c in ev.cpu_children):  # count each at its innermost op
            continue
        chain, parent = [f"{ev.name}{list(ev.input_shapes)[:2] if ev.input_shapes else ''}"], ev.cpu_parent
        while parent is not None and len(chain) < 5:
            chain.append(parent.name)
            parent = parent.cpu_parent
        slot = origins.setdefault(" < ".join(chain)[:230], [0.0, 0])
        slot[0] += sum(k.duration for k in copies) / 1e3 / steps
        slot[1] += len(copies)
    return sorted(origins.items(), key=lambda kv: -kv[1][0])


def _cudagraph_copies(device) -> list:
    """What CUDA graph trees copy into their graphs' static buffers before each replay: every
    recorded graph's inputs that are neither static (parameters) nor outputs of an earlier graph
    of the tree, by placeholder name (``tangents``: incoming gradients, ``primals``: forward
    inputs, others: saved activations), with their bytes. A diagnosis through torch's private
    tree structures, read only."""
    import torch
    from torch._inductor import cudagraph_trees

    manager = cudagraph_trees.get_manager(device.index or 0, create_if_none_exists=False)
    if manager is None:
        return ["  (no CUDA graph trees)"]
    nodes = [n for group in manager.roots.values() for n in group]
    kinds: dict[str, list] = {}
    graphs = 0
    while nodes:
        node = nodes.pop()
        nodes.extend(c for group in node.children.values() for c in group)
        if not hasattr(node, "non_static_input_idx"):  # a warm-up node: nothing recorded
            continue
        graphs += 1
        for i in node.non_static_input_idx:
            t = node.reconstructed_inputs[i]
            if not isinstance(t, torch.Tensor):
                continue
            name = re.sub(r"_\d+$", "", node.wrapped_function.placeholders[i].name)
            key = f"{name} {str(t.dtype).removeprefix('torch.')} {tuple(t.shape)}"
            slot = kinds.setdefault(key, [0, 0])
            slot[0] += 1
            slot[1] += t.numel() * t.element_size()
    total = sum(n for n, _ in kinds.values()), sum(b for _, b in kinds.values())
    lines = [f"  {total[0]} inputs, {total[1] / 2**20:.1f} MiB copied per replay of the tree's {graphs} graphs:"]
    top = sorted(kinds.items(), key=lambda kv: -kv[1][1])[:15]
    return lines + [f"  {n:5d} x  {b / 2**20:9.1f} MiB  {key}" for key, (n, b) in top]


def host_time(t, batch, device, path: Path, steps: int = 3) -> list:
    """How long the host takes to enqueue a step (no sync inside: the GPU runs behind), against
    the step's wall time; near equal, the host sets the pace. Then one step under cProfile,
    its functions by own time, written to ``path``."""
    import cProfile
    import io
    import pstats

    import torch

    enqueue, wall = [], []
    for _ in range(steps):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        t.train_step(batch)
        enqueue.append(time.perf_counter() - t0)
        torch.cuda.synchronize(device)
        wall.append(time.perf_counter() - t0)
    prof = cProfile.Profile()
    torch.cuda.synchronize(device)
    prof.enable()
    t.train_step(batch)
    torch.cuda.synchronize(device)
    prof.disable()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("tottime").print_stats(45)
    stats.sort_stats("cumulative").print_stats(60)
    path.write_text(buf.getvalue())
    e, w = 1e3 * min(enqueue), 1e3 * min(wall)
    return [f"host: enqueueing a step takes {e:.1f} ms of its {w:.1f} ms wall ({100 * e / w:.0f}%); {path.name}"]


def profile_steps(t, batch, args, device, steps: int = 2) -> dict:
    """Kernel time of ``steps`` training steps by kind, and the top kernels (torch.profiler)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        for _ in range(steps):
            t.train_step(batch)
        torch.cuda.synchronize(device)
    wall = (time.perf_counter() - t0) / steps
    kernels = device_kernels(prof)
    per = lambda e: getattr(e, "self_device_time_total", 0) / 1e3 / steps  # ms per step
    kinds: dict[str, float] = {}
    for e in kernels:
        kind = kernel_kind(e.key)
        kinds[kind] = kinds.get(kind, 0.0) + per(e)
    ranked = sorted(kernels, key=per, reverse=True)
    top = ranked[:25]
    busy = sum(kinds.values())
    lines = [f"step wall {1e3 * wall:.1f} ms, kernels {busy:.1f} ms/step ({100 * busy / (1e3 * wall):.0f}% busy)"]
    lines += [f"  {k:<28} {v:8.1f} ms  {100 * v / busy:5.1f}%" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])]
    lines += ["top kernels (ms/step, calls/step):"]
    lines += [f"  {per(e):8.2f} {e.count // steps:5d}  {e.key[:150]}" for e in top]
    lines += ["copy kernels by the CPU ops that launched them (ms/step, calls/step):"]
    try:  # a diagnosis only: a profiler API difference must not lose the table above
        lines += [f"  {ms:8.2f} {n // steps:5d}  {chain}" for chain, (ms, n) in _copy_origins(prof, steps)[:10]]
    except Exception as e:  # noqa: BLE001
        lines.append(f"  (not available: {e!r})")
    if args.compile:
        lines += ["CUDA graph trees' input copies:"]
        try:  # a diagnosis only, as above
            lines += _cudagraph_copies(device)
        except Exception as e:  # noqa: BLE001
            lines.append(f"  (not available: {e!r})")
    mode = "compiled" if args.compile else "eager"
    tag = f"{args.model}_{args.sharding}_{mode}{'_' + args.variant if args.variant else ''}"
    tag = re.sub(r"[^A-Za-z0-9_.-]", "-", tag.replace(",", "_"))  # file names any tool takes
    out = Path(args.profile)
    out.mkdir(parents=True, exist_ok=True)
    trace = out / f"trace_{tag}.json"  # the timeline (chrome://tracing, perfetto): where the GPU waits
    prof.export_chrome_trace(str(trace))
    with trace.open("rb") as src, gzip.open(f"{trace}.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    trace.unlink()
    lines += host_time(t, batch, device, out / f"host_{tag}.txt")
    text = "\n".join(lines)
    (out / f"profile_{tag}.txt").write_text(text + "\n")
    every = [f"{per(e):.4f}\t{e.count // steps}\t{e.key}" for e in ranked]  # for a closer look than the top 25
    (out / f"kernels_{tag}.tsv").write_text("ms_per_step\tcalls_per_step\tkernel\n" + "\n".join(every) + "\n")
    print(f"PROFILE {tag}\n{text}", file=sys.stderr, flush=True)
    return {"wall_ms": 1e3 * wall, "kernel_ms": busy, "kinds_ms": kinds}


def worker(args) -> None:
    import torch

    from framework import registry
    from framework.config.schema import ParallelConfig, PrecisionConfig, ShardingConfig, TrainerConfig
    from framework.distributed import env as dist_env
    from framework.distributed import mesh
    from framework.distributed import precision as precision_mod
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
        degrees = mesh.resolve(par, env.world_size)
        topo = mesh.build(degrees, device.type)
        prec = precision_mod.build(PrecisionConfig(name=args.precision), device)
        prec.apply_backend_flags()
        torch.manual_seed(0)
        model, io, factor = build_model(args)
        model = model.to(device)
        plain = model
        rows, weight = args.height, 1.0
        if args.domain > 1:  # split every sample's rows over the domain ranks
            from framework.domain.comm import DomainGroup, split_extents
            from framework.domain.splitter import split

            extents = split_extents(args.height, args.domain, factor)
            dg = DomainGroup(topo.group("domain"), extents)
            if args.model == "dit":
                from recipes.stormscope.parallelize import PLAN
            else:
                from recipes.stormcast.parallelize import PLAN
            model = split(model, dg, PLAN)
            rows, weight = extents[dg.rank], args.domain * extents[dg.rank] / args.height

        if args.domain > 1 and args.model == "diffusion":
            raise SystemExit("--model diffusion: not with --domain (the benchmark's denoiser is not split)")
        # the diffusion denoiser sees the noisy target and the conditions: x holds the conditions
        x_ch = io[0] - io[1] if args.model == "diffusion" else io[0]

        class Task:  # the training loss on in-memory tensors
            @staticmethod
            def loss(m, batch):
                return _loss(m, batch, args.model) * weight

            @staticmethod
            def example_batch(n, empty):  # what precompilation traces on fake tensors
                out = {"x": empty((n, x_ch, rows, args.width)), "y": empty((n, io[1], rows, args.width))}
                if args.model == "diffusion":
                    out.update(sigma=empty((n,)), noise=empty((n, io[1], rows, args.width)))
                return out

        compiled = None
        if args.cudnn_benchmark:
            torch.backends.cudnn.benchmark = True
        if args.compile:
            from framework.train.compile import compile_model
            from recipes.stormcast.layers import set_compiled_form

            variant = preset_compile(args, device.type, degrees) | _variant(args.variant)
            if "gn" in variant:  # else the model's default (auto: fused with CUDA graphs)
                set_compiled_form(model, variant.pop("gn"))
            levels = variant.pop("norm_levels")  # model.recompute_norm_levels, e.g. norm_levels=1+2
            levels = [int(v) for v in str(levels).split("+") if v]
            for m in model.modules():
                if hasattr(m, "set_norm_recompute"):
                    m.set_norm_recompute(levels)
            compiled = compile_model(model, device_type=device.type, **variant)
            compile_settings = {"memory_budget": float(variant["memory_budget"]), "norm_levels": levels}
        jobs = []
        if compiled is not None:  # as the runtime does (trainer.compile_workers)
            from framework.train import precompile

            jobs = precompile.plan_jobs(args.compile_workers, compiled, model, Task(), args.batch_per_gpu, prec, device)
        sharded = registry.sharding.build(
            args.sharding, model, ShardingConfig(name=args.sharding), topology=topo, precision=prec, device=device
        )
        prec.sharded_cast = sharded.mixed_precision
        model = sharded.model
        precompiled = None
        if jobs:
            precompiled = precompile.run_jobs(
                jobs, args.compile_workers, compiled, prec, sharded.mixed_precision, device, env, timeout_s=480
            )
            if torch.distributed.is_initialized():
                torch.distributed.barrier()
        from framework.config.schema import OptimConfig
        from framework.train import optim as optim_mod

        fused = {"auto": None, "true": True, "false": False}[args.optim_fused]  # auto: the framework's choice
        opt = optim_mod.build(OptimConfig(lr=1e-4, fused=fused), model.parameters())
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)

        t = Trainer(
            cfg=TrainerConfig(),
            run=None,
            env=env,
            device=device,
            task=Task(),
            model=model,
            optimizer=opt,
            scheduler=sched,
            precision=prec,
            checkpoint=None,
            sinks=[],
            run_dir=Path("."),
            dp_rank=topo.dp_rank,
            dp_size=topo.dp_size,
        )
        b = args.batch_per_gpu
        batch = {
            "x": torch.randn(b, x_ch, rows, args.width, device=device),
            "y": torch.randn(b, io[1], rows, args.width, device=device),
        }
        if args.model == "diffusion":  # EDM's lognormal noise levels (P_mean -1.2, P_std 1.2)
            batch["sigma"] = (torch.randn(b, device=device) * 1.2 - 1.2).exp()
            batch["noise"] = torch.randn(b, io[1], rows, args.width, device=device)
        from framework.train import metrics

        sync = torch.cuda.synchronize if cuda else (lambda: None)
        flops, first_step_s = model_flops(args, plain, x_ch, io), None
        for i in range(args.warmup):  # step times on stderr tell a slow start (compiling) from a hang
            t0 = time.perf_counter()
            t.train_step(batch)
            sync()
            dt = time.perf_counter() - t0
            first_step_s = dt if first_step_s is None else first_step_s
            print(f"rank {env.rank} warm-up step {i}: {dt:.2f} s", file=sys.stderr, flush=True)
            if i == 0 and compiled is not None and env.is_main:  # where the first step's compile time went
                from torch._dynamo.utils import compile_times

                print(f"compile times (s, aggregated):\n{compile_times(repr='str', aggregate=True)}", file=sys.stderr)
        warm_reserved = 0.0
        if cuda:
            # What the warm-up left cached (cuDNN's algorithm search, the steps before CUDA graphs
            # record) is returned first: the peak below is what the steady step needs, as the
            # allocator would free those blocks itself before failing an allocation.
            warm_reserved = torch.cuda.max_memory_reserved(device) / 2**30
            torch.cuda.empty_cache()
            t.train_step(batch)  # untimed: the steady step's memory allocated again
            sync()
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
            "model": args.model,
            "tflop_per_sample": flops / 1e12,
            "tflops": flops * sps / 1e12,
            "mfu": flops * sps / 1e12 / (peak * env.world_size) if peak else None,
            "sharding": args.sharding,
            "gpus": env.world_size,
            "precision": args.precision,
            "compile": args.compile,
            "optimizer": "fused" if opt.param_groups[0].get("fused") else "foreach",
            "batch_per_gpu": b,
            "grid": [args.height, args.width],
            "domain": args.domain,
            "step_s": dt,
            "samples_per_s": b * topo.dp_size / dt,
            "samples_per_s_per_gpu": b * topo.dp_size / dt / env.world_size,
            "peak_mem_gib": (torch.cuda.max_memory_allocated(device) if cuda else 0) / 2**30,
            # what the allocator holds: with CUDA graphs the pool's memory counts here, not above
            "peak_reserved_gib": (torch.cuda.max_memory_reserved(device) if cuda else 0) / 2**30,
            "warmup_reserved_gib": warm_reserved,  # the peak before the cache was emptied
            "state_gib": (2 * _local_bytes(params) + _local_bytes(state)) / 2**30,
            "first_step_s": first_step_s,
            "precompile_s": precompiled["seconds"] if precompiled else None,
            # what the workers built: a graph the first step builds itself is one they failed or keyed otherwise
            "precompiled": {k: precompiled[k] for k in ("jobs", "built", "failed")} if precompiled else None,
            "variant": args.variant,
            "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
        }
        if args.model == "dit":  # what ran (--compare's variants differ here)
            result["impls"] = dict(
                attn=args.attn_impl,
                attn_tiles=args.attn_tiles,
                mlp=args.mlp_impl,
                residual=args.residual_impl,
                residual_tiles=args.residual_tiles,
            )
        if compiled is not None:
            result["compile_stats"] = {k: v for k, v in compiled.stats().items() if k != "break_reasons"}
            result["compile_stats"]["enabled"] = compiled.enabled
            result["channels_last"] = compiled.channels_last
            result["cudagraphs"] = bool(compiled.cudagraphs)
            result["compile_settings"] = compile_settings
        if env.is_main:  # before the profile: a profile cut short keeps the measurement
            print("RESULT " + json.dumps(result), flush=True)
        if args.profile and env.is_main:  # the same figures again, with the profile's (the driver keeps the last)
            result["profile"] = profile_steps(t, batch, args, device)
            print("RESULT " + json.dumps(result), flush=True)


def launch(sharding: str, gpus: int, args, domain: int = 1, compile: bool | None = None) -> dict:
    compile = args.compile if compile is None else compile
    cmd = (
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={gpus}",
            str(Path(__file__).resolve()),
            "--worker",
            "--sharding",
            sharding,
            "--precision",
            args.precision,
            "--batch-per-gpu",
            str(args.batch_per_gpu),
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
            "--height",
            str(args.height),
            "--width",
            str(args.width),
            "--domain",
            str(domain),
            "--device",
            args.device,
            "--model",
            args.model,
            "--attn-impl",
            args.attn_impl,
            *(["--attn-block", str(args.attn_block)] if args.attn_block else []),
            "--mlp-impl",
            args.mlp_impl,
            "--residual-impl",
            args.residual_impl,
            *(["--attn-tiles", args.attn_tiles] if args.attn_tiles else []),
            *(["--residual-tiles", args.residual_tiles] if args.residual_tiles else []),
            *(["--dropout", str(args.dropout)] if args.dropout is not None else []),
            "--watchdog",
            str(args.watchdog),
            "--optim-fused",
            args.optim_fused,
        ]
        + (["--compile", "--variant", args.variant] if compile else [])
        + (["--compile-workers", str(args.compile_workers)] if compile and args.compile_workers is not None else [])
        + (["--cudnn-benchmark"] if args.cudnn_benchmark else [])
        + (["--profile", str(args.profile)] if args.profile else [])
    )
    print(f"launch: {sharding} x{gpus} {'compiled' if compile else 'eager'}", file=sys.stderr, flush=True)
    # its own process group: a run past --worker-timeout is stopped with its workers, and what it
    # printed (a RESULT before a long profile) is kept
    with subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ), start_new_session=True
    ) as p:
        try:
            out, err = p.communicate(timeout=args.worker_timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGTERM)  # torchrun stops its workers (their own sessions) on SIGTERM
            try:
                out, err = p.communicate(timeout=60)  # longer than torchrun's 30 s for its workers
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                out, err = p.communicate()
            err += f"\nstopped after --worker-timeout {args.worker_timeout} s"
    proc = subprocess.CompletedProcess(cmd, p.returncode, out, err)
    if args.log_dir:
        tag = f"{sharding}_x{gpus}_d{domain}_{'compiled' if compile else 'eager'}"
        Path(args.log_dir).mkdir(parents=True, exist_ok=True)
        (Path(args.log_dir) / f"{tag}.log").write_text(proc.stdout + "\n" + proc.stderr)
    results = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if results:
        return results[-1]
    err = proc.stderr.splitlines()
    start = next((i for i, ln in enumerate(err) if ln.startswith("Traceback")), max(0, len(err) - 15))
    # the traceback's end: the exception's own line (out of memory, say) comes last
    raise SystemExit(f"{sharding} on {gpus} GPU(s) failed:\n" + "\n".join(err[max(start, len(err) - 40) :]))


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
    ap.add_argument("--compile", action="store_true", help="worker: trainer.compile=true; driver: compiled only")
    ap.add_argument(
        "--modes", default="eager,compiled", help="driver: comma list of eager, compiled (default: both, side by side)"
    )
    ap.add_argument(
        "--layouts",
        default=None,
        help="driver: comma list of none, ddp, fsdp2, hsdp (default none, plus ddp and fsdp2 with --gpus > 1)",
    )
    ap.add_argument("--variant", default="", help="compile_model options, e.g. channels_last=0,cudnn_benchmark=1")
    ap.add_argument(
        "--compile-workers",
        type=int,
        default=None,
        help="with --compile: trainer.compile_workers (None: auto; 0: the first step compiles every block)",
    )
    ap.add_argument("--cudnn-benchmark", action="store_true", help="torch.backends.cudnn.benchmark on (eager too)")
    ap.add_argument("--profile", type=Path, default=None, help="write a kernel-time table per run into this dir")
    ap.add_argument("--log-dir", type=Path, default=None, help="driver: keep each run's stdout/stderr here")
    ap.add_argument("--worker-timeout", type=float, default=None, help="driver: stop a run after this many seconds")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke test of the harness")
    ap.add_argument("--domain", type=int, default=1, help="worker: domain ranks per sample")
    ap.add_argument(
        "--mode",
        choices=["dp", "domain"],
        default="dp",
        help="dp: none/ddp/fsdp2 scaling; domain: one sample split over the GPUs",
    )
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    ap.add_argument(
        "--model",
        choices=["songunet", "diffusion", "dit"],
        default="songunet",
        help="songunet: the regression net; diffusion: the EDM denoiser of stormcast_diffusion_fast; dit: StormScope's",
    )
    ap.add_argument("--attn-impl", default="auto", help="dit: auto | flex | fused | reference")
    ap.add_argument("--mlp-impl", default="fused", choices=("fused", "torch"), help="dit: the MLP's bias + GELU")
    ap.add_argument(
        "--residual-impl",
        default="fused",
        choices=("fused", "torch"),
        help="dit: the blocks' gated residual sums and the norm between them",
    )
    ap.add_argument("--attn-block", type=int, choices=[64, 128], help="dit: flex's sparse block (default: auto)")
    ap.add_argument(
        "--attn-tiles",
        type=_tile_set("fused_natten"),
        help="dit, fused: the kernels' 16-bit tiles, SPEC or fwd=SPEC,dq=SPEC,dkdv=SPEC, or @FILE "
        "(benchmarks/natten.py --best-tiles); default: the recipe's",
    )
    ap.add_argument(
        "--residual-tiles",
        type=_tile_set("residual"),
        help="dit, residual-impl fused: the ops' tiles, ROWSxSTEP/WARPS or fwd=SPEC,bwd=SPEC "
        "(benchmarks/residual_norm.py --sweep's notation); default: the recipe's",
    )
    ap.add_argument("--dropout", type=float, help="the SongUNets' dropout (default: the presets', 0.1)")
    ap.add_argument(
        "--optim-fused",
        default="auto",
        choices=("auto", "true", "false"),
        help="Adam's fused kernel (optim.fused); auto: the framework's choice (fused on CUDA)",
    )
    ap.add_argument(
        "--watchdog",
        type=float,
        default=0,
        help="worker: after this many seconds print every thread's stack and exit (0: off)",
    )
    ap.add_argument(
        "--compare",
        nargs="+",
        metavar="KEY=VALUE[,KEY=VALUE]",
        help="driver: one run of the first layout and mode per variant (driver options without their "
        "dashes, e.g. residual-impl=fused), each printed against the first",
    )
    ap.add_argument("--rounds", type=int, default=1, help="driver, --compare: the variants' runs, alternating")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.mode == "domain":
        return domain_table(args)
    modes = ["compiled"] if args.compile else [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or set(modes) - {"eager", "compiled"}:
        ap.error(f"--modes {args.modes!r}: expected a comma list of eager, compiled")
    layouts = args.layouts.split(",") if args.layouts else ["none"] + (["ddp", "fsdp2"] if args.gpus > 1 else [])
    if args.compare:
        variants = {spec: _variant_args(ap, argv, spec) for spec in args.compare}
        return compare_table(variants, layouts[0], modes[0], args)
    runs = []
    for layout in layouts:
        gpus = 1 if layout == "none" else args.gpus
        for mode in modes:
            try:
                runs.append(launch(layout, gpus, args, compile=mode == "compiled"))
            except SystemExit as e:  # one failed layout does not lose the others' figures
                print(e, file=sys.stderr, flush=True)
            if args.out:
                args.out.write_text(json.dumps(runs, indent=1))
    if not runs:
        raise SystemExit("no run succeeded")
    print_table(runs, args)


def print_table(runs: list[dict], args) -> None:
    base = next((r for r in runs if r["sharding"] == "none" and not r["compile"]), runs[0])
    attention = ""
    if args.model == "dit":
        attention = f", attention {args.attn_impl}" + (f" ({args.attn_tiles})" if args.attn_tiles else "")
        attention += f", MLP {args.mlp_impl}, residuals {args.residual_impl}"
        attention += f" ({args.residual_tiles})" if args.residual_tiles else ""
    print(
        f"{args.model}, {args.height}x{args.width}, batch {args.batch_per_gpu}/GPU, {args.precision}, "
        f"{base['tflop_per_sample']:.2f} TFLOP/sample{attention}"
    )
    print(
        f"{'layout':>8} {'gpus':>4} {'mode':>8} {'samples/s':>10} {'/GPU':>7} {'x eager':>7} {'MFU':>6} "
        f"{'peak GiB/GPU':>12} {'reserved':>8} {'warm-up':>7} {'p+g+opt GiB':>11} {'1st step s':>10} {'precomp s':>9}"
    )
    for r in runs:
        eager = next(
            (e for e in runs if e["sharding"] == r["sharding"] and e["gpus"] == r["gpus"] and not e["compile"]), None
        )
        ratio = f"{r['samples_per_s'] / eager['samples_per_s']:.2f}" if eager else "-"
        first = f"{r['first_step_s']:.1f}" if r.get("first_step_s") is not None else "-"
        pre = f"{r['precompile_s']:.1f}" if r.get("precompile_s") is not None else "-"
        # the allocator's peak misses CUDA graphs' pool: only "reserved" counts there
        peak = "-" if r.get("cudagraphs") else f"{r['peak_mem_gib']:.1f}"
        print(
            f"{r['sharding']:>8} {r['gpus']:>4} {'compiled' if r['compile'] else 'eager':>8} "
            f"{r['samples_per_s']:>10.2f} {r['samples_per_s_per_gpu']:>7.2f} {ratio:>7} {_pct(r['mfu']):>6} "
            f"{peak:>12} {r.get('peak_reserved_gib', 0):>8.1f} {r.get('warmup_reserved_gib', 0):>7.1f} "
            f"{r['state_gib']:>11.3f} "
            f"{first:>10} {pre:>9}"
        )
        if r.get("compile_stats"):
            c = r["compile_stats"]
            print(
                f"{'':>8} compile: {c.get('cached_graphs')} graphs for {c.get('units')} units, "
                f"{c.get('recompiles')} recompiles, {c.get('graph_breaks')} graph breaks, "
                f"inductor built {c.get('built')} / loaded {c.get('loaded')} graphs, "
                f"channels_last={r.get('channels_last')}, CUDA graph skips {c.get('cudagraph_skips', '-')}"
            )
            cs = r.get("compile_settings") or {}
            print(
                f"{'':>8} settings: CUDA graphs {'on' if r.get('cudagraphs') else 'off'}, memory budget "
                f"{cs.get('memory_budget')}, norms recomputed at levels {cs.get('norm_levels')}"
            )
        if r.get("precompiled"):
            w = r["precompiled"]
            failed = f"; not built: {'; '.join(w['failed'][:3])}" if w["failed"] else ""
            share = " (rank 0's share)" if r["gpus"] > 1 else ""
            built = f"{w['built']} of {w['jobs']} block signatures built by the workers{share}"
            print(f"{'':>8} precompiled: {built}{failed}")
    if args.out:
        args.out.write_text(json.dumps(runs, indent=1))


def _variant_args(ap: argparse.ArgumentParser, argv: list[str], spec: str) -> argparse.Namespace:
    """The driver's arguments with a variant's options (``key=value,...``) after them (the later wins).
    A comma followed by something other than an option's name is the value's own (a tile set's
    ``fwd=...,bwd=...``)."""
    options = {s[2:] for s in ap._option_string_actions if s.startswith("--")}
    items: list[str] = []
    for item in filter(None, (i.strip() for i in spec.split(","))):
        if items and item.partition("=")[0] not in options:
            items[-1] += "," + item
        else:
            items.append(item)
    extra = []
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key or key.startswith("-"):
            ap.error(f"--compare {spec!r}: expected key=value[,key=value] (driver options without their dashes)")
        if key in ("compare", "rounds", "worker", "layouts", "modes", "mode", "gpus"):
            ap.error(f"--compare {spec!r}: {key} is the comparison's own, not a variant's")
        extra += [f"--{key}", value]
    return ap.parse_args([*argv, *extra])


def compare_table(variants: dict[str, argparse.Namespace], layout: str, mode: str, args) -> None:
    """Each variant's run of one layout and mode, alternating over ``args.rounds``; each against the
    first variant's mean samples/s."""
    gpus = 1 if layout == "none" else args.gpus
    runs: dict[str, list[dict]] = {spec: [] for spec in variants}
    for _ in range(max(1, args.rounds)):
        for spec, ns in variants.items():
            try:
                r = launch(layout, gpus, ns, compile=mode == "compiled")
            except SystemExit as e:  # one failed variant does not lose the others' figures
                print(e, file=sys.stderr, flush=True)
                continue
            runs[spec].append(dict(r, compared=spec))
            if args.out:
                args.out.write_text(json.dumps([x for rs in runs.values() for x in rs], indent=1))
    done = {spec: rs for spec, rs in runs.items() if rs}
    if not done:
        raise SystemExit("no run succeeded")
    first = next(iter(done.values()))
    base = sum(r["samples_per_s"] for r in first) / len(first)
    print(
        f"{args.model}, {args.height}x{args.width}, batch {args.batch_per_gpu}/GPU, {args.precision}, {layout} x{gpus} "
        f"{mode}, {first[0]['tflop_per_sample']:.2f} TFLOP/sample, {args.rounds} round(s) alternating"
    )
    width = max(len("variant"), *(len(s) for s in done))
    print(f"{'variant':<{width}} {'samples/s (each run)':>24} {'mean':>7} {'x first':>7} {'MFU':>6} {'peak GiB':>8}")
    for spec, rs in done.items():
        mean = sum(r["samples_per_s"] for r in rs) / len(rs)
        each = " ".join(f"{r['samples_per_s']:.2f}" for r in rs)
        mfu = sum(r["mfu"] for r in rs) / len(rs) if all(r["mfu"] is not None for r in rs) else None
        peak = max(r["peak_reserved_gib"] if r.get("cudagraphs") else r["peak_mem_gib"] for r in rs)
        print(f"{spec:<{width}} {each:>24} {mean:>7.2f} {mean / base:>7.3f} {_pct(mfu):>6} {peak:>8.1f}")


def domain_table(args) -> None:
    """One sample split over the GPUs (fsdp2 over the flattened axis) against one GPU."""
    runs = [
        launch("none", 1, args),
        launch("fsdp2", args.gpus, args, domain=args.gpus),
        launch("ddp", args.gpus, args, domain=args.gpus),
    ]
    base = runs[0]
    print(f"{args.model}, grid {args.height}x{args.width}, batch {args.batch_per_gpu}, {args.precision}")
    print(f"{'layout':>14} {'gpus':>4} {'s/step':>8} {'speed-up':>9} {'peak GiB/GPU':>12} {'x mem':>6} {'MFU':>6}")
    for r in runs:
        name = f"{r['sharding']}+domain{r['domain']}" if r["domain"] > 1 else r["sharding"]
        print(
            f"{name:>14} {r['gpus']:>4} {r['step_s']:>8.3f} {base['step_s'] / r['step_s']:>9.2f} "
            f"{r['peak_mem_gib']:>12.1f} {r['peak_mem_gib'] / max(base['peak_mem_gib'], 1e-9):>6.2f} "
            f"{_pct(r['mfu']):>6}"
        )
    if args.out:
        args.out.write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
