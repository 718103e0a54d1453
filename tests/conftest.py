"""Shared fixtures: configs composed through Hydra's compose API, runs in tmp_path."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


class MarkerPayload:
    """A hostile pickle's stand-in: unpickling it calls ``open(marker, "w")``, so a file appears
    if anything ever runs it (tests show it does when unpickled plainly)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


_OWN_CACHE: list[str] = []  # the cache dir this process made (xdist workers inherit the controller's)


def pytest_configure(config):
    # The compiled-kernel cache lives under XDG_CACHE_HOME (framework.train.compile): tests get
    # their own, never the user's, made by the controller (xdist's workers inherit it) and
    # removed at the end.
    cache = os.environ.get("FRAMEWORK_TESTS_CACHE")
    if cache is None:
        cache = tempfile.mkdtemp(prefix="framework-tests-cache-")
        os.environ["FRAMEWORK_TESTS_CACHE"] = cache
        _OWN_CACHE.append(cache)
    os.environ["XDG_CACHE_HOME"] = cache
    os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)  # it would take precedence over XDG_CACHE_HOME
    # Inductor's CPU backend checks each vector ISA the CPU reports by building a probe and loading
    # it in a new interpreter, once per process: 8 s for every process that compiles (28 s on the
    # CUDA build of torch 2.11 the smoke run uses), and the tests start dozens. "0" skips the probe
    # and has inductor write scalar C++ kernels: g++ then builds each kernel without instantiating
    # ATen's vector templates, the tiny recipe's 81 kernels in 49 s of g++ instead of 76 (its test
    # 72 s instead of 91 here). The vector code is inductor's own, not what these tests check.
    os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")
    # Inductor builds its kernels in a pool of as many processes as there are cores, each importing
    # torch when it starts. With two xdist workers on 2 cores the pool only adds those start-ups
    # (the tiny recipe's compiled CLI test: 71 s instead of 91, 32 s less CPU); the precompile
    # workers set their own count.
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    # Under pytest-xdist the workers share the cores: one thread per process (inherited by the
    # runs a test launches), else two multi-threaded runs on two cores oversubscribe them (the
    # main-job test took 4.5x longer).
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["OMP_NUM_THREADS"] = "1"
        import torch

        torch.set_num_threads(1)


def pytest_unconfigure(config):
    for path in _OWN_CACHE:
        shutil.rmtree(path, ignore_errors=True)
        os.environ.pop("FRAMEWORK_TESTS_CACHE", None)  # a second session in this process makes its own
    _OWN_CACHE.clear()


@pytest.fixture
def compose():
    from framework.cli import compose as _compose

    return _compose


def framework_command(nproc: int = 1) -> list[str]:
    """``python -m framework``, under torchrun on one host when ``nproc`` > 1."""
    if nproc == 1:
        return [sys.executable, "-m", "framework"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    return [*torchrun, "-m", "framework"]


def run_cli(args, cwd, env=None, timeout=600, nproc=1, real=False):
    """Run ``python -m framework`` as a user would (under torchrun for ``nproc`` > 1); returns the
    CompletedProcess. The checkout is on PYTHONPATH (after any PYTHONPATH in ``env``), so a run
    from any ``cwd`` imports this tree.

    The run is forked from a pre-imported interpreter (tests/zygote.py: the same argv, environment,
    files and exit status, without the imports' 5-15 s per process); ``real=True``, or a
    PYTHONPATH of the caller's (which may shadow a preloaded package), starts a new interpreter
    under the real torchrun instead."""
    env = dict(env or {})
    shadow = env.pop("PYTHONPATH", None)
    # the caller's PYTHONPATH first (a test may shadow a package), then this checkout
    path = os.pathsep.join(filter(None, [shadow, str(REPO), os.environ.get("PYTHONPATH")]))
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=path, **env)
    if real or shadow or os.environ.get("FRAMEWORK_TESTS_NO_ZYGOTE"):
        cmd = [*framework_command(nproc), *args]
        return subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)
    return _zygote().run("framework", [str(a) for a in args], cwd, full_env, nproc, timeout)


class _Zygote:
    """The client of tests/zygote.py: one per pytest process, started on first use."""

    def __init__(self):
        self.proc = None

    def _start(self):
        import atexit

        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.zygote"],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))),
        )
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError("tests/zygote.py did not start")
        atexit.register(self.proc.kill)

    def run(self, module, args, cwd, env, nproc, timeout):
        import json
        import tempfile

        if self.proc is None or self.proc.poll() is not None:
            self._start()
        from tests.zygote import held_store

        store = held_store(nproc) if nproc > 1 else contextlib.nullcontext({})
        with tempfile.TemporaryDirectory() as tmp, store as store_env:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            req = dict(module=module, argv=args, cwd=str(cwd), env=env, nproc=nproc, timeout=timeout)
            req.update(stdout=str(out), stderr=str(err), store=store_env)
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
            reply = json.loads(self.proc.stdout.readline())
            stdout = out.read_text() if out.exists() else ""
            stderr = err.read_text() if err.exists() else ""
        cmd = [*framework_command(nproc), *args] if module == "framework" else [sys.executable, "-m", module, *args]
        if reply["timed_out"]:
            raise subprocess.TimeoutExpired(cmd, timeout, stdout, stderr)
        return subprocess.CompletedProcess(cmd, reply["returncode"], stdout, stderr)


