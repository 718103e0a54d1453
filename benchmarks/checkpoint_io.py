"""Checkpoint I/O at the StormCast diffusion size: save/load GB/s and loop-blocked time, sync vs async.

The model is the StormCast diffusion SongUNet (512x640, 226 -> 99 channels, 121 M
parameters) with Adam's state initialised by one optimizer step: about 1.45 GB of
model + optimizer state. Saves go through the framework's CheckpointManager exactly as
in training (atomic commit, meta.json, per-rank RNG files, fsync of every file).

- ``dcp`` (sync): the loop is blocked for the whole save; GB/s = state bytes / save time.
- ``dcp_async``: blocked = the ``save()`` call + the time spent in
  ``before_optimizer_step()`` over the steps that follow until the save is committed (the
  staging copy overlaps the next step's forward/backward; the write and the commit run in
  the background).
- load: ``CheckpointManager.load`` into the live model/optimizer (which verifies every
  checksum of the manifest first, then reads); the files are evicted from the page cache
  first (``posix_fadvise(DONTNEED)``, ``--warm`` keeps them).
- verify: ``backend.verify(full=True)`` alone, cold (evicted) and warm (page cache): GB/s
  of checkpoint bytes hashed against ``manifest.json``; the manifest's share of a sync save
  (hashing every file at commit); the quick check (sizes, meta.json); and the raw speed of
  the candidate hashes (blake2b, sha256) on one thread and on the verifier's threads.

The step between an async save and the next optimizer step is a real forward/backward
(batch 1, bf16 autocast on CUDA) by default on CUDA. On CPU a real step at 512x640 takes
minutes on a few cores, so by default it is ``--step-s`` seconds of matmul work on one
thread (``--step real`` forces the real one); the worst case, no step at all, is printed
too (``staging only``).

    python benchmarks/checkpoint_io.py                      # CPU
    python benchmarks/checkpoint_io.py --device cuda        # one GPU
    python benchmarks/checkpoint_io.py --dir /local/nvme --rounds 5 --io-threads 4

Prints one line per measurement and the ratio async-blocked / sync-save (target <= 0.05).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from framework.checkpoint import manifest as manifest_mod  # noqa: E402
from framework.checkpoint.dcp import DcpBackend  # noqa: E402
from framework.checkpoint.dcp_async import AsyncDcpBackend  # noqa: E402
from framework.checkpoint.manager import CheckpointManager  # noqa: E402
from framework.config.schema import CheckpointConfig  # noqa: E402
from framework.distributed.env import DistEnv  # noqa: E402
from framework.distributed.precision import Precision  # noqa: E402

GRID = (512, 640)
IN_CH, OUT_CH = 226, 99


def build(device: torch.device):
    from recipes.stormcast.songunet import SongUNet

    torch.manual_seed(0)
    model = SongUNet(
        img_resolution=GRID,
        in_channels=IN_CH,
        out_channels=OUT_CH,
        model_channels=128,
        channel_mult=[1, 2, 2, 2, 2],
        num_blocks=4,
        attn_resolutions=[],
        embedding_type="positional",
        additive_pos_embed=True,
        dropout=0.0,
    ).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    for p in model.parameters():  # one step with small gradients: Adam's moments exist
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    opt.zero_grad(set_to_none=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return SimpleNamespace(
        model=model,
        optimizer=opt,
        scheduler=sched,
        precision=Precision("bf16", None, False, None),
        step=1,
        run_id="bench",
    )


def state_bytes(t) -> int:
    n = sum(p.numel() * p.element_size() for p in t.model.parameters())
    n += sum(b.numel() * b.element_size() for b in t.model.buffers())
    for s in t.optimizer.state.values():
        n += sum(v.numel() * v.element_size() for v in s.values() if torch.is_tensor(v))
    return n


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_step(t, device, how: str, seconds: float):
    """What runs between a save and the next optimizer step."""
    if how == "real":
        x = torch.randn(1, IN_CH, *GRID, device=device)
        sigma = torch.ones(1, device=device)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

        def step():
            with torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
                out = t.model(x, sigma)
            out.float().square().mean().backward()
            sync(device)

        return step

    a = torch.randn(512, 512)

    def busy():  # ``seconds`` of matmul work on one thread (a CPU stand-in for fwd/bwd)
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            a @ a

    return busy


def evict(path: Path) -> None:
    """Drop a checkpoint's (fsynced, clean) pages from the page cache: a cold read."""
    for f in path.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def hash_speeds(mb: int = 256) -> dict[str, tuple[float, float, float]]:
    """GB/s of each candidate hash on ``mb`` MiB in memory: one thread (wall), the verifier's
    threads (64 MiB chunks hashed in parallel, as manifest.verify does; wall), and one thread
    per CPU-second (what a core does, whatever else shares the machine)."""
    from concurrent.futures import ThreadPoolExecutor

    data = memoryview(os.urandom(mb << 20))
    chunk = 64 << 20
    pieces = [data[o : o + chunk] for o in range(0, len(data), chunk)]
    out = {}
    for name in manifest_mod.ALGORITHMS:

        def one(piece, name=name):
            h = manifest_mod._hasher(name)
            for o in range(0, len(piece), 8 << 20):
                h.update(piece[o : o + (8 << 20)])
            return h.hexdigest()

        t0, c0 = time.perf_counter(), time.process_time()
        for p in pieces:
            one(p)
        single = len(data) / (time.perf_counter() - t0) / 1e9
        per_cpu = len(data) / (time.process_time() - c0) / 1e9
        with ThreadPoolExecutor(manifest_mod.workers()) as pool:
            t0 = time.perf_counter()
            list(pool.map(one, pieces))
            threaded = len(data) / (time.perf_counter() - t0) / 1e9
        out[name] = (single, threaded, per_cpu)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dir", type=Path, default=None, help="where checkpoints are written (default: a temp dir)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--io-threads", type=int, default=1, help="DCP writer threads (checkpoint.io_threads)")
    ap.add_argument(
        "--step",
        choices=["auto", "real", "busy"],
        default="auto",
        help="the work between an async save and the next optimizer step (auto: real on CUDA)",
    )
    ap.add_argument("--step-s", type=float, default=1.0, help="seconds of the CPU stand-in step (--step busy)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads of the training loop")
    ap.add_argument("--warm", action="store_true", help="load from the page cache (no eviction)")
    args = ap.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            print("error: --device cuda but no CUDA device", file=sys.stderr)
            return 2
        torch.cuda.set_device(0)
    torch.set_num_threads(args.threads)
    how = args.step if args.step != "auto" else ("real" if device.type == "cuda" else "busy")

    t = build(device)
    nbytes = state_bytes(t)
    gb = nbytes / 1e9
    params = sum(p.numel() for p in t.model.parameters())
    where = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU x{os.cpu_count()}"
    print(
        f"model: SongUNet {params / 1e6:.1f} M parameters, {GRID[0]}x{GRID[1]}, {IN_CH}->{OUT_CH}; "
        f"model + Adam state {gb:.3f} GB ({nbytes / 2**30:.3f} GiB)"
    )
    print(
        f"device: {name}; torch {torch.__version__}; dir: {where}; io_threads={args.io_threads}; "
        f"loop threads={args.threads}; step between save and optimizer step: "
        f"{'real fwd/bwd' if how == 'real' else f'{args.step_s:g} s matmul stand-in'}",
        flush=True,
    )
    speeds = hash_speeds()
    print(
        f"hash speed in memory (1 thread / {manifest_mod.workers()} threads / per CPU-second): "
        + ", ".join(f"{k} {a:.2f} / {b:.2f} / {c:.2f} GB/s" for k, (a, b, c) in speeds.items())
        + f"; manifests use {manifest_mod.ALGORITHM}",
        flush=True,
    )

    cfg = CheckpointConfig(keep=1)
    sync_m = CheckpointManager(cfg, DcpBackend(args.io_threads), where / "sync", DistEnv())
    async_m = CheckpointManager(cfg, AsyncDcpBackend(args.io_threads), where / "async", DistEnv())
    step = make_step(t, device, how, args.step_s)

    try:
        # warm-up: first-time allocations (staging buffers, pinned memory), imports, plans
        sync_m.save(t, {})
        async_m.save(t, {})
        async_m.finish()
        if how == "real":
            step()
            t.model.zero_grad(set_to_none=True)

        rows = {
            k: []
            for k in (
                "sync",
                "load",
                "blocked",
                "call",
                "wait",
                "staging",
                "written",
                "steps",
                "verify_cold",
                "verify_warm",
                "verify_cpu",
                "manifest",
                "quick",
            )
        }
        for r in range(args.rounds):
            t.step += 1
            sync(device)
            t0 = time.perf_counter()
            path = sync_m.save(t, {})
            sync(device)
            rows["sync"].append(time.perf_counter() - t0)

            # async: the loop goes on with steps; blocked = the save call + every
            # before_optimizer_step() until the save is committed
            t.step += 1
            t0 = time.perf_counter()
            async_m.save(t, {})
            call = time.perf_counter() - t0
            wait, steps, first = 0.0, 0, None
            while async_m.in_flight:
                step()
                t1 = time.perf_counter()
                async_m.before_optimizer_step()
                hook = time.perf_counter() - t1
                wait += hook
                first = hook if first is None else first
                t.model.zero_grad(set_to_none=True)
                steps += 1
            rows["written"].append(time.perf_counter() - t0)
            rows["call"].append(call)
            rows["wait"].append(wait)
            rows["blocked"].append(call + wait)
            rows["steps"].append(steps)

            # async, worst case: the optimizer step comes at once (blocked = the whole staging)
            t.step += 1
            t0 = time.perf_counter()
            async_m.save(t, {})
            async_m.before_optimizer_step()
            rows["staging"].append(time.perf_counter() - t0)
            async_m.finish()
            print(
                f"round {r + 1}: sync save {rows['sync'][-1]:.3f} s, "
                f"async blocked {rows['blocked'][-1]:.4f} s (call {call:.4f} + hooks {wait:.4f} over {steps} steps, "
                f"the first {first or 0:.4f}), "
                f"staging only {rows['staging'][-1]:.3f} s, async committed after {rows['written'][-1]:.3f} s",
                flush=True,
            )
        # Correctness under load: the optimizer steps right after an async save (the hook
        # waits for the staging copy); the checkpoint must hold the state of its step.
        snapshot = {k: v.detach().clone() for k, v in t.model.state_dict().items()}
        t.step += 1
        checked = async_m.save(t, {})
        for _ in range(3):
            for p in t.model.parameters():
                p.grad = torch.randn_like(p) * 1e-2
            async_m.before_optimizer_step()
            t.optimizer.step()
        t.optimizer.zero_grad(set_to_none=True)
        async_m.finish()
        moved = any(not torch.equal(v, snapshot[k]) for k, v in t.model.state_dict().items())
        async_m.load(checked, t)
        same = all(torch.equal(v, snapshot[k]) for k, v in t.model.state_dict().items())
        print(
            f"async checkpoint holds the state of its step while the optimizer stepped on: "
            f"{'OK' if same and moved else 'FAILED'}",
            flush=True,
        )
        del snapshot

        # Loads last: loading replaces the optimizer's state tensors, so the async stager's
        # buffers (kept from save to save, keyed by tensor storage) would be re-allocated,
        # which a training run pays once, at its first save after resuming.
        for r in range(args.rounds):
            if not args.warm:
                evict(path)
            t0 = time.perf_counter()
            sync_m.load(path, t)
            sync(device)
            rows["load"].append(time.perf_counter() - t0)
            print(f"load {r + 1}: {rows['load'][-1]:.3f} s", flush=True)

        # Verification alone: every checksum (what resume, export and weights.load do before
        # reading), cold and warm; the manifest a commit writes; the quick check.
        backend = DcpBackend()
        listed = json.loads((path / manifest_mod.MANIFEST).read_text())["files"]
        vbytes = sum(e["size"] for e in listed.values())
        for r in range(args.rounds):
            evict(path)
            t0 = time.perf_counter()
            backend.verify(path, full=True)
            rows["verify_cold"].append(time.perf_counter() - t0)
            t0, c0 = time.perf_counter(), time.process_time()
            backend.verify(path, full=True)
            rows["verify_warm"].append(time.perf_counter() - t0)
            rows["verify_cpu"].append(time.process_time() - c0)
            meta = json.loads((path / "meta.json").read_text())
            t0 = time.perf_counter()
            manifest_mod.build(path, meta, world={})
            rows["manifest"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            backend.verify(path, full=False)
            rows["quick"].append(time.perf_counter() - t0)
            print(
                f"verify {r + 1}: cold {rows['verify_cold'][-1]:.3f} s, warm {rows['verify_warm'][-1]:.3f} s, "
                f"manifest at commit {rows['manifest'][-1]:.3f} s, quick {rows['quick'][-1] * 1e3:.1f} ms",
                flush=True,
            )
    finally:
        shutil.rmtree(where, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"\nmedian of {args.rounds} rounds ({gb:.3f} GB):")
    print(f"  dcp sync save        {med['sync']:8.3f} s   {gb / med['sync']:6.2f} GB/s   (loop blocked for all of it)")
    print(
        f"  dcp load             {med['load']:8.3f} s   {gb / med['load']:6.2f} GB/s   "
        f"({'page cache' if args.warm else 'cold: pages evicted'})"
    )
    print(
        f"  dcp_async blocked    {med['blocked']:8.4f} s                 (save call {med['call']:.4f} + "
        f"before_optimizer_step {med['wait']:.4f} over {med['steps']:g} steps until committed)"
    )
    print(
        f"  dcp_async staging    {med['staging']:8.3f} s   {gb / med['staging']:6.2f} GB/s   "
        f"(blocked if the optimizer step came at once)"
    )
    print(
        f"  dcp_async committed  {med['written']:8.3f} s   {gb / med['written']:6.2f} GB/s   "
        f"(save call -> commit, training meanwhile)"
    )
    vgb = vbytes / 1e9
    print(
        f"  verify (cold)        {med['verify_cold']:8.3f} s   {vgb / med['verify_cold']:6.2f} GB/s   "
        f"(every checksum of {vgb:.3f} GB, {manifest_mod.ALGORITHM}, {manifest_mod.workers()} threads, "
        "pages evicted)"
    )
    print(
        f"  verify (warm)        {med['verify_warm']:8.3f} s   {vgb / med['verify_warm']:6.2f} GB/s   "
        f"(page cache: the hashing alone; {vgb / med['verify_cpu']:.2f} GB per CPU-second)"
    )
    print(
        f"  manifest at commit   {med['manifest']:8.3f} s   {vgb / med['manifest']:6.2f} GB/s   "
        f"(part of the sync save above: {med['manifest'] / med['sync']:.0%})"
    )
    print(
        f"  quick check          {med['quick'] * 1e3:8.1f} ms               (manifest, sizes, meta.json: latest(), "
        "describe)"
    )
    ratio = med["blocked"] / med["sync"]
    print(f"async blocked / sync save = {ratio:.4f} (target <= 0.05: {'met' if ratio <= 0.05 else 'NOT met'})")
    print(f"staging only / sync save  = {med['staging'] / med['sync']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
