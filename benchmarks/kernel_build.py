"""Build the fused neighbourhood-attention kernels for a GPU, on any machine, and report them.

Triton's interpreter (``TRITON_INTERPRET=1``, the CPU tests) runs a kernel's Python, not its
compilation: a kernel that computes the right numbers there may still fail to compile, spill
registers or miss the software pipelining on the GPU. This script takes the launches a real call
makes (CPU tensors of the chosen size, recorded instead of launched), specialises their arguments
as Triton's JIT would on a GPU (16-aligned pointers, integers divisible by 16, integers equal to 1),
compiles each kernel for the target with Triton's own ptxas, and prints per kernel: registers,
spilled bytes, shared memory, how many loads became asynchronous copies (cp.async or TMA: pipelined), and the PTX
instructions of its inner loop per score (and, with Triton's nvdisasm, the machine instructions of its
main loop a thread, and the integer divisions among them). At head dim 48 the softmax and masking arithmetic, not
the products, sets these kernels' pace, so the last figure is the one to lower. With ``/full``
tiles, a tile inside every window on an axis skips that axis' window test: the figure is then the
average over the loop's paths (both tests, one, none; each counted through the loop's PTX control
flow), weighted by the share of tiles taking each at this size (the paths are printed).

    python benchmarks/kernel_build.py                                   # StormScope's layer, bf16, sm90
    python benchmarks/kernel_build.py --grid 128 160 --heads 16 --head-dim 48 --tiles 8x16/8x8/8/3

No GPU needed (ptxas ships with Triton's NVIDIA backend). Figures for the GPU's own Triton may
differ from this machine's where the versions differ.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from recipes.stormscope import fused_natten  # noqa: E402
from recipes.stormscope.natten import window_starts  # noqa: E402

KERNELS = ("_fna_forward", "_fna_backward_dq", "_fna_backward_dkdv")  # the tiled ones
DELTA = "_fna_delta"  # the backward's rowsum(dO * O) without a dQ kernel (/atomic): no tiles, no loop
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_OPTIONS = ("num_warps", "num_stages", "maxnreg")


class _Recorder:
    """Stands in for a kernel: ``kernel[grid](*args, **kw)`` records the call instead."""

    def __init__(self, kernel, calls: list):
        self.kernel, self.calls = kernel, calls

    def __getitem__(self, grid):
        return lambda *args, **kw: self.calls.append((self.kernel, grid, args, kw))


@contextlib.contextmanager
def recorded_launches():
    """Within: the fused kernels' launches are recorded into the yielded list, not run."""
    calls: list = []
    saved = {name: getattr(fused_natten, name) for name in (*KERNELS, DELTA)}
    for name, kernel in saved.items():
        setattr(fused_natten, name, _Recorder(kernel, calls))
    try:
        yield calls
    finally:
        for name, kernel in saved.items():
            setattr(fused_natten, name, kernel)


