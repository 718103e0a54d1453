"""``trainer.compile=true``: regional compilation of the training model, on every layout.

What is compiled: the forward of each repeated block (the units ``find_units`` picks, the
FSDP2 units, e.g. a UNet's residual blocks or a transformer's blocks), once per block class and
input signature. All instances of a class share one code object, so torch.compile caches
one graph per distinct signature (channels, up/down, attention, resolution) and every block
with that signature reuses it: a 78.6 M-parameter UNet of 55 blocks has 22-24 signatures
(graphs). The parts between blocks (input conv, output head, loss) stay eager, except the
layers a model names in ``compile_regions`` (``named_regions``), compiled like the blocks.

Why not ``unit.compile()`` per block (what this replaced): every block compiled
``nn.Module._call_impl``, one code object for all 55, so after dynamo's default
``recompile_limit`` of 8 signatures the rest ran eager; worse, the trainer then counted FLOPs
on the first step under ``FlopCounterMode``, and dynamo permanently skips a frame it first
meets under a torch dispatch mode (seen with torch 2.13; the 2.11 GPU figures fit it: compiled
ran at eager speed). Here the recompile limit is raised to the number of units, a block runs
eager while a dispatch mode is active (a user's debug mode), and the trainer's FLOPs come from
a step traced on fake tensors (``framework.plan.step_flops``), so the first step is compiled.

Layouts: compiled before sharding (torchtitan's order). FSDP2's and DDP's hooks stay eager
around the compiled forwards (``forward`` is replaced on the instance: hooks, parameter
names and checkpoints are untouched). Domain layouts compile too, after the splitter: inside
a compiled block the halo exchanges, GroupNorm sums and row gathers take their functional-
collective form (framework/domain/comm.py: one all-to-all per halo exchange, functional
all-reduces), which dynamo traces into the block's graph without a break, with the same
values as the eager p2p path.

Memory format: convolutional blocks on CUDA compile channels-last (``_wants_channels_last``):
cuDNN's NHWC kernels then need no transposes. What makes it pay is the model's: normalisations
whose reductions read NHWC well under compile, and blocks that hand back dense gradients, so no
compiled backward copies what it receives (the UNet recipe's layers do both).

CUDA graphs (``trainer.compile_cudagraphs``): the blocks' graphs replayed through inductor's
cudagraph trees, one launch per graph, where the parameters stay at fixed addresses (sharding
``none`` or ``ddp``, no domain split, no activation checkpointing around the blocks:
``cudagraph_obstacle``); see ``_replay_as_cuda_graphs``.

Only training steps (grad enabled) run compiled; validation and sampling (no_grad) run the
eager forward, so they cost no second set of compiles.

Cache: the inductor/Triton cache goes to the user's own ``~/.cache/framework/compile``
(``$XDG_CACHE_HOME`` moves it) unless ``TORCHINDUCTOR_CACHE_DIR`` is set, so a resumed job, or
another run of the same model, loads the compiled kernels instead of compiling again. It is
never in the run dir: inductor unpickles and imports what it finds in its cache, and a run dir
may come from someone else (a shared or copied run), so the cache must be a directory only
this user can write to or swap (``private_dir``). With a warm cache dynamo still traces: an
8 s first step on an H200, against 143-216 s cold for the regression preset. For moving
caches between machines torch has the portable "mega-cache"
(``torch.compiler.save_cache_artifacts`` / ``load_cache_artifacts``). The cache keys carry a
digest of the custom ops the model's code registers (``custom_ops_tag``): an upgrade that changes
one compiles afresh instead of loading graphs that call it the old way.
"""

from __future__ import annotations

import logging
import os
import stat
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from framework.errors import ConfigError

log = logging.getLogger("framework")


def compile_wanted(setting: bool | None, device_type: str) -> bool:
    """``trainer.compile``: true and false as said; null (auto, the GPU presets) compiles on CUDA,
    where it pays (1.9x the eager step for the regression preset), and leaves CPU runs eager."""
    return setting if setting is not None else device_type == "cuda"


# layouts whose parameters keep their addresses from step to step, as a replayed CUDA graph needs
# (FSDP2 gathers its parameters into new storage every step; domain layouts' collectives are not
# captured)
CUDAGRAPH_SHARDINGS = ("none", "ddp")
# where null (auto) turns them on: measured on one GPU; DDP's gradient hooks around the replayed
# backward graphs are not yet run on GPUs here, so DDP takes them when asked (``true``) only
CUDAGRAPH_AUTO = ("none",)


