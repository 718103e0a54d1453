"""OmegaConf resolvers the config tree uses, and the only ones a config may call.

Resolving a config must never run code: :func:`restrict` removes every resolver that is
not in :data:`SAFE` (OmegaConf's ``oc.*``, which only read the environment, parse YAML
with a safe loader or select keys; Hydra's ``now``, ``hydra``, ``python_version``; our
``launch_time``). It runs before any config is resolved (``framework.cli``), so a resolver
that some installed package registered cannot be reached from a config or an override.
"""

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


SAFE = frozenset(
    {
        "oc.env",
        "oc.create",
        "oc.decode",
        "oc.deprecated",
        "oc.select",
        "oc.dict.keys",
        "oc.dict.values",
        "now",
        "hydra",
        "python_version",
        "launch_time",
    }
)


def registered() -> list[str]:
    from omegaconf.basecontainer import BaseContainer

    return sorted(BaseContainer._resolvers)


def restrict() -> list[str]:
    """Unregister every resolver outside :data:`SAFE`; returns the names removed."""
    removed = [name for name in registered() if name not in SAFE]
    for name in removed:
        OmegaConf.clear_resolver(name)
    return removed


def register() -> None:
    if not OmegaConf.has_resolver("launch_time"):
        OmegaConf.register_new_resolver("launch_time", launch_time, use_cache=True)


register()
