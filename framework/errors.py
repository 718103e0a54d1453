"""Errors the CLI turns into one readable line and an exit code.

- 0: done
- 1: an unexpected error (a bug): Python's traceback
- 2: the configuration is refused before any heavy work: a bad key or value, a composition
  error, a refused ``_target_`` / Hydra node / trust, an unusable or locked run dir, a
  change a resume may not make, a usage error on the command line
- 3: the input data cannot be used (missing file, channel, NaN, corrupt checkpoint)
- 4: the loss or gradient norm became NaN/inf (the last good checkpoint is kept)
- 5: a peer rank failed or a collective timed out
- 75: stopped early with a checkpoint (SIGUSR2, SIGTERM, the first Ctrl-C, the wall-time
  margin): run again to resume (EX_TEMPFAIL)
- 130: interrupted without a checkpoint (a second Ctrl-C, or Ctrl-C before training started)
- 143: SIGTERM while writing the synthetic stores (:func:`sigterm_raises`)
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


class FrameworkError(Exception):
    exit_code = 1


class ConfigError(FrameworkError):
    """A configuration problem: exit code 2, before any heavy work."""

    exit_code = 2


class RunDirError(ConfigError):
    """The run directory cannot be used (not a directory, not writable, held by a live run): exit code 2."""


class DataError(FrameworkError):
    """Input data that cannot be used (missing file, channel, NaN...): exit code 3."""

    exit_code = 3


class DistributedError(FrameworkError):
    """A peer rank failed or a collective timed out: exit code 5, never a hang."""

    exit_code = 5


EXIT_INTERRUPTED = 130  # second Ctrl-C: KeyboardInterrupt, no checkpoint


class Terminated(FrameworkError):
    """SIGTERM during work that has nothing to checkpoint: exit 143 (the shell's 128 + 15)."""

    exit_code = 128 + signal.SIGTERM
    prefix = "terminated"


@contextlib.contextmanager
def sigterm_raises(what: str) -> Iterator[None]:
    """Within the block, SIGTERM raises :class:`Terminated` ("terminated: SIGTERM while <what>")
    instead of ending the process at once, so that the block's own cleanup (a temporary
    directory's removal) runs. Only in the main thread and where SIGTERM still has its default
    action: a handler already there (training's stop request, submitit's) is left alone. For
    local work with no collective inside, which a raise could desert."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) not in (
        signal.SIG_DFL,
        None,
    ):
        yield
        return

    def _raise(signum, frame) -> None:
        raise Terminated(f"SIGTERM while {what}")

    signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def first_line(e: BaseException) -> str:
    """An exception's first line (its type where it has no text): what a one-line error quotes."""
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
