"""Compiling the blocks in parallel before the first step (``trainer.compile_workers``).

Compilation is lazy: the first training step meets the compiled blocks one after another, and
each distinct block signature (channels, resolution, up/down) is traced, lowered and built by
inductor in turn, one graph at a time (a 78.6 M-parameter UNet: 22 forward and 22 backward
graphs, 140-190 s on an H200 host). Those graphs do not depend on each other, so
they can be built side by side, as neuron_parallel_compile does for its graphs:

1. ``discover``: one forward of the task's loss on fake tensors (no memory, no compute) records
   the inputs every unit is called with: shapes, dtypes, whether they need gradients.
2. ``precompile``: worker processes (spawned, one GPU share each on the rank's device) each
   take some of the distinct (block structure, inputs) pairs, build that block, run its
   compiled forward and backward once on random tensors of those shapes, and so fill inductor's
   on-disk cache (the user's ``~/.cache/framework/compile``, or ``TORCHINDUCTOR_CACHE_DIR``).
3. The first real step then compiles every block from that cache: dynamo traces, AOTAutograd
   traces, inductor loads the built graph (its FX graph cache), and Triton loads the kernels.

The ranks of a job split the pairs among themselves (each rank's workers build a share, then
all wait at one barrier), so more GPUs compile faster. Everything here is an optimisation that
cannot change a result: a pair a worker could not build (an error, a timeout, a dead worker, a
signature this emulation got wrong) is compiled by the first step as before, and the start-up
log says how many graphs came from the cache.

What the emulation reproduces of the training step, since inductor's cache key holds it: the
block's parameters (float32 under autocast; the FSDP2 MixedPrecisionPolicy's dtype, inputs cast
to it, where sharding casts), autocast, grad mode, the memory format the compiled blocks receive
(``RegionForward`` normalises it: channels-last where compiled so, else contiguous), the
inductor options and the global flags the kernels depend on (cudnn, TF32, determinism).
The workers also fill AOTAutograd's cache (``compile.use_caches`` lets it take the blocks'
autograd functions), so the first step neither traces nor partitions a joint graph, and they
time inductor's candidate kernel configurations one worker at a time (a lock per GPU:
``framework.compat.serialise_kernel_timing``), keeping each pick in the cache for the first
step to read instead of timing again. ``framework.compat.stable_cache_keys`` makes the cache
keys independent of the order in which a process imported its modules. Domain-split models
are not precompiled: their blocks hold collectives, which need the job's process groups.
"""

from __future__ import annotations

import copy
import logging
import os
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

log = logging.getLogger("framework")


@dataclass
class Job:
    """One distinct (block structure, inputs) pair: the block (a CPU copy), its inputs' metadata."""

    block: nn.Module
    args: tuple
    kwargs: dict = field(default_factory=dict)


def _one_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:160]}" if text else type(e).__name__


def _meta(value: Any) -> Any:
    """One block input as a job holds it: a tensor as ("tensor", shape, dtype, requires_grad), a
    plain value (None, a number) as it is."""
    if torch.is_tensor(value):
        return ("tensor", tuple(value.shape), value.dtype, bool(value.requires_grad))
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"a block input of type {type(value).__name__} cannot be precompiled")


def structure_key(module: nn.Module) -> tuple:
    """What a block's graph depends on besides its inputs: class, parameter and buffer shapes,
    and the plain attributes (dropout rate, up/down, scales) of it and its submodules."""
    out: list = [type(module).__qualname__]
    for name, m in module.named_modules():
        plain = sorted((k, v) for k, v in vars(m).items() if isinstance(v, (bool, int, float, str)) or v is None)
        params = m.named_parameters(recurse=False)
        tensors: list[tuple] = [(n, tuple(t.shape), t.dtype, t.requires_grad) for n, t in params]
        tensors += [(n, tuple(t.shape), t.dtype) for n, t in m.named_buffers(recurse=False)]
        out.append((name, type(m).__qualname__, tuple(plain), tuple(tensors)))
    return tuple(out)


def signature(module: nn.Module, args: tuple, kwargs: dict) -> tuple:
    """What a compiled unit's graph depends on: its structure, and its inputs' shapes and dtypes
    (two units of one signature share a graph)."""
    inputs = tuple(_meta(a) for a in args), tuple(sorted((k, _meta(v)) for k, v in kwargs.items()))
    return (structure_key(module), *inputs)