def cudagraph_obstacle(sharding: str, domain: int, checkpointed: bool) -> str | None:
    """Why the compiled blocks cannot replay as CUDA graphs in this layout, or None.
    ``sharding``: the policy the run applies (``plan.effective``); ``checkpointed``: activation
    checkpointing wraps the blocks (a recording would see tensors freed under it: torch issue
    154306, open)."""
    if sharding not in CUDAGRAPH_SHARDINGS:
        return f"sharding={sharding} gathers its parameters into new storage every step (CUDA graphs: none or ddp)"
    if domain > 1:
        return f"parallel.domain={domain}: its collectives are not captured"
    if checkpointed:
        return "activation checkpointing wraps the compiled blocks (model.checkpoint_level > 0)"
    return None


def cudagraphs_wanted(
    setting: bool | None, device_type: str, sharding: str, domain: int, checkpointed: bool = False
) -> bool:
    """``trainer.compile_cudagraphs``: null (auto) turns them on for CUDA under ``sharding=none``
    where nothing stands in the way (``cudagraph_obstacle``); ``true`` there too, and under
    ``ddp``. (``true`` with an obstacle is refused at start-up: ``framework.runtime``.)"""
    if setting is not None:
        return setting
    auto = device_type == "cuda" and sharding in CUDAGRAPH_AUTO
    return auto and not cudagraph_obstacle(sharding, domain, checkpointed)


def dispatch_mode_active() -> bool:
    """A torch dispatch mode is on (FlopCounterMode, fake tensors, a debug mode): the compiled
    blocks run their eager forwards, as dynamo would skip the frame for good (and fake tensors
    in precompilation's discovery should meet the eager code). Only modes made to be traced
    through compiled code (``compat.fake_mode`` and ``compat.step_tracer`` with
    ``through_compiled``: the plan's trace of a compiled step) leave the blocks compiled."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return any(not getattr(m, "through_compiled", False) for m in _get_current_dispatch_mode_stack())


def canonical(t, channels_last: bool):
    """A floating tensor in the memory format the compiled blocks take (4-D: channels-last where
    compiled so, else contiguous; others contiguous); anything else as it is. A no-op for what the
    blocks hand each other; it makes a block's graph depend on shapes and dtypes alone, which is
    what parallel precompilation (framework/train/precompile.py) reproduces."""
    if not (torch.is_tensor(t) and t.is_floating_point()):
        return t
    if t.dim() == 4:
        return t.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    return t.contiguous()


class RegionForward:
    """A unit's ``forward``: the class's compiled forward in training steps, else the eager one."""

    def __init__(self, module: nn.Module, compiled, eager, channels_last: bool = False):
        self.module, self.compiled, self.eager, self.channels_last = module, compiled, eager, channels_last

    def __call__(self, *args, **kwargs):
        if torch.is_grad_enabled() and not dispatch_mode_active():
            cl = self.channels_last
            args = tuple(canonical(a, cl) for a in args)
            kwargs = {k: canonical(v, cl) for k, v in kwargs.items()}
            return self.compiled(self.module, *args, **kwargs)
        return self.eager(*args, **kwargs)


def dynamo_counts(codes=()) -> dict:
    """Dynamo's running totals: graphs, frames, graph breaks (with reasons), and per code object
    of ``codes`` the cached graphs (one per signature; cached - 1 are recompiles)."""
    from torch._dynamo.utils import counters

    breaks = Counter({k.split("\n")[0][:160]: v for k, v in counters["graph_break"].items()})
    inductor = counters["inductor"]
    entries = getattr(torch._dynamo.eval_frame, "_debug_get_cache_entry_list", None)  # private helper
    cached = sum(len(entries(code)) for code in codes) if entries is not None else 0
    return {
        "graphs": int(counters["stats"]["unique_graphs"]),
        "frames": int(counters["frames"]["ok"]),
        "graph_breaks": int(sum(breaks.values())),
        "break_reasons": dict(breaks.most_common(3)),
        "cached": cached,
        "recompiles": max(0, cached - len(codes)),
        "built": int(inductor["fxgraph_cache_miss"]),  # graphs inductor built here
        "loaded": int(inductor["fxgraph_cache_hit"]),  # graphs it loaded from its cache
        # joint graphs AOTAutograd loaded from its cache (no tracing, no partitioning)
        "aot_loaded": int(counters["aot_autograd"]["autograd_cache_hit"]),
        "cudagraph_skips": int(inductor["cudagraph_skips"]),  # graphs inductor would not capture
    }


@dataclass
class Compiled:
    """What ``compile_model`` did; ``stats()`` after a step gives the compile counts."""

    enabled: bool
    reason: str = ""
    classes: dict = field(default_factory=dict)  # class name -> units
    channels_last: bool = False
    cache_dir: str = ""
    first_step_s: float | None = None
    codes: list = field(default_factory=list)
    compile_kwargs: dict = field(default_factory=dict)  # torch.compile's: backend, dynamic, options
    memory_budget: float = 1.0  # AOTAutograd's activation_memory_budget
    cudagraphs: bool = False  # the compiled graphs replayed as CUDA graphs
    units_list: list = field(default_factory=list)  # (name, module) of the compiled units
    _base: dict = field(default_factory=dict)

    @property
    def units(self) -> int:
        return len(self.units_list)

    def stats(self) -> dict:
        now = dynamo_counts(self.codes)
        counted = ("graphs", "frames", "graph_breaks", "built", "loaded", "aot_loaded", "cudagraph_skips")
        out = {k: now[k] - self._base.get(k, 0) for k in counted}
        out.update(
            cached_graphs=now["cached"],
            recompiles=now["recompiles"],
            break_reasons=now["break_reasons"],
            units=self.units,
            first_step_s=self.first_step_s,
        )
        return out

    def summary(self) -> str:
        s = self.stats()
        first = f"first compiled step {s['first_step_s']:.1f} s; " if s["first_step_s"] is not None else ""
        return (
            f"compile: {first}{s['cached_graphs']} graphs for {self.units} units "
            f"({', '.join(f'{n} x{c}' for n, c in self.classes.items())}), {s['recompiles']} recompiles "
            f"(one per distinct block signature, limit {torch._dynamo.config.recompile_limit}), "
            f"{s['graph_breaks']} graph breaks; inductor built {s['built']} forward/backward graphs "
            f"and loaded {s['loaded']} from its cache ({s['aot_loaded']} joint graphs from AOTAutograd's)"
            + (f"; CUDA graphs on, {s['cudagraph_skips']} graphs not captured" if self.cudagraphs else "")
        )


def user_cache_dir() -> Path:
    """Where compiled kernels are cached unless ``TORCHINDUCTOR_CACHE_DIR`` says otherwise."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "framework" / "compile"


