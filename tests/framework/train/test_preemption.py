"""SIGUSR2 / SIGTERM (SLURM preemption, time limit): all ranks agree, checkpoint, stop; resume continues."""

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from framework.logging.jsonl import read
from tests.conftest import framework_command, run_cli, tiny_overrides, wait_for_files

pytestmark = pytest.mark.timeout(600)
ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # as _launch: the curves compared to 1e-5 come from one thread each


def _overrides(tmp_path, run, **extra):
    return tiny_overrides(
        tmp_path,
        tmp_path / "data",
        deterministic="true",
        **{
            "hydra.run.dir": str(tmp_path / run),
            "trainer.max_steps": 40,
            "trainer.val_every": 0,
            "checkpoint.every": 1000,
            "data.hours_per_year": 96,
            **extra,
        },
    )


def _launch(args, nproc, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = framework_command(nproc)
    return subprocess.Popen(
        [*cmd, *args], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _wait_for_step(metrics, step, proc, timeout=240):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if metrics.exists() and any(r["step"] >= step for r in read(metrics, "train")):
            return
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    raise AssertionError("training did not reach the step in time")


def _train_losses(path):
    out = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if row.get("split") == "train":
            out[row["step"]] = row["loss"]
    return out


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory):
    """The unbroken curve, from one process: every layout logs its losses (to ~1e-7 over these
    40 steps; tests/framework/distributed/test_loss_parity.py), so it serves both layouts."""
    tmp = tmp_path_factory.mktemp("unbroken")
    proc = run_cli(_overrides(tmp, "unbroken", parallel="none"), tmp, env=ONE_THREAD, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _train_losses(tmp / "unbroken" / "metrics.jsonl")


@pytest.mark.parametrize("nproc,layout", [(1, "none"), (2, "fsdp2")])
def test_signal_checkpoints_stops_and_resume_continues_the_curve(tmp_path, nproc, layout, unbroken):

    args = _overrides(tmp_path, "run", parallel=layout)
    proc = _launch(args, nproc, tmp_path)
    _wait_for_step(tmp_path / "run" / "metrics.jsonl", 3, proc)
    # SLURM signals every task; here only one rank is told: the others must follow.
    target = proc.pid if nproc == 1 else psutil.Process(proc.pid).children()[-1].pid
    os.kill(target, signal.SIGUSR2)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    stopped = [ln for ln in err.splitlines() if ln.startswith("stopped:")]
    assert stopped and "on signal SIGUSR2" in stopped[0] and "checkpoint step_" in stopped[0], err[-2000:]
    step = int(stopped[0].split("stopped at step ")[1].split()[0])
    assert (tmp_path / "run" / "checkpoints" / f"step_{step:08d}" / "meta.json").is_file()
    assert 3 <= step < 40

    # only the signalled run needs the real launcher (its rank gets the signal)
    again = run_cli(args, tmp_path, env=ONE_THREAD, nproc=nproc, timeout=400)
    assert again.returncode == 0, again.stderr[-3000:]
    got, ref = _train_losses(tmp_path / "run" / "metrics.jsonl"), unbroken
    assert sorted(got) == list(range(1, 41))
    for s in range(1, 41):
        assert abs(got[s] - ref[s]) <= 1e-5 * abs(ref[s]), (s, got[s], ref[s])


def test_a_previous_handler_runs_after_the_checkpoint(monkeypatch):
    """Under submitit the handler installed before ours requeues the job: it must still run."""
    from framework.train.preemption import StopRequest

    seen = []
    originals = {s: signal.getsignal(s) for s in (signal.SIGUSR2, signal.SIGTERM)}
    monkeypatch.setattr(signal, "getsignal", lambda s: lambda signum, frame: seen.append(signum))
    stop = StopRequest()
    stop.install()
    try:
        os.kill(os.getpid(), signal.SIGUSR2)
        assert stop.agreed()
        stop.hand_over()
    finally:
        stop.uninstall()
        for s, h in originals.items():
            signal.signal(s, h)
    assert seen == [signal.SIGUSR2]


# -- Ctrl-C -------------------------------------------------------------------------------------------
def test_first_ctrl_c_requests_a_stop_and_a_second_aborts():
    from framework.train.preemption import StopRequest

    original = signal.getsignal(signal.SIGINT)
    stop = StopRequest()
    stop.install()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)  # the handler runs at the next bytecode
        assert stop.signum == signal.SIGINT and stop.agreed() and stop.reason() == "signal SIGINT"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)
    finally:
        stop.uninstall()
        signal.signal(signal.SIGINT, original)
    assert signal.getsignal(signal.SIGINT) is original