def discover(units: list[tuple[str, nn.Module]], forward: Callable[[Any], Any]) -> list[Job]:
    """The distinct (structure, inputs) pairs the units meet in ``forward(fake_mode)``, which runs
    the training forward on fake tensors made in that mode. The units run their eager forwards
    there, but seeing ``torch.compiler.is_compiling()`` as their compiled forwards will: what a
    unit hands the next is then what it will hand it in the step (the regression preset's fused
    output GroupNorm gives the output convolution 16-bit inputs only when compiled; recorded as
    float32, they left that unit's two graphs to the first step)."""
    from framework import compat

    seen: dict[tuple, nn.Module] = {}

    def recorded(unit, run):  # the unit's forward: its inputs recorded, run as compiled code sees itself
        def call(*args, **kwargs):
            seen.setdefault(signature(unit, args, kwargs), unit)
            with compat.compiling():
                return run(*args, **kwargs)

        return call

    own = [(unit, unit.__dict__.get("forward")) for _, unit in units]  # RegionForward, set by compile_model
    for unit, _ in own:
        unit.forward = recorded(unit, unit.forward)
    try:
        forward(compat.fake_mode())
    finally:
        for unit, before in own:
            if before is None:
                del unit.forward
            else:
                unit.forward = before
    return [Job(cpu_copy(module), key[1], dict(key[2])) for key, module in seen.items()]  # copies: real tensors


@dataclass
class Settings:
    """What a worker needs to build the graphs the training step will ask for."""

    compile_kwargs: dict  # torch.compile's backend, dynamic, options
    channels_last: bool
    device: str
    autocast_dtype: torch.dtype | None  # None: no autocast (fp32, or FSDP2's bf16 parameters)
    param_dtype: torch.dtype | None  # FSDP2's MixedPrecisionPolicy: parameters and inputs cast to it
    threads: int  # inductor's compile threads per worker
    flags: dict  # the global switches the kernels depend on
    recompile_limit: int
    memory_budget: float  # AOTAutograd's activation_memory_budget (in its cache key)
    env: dict  # TORCHINDUCTOR_CACHE_DIR and friends


_FP32 = ("", "cuda.matmul", "cudnn", "cudnn.conv", "cudnn.rnn", "mkldnn", "mkldnn.matmul", "mkldnn.conv")


def _backend(path: str) -> Any:
    obj: Any = torch.backends
    for part in filter(None, path.split(".")):
        obj = getattr(obj, part, None)
    return obj


def global_flags() -> dict:
    """The switches inductor's cache keys and kernels read, as this process has them. The fp32
    precision settings are copied raw: setting them through ``set_float32_matmul_precision``
    gives "ieee" where a process that never set them reads "none", another cache key."""
    fp32 = {p: _backend(p).fp32_precision for p in _FP32 if hasattr(_backend(p), "fp32_precision")}
    return {
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "fp32": fp32,
        "cudnn_tf32": torch.backends.cudnn.allow_tf32,  # torch without fp32_precision
        "matmul_tf32": torch.backends.cuda.matmul.allow_tf32,
        "matmul_precision": torch.get_float32_matmul_precision(),
        "cache_key_tag": torch.compiler.config.cache_key_tag,  # framework.train.compile.custom_ops_tag
    }


def _apply_flags(flags: dict) -> None:
    torch.backends.cudnn.benchmark = flags["cudnn_benchmark"]
    torch.backends.cudnn.deterministic = flags["cudnn_deterministic"]
    torch.use_deterministic_algorithms(flags["deterministic"])
    if not flags["fp32"]:
        torch.backends.cudnn.allow_tf32 = flags["cudnn_tf32"]
        torch.backends.cuda.matmul.allow_tf32 = flags["matmul_tf32"]
        torch.set_float32_matmul_precision(flags["matmul_precision"])
    for path, value in flags["fp32"].items():
        backend = _backend(path)
        if backend is not None and backend.fp32_precision != value:
            backend.fp32_precision = value
    torch.compiler.config.cache_key_tag = flags["cache_key_tag"]


def _make(meta: Any, settings: Settings, generator: torch.Generator, channels_last: bool) -> Any:
    from framework.train.compile import canonical

    if not (isinstance(meta, tuple) and meta and meta[0] == "tensor"):
        return meta
    _, shape, dtype, grad = meta
    if settings.param_dtype is not None and dtype.is_floating_point:
        dtype = settings.param_dtype  # FSDP2's MixedPrecisionPolicy casts a unit's floating inputs
    if dtype.is_floating_point:
        t = torch.randn(shape, generator=generator, device=settings.device).to(dtype)
    else:
        t = torch.zeros(shape, dtype=dtype, device=settings.device)
    return canonical(t, channels_last).requires_grad_(grad)


