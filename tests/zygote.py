"""A Python that has imported torch, DCP, dynamo, Hydra and zarr once, and forks `python -m framework`
(or `python -m framework.export`, ...) runs from there: the test suite's runs without the 5-15 s of
imports every process otherwise pays (most of a tiny run's time on two cores).

Each request starts ``nproc`` forked processes that run ``framework.__main__`` exactly as
``python -m framework ARGS`` would (argv, environment, working directory, sys.path, stdout and
stderr in files, the exit status), with the variables torchrun sets when ``nproc`` > 1 (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT of the client's ``held_store``: gloo over TCP between
real processes). Like torchrun, the first rank to fail stops the others. The framework's own
modules are imported fresh in every child, so PYTHONPATH and the code on disk count as in a new
interpreter. What torchrun itself does
(its signals, its death) is tested through the real torchrun (tests.conftest.run_cli(real=True)).

Protocol: one JSON request per stdin line, one JSON reply per stdout line.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import sys
import time

# What a tiny run spends its start-up on (measured with py-spy): torch, torch.distributed.checkpoint
# and the dynamo import that torch.use_deterministic_algorithms and the first optimizer step trigger.
PRELOAD = (
    "numpy",
    "torch",
    "torch._dynamo",
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.utils.flop_counter",
    "omegaconf",
    "hydra",
    "hydra.main",
    "zarr",
    "matplotlib.pyplot",
)
STOP_GRACE_S = 5.0  # after the first failure, SIGTERM the other ranks, SIGKILL this long after


@contextlib.contextmanager
def held_store(world: int):
    """A TCPStore server on a port the kernel chose, held by the caller while ranks run: yields
    the environment that makes them join it as clients (as torchrun's agent store). A port
    picked free and closed again could be taken (by any socket's ephemeral port) before rank
    0 bound it: EADDRINUSE, seen under the parallel suite."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    try:
        yield {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}
    finally:
        del store


def _child(req: dict, rank: int, base_path: list[str]) -> None:
    code = 1
    try:
        os.setpgid(0, 0)  # its own group: a stop reaches what it started too
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644), fd)
        sys.stdout = sys.__stdout__  # the serving loop had pointed it at stderr
        sys.stdout.reconfigure(line_buffering=True)  # as PYTHONUNBUFFERED
        sys.stderr.reconfigure(line_buffering=True)
        env = dict(req["env"])
        if req["nproc"] > 1:
            env.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(req["nproc"]),
                LOCAL_WORLD_SIZE=str(req["nproc"]),
                GROUP_RANK="0",
                **req["store"],  # the client's held_store
                TORCHELASTIC_RUN_ID=req["run_id"],  # one launch: one run lock owner, one launch time
            )
        os.environ.clear()
        os.environ.update(env)
        if env.get("OMP_NUM_THREADS", "").isdigit():  # read at torch's import, which came before
            import torch

            torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
        os.chdir(req["cwd"])
        extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [req["cwd"], *extra, *base_path]  # as `python -m` builds it
        for name in [m for m in sys.modules if m.split(".")[0] in ("framework", "recipes", "tests", "scripts")]:
            del sys.modules[name]  # this checkout's code, fresh
        sys.argv = ["-m", *req["argv"]]
        import runpy

        try:
            runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
        except BaseException:  # noqa: BLE001  (what the interpreter would print, then exit 1)
            import traceback

            traceback.print_exc()
        import atexit

        atexit._run_exitfuncs()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _stop(pids: dict[int, int], sig: int) -> None:
    for pid in pids:
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            pass


def launch(req: dict, base_path: list[str]) -> dict:
    req["run_id"] = f"zygote-{os.getpid()}-{time.monotonic_ns()}"
    sys.stdout.flush()
    sys.stderr.flush()
    pids: dict[int, int] = {}
    for rank in range(req["nproc"]):
        pid = os.fork()
        if pid == 0:
            _child(req, rank, base_path)
        pids[pid] = rank
    codes: dict[int, int] = {}
    deadline = time.monotonic() + req["timeout"]
    stop_at = None
    timed_out = False
    while len(codes) < len(pids):
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            now = time.monotonic()
            if now > deadline and not timed_out:
                timed_out = True
                _stop({p: r for p, r in pids.items() if pids[p] not in codes}, signal.SIGKILL)
            if stop_at is not None and now > stop_at:
                _stop({p: r for p, r in pids.items() if pids[p] not in codes}, signal.SIGKILL)
                stop_at = None
            time.sleep(0.02)
            continue
        if pid not in pids:
            continue
        code = os.waitstatus_to_exitcode(status)
        codes[pids[pid]] = code
        if code != 0 and stop_at is None and len(codes) < len(pids):  # as torchrun: stop the peers
            _stop({p: r for p, r in pids.items() if r not in codes}, signal.SIGTERM)
            stop_at = time.monotonic() + STOP_GRACE_S
    failed = [c for r, c in sorted(codes.items()) if c != 0]
    return {"returncode": failed[0] if failed else 0, "timed_out": timed_out}


def main() -> None:
    for name in PRELOAD:
        importlib.import_module(name)
    base_path = [p for p in sys.path[1:] if p not in os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    proto = sys.stdout
    sys.stdout = sys.stderr  # nothing but replies on the protocol pipe
    proto.write("ready\n")
    proto.flush()
    for line in sys.stdin:
        reply = launch(json.loads(line), base_path)
        proto.write(json.dumps(reply) + "\n")
        proto.flush()


if __name__ == "__main__":
    main()