def private_dir(path: Path) -> Path | None:
    """``path``, created if need be (mode 700), or None if it cannot be (a read-only or absent
    home). Refused (ConfigError) unless this user owns it and no one else could put files in it
    or swap it: inductor runs the code it finds in its cache. So, as ssh checks its files, every
    directory above it must be this user's or root's and writable by no one else (unless
    sticky, as /tmp is)."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = path.resolve()  # the directories a link leads through are the ones to check
        chain = [(p, p.stat()) for p in (path, *path.parents)]
    except OSError as e:
        log.warning("compile cache %s cannot be created (%s): using torch's default", path, e.strerror or e)
        return None
    uid = os.getuid() if hasattr(os, "getuid") else None
    for p, st in chain:
        owners = (uid,) if p == path else (uid, 0)
        if uid is not None and st.st_uid not in owners:
            raise ConfigError(
                f"compile cache {path}: {p} belongs to another user (uid {st.st_uid}), and inductor runs the "
                f"code it finds in its cache; set TORCHINDUCTOR_CACHE_DIR or XDG_CACHE_HOME to a directory of your own"
            )
        if st.st_mode & 0o022 and not (p != path and st.st_mode & stat.S_ISVTX):
            raise ConfigError(
                f"compile cache {path}: {p} may be written by others (mode {st.st_mode & 0o7777:o}), and inductor "
                f"runs the code it finds in its cache; chmod go-w it, or set TORCHINDUCTOR_CACHE_DIR to a "
                f"directory only you write"
            )
    return path


def _set_cache_dir(cache_dir: Path | None) -> str:
    """The run's cache dir, unless the user set one. Torch writes its default into the variable
    the first time it asks (an import may have done so): that value counts as unset."""
    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        default = os.path.abspath(default_cache_dir())
    except ImportError:  # older layout of torch's private modules
        default = None
    if cache_dir is not None and (current is None or os.path.abspath(current) == default):
        private = private_dir(Path(cache_dir))
        if private is not None:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(private.resolve())
    return os.environ.get("TORCHINDUCTOR_CACHE_DIR", "(torch default)")


def set_memory_budget(budget: float) -> None:
    """AOTAutograd's ``activation_memory_budget`` (shared by the training process and the
    precompile workers: it is part of the cache key). 1: its default min-cut partition, which
    keeps every convolution's input for backward; below 1 it recomputes such pointwise results
    (GroupNorm + SiLU of a saved tensor) in backward, within that share of the activations."""
    import torch._functorch.config as functorch_config

    functorch_config.activation_memory_budget = float(budget)


def use_caches() -> None:
    """Cache settings shared by the training process and the precompile workers (idempotent).

    Memory formats pickled by name (``compat.stable_cache_keys``), so both compute one key.
    AOTAutograd's cache takes graphs holding autograd functions: off by default in torch 2.11-2.14
    (being rolled out; torch's PR 149751 checked that the traced function is pure in its
    inputs), so every block's joint graph was traced and partitioned again by the first step, even
    with precompiled graphs on disk. The blocks' functions (``_DenseGrad``, the GroupNorm's
    explicit backward) hold no state: their forward and backward are traced into the key."""
    import torch._functorch.config as functorch_config

    from framework import compat

    compat.stable_cache_keys()
    if hasattr(functorch_config, "autograd_cache_allow_custom_autograd_functions"):
        functorch_config.autograd_cache_allow_custom_autograd_functions = True
    torch.compiler.config.cache_key_tag = custom_ops_tag()


def custom_ops_tag() -> str:
    """``torch.compiler.config.cache_key_tag`` for this process: the user's
    ``TORCH_COMPILE_CACHE_KEY_TAG``, and a digest of the custom ops registered outside torch (each
    one's name, schema and defining module's source). Inductor's cache keys a graph by its code,
    which names a custom op but not its signature: a cached graph written against an op's old
    schema (an upgrade of the model's code) would call it with arguments it no longer takes, or
    expect outputs of another shape. The precompile workers take the training process's tag (a
    worker may import fewer of the recipes' modules)."""
    import hashlib
    import sys

    from torch._library import custom_ops

    digest = hashlib.sha256()
    for name, opdef in sorted(getattr(custom_ops, "OPDEFS", {}).items()):  # (private: absent, no digest)
        module = getattr(getattr(opdef, "_init_fn", None), "__module__", None) or ""
        if module == "torch" or module.startswith("torch."):
            continue
        namespace, op = name.split("::", 1)
        digest.update(f"{name}|{getattr(getattr(torch.ops, namespace), op).default._schema}|".encode())
        path = getattr(sys.modules.get(module), "__file__", None)
        if path and os.path.exists(path):
            digest.update(Path(path).read_bytes())
    user = os.environ.get("TORCH_COMPILE_CACHE_KEY_TAG", "")
    return f"{user}+ops-{digest.hexdigest()[:16]}" if user else f"ops-{digest.hexdigest()[:16]}"


def _wants_channels_last(units: list, device_type: str) -> bool:
    """On for CUDA when the compiled blocks convolve (4-D weights) and are not split over a domain.

    cuDNN's convolutions run NHWC: NCHW activations cost a transpose in and out of each (41 ms
    of a 300 ms step, the 78.6 M UNet of docs/benchmarks.md on an H200). Channels-last used to
    lose (11.6 samples/s against 12.7) to GroupNorm reductions over channel groups strided by C
    and to layout copies at the blocks' edges; with the per-channel GroupNorm of the compiled
    blocks it is the faster (13.5 against 13.2 in one run). Domain-split blocks stay NCHW: their
    GroupNorm reshapes and halo rows are written for it."""
    from framework.domain.splitter import is_split

    if device_type != "cuda":
        return False
    modules = [m for _, unit in units for m in unit.modules()]
    if any(is_split(m) for m in modules):
        return False
    return any(p.dim() == 4 for m in modules for p in m.parameters(recurse=False))


def takes_channels_last(unit: nn.Module, channels_last: bool) -> bool:
    """Whether a compiled unit takes its 4-D inputs channels-last: all of them when the blocks run
    so, but a unit marked ``compile_contiguous_inputs`` (a network's first convolution, which reads
    the NCHW batch) takes them contiguous and changes their layout inside its graph, fused into its
    first kernel (with the cast and channel padding), instead of a separate copy of the whole
    input (1.06 ms of the regression step on an H200, docs/benchmarks.md, run 13); such a unit
    hands back channels-last outputs (``configure_compile(channels_last=True)`` tells it)."""
    return channels_last and not getattr(unit, "compile_contiguous_inputs", False)


def compile_model(
    model: nn.Module,
    *,
    units: list[str] | None = None,
    device_type: str = "cuda",
    deterministic: bool = False,
    cache_dir: Path | None = None,
    backend="inductor",
    channels_last: bool | None = None,
    cudnn_benchmark: bool | None = None,
    options: dict | None = None,
    dynamic: bool | None = False,
    memory_budget: float = 1.0,
    cudagraphs: bool = False,
) -> Compiled:
    """Compile ``model``'s repeated blocks in place (before sharding); see the module doc.

    ``channels_last``: channels-last activations with inductor's layout optimisation forced
    (None: on for convolutional blocks on CUDA, see ``_wants_channels_last``).
    ``cudnn_benchmark``: None turns it on for CUDA unless ``deterministic``. ``options``: inductor
    config patches. ``dynamic``: torch.compile's (False: static shapes, one graph per block
    signature). ``memory_budget``: ``trainer.compile_memory_budget`` (``set_memory_budget``).
    ``cudagraphs``: ``trainer.compile_cudagraphs`` (``_replay_as_cuda_graphs``). Before compiling,
    every module of ``model`` with a ``configure_compile(*, cudagraphs, channels_last)`` method is
    told whether the graphs will replay as CUDA graphs and whether the blocks run channels-last (a
    model's layer may pick its kernels by them, or, taking contiguous inputs
    (``takes_channels_last``), hand back channels-last outputs).
    """
    from framework.distributed.sharding import find_units

    picked = find_units(model, list(units or []))
    if not picked:
        msg = "trainer.compile: the model has no repeated blocks to compile; running eager"
        warnings.warn(msg, stacklevel=2)
        log.warning(msg)
        return Compiled(False, reason="no units")
    blocks = list(picked)
    picked += named_regions(model, picked)

    cache = _set_cache_dir(cache_dir)
    use_caches()
    set_memory_budget(memory_budget)
    cfg = torch._dynamo.config
    # one cache entry per distinct signature of a block class, at most one per unit
    cfg.recompile_limit = max(cfg.recompile_limit, len(picked) + 8)
    cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 2 * len(picked) + 64)
    if cudnn_benchmark is None:
        cudnn_benchmark = device_type == "cuda" and not deterministic
    if cudnn_benchmark:  # static shapes: pick each conv's fastest algorithm once
        torch.backends.cudnn.benchmark = True
    if channels_last is None:  # the blocks' choice: a region's convolution (a DiT's patches) does not make one
        channels_last = _wants_channels_last(blocks, device_type)
    options = dict(options or {})
    if channels_last:
        # NHWC convs inside every graph: inductor's own heuristic skips it for graphs with a conv
        # whose output has half its input channels (the decoder's), and leaves its intermediate
        # buffers (the conv inputs) NCHW, so cuDNN transposed in and out of every conv.
        options.setdefault("force_layout_optimization", True)
    recomputed = recomputed_ops(model)
    if backend == "inductor":
        if options.get("joint_custom_pre_pass") is not None:
            log.warning(
                "compile: options hold a joint_custom_pre_pass; %s not marked for recompute, random inputs of "
                "custom ops not marked saved",
                recomputed,
            )
        else:
            options["joint_custom_pre_pass"] = RecomputeOps(recomputed)
    replay = cudagraphs and device_type == "cuda" and backend == "inductor"
    if replay:
        options["triton.cudagraphs"] = True  # what mode="reduce-overhead" sets
    elif cudagraphs:
        msg = f"trainer.compile_cudagraphs: CUDA graphs need CUDA and inductor (here {device_type}, {backend}); off"
        warnings.warn(msg, stacklevel=2)
        log.warning(msg)
    kwargs = {"backend": backend, "dynamic": dynamic}
    if options and backend == "inductor":
        kwargs["options"] = options
    for m in model.modules():  # a module may pick the kernels that pay under these settings
        configure = getattr(m, "configure_compile", None)
        if callable(configure):
            configure(**_accepted(configure, cudagraphs=replay, channels_last=channels_last))
    compiled_by_class: dict[type[nn.Module], object] = {}
    classes: Counter = Counter()
    for _, unit in picked:
        cls = type(unit)
        if cls not in compiled_by_class:
            compiled_by_class[cls] = torch.compile(cls.forward, **kwargs)
        cl = takes_channels_last(unit, channels_last)
        unit.forward = RegionForward(unit, compiled_by_class[cls], unit.forward, cl)
        classes[cls.__name__] += 1
    codes = list({c.forward.__code__ for c in compiled_by_class})
    out = Compiled(
        True,
        classes=dict(classes),
        channels_last=channels_last,
        cache_dir=cache,
        codes=codes,
        compile_kwargs=kwargs,
        memory_budget=float(memory_budget),
        cudagraphs=replay,
        units_list=picked,
        _base=dynamo_counts(),
    )
    _watch_first_step(model, out)
    if out.cudagraphs:
        _replay_as_cuda_graphs(model)
    log.info(
        "compile: %d units (%s) compiled per block class, regional, backend=%s; activations %s; "
        + ("CUDA graphs; " if out.cudagraphs else "")
        + "cache %s",
        out.units,
        ", ".join(f"{n} x{c}" for n, c in classes.items()),
        backend if isinstance(backend, str) else type(backend).__name__,
        "channels_last" if channels_last else "as given",
        cache,
    )
    return out