_ZYGOTE = _Zygote()


def _zygote() -> _Zygote:
    return _ZYGOTE


def run_module(name: str, args, cwd, timeout=300):
    """``python -m name args`` (an export or inference CLI) from ``cwd``, importing this checkout
    (forked from the pre-imported interpreter, as run_cli)."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)
    if os.environ.get("FRAMEWORK_TESTS_NO_ZYGOTE"):
        cmd = [sys.executable, "-m", name, *args]
        return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    return _zygote().run(name, [str(a) for a in args], cwd, env, 1, timeout)


def benchmark_json(script: str, *args) -> dict:
    """``python benchmarks/<script> args --json`` in a new interpreter (the lowering benchmarks set
    TRITON_INTERPRET before Triton's import), from the checkout: its JSON line, or the failure's
    stderr as the assertion's message."""
    import json

    cmd = [sys.executable, f"benchmarks/{script}", *map(str, args), "--json"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def wait_for_files(proc, folder: Path, pattern: str, what: str, timeout_s: float = 120) -> None:
    """Wait until ``folder`` holds something matching ``pattern`` while ``proc`` runs (e.g. a
    write to interrupt midway); fail with its stderr if it ends first."""
    import time

    t0 = time.time()
    while not list(folder.glob(pattern)):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.time() - t0 < timeout_s, f"{what} never started"
        time.sleep(0.05)


def tiny_overrides(tmp_path, data_root, **extra):
    """A fast tiny run: small synthetic grid and few steps, outputs under tmp_path."""
    o = {
        "hydra.run.dir": str(tmp_path / "run"),
        "data.root": str(data_root),
        "data.grid": "[16,16]",
        "data.hours_per_year": 48,
        "data.batch_size": 4,
        "model.model_channels": 8,
        "trainer.max_steps": 6,
        "trainer.log_every": 1,
        "trainer.val_every": 3,
        "trainer.val_batches": 1,
        "trainer.progress": "false",
        "trainer.figures": "false",  # ~1-2 s per validation; tests/recipes/weather/test_plots.py draws them
        "checkpoint.every": 3,
        "schedule.warmup_steps": 2,
    }
    o.update(extra)
    return [f"{k}={v}" for k, v in o.items()]


# A rank that dies of a native crash inside torch: a heap corruption ("free(): invalid size") in
# the FSDP2 roundtrip's first full_tensor on gloo, before any save, about once in 100+ runs on
# CI, never reproduced here in 350 tries (glibc's malloc checks on); a SIGSEGV once before; once
# here in an fsdp2_domain run's checkpoint save ("malloc_consolidate(): invalid chunk size", the
# launch's return code -6, its peer reporting the connection closed). Such a test runs once more
# with fresh fixtures (pytest-rerunfailures, reported as a rerun): torchrun's report of the signal,
# or glibc's heap check in the rank's stderr before it aborts. A Python failure, an assertion or a
# rank's exception, is never rerun.
NATIVE_CRASH = (
    r"process \d+ terminated with signal SIG(ABRT|SEGV|BUS)"
    r"|\b(malloc|free|realloc|munmap_chunk|malloc_consolidate)\(\): (invalid|corrupted|unaligned)[a-z ]*"
    r"|double free or corruption|corrupted size vs\. prev_size"
)


def pytest_collection_modifyitems(config, items):
    import torch

    if config.pluginmanager.hasplugin("rerunfailures"):  # a dev install has it; the GPU machine may not
        rerun = pytest.mark.flaky(reruns=1, only_rerun=[NATIVE_CRASH])
        for item in items:
            item.add_marker(rerun)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run with -m gpu on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def zarr_reads(monkeypatch):
    """Every value zarr's LocalStore hands back, as (key, bytes): chunk reads, counted."""
    from zarr.storage import LocalStore

    calls = []
    original = LocalStore.get

    async def counting_get(self, key, *args, **kwargs):
        buf = await original(self, key, *args, **kwargs)
        calls.append((key, 0 if buf is None else len(buf)))
        return buf

    monkeypatch.setattr(LocalStore, "get", counting_get)
    return calls


def run_layout(layout: list[str], nproc: int, run_dir: Path, steps: int, extra: list[str]) -> list[float]:
    """scripts/loss_compare.py's run of one layout (its train losses), launched by run_cli."""
    from scripts.loss_compare import run_layout as _run_layout

    def launch(overrides, n):
        return run_cli(overrides, Path(run_dir).parent, env={"OMP_NUM_THREADS": "1"}, nproc=n)

    return _run_layout(layout, nproc, run_dir, steps, extra, run=launch)


def layout_reference(tmp_path_factory, name: str, extra: list[str], steps: int = 5):
    """A parallel=none run every layout is compared to: (tmp dir, overrides, losses)."""
    tmp = tmp_path_factory.mktemp(name)
    extra = [*extra, f"data.root={tmp / 'data'}"]
    return tmp, extra, run_layout(["parallel=none"], 1, tmp / "none", steps, extra)
