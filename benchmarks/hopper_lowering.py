"""Inductor's lowering and code generation for a Hopper GPU, on a machine without one.

Inductor decides a graph's kernels (which operations fuse, which templates and tile candidates it
keeps, what each kernel reads and writes) while it lowers the graph, before anything is built or
run. Given an aten graph traced on CPU, ``lower`` runs that lowering for a CUDA device that
answers as an H200 (sm90; its properties below) and, if asked, the code generation: the Python
module inductor would run on the GPU, Triton kernels included, each with its estimated traffic
(``kernel_num_gb``). Nothing is compiled for or launched on a GPU. Used by
``benchmarks/flex_lowering.py`` (flex's templates) and ``benchmarks/block_lowering.py`` (a
compiled DiT block's kernels). Figures are this machine's torch's.
"""

from __future__ import annotations

import contextlib
import re
import types
from unittest import mock

import torch

# What torch.cuda reports on an H200 (what inductor's heuristics read)
_H200 = dict(
    major=9, minor=0, multi_processor_count=132, name="NVIDIA H200", total_memory=140 << 30,
    shared_memory_per_block_optin=232448, warp_size=32, regs_per_multiprocessor=65536,
    max_threads_per_multi_processor=2048, max_threads_per_block=1024, L2_cache_size=50 << 20, gcnArchName="",
)  # fmt: skip


def _cudnn_memory_format(input, weight, backend):
    """The layout cuDNN gives a convolution's outputs (and its gradients): channels-last where the
    input or the weight is (``cudnn_conv_suggest_memory_format``). A CPU build of torch picks no
    cuDNN backend for a fake CUDA tensor, and its fallback's answer (contiguous) would have
    inductor transpose every convolution's output."""
    if input.dim() == 4 and torch.channels_last in (_suggested(input), _suggested(weight)):
        return torch.channels_last
    return torch.contiguous_format


def _suggested(t: torch.Tensor):
    return torch.channels_last if t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous() else None


@contextlib.contextmanager
def hopper_device():
    """torch.cuda and inductor's device queries answer as one H200 would, and Triton counts as
    usable for it (inductor checks once per process, against the real machine)."""
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
            ("torch.utils._triton.has_triton", lambda: True),
            ("torch._inductor.scheduler.has_triton", lambda: True),
            # with a warm pool of compile workers (a CPU graph's, earlier) code generation would
            # hand each kernel to them as it goes, loading the kernel's module for a GPU here
            ("torch._inductor.async_compile.AsyncCompile.use_process_pool", classmethod(lambda cls: False)),
            ("torch._C._conv_determine_backend_memory_format", _cudnn_memory_format),
        ]:
            stack.enter_context(mock.patch(name, value))
        stack.enter_context(mock.patch.object(DeviceProperties, "create", classmethod(lambda cls, d: cls(**hints))))
        yield


def lower(graph: torch.fx.GraphModule, cpu_args: list, codegen: bool = False, patches=()) -> dict:
    """Lower ``graph`` (traced on CPU; ``cpu_args`` its example inputs) for an H200: ``{"error":
    None or the first line of what stopped it, "code": the generated module's source (with
    ``codegen``) or None}``. ``patches``: more context managers to hold while it lowers. The
    tensors ``graph`` makes itself are moved to the GPU in place."""
    from torch._inductor import config
    from torch._inductor.debug import DebugContext
    from torch._inductor.graph import GraphLowering
    from torch._inductor.virtualized import V
    from torch._subclasses.fake_tensor import FakeTensorMode

    for node in graph.graph.nodes:  # tensors the graph makes itself (zeros, aranges) go to the GPU too
        device = node.kwargs.get("device")
        if isinstance(device, torch.device) and device.type == "cpu":
            node.update_kwarg("device", torch.device("cuda", 0))
    graph.recompile()
    error = code = None
    with FakeTensorMode(allow_non_fake_inputs=True) as fake, contextlib.ExitStack() as stack:
        # (made before the device answers: on a CUDA build of torch a fake CUDA tensor would
        # otherwise initialise the driver it believes in)
        args = [
            torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="cuda") if isinstance(a, torch.Tensor) else a
            for a in cpu_args
        ]
        stack.enter_context(hopper_device())
        stack.enter_context(DebugContext())
        stack.enter_context(config.patch(benchmark_kernel=True))  # each kernel's estimated traffic
        for patch in patches:
            stack.enter_context(patch)
        lowering = GraphLowering(graph, example_inputs=args)
        with V.set_graph_handler(lowering), V.set_fake_mode(fake):
            try:
                lowering.run(*args)
                if codegen:
                    code = lowering.codegen()
            except Exception as e:  # noqa: BLE001 - what stopped inductor, reported
                error = f"{type(e).__name__}: " + (str(e).strip().splitlines() or [""])[0]
    if isinstance(code, tuple):  # (source, line map) in some versions
        code = code[0]
    if code is not None and not isinstance(code, str):
        code = getattr(code, "value", str(code))
    return {"error": error, "code": code}