def source(kernel, args, kw):
    """The ASTSource of one launch, specialised as the JIT would specialise it on a GPU."""
    from triton.compiler import ASTSource

    names = kernel.arg_names
    constants = {n: v for n, v in kw.items() if n not in _OPTIONS}
    signature, attrs = {}, {}
    for i, (name, value) in enumerate(zip(names, args)):
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + _TYPES[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif type(value).__name__ == "TensorDescriptor":  # a host-side TMA descriptor
            block = ",".join(map(str, value.block_shape))
            signature[name] = f"tensordesc<{_TYPES[value.base.dtype]}[{block}]>"
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            if value == 1:
                signature[name], constants[name] = "constexpr", 1
                continue
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{name}: cannot specialise {type(value).__name__}")
    for name in constants:
        signature[name] = "constexpr"
    return ASTSource(kernel, signature, constants, attrs)


def report(kernel, args, kw, arch: int) -> dict:
    """Compile one launch for sm``arch``; registers, spills, shared memory, pipelined loads."""
    import triton
    from triton.backends.compiler import GPUTarget

    options = {k: kw[k] for k in _OPTIONS if k in kw}
    compiled = triton.compile(source(kernel, args, kw), target=GPUTarget("cuda", arch, 32), options=options)
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    # the newest ptxas Triton ships reads the PTX versions its LLVM writes
    ptxas = next(p for p in (bin_dir / "ptxas-blackwell", bin_dir / "ptxas") if p.exists())
    ptx = Path(os.environ.get("TMPDIR", "/tmp")) / f"kernel_build_{os.getpid()}.ptx"
    ptx.write_text(compiled.asm["ptx"])
    try:
        suffix = "a" if arch >= 90 else ""
        out = subprocess.run(
            [str(ptxas), "-v", f"-arch=sm_{arch}{suffix}", str(ptx), "-o", os.devnull], capture_output=True, text=True
        )
    finally:
        ptx.unlink(missing_ok=True)
    if out.returncode:
        raise RuntimeError(f"ptxas failed for {kernel.__name__}: {out.stderr[-2000:]}")
    regs = re.search(r"Used (\d+) registers", out.stderr)
    spills = re.search(r"(\d+) bytes spill stores", out.stderr)
    ttgir = compiled.asm["ttgir"]
    loop = main_loop_sass(compiled.asm["cubin"], bin_dir / "nvdisasm")
    tested = untested = one_axis = None
    if "QH" in kw:  # a tiled kernel (not the delta kernel)
        per_score = 32 * options["num_warps"] / (kw["QH"] * kw["QW"] * kw["KH"] * kw["KW"])  # scores per loop pass
        paths = [n * per_score for n in loop_paths(compiled.asm["ptx"])]
        tested, untested = paths[-1], paths[0]
        if len(paths) > 2:  # the rows' test and the columns' apart: the paths with one of them
            one_axis = sum(paths[1:-1]) / len(paths[1:-1])
    return {
        "kernel": kernel.__name__,
        "registers": int(regs.group(1)) if regs else None,
        "spill_bytes": int(spills.group(1)) if spills else None,
        # local-memory loads and stores in the main loop's machine code: spills it pays per tile
        "loop_local_accesses": None if loop is None else sum(bool(re.search(r"\b(LDL|STL)\b", i)) for i in loop),
        "loop_sass": None if loop is None else len(loop),  # machine instructions a thread, once around
        # integer divisions by a runtime value, which SASS does in software (a reciprocal's
        # approximation, I2F.RP, then fix-ups: about 25 instructions each)
        "loop_divisions": None if loop is None else sum("I2F" in i and ".RP" in i for i in loop),
        "shared_bytes": compiled.metadata.shared,
        # ptxas's advisory C7515: it serialised the warp-group products (an instruction other than a
        # product writes to their accumulators within a pipeline stage), each waited for at once
        "wgmma_serialized": "C7515" in out.stderr,
        "atomics": len(re.findall(r"\b(?:red|atom)\.global", compiled.asm["ptx"])),  # /atomic's dQ adds, by threads
        "bulk_reductions": compiled.asm["ptx"].count("cp.reduce.async.bulk"),  # ... by the copy engine (/tma)
        "async_loads": ttgir.count("async_copy_global_to_local"),  # cp.async, pipelined
        # cp.async copies under 16 bytes in the PTX (prologue and loop): a per-query value loaded in
        # the layout its scores use is copied once for every thread that needs it, 4 bytes at a time
        "narrow_copies": len(
            re.findall(
                r"cp\.async\.c[ag]\.shared\.global\s*\[[^\]]*\],\s*\[[^\]]*\],\s*(?:0x[48]|[48])\b", compiled.asm["ptx"]
            )
        ),
        "tma_loads": ttgir.count("async_tma_copy_global_to_local"),  # the copy engine's, pipelined
        # Hopper's warp-group MMA, the older per-warp MMA, or none (float32 "ieee" products run on FMAs)
        "tensor_core": "wgmma" if "warp_group_dot" in ttgir else ("mma" if "nvidia_mma" in ttgir else "none"),
        "instructions_per_score": tested,  # every tile through the window test
        "full_tile_instructions_per_score": untested,  # a tile inside every window (FULL), else the same
        "one_axis_instructions_per_score": one_axis,  # a tile testing rows or columns only (None: no such path)
        **options,
    }


def _loops(code: str, label: str, branch: str) -> list[list[str]]:
    """The spans of ``code``'s lines from a label (``label`` matches its line, group 1 its name) to
    a branch back to it (``branch`` searches the line, group 1 the name): the loops."""
    lines = code.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(label, line))}
    return [
        lines[labels[m.group(1)] : i]
        for i, line in enumerate(lines)
        if (m := re.search(branch, line)) and labels.get(m.group(1), i) < i
    ]


_SASS_INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+[@A-Z]")  # an instruction's line in nvdisasm's listing