def _accepted(fn, **settings) -> dict:
    """The ``settings`` ``fn`` takes (all of them if it takes ``**kwargs``): a ``configure_compile``
    written before an argument was added keeps working."""
    import inspect

    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return settings
    return {k: v for k, v in settings.items() if k in params}


def recomputed_ops(model: nn.Module) -> tuple[str, ...]:
    """The custom ops (``"namespace::name"``) the model's layers name in a ``recomputed_ops``
    attribute: compiled graphs recompute their outputs in backward instead of keeping them."""
    names = {n for m in model.modules() for n in getattr(m, "recomputed_ops", ())}
    return tuple(sorted(names))


try:
    from torch._inductor.custom_graph_pass import CustomGraphPass
except ImportError:  # (present in torch 2.11-2.14)
    CustomGraphPass = object  # type: ignore[assignment,misc]


class RecomputeOps(CustomGraphPass):
    """Inductor's joint-graph pass marking every node of the named ops must-recompute, as a
    selective activation-checkpointing policy would: AOTAutograd's partitioner then recomputes
    their outputs in backward from their inputs, whatever the memory budget (at budget 1 it would
    keep them; below 1 its knapsack counts custom ops as free, so it recomputes all or none).
    A layer picks where by which op it calls (a GroupNorm of chosen levels, for instance).

    It also marks must-save every random draw (an op tagged ``nondeterministic_seeded``) that a
    custom op reads, e.g. the seed of a kernel drawing its own dropout mask: below budget 1 the
    partitioner counts a seed as free to recompute and would draw a new one in backward, whose
    gradients would then belong to another mask than the forward's (its own random ops it keeps
    by name; a custom op's inputs it cannot know).
    Picklable, and named in the compiled graphs' cache keys through ``uuid``."""

    VERSION = 2

    def __init__(self, names):
        self.names = tuple(sorted(names))

    def __call__(self, graph) -> None:
        from torch.utils.checkpoint import CheckpointPolicy

        for node in graph.nodes:
            op = node.target
            if node.op != "call_function" or not isinstance(op, torch._ops.OpOverload):
                continue
            if op._schema.name in self.names:
                node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            if op.namespace not in ("aten", "prims"):  # a custom op: opaque to the partitioner
                for arg in node.all_input_nodes:
                    if isinstance(arg.target, torch._ops.OpOverload) and _random(arg.target):
                        arg.meta["recompute"] = CheckpointPolicy.MUST_SAVE

    def uuid(self):
        return f"framework.RecomputeOps.v{self.VERSION}:{','.join(self.names)}"


