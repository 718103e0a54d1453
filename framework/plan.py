"""Know before you launch: what every rank of a layout holds, reads and computes.

``python -m framework mode=plan plan.world_size=8 plan.gpu_memory_gib=80`` prints it with no
GPU, no process group and no data read; ``parallel=auto`` makes the same plans at start-up and
takes the first layout that fits (:func:`choose`). docs/plan.md shows an example output.

The model is the task's own, built (and, for a domain layout, split) under FakeTensorMode:
every tensor has its real shape and dtype and no memory behind it.

* Exact, from the rules torch applies: parameter bytes (FSDP2 cuts dim 0 of each parameter
  into ``ceil(n / shards)``-row chunks, one per shard rank, and pads every rank's storage to a
  full chunk), gradient bytes (FSDP2: a unit's reduce-scatter output, padded alike; else the
  whole gradient), optimizer state (the configured ``torch.optim`` optimizer, stepped once on
  meta tensors of the rank's own shard shapes).
* Estimated: activations (the peak of the bytes that aten ops allocate and still hold during
  one traced eager forward + backward of a rank's micro-batch, its band of rows when split) and
  communication buffers (DDP's gradient buckets; FSDP2's gathered units).

The trace runs on the CPU, casting as the planned device would: a GPU's autocast rules
(framework/gpu_rules.py) unless ``device=cpu``, and FSDP2's bf16 MixedPrecisionPolicy (the
whole network in bf16, no autocast) for sharded bf16 layouts.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, cast

import torch

from framework import compat, registry
from framework.distributed.mesh import Degrees, resolve
from framework.errors import ConfigError

log = logging.getLogger("framework")
GIB = 2**30
# Where the step is traced, also when planning for GPUs: the same on every machine (a laptop plans
# a cluster job); the casts follow the planned device (Machine.device).
TRACE_DEVICE = torch.device("cpu")


@dataclass(frozen=True)
class Machine:
    world: int
    gpus_per_node: int
    memory: int | None  # bytes per GPU; None: no limit
    headroom: float = 0.1
    device: str = "cuda"  # whose autocast rules the traced step follows: cuda | cpu

    @property
    def usable(self) -> int | None:
        return None if self.memory is None else int(self.memory * (1 - self.headroom))


@dataclass(frozen=True)
class Layout:
    degrees: Degrees
    sharding: str  # what the policy does on this world: none | ddp | fsdp2 | hsdp

    @property
    def shards(self) -> int:
        """Ranks each parameter is split over (1: every rank holds it whole)."""
        d = self.degrees
        return d.dp_shard * d.domain if self.sharding in ("fsdp2", "hsdp") else 1

    def describe(self) -> str:
        d = self.degrees
        return f"{self.sharding} {d.dp_replicate}x{d.dp_shard}x{d.domain}"


def effective(sharding: str, degrees: Degrees) -> str:
    """The policy a sharding option becomes on ``degrees`` (framework.distributed.sharding)."""
    if degrees.world == 1:
        return "none"
    if sharding in ("fsdp2", "hsdp"):
        return "hsdp" if degrees.dp_replicate > 1 else "fsdp2"
    return sharding


@dataclass
class Plan:
    run: Any
    layout: Layout
    machine: Machine
    batch: int  # samples a data-parallel rank loads per step
    micro: int  # samples per forward (batch / trainer.grad_accum)
    bands: list[int]  # rows of each domain rank
    halos: Counter  # (rows above, rows below) per halo exchange of one forward
    units: list[tuple[str, int, int, int]]  # (name, parameters, unsharded bytes, bytes per rank)
    params: list[int]  # bytes per rank
    grads: list[int]
    optim: list[int]
    buffers: int  # every rank holds them whole
    activations: int | None  # None: unknown (``note`` says why)
    comm: int
    data: int | None  # bytes a rank loads per step
    n_params: int
    flops: float | None  # per sample, forward + backward
    flops_source: str
    note: str  # why activations are unknown
    activations_of: str = "the eager step"

    def total(self, r: int) -> int:
        """Bytes rank ``r`` needs on its GPU at the peak of a step."""
        held = self.params[r] + self.grads[r] + self.optim[r]
        if self.layout.shards > 1 and self.run.sharding.cpu_offload:
            held = 0  # FSDP2's CPUOffloadPolicy keeps them in host memory
        return held + self.buffers + (self.activations or 0) + self.comm + (self.data or 0)

    @property
    def need(self) -> int:
        return max(self.total(r) for r in range(self.machine.world))

    @property
    def fits(self) -> bool | None:
        usable = self.machine.usable
        return None if usable is None else self.need <= usable

    def lines(self) -> list[str]:
        run, m, d = self.run, self.machine, self.layout.degrees
        mem = "no memory limit (set plan.gpu_memory_gib)" if m.memory is None else f"{_b(m.memory)} per GPU"
        out = [
            f"plan: recipe={run.recipe} task={run.task.name} model={run.model.name} precision={run.precision.name} "
            f"optim={run.optim._target_}",
            f"machine: {m.world} ranks, {m.gpus_per_node} per node, {mem}",
            f"mesh: dp_replicate={d.dp_replicate} x dp_shard={d.dp_shard} x domain={d.domain}; "
            f"sharding={self.layout.sharding}"
            + (f" over {self.layout.shards} ranks" if self.layout.shards > 1 else "")
            + f", splitter={'rows' if d.domain > 1 else 'off'}",
            f"batch: global {run.data.batch_size} = {d.dp} data-parallel ranks x {self.batch}; "
            f"micro-batch {self.micro} (trainer.grad_accum={run.trainer.grad_accum})",
        ]
        if d.domain > 1:
            out.append(f"domain bands: rows per domain rank {self.bands} (of {sum(self.bands)})")
            widths = ", ".join(f"{a}/{b} x{n}" for (a, b), n in sorted(self.halos.items()))
            out.append(f"halos: rows fetched above/below per exchange: {widths or 'none'} (one forward)")
        if self.layout.shards > 1:
            out.append(f"FSDP2 units (dim 0 of each parameter in chunks over {self.layout.shards} ranks, padded):")
            width = max(len(u[0]) for u in self.units)
            out.append(f"  {'unit':<{width}}  {'params':>10}  {'unsharded':>10}  {'per rank':>10}")
            out += [f"  {n:<{width}}  {c:>10,}  {_b(s):>10}  {_b(r):>10}" for n, c, s, r in self.units]
        else:
            out.append("FSDP2 units: none (every rank holds the whole model)")
        cols = ("params", "grads", "optimizer", "activations", "comm (est.)", "batch", "total")
        out.append(f"{'per rank':<12}" + "".join(f"{c:>13}" for c in cols))
        rows: dict[tuple, list[int]] = {}
        for r in range(m.world):
            vals = (self.params[r], self.grads[r], self.optim[r], self.activations, self.comm, self.data, self.total(r))
            rows.setdefault(vals, []).append(r)
        for vals, ranks in rows.items():
            out.append(f"{_ranks(ranks):<12}" + "".join(f"{_b(v):>13}" for v in vals))
        flops = "unknown" if self.flops is None else f"{self.flops / 1e12:.4g} TFLOP per sample ({self.flops_source})"
        out.append(f"model: {self.n_params / 1e6:.3f} M parameters, buffers {_b(self.buffers)} per rank; {flops}")
        if self.data is not None:
            each = _b(self.data // self.batch)
            n = f"{self.batch} sample{'s' if self.batch != 1 else ''}"
            out.append(f"data: each rank loads {n} x {each} (its rows) = {_b(self.data)} per step")
        usable = m.usable
        verdict = {None: "not checked", True: "yes", False: "NO"}[self.fits]
        room = "" if usable is None else f" of {_b(usable)} usable ({m.headroom:.0%} headroom)"
        out.append(f"fits: {verdict}: the fullest rank needs {_b(self.need)}{room}")
        if self.activations is None:
            out.append(f"  (activations unknown: {self.note})")
        else:
            out.append(f"  (activations: {self.activations_of})")
        return out


def _b(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _ranks(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``ranks 0-2,5``."""
    parts: list[str] = []
    start = ranks[0]
    for a, b in zip(ranks, [*ranks[1:], None]):
        if b != a + 1:
            parts.append(str(a) if a == start else f"{start}-{a}")
            start = b if b is not None else a
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(parts)


