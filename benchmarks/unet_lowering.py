"""The regression SongUNet's compiled blocks for an H200, generated on any machine: what each
block's inductor kernels move per training step.

``trainer.compile=true`` compiles each distinct (block, input shapes) signature once and replays it
for every unit that meets it (55 UNetBlocks in 22 signatures at the preset's size). This script
runs the preset's network (``recipe=stormcast``: 512x640, 127 -> 99 channels, dropout 0.1) on fake
tensors to find those signatures and how many units share each, compiles one unit of each as the
trainer does on CUDA (bf16 autocast, channels-last activations, the fused GroupNorm kernels,
inductor's joint-graph passes with the framework's recompute marks, AOTAutograd's min-cut
partition at the chosen memory budget), and has inductor lower and generate the forward's and the
backward's code for an H200 (``hopper_lowering.py``): nothing runs on a GPU. It adds up inductor's
estimate of each Triton kernel's traffic, times the units that replay it. The convolutions
(cuDNN) and the fused GroupNorm's custom ops are calls outside these figures.

    python benchmarks/unet_lowering.py                          # the preset, batch 4, level 1's norms recomputed
    python benchmarks/unet_lowering.py --levels 1 2 --top 8
    python benchmarks/unet_lowering.py --batch 1 --grid 64 80 --json

Traced under CPU autocast (which casts as CUDA's does for these layers) and without inductor's
post-grad passes: an estimate of the GPU's graphs, not a copy of them.
"""

from __future__ import annotations

import os

# The fused GroupNorm's custom ops are traced where their kernels could run: on CPU, under
# Triton's interpreter, which must be chosen before Triton is imported (nothing is launched).
os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import collections  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from unittest import mock  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault(
    "FRAMEWORK_RECIPES", "recipes.weather.registry,recipes.stormcast.registry,recipes.stormscope.registry"
)
from benchmarks import hopper_lowering  # noqa: E402

BANDWIDTH = 4.8e12  # H200, bytes/s
H200_SMS = 132
PRESET = dict(model_channels=128, channel_mult=[1, 2, 2, 2, 2], num_blocks=4, attn_resolutions=[])


class _OnH200:
    """What ``fused_norm._chunks`` reads of a tensor, for a tensor on the H200."""

    is_cuda = True

    def __init__(self, device):
        self.device = device


@contextlib.contextmanager
def _h200_chunks():
    """The fused GroupNorm splits its reductions into chunks by the GPU's SM count (a CPU tensor:
    4). The traced graph holds that count (the partial sums' shapes), and inductor re-derives the
    custom ops' output shapes for the GPU: both must be an H200's 132."""
    from recipes.stormcast import fused_norm

    chunks = fused_norm._chunks
    with (
        mock.patch.object(fused_norm, "_multiprocessors", lambda device: H200_SMS),
        mock.patch.object(fused_norm, "_chunks", lambda x, *args: chunks(_OnH200(x.device), *args)),
    ):
        yield


def signatures(batch: int, grid: tuple[int, int], levels: list[int], dropout: float):
    """The network (on fake tensors), and its compiled units' distinct signatures in call order:
    [(name, unit, args, kwargs, units sharing it)], args and kwargs fake tensors of the shapes met."""
    from framework import compat, registry
    from framework.distributed.sharding import find_units
    from framework.train.compile import named_regions
    from framework.train.precompile import signature
    from recipes.stormcast.config import SongUNetConfig
    from recipes.stormcast.layers import set_compiled_form

    cfg = SongUNetConfig(**PRESET, dropout=dropout, recompute_norm_levels=levels)
    fake = compat.fake_mode()
    with fake:
        model = registry.models.build("songunet", cfg, in_channels=127, out_channels=99, img_resolution=grid)
    set_compiled_form(model, "fused")  # what the GPU's compiled blocks run (model.compiled_norm=auto, CUDA graphs)
    units = find_units(model, [])
    units += named_regions(model, units)
    seen: dict[tuple, list] = {}
    name_of = {id(u): n for n, u in units}

    def record(module, args, kwargs):
        key = signature(module, args, kwargs)
        if key not in seen:
            seen[key] = [name_of[id(module)], module, args, kwargs, 0]
        seen[key][4] += 1

    handles = [u.register_forward_pre_hook(record, with_kwargs=True) for _, u in units]
    try:
        with fake, torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            model(torch.randn(batch, 127, *grid))
    finally:
        for h in handles:
            h.remove()
    return model, [tuple(v) for v in seen.values()]