def _random(op) -> bool:
    return torch.Tag.nondeterministic_seeded in op.tags


def named_regions(model: nn.Module, units: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """The submodules a model asks to compile besides its repeated blocks: each module's
    ``compile_regions`` attribute, a tuple of paths below it (a single layer outside every block
    whose eager kernels cost time, e.g. a model's output norm: docs/benchmarks.md, run 10).

    A region inside a unit is left to it, one that holds a unit would compile the unit twice and
    is refused, a layer named twice (by a wrapper and by the model) is compiled once, and one
    without trainable parameters is left eager like such blocks (``find_units``)."""
    out: list[tuple[str, nn.Module]] = []
    seen = {id(m) for _, m in units}
    for prefix, module in model.named_modules():
        paths = getattr(module, "compile_regions", ())
        if not isinstance(paths, (tuple, list)):
            raise ConfigError(f"{type(module).__name__}.compile_regions: a tuple of submodule paths, got {paths!r}")
        for path in paths:
            name = f"{prefix}.{path}" if prefix else path
            try:
                region = module.get_submodule(path)
            except AttributeError:
                raise ConfigError(f"{type(module).__name__}.compile_regions: no submodule {path!r}") from None
            if any(u.startswith(name + ".") for u, _ in units):
                raise ConfigError(f"compile_regions: {name!r} holds compiled blocks; name a layer outside them")
            inside = any(name.startswith(u + ".") for u, _ in units)
            if inside or id(region) in seen or not any(p.requires_grad for p in region.parameters()):
                continue
            seen.add(id(region))
            out.append((name, region))
    return out


def _replay_as_cuda_graphs(model: nn.Module) -> None:
    """What the training step needs around compiled blocks replayed as CUDA graphs (inductor's
    cudagraph trees, one memory pool for every block's forward and backward graph).

    Why: each kernel of a compiled graph is otherwise a launch from Python; the regression
    UNet's step enqueues several thousand, and with fast kernels the host, not the GPU, set the
    pace (docs/benchmarks.md, run 8). A replayed graph is one launch.

    Each training forward of the model (each micro-batch) starts a new generation of the tree:
    from then on the previous one's outputs may be overwritten. Gradients of the blocks'
    parameters are outputs of the backward graphs, which autograd keeps as ``.grad`` without a
    copy: with several micro-batches per step the next replay would overwrite them, so each
    such gradient is copied out of the pool once, before the next micro-batch (with one
    micro-batch per step: nothing, the optimizer has used them before the next forward and
    ``zero_grad`` drops them)."""
    params = [p for p in model.parameters() if p.requires_grad]
    moved: set[int] = set()  # ids of this step's gradients that live outside the pool

    def hook(module, args):
        if not torch.is_grad_enabled() or dispatch_mode_active():
            return
        held = [p for p in params if p.grad is not None]
        if not held:  # the step's first micro-batch
            moved.clear()
        for p in held:  # per parameter: one may get its first gradient in a later micro-batch
            if id(p.grad) not in moved:
                p.grad = p.grad.clone()
                moved.add(id(p.grad))  # held by the parameter until zero_grad: the id stays unique
        torch.compiler.cudagraph_mark_step_begin()

    model.register_forward_pre_hook(hook)


def _watch_first_step(model: nn.Module, out: Compiled) -> None:
    """Log the compile counts once the first compiled forward+backward is done (at the next
    compiled forward): compilation happens lazily, inside the first training step."""
    state = {"t0": None}

    def hook(module, args):
        if not torch.is_grad_enabled() or dispatch_mode_active():
            return
        if state["t0"] is None:
            state["t0"] = time.perf_counter()
            return
        out.first_step_s = time.perf_counter() - state["t0"]
        handle.remove()
        s = out.stats()
        log.info(out.summary())
        if s["graph_breaks"]:
            log.warning(
                "compile: %d graph breaks; most frequent: %s",
                s["graph_breaks"],
                "; ".join(f"{k} (x{v})" for k, v in s["break_reasons"].items()),
            )
        if s["cached_graphs"] >= torch._dynamo.config.recompile_limit:
            log.warning(
                "compile: recompile limit %d reached: further block signatures run eager",
                torch._dynamo.config.recompile_limit,
            )

    handle = model.register_forward_pre_hook(hook)
