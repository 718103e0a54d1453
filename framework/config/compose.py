"""Compose the config Hydra is about to run, through Hydra's public compose API.

``@hydra.main`` searches, in order: Hydra's own configs, the primary config dir (``conf/``
or ``--config-path``), search-path plugins, ``--config-dir`` (provider ``command-line``,
just before the structured configs), then ``hydra.searchpath``. The compose API has no
``--config-dir``; a search-path plugin registered through Hydra's public
``Plugins.instance().register`` puts it at exactly that place while :func:`compose` runs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from framework.compat import CONF_DIR  # noqa: F401  (the checkout's conf/, else the installed one)
from framework.errors import ConfigError

FRAMEWORK_DIR = Path(__file__).resolve().parent.parent  # where framework/__main__.py lives


@dataclass(frozen=True)
class Source:
    config_dir: str = CONF_DIR  # the primary config dir
    extra_dir: str | None = None  # --config-dir
    config_name: str = "config"

    @classmethod
    def from_args(cls, args) -> Source:
        primary = CONF_DIR
        if args.config_path:
            primary = (
                args.config_path
                if os.path.isabs(args.config_path)
                else os.path.normpath(os.path.join(FRAMEWORK_DIR, args.config_path))
            )
        extra = None
        if args.config_dir:
            extra = os.path.abspath(args.config_dir)
            if not os.path.isdir(extra):
                raise ConfigError(f"--config-dir: additional config directory '{extra}' not found")
        return cls(primary, extra, args.config_name or "config")


def compose(overrides: list[str], source: Source | None = None, *, with_hydra: bool = False) -> DictConfig:
    """The composed config (with its ``hydra`` node if ``with_hydra``); composition errors are ConfigErrors."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    source = source or Source()
    _ConfigDir.register()
    _ConfigDir.path = source.extra_dir
    try:
        with initialize_config_dir(config_dir=source.config_dir, version_base="1.3", job_name="framework"):
            return hydra_compose(
                config_name=source.config_name, overrides=list(overrides), return_hydra_config=with_hydra
            )
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(hydra_message(e)) from None
    finally:
        _ConfigDir.path = None


class _ConfigDir:
    """``--config-dir`` for the compose API, where ``@hydra.main`` puts it (see the module docstring)."""

    path: str | None = None
    _plugin = None

    @classmethod
    def register(cls) -> None:
        if cls._plugin is not None:
            return
        from hydra.core.config_search_path import ConfigSearchPath
        from hydra.core.plugins import Plugins
        from hydra.plugins.search_path_plugin import SearchPathPlugin

        class FrameworkConfigDir(SearchPathPlugin):
            def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
                # plugins run before Hydra appends the structured-config source: the end is
                # "just before it", where @hydra.main prepends --config-dir
                if cls.path is not None:
                    search_path.append(provider="command-line", path=f"file://{cls.path}")

        Plugins.instance().register(FrameworkConfigDir)
        cls._plugin = FrameworkConfigDir


def hydra_message(e: Exception) -> str:
    lines = [ln.rstrip() for ln in str(e).splitlines() if ln.strip()]
    if not lines:
        return type(e).__name__
    text = lines[0]
    if text.startswith("Could not override") and "+" in str(e):
        text += " (unknown key; prefix with + to add a new one)"
    if "Available options" in str(e):  # list the choices, not Hydra's search path
        i = next(i for i, ln in enumerate(lines) if ln.startswith("Available options"))
        opts = [ln.strip() for ln in lines[i + 1 :] if ln.startswith("\t") and "provider=" not in ln]
        text += "; available: " + ", ".join(opts)
    elif len(lines) > 1 and lines[0].startswith(("Ambiguous", "no viable", "mismatched", "extraneous")):
        text = f"bad override syntax: {text}"
    return text
