"""Compose the config Hydra is about to run, through Hydra's public compose API.

``@hydra.main`` searches, in order: Hydra's own configs, the primary config dir (``conf/``
or ``--config-path``), search-path plugins, ``--config-dir`` (provider ``command-line``,
just before the structured configs), then ``hydra.searchpath``. The compose API has no
``--config-dir``; a search-path plugin registered through Hydra's public
``Plugins.instance().register`` puts it at exactly that place while :func:`compose` runs.
"""

from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

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
        error: Exception = e
    finally:
        _ConfigDir.path = None
    raise ConfigError(hydra_message(error) + _near_key(error, list(overrides), source, with_hydra))


def _near_key(e: Exception, overrides: list[str], source: Source, with_hydra: bool) -> str:
    """For an unknown key (``trainer.max_step=5``): "; did you mean 'trainer.max_steps'?", from the
    keys beside it in the config composed without that override ("" when nothing is close)."""
    found = re.match(r"Could not override '([^']+)'", str(e))
    if found is None:
        return ""
    key = found.group(1).lstrip("+~")
    parent, _, leaf = key.rpartition(".")
    rest = [o for o in overrides if o.lstrip("+~").split("=", 1)[0] != key]
    try:
        cfg = compose(rest, source, with_hydra=with_hydra or key.startswith("hydra."))
    except ConfigError:  # another error in the overrides: the first one's line stands
        return ""
    node = OmegaConf.select(cfg, parent) if parent else cfg
    if not isinstance(node, DictConfig):
        return ""
    near = difflib.get_close_matches(leaf, [str(k) for k in node.keys()], n=1)
    return f"; did you mean '{parent + '.' if parent else ''}{near[0]}'?" if near else ""


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
        wanted = re.search(r"Could not find '(?:[^']*/)?([^'/]+)'", text)
        near = difflib.get_close_matches(wanted.group(1), opts, n=1) if wanted else []
        text += (f"; did you mean {near[0]}?" if near else "") + "; available: " + ", ".join(opts)
    elif len(lines) > 1 and lines[0].startswith(("Ambiguous", "no viable", "mismatched", "extraneous")):
        text = f"bad override syntax: {text}"
    return text
