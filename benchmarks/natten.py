"""Neighbourhood attention against dense masked attention: time per forward+backward, peak memory.

Runs, side by side in one process: flex (where it has a backward on the device), the chunked
reference, and dense SDPA with the full (HW x HW) boolean neighbourhood mask; prints each
one's time and peak memory and their ratios to dense.

    python benchmarks/natten.py --device cpu --grid 16 20 --kernel 7
    python benchmarks/natten.py --device cuda --grid 128 160 --kernel 31 --dtype bf16   # StormScope 512x640

flex runs as the DiT runs it (``flex``: 64-token blocks of 8 x 8 tiles on Hopper for 16-bit heads
under 64, else 128-token blocks of 8 x 16), in 128-token blocks (``flex-128``) and in row-major
token order (``flex-rows``), whose 128-token blocks are slivers of one row. ``fused`` is the
recipe's Triton kernels (CUDA only); ``--fused-tiles`` adds a run per tile variant
(``QHxQW/KHxKW/warps/stages``, ``/pad`` for heads padded to a power of two rather than split,
``/tma`` for tiles loaded through tensor descriptors, ``/full`` for the window test skipped on
tiles inside every window, ``/atomic`` for dQ added up by the dK/dV kernel; for the three kernels
alike, or per kernel as ``fwd=SPEC,dq=SPEC,dkdv=SPEC``, the rest as they are), ``--impls`` picks
which run:

    python benchmarks/natten.py --device cuda --grid 128 160 --kernel 31 --dtype bf16 --batch 4 \
        --impls flex fused --fused-tiles 8x16/8x8/8/3 8x8/8x8/4/3 dkdv=8x8/8x8/4/2/atomic

``--fused-at REV`` adds a run of the fused kernels as they were at git revision ``REV``
(``fused@REV``: that revision's ``fused_natten.py``, loaded beside today's; or REV names a copy
of that file, where the checkout has no git history), for a kernel change measured against its
parent in one call:

    python benchmarks/natten.py --device cuda --grid 128 160 --kernel 31 --dtype bf16 --batch 4 \
        --impls fused --fused-at HEAD~1

Each row gives the forward alone and forward + backward. ``--best-tiles FILE`` writes the fastest
fused variants, the forward's by forward time and the backward kernels' by the rest
(``fwd=SPEC,dq=SPEC,dkdv=SPEC``), which ``benchmarks/scaling.py --attn-tiles @FILE`` then runs
in the DiT.

Peak memory is what the call adds on top of its inputs: CUDA's allocator peak, or on CPU the
process RSS sampled every millisecond by a thread (coarse, but enough for ratios).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from recipes.stormscope import fused_natten  # noqa: E402
from recipes.stormscope.natten import (  # noqa: E402
    dense_neighbourhood_attention,
    flex_neighbourhood_attention,
    reference_neighbourhood_attention,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _rss_peak_reset() -> int:
    """Reset the kernel's RSS high-water mark (VmHWM) and return the current RSS in bytes."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # not Linux or not allowed: the peak then includes earlier high-water marks
    return psutil.Process().memory_info().rss


def _rss_peak() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return psutil.Process().memory_info().rss


class PeakMemory:
    """Peak bytes the block adds above what was in use when it started (allocator peak on CUDA,
    RSS high-water mark on CPU; each implementation runs in its own process so CPU peaks are clean)."""

    def __init__(self, device: torch.device):
        self.device, self.peak = device, 0

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            self.base = _rss_peak_reset()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self.base
        else:
            self.peak = max(0, _rss_peak() - self.base)
        return False


def is_oom(e: BaseException) -> bool:
    msg = str(e).lower()
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in msg or "can't allocate memory" in msg


def measure(fn, q, k, v, kernel, iters, warmup):
    """(seconds per forward+backward, peak bytes, seconds per forward) of fn."""
    grad = torch.randn_like(q)

    def step():
        q.grad = k.grad = v.grad = None
        fn(q, k, v, kernel).backward(grad)
        if q.is_cuda:
            torch.cuda.synchronize()

    def forward():
        fn(q, k, v, kernel)
        if q.is_cuda:
            torch.cuda.synchronize()

    mem = PeakMemory(q.device)
    if not q.is_cuda:  # CPU: malloc keeps what the first call grew, so the peak must include warm-up
        mem.__enter__()
    for _ in range(warmup):  # compilation, block-mask build, allocator warm-up
        step()
    if q.is_cuda:  # CUDA: the allocator's exact peak, in steady state
        mem.__enter__()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    mem.__exit__()
    forwards = []
    for _ in range(iters):
        t0 = time.perf_counter()
        forward()
        forwards.append(time.perf_counter() - t0)
    return statistics.median(times), mem.peak, statistics.median(forwards)


