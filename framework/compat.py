"""Adapters to what differs between installs and torch versions, in one place.

- ``conf_dir()``: where the Hydra config tree is. A checkout has it beside the package
  (``<checkout>/conf``); an installed wheel has it as the data-only package
  ``framework_conf`` (pyproject.toml maps ``conf/`` to it), found through the import
  system (``importlib.util.find_spec``); an editable install maps that package onto the
  checkout's ``conf/``, so both lookups agree there.
- Torch's private APIs that the engine still needs, each behind a function that feature-
  detects it and has a public fallback: ``flatten_mesh`` (``DeviceMesh._flatten``) and
  ``group_timeout`` (the timeout in a process group's backend options). Each was checked
  on the torch minors in ``TORCH_CHECKED`` (tests/framework/distributed/test_compat.py
  runs them on the installed torch; .ci/run runs that file on the oldest and the newest
  minor of the range pyproject.toml claims).
- ``funcol()``: ``torch.distributed._functional_collectives``, the collectives dynamo traces
  (torch.compile through a domain-split model). No public alias in 2.11 to 2.14; the names used
  (``all_to_all_single``, ``all_reduce``, ``all_gather_tensor``) are the ones DTensor is built on.
- ``fake_mode`` and ``step_tracer``: ``torch._subclasses.FakeTensorMode`` and
  ``torch.utils._python_dispatch.TorchDispatchMode``, which framework/plan.py traces a step
  with. Neither has a public alias nor a fallback (without them ``mode=plan`` cannot trace);
  both have been stable since torch 2.0, but so far they were run on 2.13 only
  (tests/framework/test_plan.py).
- ``stable_cache_keys()``: inductor's FX graph cache key pickles each input's memory format,
  which pickle finds by its dotted name ``torch.contiguous_format`` in the first module of
  ``sys.modules`` holding a ``torch`` attribute: whichever module imported torch first, so a
  process that imports in another order (a spawned precompile worker) computes other keys for
  the same graphs. A ``copyreg`` reducer names the format through a function of ours instead.
- ``serialise_kernel_timing(lock)``: wraps inductor's ``CachingAutotuner.benchmark_all_configs``
  (private, present in 2.11 to 2.14) so that precompile workers sharing a GPU time their kernels'
  configurations one at a time; without it the workers leave the timing to the training process.
- ``compiling()``: ``torch.compiler.is_compiling()`` answers True inside it, as it does inside
  a compiled region, by setting the flag behind it (``torch.compiler._is_compiling_flag``, private,
  present in 2.11 to 2.14, which torch's own compile session and export set the same way).
  Precompilation's discovery runs the units' eager forwards under it, so that a layer whose
  compiled form differs (the fused GroupNorm's 16-bit output) hands the next unit what the
  compiled step will. Without the flag it changes nothing, and a unit fed otherwise than its
  emulation is compiled by the first step, as before.

Nothing here imports torch at module level: the CLI validates a config before torch loads.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

CONF_PACKAGE = "framework_conf"

# torch minors every adapter below was run on (CPU, gloo); they must cover pyproject's range.
TORCH_CHECKED = ("2.11", "2.12", "2.13", "2.14")


def conf_dir() -> Path:
    """The config tree: the checkout's ``conf/`` beside this package, else the installed one.

    The checkout wins when there is one, so code and configs always come from the same
    tree (a checkout on PYTHONPATH next to an older wheel uses its own configs). With
    neither, the checkout's path comes back and Hydra says that it is missing (exit 2).
    """
    checkout = Path(__file__).resolve().parent.parent / "conf"
    if (checkout / "config.yaml").is_file():
        return checkout
    return installed_conf_dir() or checkout


def installed_conf_dir() -> Path | None:
    """The folder of the installed package ``framework_conf`` that holds config.yaml, if any.

    A data-only (namespace) package: its folders are the search locations of its spec
    (site-packages/framework_conf for a wheel, the checkout's conf/ for an editable install).
    """
    spec = importlib.util.find_spec(CONF_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        if (Path(folder) / "config.yaml").is_file():
            return Path(folder)
    return None


CONF_DIR = str(conf_dir())


def torch_minor() -> str:
    """``"2.13"`` for torch 2.13.0+cpu."""
    import torch

    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return f"{major}.{minor}"


# -- DeviceMesh._flatten ---------------------------------------------------------------------
def flatten_mesh(mesh: Any, dims: tuple[str, ...], name: str) -> Any:
    """A 1-D mesh over the named adjacent dims of ``mesh`` (a root DeviceMesh), named ``name``.

    ``mesh[dims]._flatten(name)`` where torch has it (2.11 to 2.14: one new process group,
    the view registered on the root mesh); otherwise the same ranks through public API: a
    new root mesh whose shape merges those dims (one process group per dim), sliced.
    """
    sub = mesh[dims] if len(dims) > 1 else mesh[dims[0]]
    private = getattr(sub, "_flatten", None)
    if callable(private):
        return private(name)
    return _flatten_public(mesh, dims, name)


def _flatten_public(mesh: Any, dims: tuple[str, ...], name: str) -> Any:
    from torch.distributed.device_mesh import DeviceMesh

    names = list(mesh.mesh_dim_names)
    idx = [names.index(d) for d in dims]
    if idx != list(range(idx[0], idx[0] + len(idx))):
        raise ValueError(f"flatten_mesh: dims {dims} are not adjacent in {tuple(names)}")
    shape = list(mesh.mesh.shape)
    merged = 1
    for i in idx:
        merged *= shape[i]
    new_shape = shape[: idx[0]] + [merged] + shape[idx[-1] + 1 :]
    new_names = names[: idx[0]] + [name] + names[idx[-1] + 1 :]
    root = DeviceMesh(mesh.device_type, mesh.mesh.reshape(new_shape), mesh_dim_names=tuple(new_names))
    return root[name]


# -- the default process group's timeout -----------------------------------------------------
def group_timeout(group: Any = None) -> datetime.timedelta | None:
    """The collective timeout a process group was created with (default group: None).

    torch has no public getter: the value sits in the backend's options (``_timeout``),
    per device type. None if no group is initialised or torch keeps it elsewhere.
    """
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    pg = group if group is not None else dist.group.WORLD
    if pg is None:
        return None
    for device in ("cpu", "cuda"):
        try:
            timeout = pg._get_backend(torch.device(device)).options._timeout
        except Exception:  # no backend for this device, or the attribute moved
            continue
        if isinstance(timeout, datetime.timedelta):
            return timeout
    return None


# -- functional collectives: what torch.compile can trace ------------------------------------------
def funcol() -> Any:
    """``torch.distributed._functional_collectives``: collectives as ops on tensors (they return a
    new tensor, waited for where it is used), which dynamo traces and inductor schedules."""
    import torch.distributed._functional_collectives as fc

    return fc


@contextlib.contextmanager
def compiling() -> Iterator[None]:
    """``torch.compiler.is_compiling()`` is True inside (see the module doc). The flag is the
    process's, not the thread's: for single-threaded start-up work only."""
    import torch.compiler

    if not isinstance(getattr(torch.compiler, "_is_compiling_flag", None), bool):
        yield
        return
    before = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = True
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag = before


# -- FakeTensorMode and a dispatch mode: framework/plan.py traces a step with them ----------------
def fake_mode(through_compiled: bool = False) -> Any:
    """torch's FakeTensorMode: tensors made inside it have shapes, dtypes and devices but no memory,
    so a paper-size model runs a step on a laptop. Real tensors may mix in (sample indices, tables
    a model builds with numpy). ``torch._subclasses`` has no public alias in 2.11 to 2.14.
    ``through_compiled``: the compiled blocks stay compiled under it (``step_tracer``'s)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    mode.through_compiled = through_compiled  # type: ignore[attr-defined]  # read by compile.dispatch_mode_active
    return mode


def partitioned_backend(joint_pass: Any = None) -> Any:
    """A torch.compile backend that splits each graph into forward and backward as inductor does
    (its decompositions, the min-cut partitioner with ``compiler="inductor"``, the memory budget
    ``activation_memory_budget`` holds, and ``joint_pass`` on the joint graph, inductor's
    ``joint_custom_pre_pass``), then runs both op by op: a compiled step's saved activations
    without generating a kernel (torch's ``aot_eager_decomp_partition`` plus the pass; the plan's
    estimate of a compiled run, framework/plan.py)."""
    from importlib import import_module

    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop
    from torch._functorch import config as functorch_config
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def partition(joint, inputs, **kwargs):
        if joint_pass is not None:
            joint_pass(joint.graph)
        return min_cut_rematerialization_partition(joint, inputs, compiler="inductor", **kwargs)

    def backend(gm, example_inputs, **kwargs):
        with functorch_config.patch({"unlift_effect_tokens": True}):
            return aot_autograd(
                fw_compiler=boxed_nop,
                bw_compiler=boxed_nop,
                decompositions=lambda: import_module("torch._inductor.compile_fx").select_decomp_table(),
                partition_fn=partition,
            )(gm, example_inputs)

    return backend


def step_tracer(through_compiled: bool = False) -> Any:
    """A context manager that sees every aten op of a traced step (fake tensors included) and
    keeps two tallies: ``.live`` / ``.peak``, the bytes of the storages ops allocate while those
    stay alive (now / the most at once), and ``.flops``, by torch.utils.flop_counter's per-op
    formulas. (FlopCounterMode itself would do for the FLOPs, but its module tracker holds
    gradients until a module's are all computed, which raises the peak.)

    An op's output is a new allocation unless its storage is one of the op's inputs' (a view or
    an in-place op); it is freed when its storage is (a weakref finalizer: torch keeps one Python
    object per live storage, so the finalizer fires when the memory would be released).

    ``through_compiled``: the compiled blocks stay compiled while the tracer is on (they run
    eagerly under any other dispatch mode, as dynamo would), torch.compile compiles under it, and
    it sees the ops the compiled graphs run, not those of their tracing
    (``TorchDispatchMode.ignore_compile_internals``, torch 2.11-2.14).
    """
    import weakref

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import flop_registry

    def tensors(x):
        if isinstance(x, torch.Tensor):
            yield x
        elif isinstance(x, (list, tuple)):
            for y in x:
                yield from tensors(y)
        elif isinstance(x, dict):
            for y in x.values():
                yield from tensors(y)

    def storage(t):
        try:
            return t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a tensor without storage (sparse, nested)
            return None

    class StepTracer(TorchDispatchMode):
        @classmethod
        def ignore_compile_internals(cls) -> bool:
            return through_compiled

        def __init__(self):
            super().__init__()
            self.through_compiled = through_compiled  # read by compile.dispatch_mode_active
            self.live = self.peak = self.flops = 0
            self._seen: dict[int, Any] = {}

        def _free(self, key: int, nbytes: int) -> None:
            self._seen.pop(key, None)
            self.live -= nbytes

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            count = flop_registry.get(func._overloadpacket)
            if count is not None:
                self.flops += count(*args, **kwargs, out_val=out)
            inputs = {id(storage(t)) for t in tensors((args, kwargs))}
            for t in tensors(out):
                st = storage(t)
                key = id(st)
                if st is None or key in inputs or key in self._seen:
                    continue
                self.live += st.nbytes()
                self.peak = max(self.peak, self.live)
                self._seen[key] = weakref.finalize(st, self._free, key, st.nbytes())
            return out

    return StepTracer()


def memory_format(name: str) -> Any:
    """``torch.<name>``: how ``stable_cache_keys`` pickles a memory format."""
    import torch

    return getattr(torch, name)


def stable_cache_keys() -> None:
    """Pickle memory formats the same way in every process (see the module doc); idempotent."""
    import copyreg

    import torch

    copyreg.pickle(torch.memory_format, lambda f: (memory_format, (str(f).removeprefix("torch."),)))


def serialise_kernel_timing(lock: Any) -> bool:
    """Inductor times each kernel's candidate configurations at its first launch
    (``CachingAutotuner.benchmark_all_configs``); make every such timing hold ``lock``, so that
    processes sharing a GPU never time while another times. False where this torch lacks the
    method (the caller then leaves the timing to one process)."""
    try:
        from torch._inductor.runtime.triton_heuristics import CachingAutotuner
    except ImportError:
        return False
    original = getattr(CachingAutotuner, "benchmark_all_configs", None)
    if original is None:
        return False
    if getattr(original, "_framework_lock", None) is lock:
        return True

    def timed_alone(self, *args, **kwargs):
        with lock:
            return original(self, *args, **kwargs)

    timed_alone._framework_lock = lock  # type: ignore[attr-defined]
    CachingAutotuner.benchmark_all_configs = timed_alone  # type: ignore[method-assign]
    return True