def main_loop_sass(cubin: bytes, nvdisasm: Path) -> list[str] | None:
    """The SASS instructions of the kernel's main loop, the loop with the most products (None
    without nvdisasm; empty without a loop)."""
    if not nvdisasm.exists():
        return None
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"kernel_build_{os.getpid()}.cubin"
    path.write_bytes(cubin)
    try:
        sass = subprocess.run([str(nvdisasm), "-c", str(path)], capture_output=True, text=True, check=True).stdout
    finally:
        path.unlink(missing_ok=True)
    loops = _loops(sass, r"\s*\.(L_x_\d+):", r"\bBRA\b.*?\.(L_x_\d+)")
    if not loops:
        return []
    # Hopper's barrier-wait stubs branch back into the middle of the loop: of the spans with the
    # most products (tensor-core ones, else FMAs), the shortest is the loop itself
    products = re.compile(r"\b(HGMMA|HMMA)\b" if "MMA" in sass else r"\bFFMA\b")
    body = max(loops, key=lambda span: (sum(bool(products.search(line)) for line in span), -len(span)))
    return [line for line in body if _SASS_INSTRUCTION.match(line)]


_INSTRUCTION = re.compile(r"\s+(@!?%p\d+\s+)?[a-z]")  # a PTX instruction's line (not a label, .loc or comment)
_BRANCH = re.compile(r"^\s+(@!?%p\d+\s+)?bra(?:\.uni)?\s+(\$L__BB\w+);")


def _blocks(ptx: str) -> tuple[list[list[str]], list[list[int]]]:
    """The PTX's basic blocks (their lines) and each one's successors (indices): a block begins at
    a branch target's label or after a branch, and falls through unless its branch is unconditional.
    (Inline assembly's own local loops, Hopper's barrier waits, count as straight-line code.)"""
    blocks: list[list[str]] = [[]]
    labels: dict[str, int] = {}
    for line in ptx.splitlines():
        if m := re.match(r"(\$L__BB\w+):", line):
            if blocks[-1]:
                blocks.append([])
            labels[m.group(1)] = len(blocks) - 1
        blocks[-1].append(line)
        if _BRANCH.match(line):
            blocks.append([])
    successors = []
    for i, lines in enumerate(blocks):
        m = next((m for line in lines if (m := _BRANCH.match(line))), None)
        nxt = [i + 1] if i + 1 < len(blocks) else []
        successors.append(nxt if m is None else [labels[m.group(2)], *(nxt if m.group(1) else [])])
    return blocks, successors


def loop_paths(ptx: str) -> list[int]:
    """PTX instructions per thread of each path once around the inner loop (the loop with the most
    matrix products), shortest first: one path, or one for each combination of the loop's
    branches (the window test's, per axis, with ``/full`` tiles)."""
    blocks, successors = _blocks(ptx)
    sizes = [sum(bool(_INSTRUCTION.match(line)) for line in b) for b in blocks]
    products = [sum("mma" in line for line in b) for b in blocks]
    cycles: list[tuple[int, int]] = []  # (products, instructions) of each simple cycle

    def walk(head: int, at: int, seen: set, mma: int, n: int) -> None:
        for s in successors[at]:
            if s == head:
                cycles.append((mma, n))
            elif s not in seen and s > head:  # each cycle once, from its first block
                walk(head, s, seen | {s}, mma + products[s], n + sizes[s])

    for head in range(len(blocks)):
        walk(head, head, {head}, products[head], sizes[head])
    most = max(m for m, _ in cycles)
    return sorted(n for m, n in cycles if m == most)


def full_tile_share(grid, kernel: int, tiles: fused_natten.Tiles, backward_kv: bool) -> float:
    """The share of the loop's tiles that lie inside every window of the program's tile (and skip
    the window test with ``/full``), at this size on one band. ``backward_kv``: the dK/dV
    kernel's query tiles around a key tile, else the forward's (and dQ's) key tiles around a
    query tile."""
    rows, cols = full_axis_shares(grid, kernel, tiles, backward_kv)
    return rows * cols