# -- the machine and the layout -------------------------------------------------------------------
def machine(run, world: int | None = None) -> Machine:
    """What a plan is for: ``plan.*``, else what this process sees (launcher, GPU)."""
    p = run.plan
    world = world or p.world_size or int(os.environ.get("WORLD_SIZE", "1"))
    cuda = run.device != "cpu" and torch.cuda.is_available()
    per_node = p.gpus_per_node or _local_world() or (torch.cuda.device_count() if cuda else world)
    memory = int(p.gpu_memory_gib * GIB) if p.gpu_memory_gib else None
    if memory is None and cuda:
        memory = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return Machine(world, min(per_node, world), memory, p.headroom, target_device(run))


def target_device(run) -> str:
    """The device a plan is for: a GPU unless ``device=cpu``, or unless this is a run starting on a
    machine without one (``parallel=auto`` there plans the CPU step it is about to take)."""
    if run.device == "cpu" or (run.mode != "plan" and not torch.cuda.is_available()):
        return "cpu"
    return "cuda"


def compute_path(run, layout: Layout | None, device: str) -> tuple[str, str]:
    """How the traced step computes, (casts, device): casts ``fp32`` (no autocast), ``params``
    (FSDP2's bf16 MixedPrecisionPolicy: bf16 parameters and inputs, no autocast:
    framework/distributed/sharding.py) or ``autocast``; the device's kernels and autocast rules."""
    casts = "autocast"
    if run.precision.name not in ("bf16", "fp16"):
        casts = "fp32"
    elif run.precision.name == "bf16" and layout is not None and layout.sharding in ("fsdp2", "hsdp"):
        casts = "params"  # fully_shard's MixedPrecisionPolicy, also on a replicate-only HSDP mesh
    return casts, device


