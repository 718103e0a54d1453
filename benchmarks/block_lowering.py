"""A compiled DiT block's kernels for an H200, generated on any machine: what each one moves.

The DiT trains with each block compiled (``trainer.compile=true``) under bf16 autocast. This
script compiles one ``DiTBlock`` as the trainer would (dynamo, AOTAutograd with inductor's
decompositions and its min-cut partitioner), traced with fake tensors at the chosen size, and
has inductor lower and generate the forward's and the backward's code for an H200
(``hopper_lowering.py``): no GPU is needed and nothing runs. It prints each Triton kernel with
inductor's estimate of the bytes it reads and writes, the bandwidth-bound custom ops (the MLP's
``stormscope::bias_gelu``, the gated residual and norm ops of ``recipes/stormscope/residual.py``)
with theirs, and the calls outside them (cuBLAS's matrix products,
the attention's custom ops). At the fused attention's size the pointwise and
norm kernels are bandwidth-bound, so their traffic over the GPU's bandwidth (4.8 TB/s) is a
floor on their time; the matrix products and the attention are not in these figures.

    python benchmarks/block_lowering.py                                # the StormScope preset's block, batch 4
    python benchmarks/block_lowering.py --batch 1 --grid 32 40 --top 5
    python benchmarks/block_lowering.py --residual-impl torch       # the residuals and norm as inductor's kernels
    python benchmarks/block_lowering.py --mlp-impl torch            # inductor's kernels throughout

``--json``: one line of JSON (for tests). The default partitioner's choices, not a memory
budget's (``trainer.memory_budget``); the attention is the fused kernels' custom op.
"""

from __future__ import annotations

import os

# The fused attention's custom op is traced where its kernels could run: on CPU, that is under
# Triton's interpreter, which must be chosen before Triton is imported (nothing is launched).
os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import hopper_lowering  # noqa: E402

BANDWIDTH = 4.8e12  # H200, bytes/s


def _graphs(batch: int, grid: tuple[int, int], hidden: int, heads: int, kernel: int, rope: bool, impls: dict) -> list:
    """The block's forward and backward graphs (AOTAutograd's, as inductor receives them) with
    their example inputs, traced with fake tensors under bf16 autocast. The block's inputs are
    bf16, as the DiT's blocks receive them under autocast (the patch embedding's convolution and
    every block's residual sum are bf16)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from recipes.stormscope.dit import DiTBlock

    with FakeTensorMode():
        block = DiTBlock(hidden, heads, 4.0, kernel, rope=rope, impl="fused", **impls)
        x = torch.randn(batch, *grid, hidden, dtype=torch.bfloat16, requires_grad=True)
        c = torch.randn(batch, hidden, dtype=torch.bfloat16)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return hopper_lowering.trace_graphs(block, x, c)


# Custom ops whose kernels are elementwise or reduce over a token's channels, so bandwidth-bound
# like inductor's: their traffic (inputs read, outputs written) joins the kernels' (the
# attention's and the products' do not).
ELEMENTWISE_OPS = (
    "stormscope::bias_gelu",
    "stormscope::bias_gelu_backward",
    "stormscope::gated_residual",
    "stormscope::gated_residual_backward",
    "stormscope::residual_norm",
    "stormscope::residual_norm_backward",
)


def _nbytes(value) -> int:
    values = value if isinstance(value, (tuple, list)) else [value]
    return sum(v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor))


def elementwise_op_traffic(graph: torch.fx.GraphModule) -> list[list]:
    """[[op, GB], ...] of the graph's calls to ``ELEMENTWISE_OPS``: its tensor arguments' bytes and
    its outputs' (from the traced graph's fake tensors)."""
    out = []
    for node in graph.graph.nodes:
        name = getattr(getattr(node.target, "_schema", None), "name", None)
        if node.op == "call_function" and name in ELEMENTWISE_OPS:
            args = [a.meta.get("val") for a in node.all_input_nodes]
            out.append([name, (_nbytes(args) + _nbytes(node.meta.get("val"))) / 1e9])
    return out


def lower_block(batch=4, grid=(128, 160), hidden=768, heads=16, kernel=31, rope=False, **impls) -> dict:
    """{"forward"/"backward": {"kernels": [[name, GB], ...], "calls": [...], "error": ...}}; the
    kernels are inductor's and those of ``ELEMENTWISE_OPS``. ``impls``: the block's ``mlp_impl``,
    ``residual_impl``."""
    graphs = _graphs(batch, grid, hidden, heads, kernel, rope, impls)
    out = {}
    for name, g in zip(("forward", "backward"), graphs):
        out[name] = hopper_lowering.lower_kernels(*g)
        out[name]["kernels"] += elementwise_op_traffic(g[0])
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--grid", type=int, nargs=2, default=[128, 160], metavar=("ROWS", "COLS"), help="token grid")
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kernel", type=int, default=31)
    p.add_argument("--depth", type=int, default=16, help="blocks per model, for the per-step figure")
    p.add_argument("--rope", action="store_true")
    p.add_argument("--mlp-impl", default="fused", choices=("fused", "torch"), help="the MLP's bias + GELU")
    p.add_argument("--residual-impl", default="fused", choices=("fused", "torch"), help="the gated residuals and norm")
    p.add_argument("--top", type=int, default=12, help="kernels listed per graph, the largest first")
    p.add_argument("--json", action="store_true", help="print one line of JSON")
    a = p.parse_args(argv)
    impls = dict(mlp_impl=a.mlp_impl, residual_impl=a.residual_impl)
    result = lower_block(a.batch, tuple(a.grid), a.hidden, a.heads, a.kernel, a.rope, **impls)
    if a.json:
        print(json.dumps(result))
        return
    print(
        f"torch {torch.__version__}, a DiT block for an H200 without one: batch {a.batch}, {a.grid[0]}x{a.grid[1]} "
        f"tokens, hidden {a.hidden}, {a.heads} heads, kernel {a.kernel}, bf16 autocast, MLP {a.mlp_impl}, "
        f"residuals {a.residual_impl}"
    )
    total = 0.0
    for name, r in result.items():
        if r["error"]:
            print(f"{name}: failed: {r['error']}")
            continue
        gb = sum(g for _, g in r["kernels"])
        total += gb
        print(
            f"{name}: {len(r['kernels'])} Triton kernels, {gb:.3f} GB ({gb * 1e9 / BANDWIDTH * 1e3:.2f} ms at "
            f"{BANDWIDTH / 1e12:.1f} TB/s); calls: {', '.join(r['calls'])}"
        )
        for kernel, g in sorted(r["kernels"], key=lambda k: -k[1])[: a.top]:
            print(f"  {g:8.3f} GB  {kernel}")
    print(
        f"per step ({a.depth} blocks): {total * a.depth:.1f} GB in Triton kernels, at least "
        f"{total * a.depth * 1e9 / BANDWIDTH * 1e3:.1f} ms"
    )


if __name__ == "__main__":
    main()