def build_graphs(jobs: list[Job], settings: Settings, timing_lock: Any = None) -> dict:
    """Compile ``jobs`` (in this process): one forward and backward each on random inputs.
    ``timing_lock``: held while inductor times a kernel's configurations (shared by the workers
    on one GPU)."""
    import contextlib

    from framework import compat
    from framework.train.compile import set_memory_budget, takes_channels_last, use_caches

    os.environ.update(settings.env)
    use_caches()
    set_memory_budget(settings.memory_budget)
    _apply_flags(settings.flags)
    import torch._inductor.config as inductor_config

    inductor_config.compile_threads = max(1, settings.threads)
    # Inductor picks a kernel's configuration by timing the candidates at its first run and keeps
    # the pick beside the kernel in the cache (autotune_local_cache), where the training process
    # finds it. Workers sharing a GPU time one at a time; where that cannot be arranged they
    # leave the pick to the training process (nothing cached: timings taken beside another
    # worker's would be off).
    cuda = settings.device.startswith("cuda")
    if cuda and not (timing_lock is not None and compat.serialise_kernel_timing(timing_lock)):
        inductor_config.autotune_local_cache = False
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, settings.recompile_limit)
    torch._dynamo.config.accumulated_recompile_limit = max(
        torch._dynamo.config.accumulated_recompile_limit, 2 * settings.recompile_limit
    )
    if cuda:
        torch.cuda.set_device(torch.device(settings.device))
    generator = torch.Generator(device=settings.device).manual_seed(0)
    compiled: dict[type, Any] = {}
    done, failed = 0, []
    for job in jobs:
        block = job.block.to(settings.device)
        if settings.param_dtype is not None:  # FSDP2 casts the parameters, not the buffers
            for p in block.parameters():
                p.data = p.data.to(settings.param_dtype)
        cls = type(block)
        if cls not in compiled:
            compiled[cls] = torch.compile(cls.forward, **settings.compile_kwargs)
        try:
            cl = takes_channels_last(block, settings.channels_last)
            args = [_make(a, settings, generator, cl) for a in job.args]
            kwargs = {k: _make(v, settings, generator, cl) for k, v in job.kwargs.items()}
            autocast = (
                torch.autocast(torch.device(settings.device).type, dtype=settings.autocast_dtype)
                if settings.autocast_dtype is not None
                else contextlib.nullcontext()
            )
            with autocast:
                out = compiled[cls](block, *args, **kwargs)
            outs = [o for o in (out if isinstance(out, (tuple, list)) else [out]) if torch.is_tensor(o)]
            outs = [o for o in outs if o.requires_grad]
            if outs:
                torch.autograd.backward(outs, [torch.randn_like(o) for o in outs])
            done += 1
        except Exception as e:  # noqa: BLE001  (the first step compiles what a worker could not)
            failed.append(f"{cls.__name__}: {_one_line(e)}")
        del block
    return {"built": done, "failed": failed}


def _worker(jobs: list[Job], settings: Settings, results, timing_lock) -> None:
    try:
        results.put(build_graphs(jobs, settings, timing_lock))
    except BaseException as e:  # noqa: BLE001  (reported to the parent, never raised into it)
        results.put({"built": 0, "failed": [f"worker: {_one_line(e)}"]})


def _spawn_workers(shares: list[list[Job]], settings: Settings, timeout_s: float) -> dict:
    """Run each share in its own spawned process; results summed, a dead or late worker counted."""
    ctx = torch.multiprocessing.get_context("spawn")
    results, timing_lock = ctx.Queue(), ctx.Lock()  # the workers of a rank share its GPU
    procs = []
    for share in shares:
        # not daemonic: inductor forks its pool
        p = ctx.Process(target=_worker, args=(share, settings, results, timing_lock))
        p.start()
        procs.append(p)
    total: dict = {"built": 0, "failed": []}
    deadline = time.monotonic() + timeout_s
    got = 0
    while got < len(procs):
        try:
            r = results.get(timeout=max(0.1, min(5.0, deadline - time.monotonic())))
        except queue.Empty:
            if time.monotonic() >= deadline or not any(p.is_alive() for p in procs):
                break
            continue
        got += 1
        total["built"] += r["built"]
        total["failed"] += r["failed"]
    for p in procs:
        p.join(timeout=1.0)
        if p.is_alive():  # past the deadline: the first step compiles what it did not finish
            p.kill()
            p.join()
    if got < len(procs):
        total["failed"].append(f"{len(procs) - got} worker(s) ended without a result (killed, crashed or timed out)")
    return total


def _local_world() -> int:
    """Ranks on this node (torchrun's LOCAL_WORLD_SIZE, or SLURM's tasks per node, "4(x2)" too)."""
    per_node = (os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("SLURM_NTASKS_PER_NODE", "1")).split("(")[0]
    return int(per_node) if per_node.isdigit() else 1