def test_hand_over_after_ctrl_c_does_not_raise_keyboard_interrupt():
    from framework.train.preemption import StopRequest

    stop = StopRequest()
    stop.install()
    try:
        stop.signum = signal.SIGINT
        stop.hand_over()  # Python's default_int_handler was there before: it is not called
    finally:
        stop.uninstall()
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _interrupt_on_step(tmp_path, args, step):
    """Start the CLI, wait until it logged ``step``, send SIGINT (as a terminal's Ctrl-C does)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "framework", *args],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    _wait_for_step(tmp_path / "run" / "metrics.jsonl", step, proc)
    os.kill(proc.pid, signal.SIGINT)
    return proc


def test_ctrl_c_checkpoints_and_stops_like_sigterm(tmp_path):
    proc = _interrupt_on_step(tmp_path, _overrides(tmp_path, "run"), 3)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err[-2000:]  # the exit code of a SIGTERM / SIGUSR2 stop
    stopped = [ln for ln in err.splitlines() if ln.startswith("stopped:")]
    assert stopped and "on signal SIGINT" in stopped[0] and "checkpoint step_" in stopped[0], err[-2000:]
    step = int(stopped[0].split("stopped at step ")[1].split()[0])
    assert (tmp_path / "run" / "checkpoints" / f"step_{step:08d}" / "meta.json").is_file()
    assert "Traceback" not in err and not (tmp_path / "run" / "run.lock").exists()


def test_a_second_ctrl_c_aborts_at_once_without_a_checkpoint(tmp_path):
    # slow steps (seconds each): the second Ctrl-C lands before the step boundary the first waits for
    args = _overrides(
        tmp_path,
        "run",
        **{
            "data.grid": "[64,64]",
            "model.model_channels": 32,
            "data.batch_size": 8,
            "data.root": str(tmp_path / "data64"),
        },
    )
    proc = _interrupt_on_step(tmp_path, args, 1)
    line = proc.stderr.readline()  # the handler's acknowledgement: the first Ctrl-C was taken
    assert line.startswith("interrupt: stopping at the next step"), line
    os.kill(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert err.strip().splitlines()[-1] == "interrupted" and "Traceback" not in err
    ckpts = tmp_path / "run" / "checkpoints"
    assert not ckpts.exists() or not [p for p in ckpts.iterdir() if p.name.startswith("step_")]
    assert not (tmp_path / "run" / "run.lock").exists()


def test_sigterm_while_the_synthetic_stores_are_written_removes_the_partial_copy(tmp_path):
    """Before training there is nothing to checkpoint: SIGTERM while the synthetic stores are
    being written ends the run with one line and exit 143, and the half-written copy (a hidden
    .tmp- directory beside data.root) is removed, not left behind."""
    data = tmp_path / "data"
    big = {"data.root": str(data), "data.grid": "[128,128]", "data.hours_per_year": 600}  # seconds to write
    args = _overrides(tmp_path, "run", **big)
    proc = _launch(args, 1, tmp_path)
    try:
        wait_for_files(proc, tmp_path, ".data.tmp-*/*", "the synthetic write")
        os.kill(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 143, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"terminated: SIGTERM while writing the synthetic stores at {data}"), err[-3000:]
    assert "Traceback" not in err
    assert not list(tmp_path.glob(".data.tmp-*")) and not data.exists(), "the partial copy was left"
    assert not (tmp_path / "run" / "run.lock").exists()