IMPLS = {
    # flex as the DiT runs it: sparse blocks of natten.auto_block (64 tokens, 8 x 8 tiles, for 16-bit
    # heads under 64 on Hopper; else 128, 8 x 16)
    "flex": lambda q, k, v, kernel: flex_neighbourhood_attention(q, k, v, kernel, block=None),
    "flex-128": flex_neighbourhood_attention,  # 128-token blocks, 8 x 16 tiles
    "flex-rows": lambda q, k, v, kernel: flex_neighbourhood_attention(q, k, v, kernel, tiled=False),
    "reference": reference_neighbourhood_attention,
    "dense": dense_neighbourhood_attention,
    "fused": lambda q, k, v, kernel: fused_natten.fused_neighbourhood_attention(q, k, v, kernel, grid_rows=q.shape[2]),
}


_KERNELS_FILE = "recipes/stormscope/fused_natten.py"


def fused_at(rev: str):
    """The fused-kernel module as it was at git revision ``rev``, or as the file ``rev`` holds (a
    copy of it, where no git history is at hand: the GPU machine's checkout); our own code, so
    trusted. Loaded beside today's, its custom ops registered under a namespace of their own
    (``stormscope_at_<rev>``): torch.library refuses a second definition of an op's name."""
    import importlib.util
    import re
    import tempfile

    root = Path(__file__).resolve().parent.parent
    if Path(rev).is_file():
        source = Path(rev).read_text()
    else:
        source = subprocess.run(
            ["git", "show", f"{rev}:{_KERNELS_FILE}"], cwd=root, capture_output=True, text=True, check=True
        ).stdout
    tag = re.sub(r"\W", "_", rev)
    if source.count('"stormscope::') == 0 or "torch.ops.stormscope." in source:
        # (renamed, its ops must be its own: one it calls through torch.ops would be today's)
        raise ValueError(f"{rev}: its custom ops are not all named as '\"stormscope::NAME\"' strings")
    source = source.replace('"stormscope::', f'"stormscope_at_{tag}::')
    path = Path(tempfile.mkdtemp()) / f"fused_natten_at_{tag}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_one(a, name) -> None:
    """Child process: measure one implementation, print one RESULT line."""
    device = torch.device(a.device)
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    q, k, v = (
        torch.randn(a.batch, a.heads, *a.grid, a.head_dim, device=device, dtype=DTYPES[a.dtype], requires_grad=True)
        for _ in range(3)
    )
    if name.startswith("fused@"):  # (first: a path may hold a colon)
        old = fused_at(name[6:])
        IMPLS[name] = lambda q, k, v, kernel: old.fused_neighbourhood_attention(q, k, v, kernel, grid_rows=q.shape[2])
    elif ":" in name:  # fused:SPEC or fused:fwd=SPEC,dq=SPEC,dkdv=SPEC (some of them)
        name, tiles = name.split(":", 1)
        fused_natten.TILES.update(fused_natten.parse_tile_set(tiles))
        if "=" not in tiles:
            fused_natten.TILES_FP32 = fused_natten.Tiles.parse(tiles)  # (--dtype fp32)
    try:
        t, m, f = measure(IMPLS[name], q, k, v, a.kernel, a.iters, a.warmup)
    except Exception as e:  # noqa: BLE001 - OOM shows up as several exception types across devices
        if not is_oom(e):
            raise
        print("RESULT " + json.dumps({"oom": True}))
        return
    print("RESULT " + json.dumps({"s": t, "bytes": m, "forward_s": f}))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--grid", type=int, nargs=2, default=[16, 20], metavar=("ROWS", "COLS"), help="token grid")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=48)
    p.add_argument("--kernel", type=int, default=7)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, help="CPU threads (torch.set_num_threads); default: torch's choice")
    p.add_argument("--skip-dense", action="store_true", help="skip dense masked attention (O((HW)^2) memory)")
    p.add_argument("--impls", nargs="*", choices=sorted(IMPLS), help="which to run (default: all that run here)")
    p.add_argument("--fused-tiles", nargs="*", type=tile_variant, default=[], help="fused tile variants to add")
    p.add_argument("--fused-at", nargs="*", default=[], metavar="REV", help="fused kernels of git revisions, or files")
    p.add_argument("--best-tiles", type=Path, help="write the fastest fused tiles per kernel here")
    p.add_argument("--only", help=argparse.SUPPRESS)  # internal: the child's job
    a = p.parse_args(argv)
    if a.only:
        return run_one(a, a.only)

    device = torch.device(a.device)
    rows, cols = a.grid
    tokens = rows * cols
    print(
        f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), "
        f"torch {torch.__version__}, grid {rows}x{cols} = {tokens} tokens, kernel {a.kernel}, batch {a.batch}, "
        f"heads {a.heads}, head_dim {a.head_dim}, {a.dtype}; median of {a.iters} forward+backward"
        + ("" if device.type == "cuda" else f"; {a.threads or torch.get_num_threads()} CPU threads")
    )
    print(f"keys per query: neighbourhood {min(a.kernel, rows) * min(a.kernel, cols)}, dense {tokens}")

    names = a.impls or ["flex", "flex-128", "flex-rows", "fused", "reference"] + ([] if a.skip_dense else ["dense"])
    if device.type != "cuda":  # torch 2.13's CPU flex has no backward, so it cannot run forward+backward
        print("flex, fused: skipped (no flex_attention backward on CPU; the fused kernels need CUDA)")
        names = [n for n in names if not n.startswith(("flex", "fused"))]
    else:
        names += [f"fused:{t}" for t in a.fused_tiles] + [f"fused@{rev}" for rev in a.fused_at]
    results = {}
    for name in names:  # one process each: clean peaks, and an OOM (even the kernel's) cannot take us down
        cmd = [sys.executable, __file__, *_strip_lists(argv), "--only", name]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        res = json.loads(line[7:]) if line else None
        if res is None and proc.returncode in (-9, 137) or res and res.get("oom"):
            print(f"{name}: out of memory")
        elif res is None:
            print(f"{name}: failed (exit {proc.returncode})\n{proc.stderr[-2000:]}")
        else:
            results[name] = (res["s"], res["bytes"], res["forward_s"])
            # (as each finishes: a run stopped part-way keeps what it measured)
            print(
                f"  {name}: {res['forward_s'] * 1e3:.2f} ms forward, {res['s'] * 1e3:.2f} ms with backward", flush=True
            )

    dense = results.get("dense")
    flex = results.get("flex")
    print(
        f"{'impl':<22} {'fwd ms':>8} {'fwd+bwd ms':>11} {'peak MiB':>10} {'time/dense':>11} {'mem/dense':>10} "
        f"{'time/flex':>10}"
    )
    for name, (t, m, f) in results.items():
        tr = f"{t / dense[0]:.3f}" if dense else "-"
        mr = f"{m / dense[1]:.3f}" if dense and dense[1] > 0 else "-"
        fr = f"{t / flex[0]:.3f}" if flex else "-"
        print(f"{name:<22} {f * 1e3:>8.2f} {t * 1e3:>11.2f} {m / 2**20:>10.1f} {tr:>11} {mr:>10} {fr:>10}")
    if a.best_tiles:
        best = best_tiles(results)
        if best is None:
            print("--best-tiles: no fused run finished; nothing written")
        else:
            a.best_tiles.write_text(fused_natten.format_tile_set(best) + "\n")
            print(f"fastest fused tiles: {fused_natten.format_tile_set(best)} (written to {a.best_tiles})")