def auto_workers(setting: int | None, jobs: int, local_world: int) -> int:
    """``trainer.compile_workers``: as set, or (null) one per 2 of this rank's CPU cores, at most 8
    (none on a 2-core machine: one worker there would only add its start-up)."""
    if setting is not None:
        return max(0, min(setting, jobs))
    cores = max(1, (os.cpu_count() or 1) // max(1, local_world))
    return min(jobs, 8, cores // 2) if cores >= 4 else 0


def precompile(
    jobs: list[Job],
    settings_for: Callable[[int], Settings],
    *,
    workers: int,
    rank: int = 0,
    world: int = 1,
    timeout_s: float = 1800.0,
) -> dict:
    """This rank's share of ``jobs`` (every ``world``-th from ``rank``), built by ``workers``
    processes; returns {"jobs", "built", "failed", "seconds"}."""
    mine = jobs[rank::world]
    t0 = time.perf_counter()
    out: dict = {"jobs": len(mine), "built": 0, "failed": [], "seconds": 0.0}
    if mine and workers > 0:
        n = min(workers, len(mine))
        out.update(_spawn_workers([mine[i::n] for i in range(n)], settings_for(n), timeout_s))
    out["seconds"] = time.perf_counter() - t0
    return out


def plan_jobs(setting: int | None, compiled, model: nn.Module, task, micro: int, precision, device) -> list[Job]:
    """Before sharding: the jobs of ``compiled``'s units, from one forward of ``task``'s loss on a
    fake ``micro``-sample batch (the task's ``example_batch``); [] where precompiling is off or
    cannot apply, said in the log. The random states are left as they were (exact resume)."""
    import random

    import numpy as np

    from framework.domain.splitter import is_split

    why = None
    if not compiled.enabled:
        return []
    if auto_workers(setting, 1 << 20, _local_world()) == 0:
        log.info("compile: blocks not precompiled (trainer.compile_workers=0, or under 4 CPU cores per rank)")
        return []
    if not isinstance(compiled.compile_kwargs.get("backend"), str):
        why = "the compile backend is not a named one"
    elif any(is_split(m) for m in model.modules()):
        why = "domain-split blocks hold collectives"
    if why is None:

        def forward(fake):
            def empty(shape, dtype=torch.float32):
                with fake:
                    return torch.empty(shape, dtype=dtype, device=device)

            batch = task.example_batch(micro, empty)
            if batch is None:
                raise LookupError("the task gives no example_batch")
            batch["step"] = 0
            with fake, precision.autocast(device):
                task.loss(model, batch)

        py, npy = random.getstate(), np.random.get_state()
        try:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                return discover(compiled.units_list, forward)
        except Exception as e:  # noqa: BLE001  (the first step compiles as it always did)
            why = _one_line(e)
        finally:
            random.setstate(py)
            np.random.set_state(npy)
    log.info("compile: blocks not precompiled (%s); the first step compiles them", why)
    return []


def run_jobs(
    jobs: list[Job], setting: int | None, compiled, precision, mixed_precision: bool, device, env, timeout_s: float
) -> dict | None:
    """After sharding: this rank's share of ``jobs`` built by its workers (``trainer.compile_workers``),
    then every rank waits for the rest at the caller's barrier. Logged; returns the counts."""
    local_world = _local_world()
    workers = auto_workers(setting, -(-len(jobs) // max(1, env.world_size)), local_world)
    if not jobs or workers == 0:
        return None
    cores = max(1, (os.cpu_count() or 1) // local_world)
    autocast = precision.autocast_dtype if not mixed_precision else None

    def settings(n: int) -> Settings:
        return Settings(
            compile_kwargs=compiled.compile_kwargs,
            channels_last=compiled.channels_last,
            device=str(device) if device.type != "cuda" else f"cuda:{torch.cuda.current_device()}",
            autocast_dtype=autocast,
            param_dtype=precision.autocast_dtype if mixed_precision else None,
            threads=max(1, cores // n),
            flags=global_flags(),
            recompile_limit=torch._dynamo.config.recompile_limit,
            memory_budget=compiled.memory_budget,
            env={k: os.environ[k] for k in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR") if k in os.environ},
        )

    out = precompile(jobs, settings, workers=workers, rank=env.rank, world=env.world_size, timeout_s=timeout_s)
    log.info(
        "compile: %d distinct block signatures precompiled by %d workers per rank, %d ranks, in %.1f s "
        "(this rank: %d of its %d built%s)",
        len(jobs),
        workers,
        env.world_size,
        out["seconds"],
        out["built"],
        out["jobs"],
        f"; not built: {'; '.join(out['failed'][:3])}" if out["failed"] else "",
    )
    return out


def cpu_copy(block: nn.Module) -> nn.Module:
    """A CPU copy of a unit without its compiled ``forward`` (the instance attribute that
    ``compile_model`` sets) and hooks, so that it pickles into a worker."""
    forward = block.__dict__.pop("forward", None)
    try:
        twin = copy.deepcopy(block)
    finally:
        if forward is not None:
            block.forward = forward
    for m in twin.modules():
        m._forward_pre_hooks.clear()
        m._forward_hooks.clear()
    return twin.to("cpu")