def lower_unet(batch=4, grid=(512, 640), levels=(1,), dropout=0.1, memory_budget=1.0, units=None) -> dict:
    """{"units": [{"name", "shapes", "count", "forward": {...}, "backward": {...}}]}, each graph
    {"kernels": [[name, GB], ...], "calls": [...], "error": ...} as ``block_lowering.lower_block``.
    ``units``: the names of the units to lower (the first of their signature; default: all)."""
    with _h200_chunks():
        return _lower_unet(batch, grid, levels, dropout, memory_budget, units)


def _lower_unet(batch, grid, levels, dropout, memory_budget, units) -> dict:
    from torch._inductor import config as inductor_config

    from framework.train.compile import RecomputeOps, canonical, recomputed_ops, set_memory_budget

    model, found = signatures(batch, tuple(grid), list(levels), dropout)
    set_memory_budget(memory_budget)
    options = dict(joint_custom_pre_pass=RecomputeOps(recomputed_ops(model)), force_layout_optimization=True)
    out = []
    for name, unit, args, kwargs, count in found:
        if units is not None and name not in units:
            continue
        args = tuple(canonical(a, True) for a in args)  # as RegionForward hands them over
        kwargs = {k: canonical(v, True) for k, v in kwargs.items()}
        entry = {"name": name, "shapes": [list(a.shape) for a in args if torch.is_tensor(a)], "count": count}
        with inductor_config.patch(options):
            graphs = hopper_lowering.trace_graphs(type(unit).forward, unit, *args, **kwargs)
            for part, (graph, inputs) in zip(("forward", "backward"), graphs):
                entry[part] = hopper_lowering.lower_kernels(graph, inputs)
        out.append(entry)
    return {"units": out}


def _report(result: dict, a: argparse.Namespace) -> None:
    print(
        f"torch {torch.__version__}, the regression SongUNet's compiled units for an H200 without one: "
        f"batch {a.batch}, {a.grid[0]}x{a.grid[1]}, dropout {a.dropout}, norms of levels {a.levels} recomputed, "
        f"memory budget {a.memory_budget}, bf16 autocast, channels-last"
    )
    print(f"{'unit (first of its signature)':34} {'inputs':26} {'x':>3} {'fwd GB':>7} {'bwd GB':>7} {'ms/step':>8}")
    totals: collections.Counter = collections.Counter()
    largest: collections.Counter = collections.Counter()
    for u in result["units"]:
        gb = {}
        for part in ("forward", "backward"):
            r = u[part]
            if r["error"]:
                print(f"{u['name']}: {part} failed: {r['error']}")
            gb[part] = sum(g for _, g in r["kernels"])
            totals[part] += gb[part] * u["count"]
            for kernel, g in r["kernels"]:
                largest[f"{u['name']} {part[:3]} {kernel}"] += g * u["count"]
        ms = (gb["forward"] + gb["backward"]) * u["count"] * 1e9 / BANDWIDTH * 1e3
        shape = "x".join(map(str, u["shapes"][0]))
        print(f"{u['name']:34} {shape:26} {u['count']:>3} {gb['forward']:7.3f} {gb['backward']:7.3f} {ms:8.2f}")
    total = totals["forward"] + totals["backward"]
    print(
        f"per step: {totals['forward']:.1f} GB forward + {totals['backward']:.1f} GB backward in Triton kernels, "
        f"at least {total * 1e9 / BANDWIDTH * 1e3:.1f} ms at {BANDWIDTH / 1e12:.1f} TB/s"
    )
    for kernel, g in largest.most_common(a.top):
        print(f"  {g:8.2f} GB/step  {kernel}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--grid", type=int, nargs=2, default=[512, 640], metavar=("ROWS", "COLS"))
    p.add_argument("--levels", type=int, nargs="*", default=[1], help="model.recompute_norm_levels")
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--memory-budget", type=float, default=1.0, help="trainer.compile_memory_budget")
    p.add_argument("--units", nargs="*", help="lower only these units (e.g. enc.512_block0)")
    p.add_argument("--top", type=int, default=5, help="kernels listed per step, the largest first")
    p.add_argument("--json", action="store_true", help="print one line of JSON")
    a = p.parse_args(argv)
    result = lower_unet(a.batch, tuple(a.grid), a.levels, a.dropout, a.memory_budget, a.units)
    print(json.dumps(result)) if a.json else _report(result, a)


if __name__ == "__main__":
    main()
