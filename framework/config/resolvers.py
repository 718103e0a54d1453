"""OmegaConf resolvers the config tree uses."""

from __future__ import annotations

import datetime
import os

from omegaconf import OmegaConf


def launch_time(fmt: str) -> str:
    """Like Hydra's ``${now:}``, but equal on every rank of one torchrun launch.

    torchrun starts its local workers a few ms apart, which can straddle a second and
    split one job over two run dirs; its agent (our parent) started once for all.
    """
    if "LOCAL_RANK" in os.environ and "TORCHELASTIC_RUN_ID" in os.environ:
        try:
            import psutil

            t = psutil.Process(os.getppid()).create_time()
            return datetime.datetime.fromtimestamp(t).strftime(fmt)
        except Exception:  # no psutil or no parent: fall back to now
            pass
    return datetime.datetime.now().strftime(fmt)


def register() -> None:
    if not OmegaConf.has_resolver("launch_time"):
        OmegaConf.register_new_resolver("launch_time", launch_time, use_cache=True)


register()