def tile_variant(text: str) -> str:
    """One ``--fused-tiles`` variant in its canonical notation: SPEC for the three kernels, or
    ``fwd=SPEC,dq=SPEC,dkdv=SPEC`` (some of them; the rest keep the defaults)."""
    try:
        if "=" in text:
            return fused_natten.format_tile_set(fused_natten.parse_tile_set(text))
        return str(fused_natten.Tiles.parse(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def best_tiles(results: dict) -> dict | None:
    """The fastest fused tiles per kernel among ``results`` (name -> (fwd+bwd s, bytes, fwd s)):
    the forward's by its time, the backward's two (measured together) by the remainder."""
    runs = {}
    for name, (t, _, f) in results.items():
        if name == "fused":
            runs[name] = (dict(fused_natten.TILES), t, f)
        elif name.startswith("fused:"):
            runs[name] = ({**fused_natten.TILES, **fused_natten.parse_tile_set(name[6:])}, t, f)
    if not runs:
        return None
    fwd = min(runs.values(), key=lambda r: r[2])[0]
    bwd = min(runs.values(), key=lambda r: r[1] - r[2])[0]
    return {"fwd": fwd["fwd"], "dq": bwd["dq"], "dkdv": bwd["dkdv"]}


def _strip_lists(argv: list[str]) -> list[str]:
    """The parent's arguments less the lists that pick runs (a child runs one, named by --only)."""
    out, skipping = [], False
    for x in argv:
        if x in ("--impls", "--fused-tiles", "--fused-at"):
            skipping = True
        elif skipping and x.startswith("--"):
            skipping = False
        if not skipping:
            out.append(x)
    return out


if __name__ == "__main__":
    main()