def _local_world() -> int | None:
    for key in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):  # torchrun; SLURM writes "4" or "4(x2)"
        value = os.environ.get(key, "").split("(")[0].split(",")[0]
        if value.isdigit():
            return int(value)
    return None


def configured(run, world: int) -> Layout:
    """The layout the config asks for on ``world`` ranks (the runtime's own checks)."""
    from framework.runtime import _check_layout

    degrees = resolve(run.parallel, world)
    _check_layout(run, degrees)
    return Layout(degrees, effective(run.sharding.name, degrees))


def candidates(m: Machine) -> list[Layout]:
    """``parallel=auto``'s order: the smallest domain degree first; for each, ddp, then hsdp
    (replicated across nodes, sharded within one) when the job spans nodes, then fsdp2."""
    out: list[Layout] = []
    for domain in (d for d in range(1, m.world + 1) if m.world % d == 0):
        flat = Degrees(1, m.world // domain, domain)
        nodes = m.world // m.gpus_per_node
        layouts = [Layout(flat, effective("ddp", flat))]
        if nodes > 1 and m.world % m.gpus_per_node == 0 and m.gpus_per_node % domain == 0:
            hsdp = Degrees(nodes, m.gpus_per_node // domain, domain)
            layouts.append(Layout(hsdp, effective("hsdp", hsdp)))
        layouts.append(Layout(flat, effective("fsdp2", flat)))
        out += [lay for i, lay in enumerate(layouts) if lay not in out + layouts[:i]]  # one process: all "none"
    return out


# -- the model, built and traced on fake tensors --------------------------------------------------
@dataclass
class _Traced:
    """One rank's model (fake) and what a traced step of it showed."""

    params: list[tuple[str, torch.Size, torch.dtype, bool]]  # name, shape, dtype, gets a gradient
    buffers: int
    units: list[tuple[str, list[str]]]  # FSDP unit name (with its class), its parameter names
    activations: int | None
    sample_bytes: float | None
    flops: float | None
    flops_source: str
    halos: Counter
    note: str  # why activations are unknown
    activations_of: str = "the eager step"  # or the compiled one's (framework.train.compile)


def _trace(run, bands: list[int], micro: int, path: tuple[str, str], compiled: bool = False) -> _Traced:
    from framework.distributed.env import DistEnv
    from framework.distributed.sharding import find_units
    from framework.domain.comm import DomainGroup
    from framework.domain.splitter import model_plan, split

    fake, device = compat.fake_mode(through_compiled=compiled), TRACE_DEVICE
    dg = DomainGroup.dry_run(bands) if bands else None  # rank 0: the widest band
    task = registry.tasks.entry(run.task.name).builder(run, DistEnv(), device, domain=dg)
    with fake:
        model = task.build_model()
        if dg is not None:
            split(model, dg, model_plan(run.model.name, len(bands)))
        shapes = [(n, p.shape, p.dtype) for n, p in model.named_parameters()]  # as every rank stores them
        for p in model.parameters():
            if p.requires_grad and path[0] != "params":  # held before the step: gradients, not activations
                p.grad = torch.zeros_like(p)
        if path[0] == "params":  # FSDP2 computes with gathered bf16 copies and reduce-scatters their grads
            for p in model.parameters():
                p.data = p.data.to(torch.bfloat16)
                if p.requires_grad:  # the unit's reduce-scatter frees the bf16 gradient (comm counts it)
                    p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    got_grad: set[str] = set()
    for name, p in model.named_parameters():
        if p.requires_grad:
            p.register_hook(lambda g, name=name: got_grad.add(name))

    def empty(shape, dtype=torch.float32):
        with fake:
            return torch.empty(shape, dtype=dtype, device=device)

    batch = task.example_batch(micro, empty)
    activations = sample_bytes = counted = None
    note = "the task gives no example_batch"
    if batch is not None:
        sample_bytes = sum(v.nbytes for v in batch.values() if torch.is_tensor(v)) / micro
        try:
            activations, counted = _step(run, task, model, batch, fake, device, path, compiled)
        except ValueError:
            raise  # a band thinner than a layer's halo: this layout cannot run (build says so)
        except Exception as e:  # noqa: BLE001  (an op fake tensors cannot run: the exact parts still stand)
            note = f"the step could not be traced on fake tensors ({type(e).__name__}: {str(e).strip()[:200]})"
    stated = task.flops_per_sample()
    flops, source = stated, "stated by the model"
    if not stated and counted is not None:  # per sample over the whole grid, as the trainer counts it
        flops = counted * max(1, len(bands)) / micro
        source = "counted with torch.utils.flop_counter" + (" on the widest band" if bands else "")
    traced = activations is not None
    trains = {n for n, p in model.named_parameters() if p.requires_grad}
    params = [(n, shape, dtype, n in got_grad if traced else n in trains) for n, shape, dtype in shapes]
    units = [
        (f"{name} ({type(m).__name__})", [f"{name}.{n}" for n, _ in m.named_parameters()])
        for name, m in find_units(model, list(run.sharding.units))
    ]
    buffers = sum(b.nbytes for b in model.buffers())
    halos = Counter((max(a for a, _ in plan), max(b for _, b in plan)) for plan, _ in getattr(dg, "halos", []))
    of = "the eager step"
    if compiled:
        of = "the compiled step (trainer.compile's units, split into forward and backward as inductor splits them)"
    return _Traced(params, buffers, units, activations, sample_bytes, flops, source, halos, note, of)


def _step(run, task, model, batch, fake, device, path: tuple[str, str], compiled: bool = False) -> tuple[int, int]:
    """(peak bytes allocated and held, FLOPs) of one forward + backward, as the trainer runs it;
    ``compiled``: with the units compiled as the runtime compiles them, each graph split into
    forward and backward as inductor splits it (what it keeps for backward under the memory budget
    and the model's recomputed ops), then run op by op. (Inductor's fusions also drop the
    temporaries inside a graph, which this counts: an estimate from above.)"""
    from framework import gpu_rules
    from framework.distributed import precision as precision_mod

    batch["step"] = 0
    precision = precision_mod.build(run.precision, device)
    casts: Any = contextlib.nullcontext()
    casts_by, device_rules = path
    if casts_by == "params":
        precision.sharded_cast = True
        model.register_forward_pre_hook(_bf16_inputs)
    if device_rules == "cuda":
        casts = gpu_rules.cuda_rules(precision.autocast_dtype if casts_by == "autocast" else None)
    tracer = compat.step_tracer(through_compiled=compiled)
    with _compiled_units(run, model, device_rules) if compiled else contextlib.nullcontext():
        with fake, tracer, casts:
            with precision.autocast(device):
                loss = task.loss(model, batch)
            (loss / run.trainer.grad_accum).backward()
            del loss
    return tracer.peak, tracer.flops


@contextlib.contextmanager
def _compiled_units(run, model, device_type: str):
    """``model``'s units compiled for the traced step as ``trainer.compile`` compiles them (its
    memory budget; no CUDA graphs: their pools are the allocator's business), with the
    partitioning backend. Dynamo's caches are cleared before and after (the plan runs before the
    run's own compile); the memory budget is left as it was."""
    from framework.train import compile as compile_mod

    functorch = torch._functorch.config
    budget, lazy = functorch.activation_memory_budget, functorch.force_non_lazy_backward_lowering
    quiet = logging.getLogger("torch._subclasses.fake_tensor")  # a failed trace is the plan's note, once
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    log.info("plan: tracing the compiled step on fake tensors (dynamo, AOTAutograd: about a second a block signature)")
    torch._dynamo.reset()
    try:
        joint_pass = compile_mod.RecomputeOps(compile_mod.recomputed_ops(model))
        # the backward's graph made with the forward's, inside compilation, not lazily in the
        # traced backward (where copying a graph's constant would run under the fake mode)
        functorch.force_non_lazy_backward_lowering = True
        own = log.level
        log.setLevel(max(own, logging.WARNING))  # the run's own compile logs its units once, later
        try:
            compile_mod.compile_model(
                model,
                units=list(run.sharding.units),
                device_type=device_type,
                backend=compat.partitioned_backend(joint_pass),
                channels_last=False,  # the same bytes in either layout
                cudnn_benchmark=False,
                memory_budget=run.trainer.compile_memory_budget,
            )
        finally:
            log.setLevel(own)
        yield
    finally:
        torch._dynamo.reset()
        functorch.activation_memory_budget = budget
        functorch.force_non_lazy_backward_lowering = lazy
        quiet.setLevel(level)


def _bf16_inputs(module, args):
    """FSDP2's MixedPrecisionPolicy casts the root module's floating inputs to its param dtype."""
    return tuple(a.to(torch.bfloat16) if torch.is_tensor(a) and a.is_floating_point() else a for a in args)


# -- sharding: FSDP2's rule, and the optimizer's state on meta tensors --------------------------
def _rows(shape: torch.Size, shards: int, index: int) -> tuple[int, int]:
    """(rows every rank's storage holds, rows that are rank ``index``'s): torch.chunk over dim 0."""
    chunk = -(-shape[0] // shards)
    return chunk, max(0, min(chunk, shape[0] - index * chunk))


def _nbytes(shape: torch.Size, dtype: torch.dtype, rows: int | None = None) -> int:
    lead = shape[0] if rows is None else rows
    return lead * math.prod(shape[1:]) * dtype.itemsize


_OPTIMIZER_BYTES: dict[tuple, int] = {}


def _optimizer_bytes(run, shapes: tuple[tuple[tuple[int, ...], torch.dtype, bool], ...]) -> int:
    """State bytes of the configured optimizer over parameters of these (shape, dtype, gets a
    gradient), from one real step on meta tensors (fused kernels need a real device: same state)."""
    from framework.train import optim as optim_mod

    key = (repr(run.optim), shapes)
    if key in _OPTIMIZER_BYTES:
        return _OPTIMIZER_BYTES[key]
    params = []
    for shape, dtype, grad in shapes:
        p = torch.empty(shape, dtype=dtype, device="meta", requires_grad=True)
        p.grad = torch.empty_like(p) if grad else None
        params.append(p)
    opt = optim_mod.build(replace(run.optim, fused=None), params)
    opt.step()
    if len(_OPTIMIZER_BYTES) >= 64:
        _OPTIMIZER_BYTES.clear()
    _OPTIMIZER_BYTES[key] = sum(v.nbytes for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
    return _OPTIMIZER_BYTES[key]


_TRACES: dict[tuple, _Traced] = {}  # by (config, bands, micro-batch): layouts and sweep jobs share them


def _traced(run, bands: list[int], micro: int, path: tuple[str, str], compiled: bool = False) -> _Traced:
    from omegaconf import OmegaConf

    cfg = cast(dict, OmegaConf.to_container(run.raw))
    data = {k: v for k, v in cfg["data"].items() if k not in ("batch_size", "num_workers", "pin_memory")}
    what = [cfg["task"], cfg["model"], data, cfg["precision"], run.deterministic, list(run.sharding.units)]
    if compiled:
        what += [run.trainer.compile_memory_budget]
    key = (repr(what), tuple(bands), micro, path, compiled)  # all a trace depends on
    if key not in _TRACES:
        if len(_TRACES) >= 16:
            _TRACES.clear()
        try:
            t = _trace(run, bands, micro, path, compiled)
        except ValueError as e:  # a band thinner than a layer's halo, said by the layer
            raise ConfigError(str(e).splitlines()[0]) from None
        if compiled:  # the model's FLOPs are the eager step's (a compiled backward may recompute some)
            eager = _traced(run, bands, micro, path)
            t = replace(t, flops=eager.flops, flops_source=eager.flops_source)
            if t.activations is None and t.sample_bytes is not None:  # dynamo could not trace it
                why = t.note.removeprefix("the step could not be traced on fake tensors ")
                t = replace(eager, activations_of=f"the eager step, above a compiled one's (its trace failed: {why})")
        _TRACES[key] = t
    return _TRACES[key]


def _step_shape(run, d: Degrees) -> tuple[int, int, list[int]]:
    """(samples per rank, samples per micro-step, rows per domain rank ([]: the whole field))."""
    from framework.data.sampler import micro_batch

    micro = micro_batch(run.data.batch_size, d.dp, run.trainer.grad_accum)
    per_rank = micro * run.trainer.grad_accum
    bands: list[int] = []
    if d.domain > 1:
        from framework.domain.comm import split_extents
        from framework.domain.splitter import model_plan

        model_plan(run.model.name, d.domain)  # a model without a split plan: the runtime's line
        try:
            rows, multiple = registry.tasks.entry(run.task.name).builder.domain_rows(run)
        except NotImplementedError as e:
            raise ConfigError(str(e)) from None
        bands = split_extents(rows, d.domain, multiple)
    return per_rank, micro, bands


def step_flops(run, degrees: Degrees) -> tuple[float | None, str]:
    """FLOPs of one sample's training step (forward + backward, the whole grid) and where they
    come from: stated by the model, or counted on fake tensors. The trainer's tflops and MFU
    use this: counting a real step would run that step eagerly under a dispatch mode, holding
    the eager activations (87 GiB for the regression preset on an H200, 36 GiB compiled).
    (None, why) where neither can say. The global random state is left as it was."""
    import random

    import numpy as np

    _, micro, bands = _step_shape(run, degrees)
    py_state, np_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):  # building the (fake) model draws its init
            t = _traced(run, bands, micro, compute_path(run, None, target_device(run)))  # FLOPs: any casts
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
    return t.flops, t.flops_source if t.flops is not None else t.note


def build(run, layout: Layout, m: Machine) -> Plan:
    """The plan of ``layout`` on ``m``; ConfigError (one line) where the layout cannot run."""
    from framework.train.compile import compile_wanted

    per_rank, micro, bands = _step_shape(run, layout.degrees)
    compiled = compile_wanted(run.trainer.compile, m.device)
    t = _traced(run, bands, micro, compute_path(run, layout, m.device), compiled)

    shards, world = layout.shards, m.world
    if shards > 1:
        scalar = next((n for n, shape, _, _ in t.params if len(shape) == 0), None)
        if scalar:
            raise ConfigError(f"FSDP2 cannot shard the scalar parameter '{scalar}'; use parallel=ddp")
    full = [_nbytes(s, dt) for _, s, dt, _ in t.params]
    padded = [_nbytes(s, dt, _rows(s, shards, 0)[0]) if shards > 1 else b for (_, s, dt, _), b in zip(t.params, full)]
    params = sum(padded)
    grads = sum(b for b, (_, _, _, g) in zip(padded, t.params) if g)
    # Optimizer state per place on the shard axis (rank r is r % shards: dp_shard x domain, row-major).
    by_shapes: dict[tuple, int] = {}
    per_index = []
    for index in range(shards):
        own = tuple(
            ((_rows(s, shards, index)[1], *s[1:]) if shards > 1 else tuple(s), dt, g) for _, s, dt, g in t.params
        )
        if own not in by_shapes:
            by_shapes[own] = _optimizer_bytes(run, own)
        per_index.append(by_shapes[own])
    optim = [per_index[r % shards] for r in range(world)]

    owner = {p: name for name, names in t.units for p in names}  # the rest: the root's
    units = []
    for name in [n for n, _ in t.units] + ["<root>"]:
        idx = [i for i, (p, *_) in enumerate(t.params) if owner.get(p, "<root>") == name]
        if idx:
            numel = sum(math.prod(t.params[i][1]) for i in idx)
            units.append((name, numel, sum(full[i] for i in idx), sum(padded[i] for i in idx)))
    return Plan(
        run=run,
        layout=layout,
        machine=m,
        batch=per_rank,
        micro=micro,
        bands=bands,
        halos=t.halos,
        units=units,
        params=[params] * world,
        grads=[grads] * world,
        optim=optim,
        buffers=t.buffers,
        activations=t.activations,
        comm=_comm(run, layout, units, t, full),
        data=None if t.sample_bytes is None else round(t.sample_bytes * per_rank),
        n_params=sum(math.prod(s) for _, s, _, _ in t.params),
        flops=t.flops,
        flops_source=t.flops_source,
        note=t.note,
        activations_of=t.activations_of,
    )


def _comm(run, layout: Layout, units, t: _Traced, full: list[int]) -> int:
    """Buffers of the sharding policy (an estimate). DDP: its gradient buckets, one copy of every
    gradient. FSDP2: the gathered (unsharded) parameters that live at once (the root's for the
    whole step, the last unit's after forward unless resharded, the unit computing and the one
    prefetched), in the compute dtype, plus one unit's unsharded gradients for its reduce-scatter."""
    if layout.sharding == "ddp":
        return sum(b for b, (_, _, _, g) in zip(full, t.params) if g)
    if layout.shards == 1:
        return 0
    gathered = [u[2] for u in units if u[0] != "<root>"] or [0]
    root = sum(u[2] for u in units if u[0] == "<root>")
    policy = run.sharding.reshard_after_forward
    if policy == "never":
        live = root + sum(gathered)
    else:
        live = root + 2 * max(gathered) + (gathered[-1] if policy == "default" else 0)
    if run.precision.name in ("bf16", "fp16"):
        live //= 2  # FSDP2's MixedPrecisionPolicy gathers in the 16-bit compute dtype
    return live + max(gathered + [root])


# -- parallel=auto ---------------------------------------------------------------------------
def choose(run, m: Machine) -> tuple[Plan, list[str]]:
    """The first of :func:`candidates` whose plan fits, and why each one before it was passed over.
    One-line ConfigError when none fits."""
    reasons, smallest = [], None
    for layout in candidates(m):
        try:
            plan = build(run, layout, m)
        except ConfigError as e:
            reasons.append(f"not {layout.describe()}: {e}")
            continue
        if plan.fits is not False:
            return plan, reasons
        reasons.append(f"not {layout.describe()}: needs {_b(plan.need)} per GPU, {_b(m.usable)} usable")
        smallest = plan if smallest is None or plan.need < smallest.need else smallest
    if smallest is None:
        raise ConfigError(f"parallel=auto: no layout can run on {m.world} ranks ({reasons[-1] if reasons else ''})")
    raise ConfigError(
        f"parallel=auto: no layout fits {_b(m.usable)} usable per GPU on {m.world} ranks; the leanest, "
        f"{smallest.layout.describe()}, needs {_b(smallest.need)} (raise trainer.grad_accum, lower "
        "data.batch_size, or use more GPUs)"
    )


def apply_auto(run, world: int, is_main: bool):
    """``run`` with the layout ``parallel=auto`` picks for ``world`` ranks (logged with its reasons)."""
    from omegaconf import OmegaConf

    m = machine(run, world)
    plan, reasons = choose(run, m)
    d, lay = plan.layout.degrees, plan.layout
    room = "no memory limit" if m.usable is None else f"{_b(m.usable)} usable per GPU"
    if is_main:
        log.info(
            "parallel=auto: %s (dp_replicate x dp_shard x domain), needs %s per GPU, %s",
            lay.describe(),
            _b(plan.need),
            room,
        )
        for line in reasons:
            log.info("parallel=auto: %s", line)
    choice: dict[str, dict[str, Any]] = {
        "parallel": {"dp_replicate": d.dp_replicate, "dp_shard": d.dp_shard, "domain": d.domain},
        "sharding": {"name": lay.sharding},
        "splitter": {"name": "rows" if d.domain > 1 else "off"},
    }
    nodes, raw = dict(run.nodes), OmegaConf.create(OmegaConf.to_container(run.raw))
    for group, values in choice.items():
        nodes[group] = replace(nodes[group], **values)
        for k, v in values.items():  # the saved config (checkpoints) says what ran
            OmegaConf.update(raw, f"{group}.{k}", v)
    return replace(run, nodes=nodes, raw=raw)


def report(run) -> list[str]:
    """``mode=plan``: the plan of the configured layout (``parallel=auto``: of its choice)."""
    m = machine(run)
    if run.parallel.name == "auto":
        plan, reasons = choose(run, m)
        head = [f"parallel=auto chose {plan.layout.describe()} (dp_replicate x dp_shard x domain)"]
        return head + [f"  {r}" for r in reasons] + plan.lines()
    return build(run, configured(run, m.world), m).lines()