def full_axis_shares(grid, kernel: int, tiles: fused_natten.Tiles, backward_kv: bool) -> tuple[float, float]:
    """Per axis, the share of the loop's tiles inside every window on that axis (which skip that
    axis' test with ``/full``): the kernels' tiling, row and column alike. A tile is inside on both
    axes in the product of the two shares, as programs and their loops' tiles are products of
    rows and columns."""
    if not tiles.full:
        return 0.0, 0.0
    shares = []
    for n, q, k in zip(grid, (tiles.qh, tiles.qw), (tiles.kh, tiles.kw)):
        span = min(kernel, n)
        starts = window_starts(torch.arange(n), kernel, n).tolist()  # non-decreasing

        def origin(lo, first_full, hi, t):  # the kernels' _aligned_origin
            o = lo - (t - (first_full - lo) % t) % t
            return o if o >= 0 and -((o - hi) // t) == -((lo - hi) // t) else lo

        f = m = 0
        if backward_kv:  # key tiles of k, each against the query tiles whose windows reach it
            for k0 in range(0, n, k):
                last = min(k0 + k, n) - 1
                # the queries whose windows reach the tile, and those whose windows hold it, [a, b]
                first, hi = bisect.bisect_left(starts, k0 - span + 1), bisect.bisect_right(starts, last)
                a, b = bisect.bisect_left(starts, last - span + 1), bisect.bisect_right(starts, k0) - 1
                o = origin(first, a, hi, q)
                for r in range(o, hi, q):
                    m += 1
                    f += r >= a and r + q - 1 <= b
        else:  # query tiles of q, each against the key tiles of its windows' union
            for r0 in range(0, n, q):
                lo, hi = starts[r0], starts[min(r0 + q, n) - 1] + span
                o = origin(lo, hi - span, hi, k)
                for r in range(o, hi, k):
                    m += 1
                    f += r >= hi - span and r + k <= lo + span
        shares.append(f / m)
    return shares[0], shares[1]


# Shared memory an SM holds for programs (KiB; each program also takes 1 KiB the runtime reserves).
SHARED_KIB = {80: 164, 86: 100, 87: 164, 89: 100, 90: 228}


def programs_an_sm(r: dict, warps: int, arch: int) -> tuple[int, int]:
    """How many programs of a report's kernel fit an SM (64 K registers), by its registers
    (allocated 8 a thread) and by its shared memory."""
    by_registers = 65536 // (-(-r["registers"] // 8) * 8 * 32 * warps)
    return by_registers, SHARED_KIB[arch] * 1024 // (r["shared_bytes"] + 1024)


def one_axis_share(f_r: float, f_c: float) -> float:
    """The share of tiles inside every window on exactly one axis, of ``f_r`` on rows and ``f_c``
    on columns (independent: a tile's row and column are)."""
    return f_r + f_c - 2 * f_r * f_c


def mean_instructions(r: dict, f_r: float, f_c: float) -> float:
    """A report's instructions per score over the loop's tiles, ``f_r``, ``f_c`` of them inside every
    window on rows, on columns (``full_axis_shares``). The two one-axis paths are taken as their
    mean (exact where the shares are equal, as they nearly are at the preset's size)."""
    both, none = r["instructions_per_score"], r["full_tile_instructions_per_score"]
    one = r["one_axis_instructions_per_score"]
    if one is None:  # one test for both axes
        return both * (1 - f_r * f_c) + none * f_r * f_c
    return both * (1 - f_r) * (1 - f_c) + one * one_axis_share(f_r, f_c) + none * f_r * f_c


def parse_tiles(text: str) -> fused_natten.Tiles:
    """``Tiles.parse`` for argparse (its message kept); the notation of every benchmark here."""
    try:
        return fused_natten.Tiles.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def launches(grid, heads, head_dim, kernel, batch, dtype, tiles=None, packed: bool = True, arch: int = 90) -> list:
    """The recorded launches of one forward and backward at this size on an sm``arch`` GPU
    (``tiles`` for the three tiled kernels, else that GPU's defaults; with ``/atomic`` dK/dV
    tiles the backward's delta kernel is among them, else the dQ kernel sums rowsum(dO * O)
    itself); ``packed``: as the DiT's whole grid calls them (the projection's bias gradient summed
    by the backward kernels), else on q, k, v views (rope, bands)."""
    saved, saved_fp32 = dict(fused_natten.TILES), fused_natten.TILES_FP32
    if tiles is not None:
        fused_natten.TILES.update(fwd=tiles, dq=tiles, dkdv=tiles)
        fused_natten.TILES_FP32 = tiles
    else:
        fused_natten.TILES.update({n: fused_natten.tiles_on(n, divmod(arch, 10)) for n in saved})
    if not fused_natten.copy_engine(divmod(arch, 10)):
        fused_natten.TILES.update({n: t._replace(tma=False) for n, t in fused_natten.TILES.items()})
    try:
        with recorded_launches() as calls:
            rows, cols = grid
            # as the DiT calls them: one (B, rows, cols, 3, heads, d) projection whole, its bias's
            # gradient summed by the backward kernels
            qkv = torch.empty(batch, rows, cols, 3, heads, head_dim, dtype=dtype)
            if packed:
                out, lse = fused_natten.natten_packed_forward(qkv, None, kernel)
                fused_natten.natten_packed_backward(torch.empty_like(out), qkv, out, lse, kernel, True)
            else:
                q, k, v = qkv.permute(3, 0, 4, 1, 2, 5)
                out, lse = fused_natten.natten_forward(q, k, v, kernel, 0, 0, rows)
                fused_natten.natten_backward(torch.empty_like(out), q, k, v, out, lse, kernel, 0, 0, rows)
    finally:
        fused_natten.TILES.clear()
        fused_natten.TILES.update(saved)
        fused_natten.TILES_FP32 = saved_fp32
    return calls


def layer_arguments(p: argparse.ArgumentParser) -> None:
    """The attention layer's size, the StormScope preset's by default (batch 4, 16 heads of 48,
    128 x 160 tokens, 31 x 31 windows)."""
    p.add_argument("--grid", type=int, nargs=2, default=[128, 160], metavar=("ROWS", "COLS"), help="token grid")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=48)
    p.add_argument("--kernel", type=int, default=31)
    p.add_argument("--batch", type=int, default=4)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    layer_arguments(p)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 (H100/H200), 80 (A100)")
    p.add_argument(
        "--tiles",
        type=parse_tiles,
        nargs="*",
        default=[None],
        help="QHxQW/KHxKW[/warps[/stages]][/pad][/tma][/full][/atomic][/rN]",
    )
    a = p.parse_args(argv)
    for tiles in a.tiles:
        label = "the defaults" if tiles is None else str(tiles)
        print(f"tiles {label}: sm{a.arch}, {a.dtype}, grid {a.grid[0]}x{a.grid[1]}, {a.heads} heads of {a.head_dim}")
        for kernel, _, args, kw in launches(
            a.grid, a.heads, a.head_dim, a.kernel, a.batch, DTYPES[a.dtype], tiles, arch=a.arch
        ):
            r = report(kernel, args, kw, a.arch)
            if r["kernel"] == DELTA:
                print(f"  {r['kernel']:<20} {r['registers']:>4} registers, {r['spill_bytes']:>4} B spilled")
                continue
            tiles_of = fused_natten.Tiles(kw["QH"], kw["QW"], kw["KH"], kw["KW"], full=kw["FULL"])
            f_r, f_c = full_axis_shares(a.grid, a.kernel, tiles_of, r["kernel"] == "_fna_backward_dkdv")
            mean = mean_instructions(r, f_r, f_c)
            one = r["one_axis_instructions_per_score"]
            paths = (
                f" ({r['instructions_per_score']:.1f} tested"
                + (f", {one:.1f} on the {one_axis_share(f_r, f_c):.0%} of tiles tested on one axis" if one else "")
                + f", {r['full_tile_instructions_per_score']:.1f} on the {f_r * f_c:.0%} of tiles inside every window)"
                if f_r * f_c
                else ""
            )
            in_loop, known = r["loop_local_accesses"], a.arch in SHARED_KIB
            print(
                f"  {r['kernel']:<20} {r['registers']:>4} registers, {r['spill_bytes']:>4} B spilled"
                + (f" ({in_loop} local loads/stores in the loop), " if in_loop else ", ")
                + f"{r['shared_bytes'] / 1024:>5.1f} KiB shared, "
                f"{r['async_loads']} async + {r['tma_loads']} TMA loads ({r['narrow_copies']} copies under 16 B), "
                f"{r['tensor_core']}, "
                f"{r.get('num_warps')} warps, {r.get('num_stages')} stages, "
                + (f"{min(programs_an_sm(r, kw['num_warps'], a.arch))} programs an SM, " if known else "")
                + (f"at most {r['maxnreg']} registers, " if r.get("maxnreg") else "")
                + (f"{r['atomics']} atomic adds (dQ), " if r["atomics"] else "")
                + (f"{r['bulk_reductions']} bulk reductions (dQ), " if r["bulk_reductions"] else "")
                + f"{mean:.1f} instructions/score{paths}"
                + (f", loop {r['loop_sass']} SASS a thread" if r["loop_sass"] else "")
                + (f" ({r['loop_divisions']} software divisions)" if r["loop_divisions"] else "")
                + (", ptxas SERIALISED its warp-group products (C7515)" if r["wgmma_serialized"] else "")
            )


if __name__ == "__main__":
    main()
