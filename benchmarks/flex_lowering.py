"""Lower compiled flex_attention for a Hopper GPU on any machine: the kernel candidates inductor keeps.

Inductor picks flex's kernel templates (flex_attention, flex_decoding, the backward) and their
candidate tile configurations while it lowers the graph, before anything runs; a template left
with no candidate fails the compile (``NoValidChoicesError: No choices exist for backend``). This
script traces one flex forward and backward at the chosen size on CPU, then runs inductor's
lowering of that graph for a CUDA device that reports itself as an H200 (``hopper_lowering.py``):
no kernel is built or run, so no GPU is needed. It prints each template inductor asked
to choose among and how many candidates it had, or the error that stopped the lowering.

    python benchmarks/flex_lowering.py --block 64 --tokens 72 --head-dim 16            # flex's defaults
    python benchmarks/flex_lowering.py --block 64 --tokens 72 --head-dim 16 --natten   # the DiT's options

``--natten``: the kernel options ``recipes/stormscope/natten.py`` passes on Hopper for these
blocks and heads; ``--options JSON`` any others. ``--json``: one line of JSON (for tests).
Figures are this machine's torch's; the GPU's may differ where the versions do.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import hopper_lowering  # noqa: E402


def _graph(block: int, tokens: int, head_dim: int, options: dict | None, batch: int, heads: int):
    """flex forward + backward over ``tokens`` (a band mask, sparse blocks of ``block``) traced on
    CPU into an aten graph, and its example inputs."""
    import torch.nn.attention.flex_attention as flex_api
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    def band(b, h, q, kv):
        return (q - kv).abs() <= 2

    n = -(-tokens // block)
    i32 = dict(dtype=torch.int32)
    # (the blocks' counts and indices are graph inputs: their values do not matter to the lowering)
    blocks = [torch.ones(1, 1, n, **i32), torch.zeros(1, 1, n, n, **i32)] * 2  # key blocks, query blocks
    qkv = [torch.randn(batch, heads, tokens, head_dim, dtype=torch.bfloat16) for _ in range(4)]

    def step(q, k, v, kv_num, kv_idx, q_num, q_idx, grad):
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        mask = BlockMask(
            (tokens, tokens), kv_num, kv_idx, None, None, q_num, q_idx, None, None,
            BLOCK_SIZE=(block, block), mask_mod=band,
        )  # fmt: skip
        out = flex_attention(q, k, v, block_mask=mask, kernel_options=options)
        return (out, *torch.autograd.grad(out, (q, k, v), grad))

    args = [*qkv[:3], *blocks, qkv[3]]
    # traced on CPU for a CUDA lowering: flex's refusal of a backward on CPU does not apply
    with mock.patch.object(flex_api, "_validate_device", lambda *tensors: None):
        graph = make_fx(step, tracing_mode="fake", decomposition_table=select_decomp_table())(*args)
    graph.graph.eliminate_dead_code()
    graph.recompile()
    return graph, args


def lower(block: int, tokens: int, head_dim: int, options: dict | None = None, batch: int = 2, heads: int = 4) -> dict:
    """Lower flex's forward + backward for an H200: ``{"choices": [[template, candidates], ...],
    "error": None or the first line of what stopped the lowering}``."""
    import torch._inductor.kernel.flex.flex_attention as flex_lowering
    import torch._inductor.kernel.flex.flex_decoding as decoding_lowering

    graph, cpu_args = _graph(block, tokens, head_dim, options, batch, heads)
    choices: list = []
    select = flex_lowering.autotune_select_algorithm

    def counted(name, candidates, *args, **kwargs):
        choices.append([name, len(candidates)])
        return select(name, candidates, *args, **kwargs)

    patches = [mock.patch.object(m, "autotune_select_algorithm", counted) for m in (flex_lowering, decoding_lowering)]
    return {"choices": choices, "error": hopper_lowering.lower(graph, cpu_args, patches=patches)["error"]}


def natten_options(block: int, head_dim: int) -> dict | None:
    """The kernel options natten passes to compiled flex on an H200 for bf16 heads of ``head_dim``."""
    from recipes.stormscope import natten

    q = torch.empty(1, 1, 1, 1, head_dim, dtype=torch.bfloat16)
    with mock.patch.object(natten, "_hopper", lambda q: True):
        return natten._kernel_options(q, block)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--block", type=int, default=64, help="sparse block (tokens)")
    p.add_argument("--tokens", type=int, default=72, help="query and key tokens (flattened)")
    p.add_argument("--head-dim", type=int, default=16)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    group = p.add_mutually_exclusive_group()
    group.add_argument("--natten", action="store_true", help="natten's kernel options for Hopper")
    group.add_argument("--options", type=json.loads, help="kernel options, as JSON")
    p.add_argument("--json", action="store_true", help="print one line of JSON")
    a = p.parse_args(argv)
    options = natten_options(a.block, a.head_dim) if a.natten else a.options
    result = {"options": options, **lower(a.block, a.tokens, a.head_dim, options, a.batch, a.heads)}
    if a.json:
        print(json.dumps(result))
        return
    print(
        f"torch {torch.__version__}, sm90 (H200) without a GPU: flex forward + backward, bf16, {a.tokens} tokens "
        f"in blocks of {a.block}, batch {a.batch}, {a.heads} heads of {a.head_dim}; kernel options {options}"
    )
    for name, n in result["choices"]:
        print(f"  {name}: {n} candidate(s)")
    print(f"  failed: {result['error']}" if result["error"] else "  lowered")
    sys.exit(1 if result["error"] else 0)


if __name__ == "__main__":
    main()
