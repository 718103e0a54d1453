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
"""


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


def first_line(e: BaseException) -> str:
    """An exception's first line (its type where it has no text): what a one-line error quotes."""
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