def trace_graphs(fn, *args, **kwargs) -> list:
    """``fn(*args, **kwargs)`` compiled (dynamo, full graph) and run forward and backward on the
    fake tensors it is given, as inductor would receive it: AOTAutograd with inductor's
    decompositions, joint-graph passes (``config.joint_custom_pre_pass`` included) and min-cut
    partition. Returns ``[(forward graph, its inputs), (backward graph, its inputs)]``; inductor
    compiles nothing. Call under the autocast (and inductor config) the training step runs in."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor import compile_fx
    from torch._inductor.decomposition import select_decomp_table

    graphs = []

    def keep(graph, inputs):
        graphs.append((graph, inputs))
        return make_boxed_func(graph.forward)

    # inductor's own partition function (its joint-graph passes, then the min-cut partitioner)
    # where this torch has one at module level (2.13 on); before, the partitioner alone
    inductors = getattr(compile_fx, "partition_fn", min_cut_rematerialization_partition)

    def partition(graph, joint_inputs, **kwargs):
        from torch._guards import detect_fake_mode
        from torch._inductor.virtualized import V

        with V.set_fake_mode(detect_fake_mode(joint_inputs)):  # as inductor's compile sets it (random ops' passes)
            return inductors(graph, joint_inputs, **kwargs)

    backend = aot_autograd(
        fw_compiler=keep, bw_compiler=keep, decompositions=select_decomp_table(), partition_fn=partition
    )
    torch._dynamo.reset()
    try:
        out = torch.compile(fn, backend=backend, fullgraph=True)(*args, **kwargs)
        out.float().sum().backward()
    finally:
        torch._dynamo.reset()
    return graphs


def lower_kernels(graph: torch.fx.GraphModule, inputs: list, patches=()) -> dict:
    """``lower`` with code generation, read back: ``{"kernels": [[name, GB], ...], "calls": the
    calls outside Triton kernels, "error": ...}``."""
    result = lower(graph, inputs, codegen=True, patches=patches)
    code = result["code"] or ""
    return {"kernels": [list(k) for k in kernels(code)], "calls": extern_calls(code), "error": result["error"]}


def kernels(code: str) -> list[tuple[str, float]]:
    """The Triton kernels of a generated module, in order, with their estimated traffic in GB."""
    out = []
    for name, body in re.findall(r"^(triton_\w+) = async_compile\.triton\('\w+', '''(.*?)'''", code, re.M | re.S):
        gb = re.search(r"'kernel_num_gb': ([\d.e+-]+)", body)
        out.append((name, float(gb.group(1)) if gb else 0.0))
    return out


def extern_calls(code: str) -> list[str]:
    """The calls a generated module makes outside its Triton kernels: aten's (``extern_kernels.mm``)
    and custom ops (``torch.ops.NS.op``), in order."""
    return re.findall(r"(extern_kernels\.\w+|torch\.ops\.(?!aten\b)\w+\.\w+)(?:\.default)?\(", code)
