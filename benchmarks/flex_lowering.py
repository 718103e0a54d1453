"""Lower compiled flex_attention for a Hopper GPU on any machine: the kernel candidates inductor keeps.

Inductor picks flex's kernel templates (flex_attention, flex_decoding, the backward) and their
candidate tile configurations while it lowers the graph, before anything runs; a template left
with no candidate fails the compile (``NoValidChoicesError: No choices exist for backend``). This
script traces one flex forward and backward at the chosen size on CPU, then runs inductor's
lowering of that graph for a CUDA device that reports itself as an H200 (sm90, its properties
below): no kernel is built or run, so no GPU is needed. It prints each template inductor asked
to choose among and how many candidates it had, or the error that stopped the lowering.

    python benchmarks/flex_lowering.py --block 64 --tokens 72 --head-dim 16            # flex's defaults
    python benchmarks/flex_lowering.py --block 64 --tokens 72 --head-dim 16 --natten   # the DiT's options

``--natten``: the kernel options ``recipes/stormscope/natten.py`` passes on Hopper for these
blocks and heads; ``--options JSON`` any others. ``--json``: one line of JSON (for tests).
Figures are this machine's torch's; the GPU's may differ where the versions do.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import types
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# What torch.cuda reports on an H200 (what inductor's template heuristics read)
_H200 = dict(
    major=9, minor=0, multi_processor_count=132, name="NVIDIA H200", total_memory=140 << 30,
    shared_memory_per_block_optin=232448, warp_size=32, regs_per_multiprocessor=65536,
    max_threads_per_multi_processor=2048, max_threads_per_block=1024, L2_cache_size=50 << 20, gcnArchName="",
)  # fmt: skip


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


@contextlib.contextmanager
def _hopper_device():
    """torch.cuda and inductor's device queries answer as one H200 would."""
    from torch._inductor.runtime.hints import DeviceProperties

    props = types.SimpleNamespace(**_H200)
    hints = dict(
        type="cuda", index=0, multi_processor_count=_H200["multi_processor_count"], cc=90, major=9,
        regs_per_multiprocessor=_H200["regs_per_multiprocessor"],
        max_threads_per_multi_processor=_H200["max_threads_per_multi_processor"],
        max_threads_per_block=_H200["max_threads_per_block"], warp_size=_H200["warp_size"],
    )  # fmt: skip
    with contextlib.ExitStack() as stack:
        for name, value in [
            ("torch.cuda.get_device_capability", lambda *a, **k: (9, 0)),
            ("torch.cuda.get_device_properties", lambda *a, **k: props),
            ("torch.cuda.is_available", lambda: True),
            ("torch.cuda.device_count", lambda: 1),
            ("torch.cuda.current_device", lambda: 0),
            ("torch.utils._triton.triton_hash_with_backend", lambda: "hopper-without-a-gpu"),
        ]:
            stack.enter_context(mock.patch(name, value))
        stack.enter_context(mock.patch.object(DeviceProperties, "create", classmethod(lambda cls, d: cls(**hints))))
        yield


def lower(block: int, tokens: int, head_dim: int, options: dict | None = None, batch: int = 2, heads: int = 4) -> dict:
    """Lower flex's forward + backward for an H200: ``{"choices": [[template, candidates], ...],
    "error": None or the first line of what stopped the lowering}``."""
    import torch._inductor.kernel.flex.flex_attention as flex_lowering
    import torch._inductor.kernel.flex.flex_decoding as decoding_lowering
    from torch._inductor.graph import GraphLowering
    from torch._inductor.virtualized import V
    from torch._subclasses.fake_tensor import FakeTensorMode

    graph, cpu_args = _graph(block, tokens, head_dim, options, batch, heads)
    choices: list = []
    select = flex_lowering.autotune_select_algorithm

    def counted(name, candidates, *args, **kwargs):
        choices.append([name, len(candidates)])
        return select(name, candidates, *args, **kwargs)

    error = None
    with FakeTensorMode(allow_non_fake_inputs=True), contextlib.ExitStack() as stack:
        # (made before the device answers: a fake CUDA tensor on a CUDA build of torch would
        # otherwise initialise the driver it believes in)
        args = [torch.empty(a.shape, dtype=a.dtype, device="cuda") for a in cpu_args]
        stack.enter_context(_hopper_device())
        for module in (flex_lowering, decoding_lowering):
            stack.enter_context(mock.patch.object(module, "autotune_select_algorithm", counted))
        lowering = GraphLowering(graph, example_inputs=args)
        with V.set_graph_handler(lowering):
            try:
                lowering.run(*args)
            except Exception as e:  # noqa: BLE001 - what stopped inductor, reported
                error = f"{type(e).__name__}: " + (str(e).strip().splitlines() or [""])[0]
    return {"choices": choices, "error": error}


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
