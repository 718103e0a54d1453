"""Named registries: every config-group option selects one entry by its ``name`` key.

An entry is a builder plus the dataclass schema its config node must satisfy (and, for a
model, the split plan that makes it domain-parallel). The engine registers its own
entries; recipes are plugins found through the ``framework.recipes`` entry point group
(``[project.entry-points."framework.recipes"]`` in a package's pyproject.toml, each value
a module whose import registers its entries). ``FRAMEWORK_RECIPES`` (comma-separated
module names) adds plugins that are importable but not installed, e.g. from a checkout.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from dataclasses import dataclass
from typing import Any

from framework.errors import ConfigError

# The engine's own modules whose import registers entries; imported lazily so the CLI
# can validate a config before torch is initialised.
_PROVIDERS = (
    "framework.config.schema",
    "framework.distributed.sharding",
    "framework.distributed.precision",
    "framework.domain",
    "framework.checkpoint",
    "framework.logging",
    "framework.train.schedule",
    "framework.train.trainer",
)
PLUGIN_GROUP = "framework.recipes"
_FROM_RECIPES = ("model", "dataset", "task")  # the kinds a recipe registers, the engine has none of
PLUGIN_ENV = "FRAMEWORK_RECIPES"


@dataclass(frozen=True)
class Entry:
    name: str
    schema: type | None
    builder: Any  # a callable (a build function or a class); None for schema-only entries
    split_plan: Any = None  # models: how the splitter makes it domain-parallel (a SplitPlan)


class Registry:
    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, Entry] = {}

    def register(self, name: str, schema: type | None = None, *, split_plan: Any = None):
        """Decorator registering ``builder`` under ``name``."""

        def deco(builder):
            self.add(name, schema, builder, split_plan=split_plan)
            return builder

        return deco

    def add(self, name, schema=None, builder=None, *, split_plan=None):
        if name in self._entries:
            raise ValueError(f"{self.kind} '{name}' is registered twice")
        if schema is not None and not dataclasses.is_dataclass(schema):
            raise TypeError(f"schema of {self.kind} '{name}' must be a dataclass")
        self._entries[name] = Entry(name, schema, builder, split_plan)

    def names(self) -> list[str]:
        return sorted(self._entries)

    def entry(self, name: str) -> Entry:
        load_providers()
        if name not in self._entries:
            valid = ", ".join(self.names()) or "(none)"
            hint = ""
            # what recipes provide, with none installed (e.g. a checkout on PYTHONPATH, never pip-installed)
            if self.kind in _FROM_RECIPES and not plugin_modules():
                hint = (
                    f" (no recipe plugin is installed: `pip install -e .` in the checkout, or name the"
                    f" modules in {PLUGIN_ENV}, comma-separated: {PLUGIN_ENV}=pkg.registry,...)"
                )
            raise ConfigError(f"unknown {self.kind} '{name}'; valid: {valid}{hint}")
        return self._entries[name]

    def build(self, name: str, *args, **kwargs):
        return self.entry(name).builder(*args, **kwargs)

    def __contains__(self, name):
        return name in self._entries


models = Registry("model")
datasets = Registry("dataset")
tasks = Registry("task")
sharding = Registry("sharding policy")
splitters = Registry("domain splitter")
precision = Registry("precision policy")
checkpoint = Registry("checkpoint backend")
loggers = Registry("logger")
schedules = Registry("schedule")
trainers = Registry("trainer")

ALL = {
    r.kind: r
    for r in (models, datasets, tasks, sharding, splitters, precision, checkpoint, loggers, schedules, trainers)
}

_loaded = False


def plugin_modules() -> list[str]:
    """Modules of the installed recipe plugins, then those named in ``FRAMEWORK_RECIPES``."""
    from importlib.metadata import entry_points

    found = sorted({ep.value for ep in entry_points(group=PLUGIN_GROUP)})
    extra = [m.strip() for m in os.environ.get(PLUGIN_ENV, "").split(",") if m.strip()]
    return found + [m for m in extra if m not in found]


def load_providers():
    global _loaded
    if _loaded:
        return
    _loaded = True
    for mod in _PROVIDERS:
        importlib.import_module(mod)
    for mod in plugin_modules():
        try:
            importlib.import_module(mod)
        except ImportError as e:  # a broken or half-installed plugin: one line, exit 2
            raise ConfigError(f"recipe plugin {mod!r} cannot be imported: {e}") from None
