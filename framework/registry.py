"""Named registries: every config-group option selects one entry by its ``name`` key.

An entry is a builder plus the dataclass schema its config node must satisfy. Entries
whose feature has not landed yet are registered as *pending*: selecting one is a config
error naming the issue, never a silent fallback.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from typing import Any, Callable

from framework.errors import ConfigError

# Modules whose import registers entries; imported lazily so the CLI can validate a
# config before torch is initialised.
_PROVIDERS = (
    "framework.config.schema",
    "framework.distributed.sharding",
    "framework.distributed.precision",
    "framework.domain",
    "framework.checkpoint",
    "framework.logging",
    "framework.train.schedule",
    "framework.train.trainer",
    "recipes.stormcast.registry",
    "recipes.stormscope.registry",
)


@dataclass(frozen=True)
class Entry:
    name: str
    schema: type | None
    builder: Callable[..., Any] | None
    pending: str | None = None  # "issue N" when the feature has not landed yet


class Registry:
    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, Entry] = {}

    def register(self, name: str, schema: type | None = None, *, pending: str | None = None):
        """Decorator registering ``builder`` under ``name``."""

        def deco(builder):
            self.add(name, schema, builder, pending=pending)
            return builder

        return deco

    def add(self, name, schema=None, builder=None, *, pending=None):
        if name in self._entries:
            raise ValueError(f"{self.kind} '{name}' is registered twice")
        if schema is not None and not dataclasses.is_dataclass(schema):
            raise TypeError(f"schema of {self.kind} '{name}' must be a dataclass")
        self._entries[name] = Entry(name, schema, builder, pending)

    def names(self) -> list[str]:
        return sorted(self._entries)

    def entry(self, name: str) -> Entry:
        load_providers()
        if name not in self._entries:
            valid = ", ".join(self.names()) or "(none)"
            raise ConfigError(f"unknown {self.kind} '{name}'; valid: {valid}")
        e = self._entries[name]
        if e.pending:
            raise ConfigError(f"{self.kind} '{name}' is not available yet ({e.pending})")
        return e

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
    for r in (models, datasets, tasks, sharding, splitters, precision, checkpoint, loggers,
              schedules, trainers)
}

_loaded = False


def load_providers():
    global _loaded
    if _loaded:
        return
    _loaded = True
    for mod in _PROVIDERS:
        importlib.import_module(mod)
