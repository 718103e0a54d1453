"""What a rank does about its launcher, before anything heavy is imported (no torch here: a
config error must exit in the time it takes to compose the config)."""

from __future__ import annotations

import os


def die_with_launcher() -> None:
    """Under torchrun, die when the launcher dies.

    torchrun starts each rank in a session of its own, so ``kill -9`` of torchrun (or of its
    process group) leaves the ranks running as orphans that keep training and writing into
    the run directory. The kernel's parent-death signal ends them with it instead.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ or not os.path.exists("/proc/self"):
        return
    import ctypes
    import signal

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the launcher died before the signal was armed
        os._exit(137)
