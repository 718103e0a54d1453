"""Start-up validation: the composed config against the schemas, one readable line per error.

Runs before any process group, allocation or dataset access. Every failure is a
:class:`ConfigError` (exit code 2) whose message names the offending key.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from framework import registry
from framework.config.schema import FIXED, Invalid, TopConfig
from framework.errors import ConfigError

ALLOWED_TARGET_PREFIXES = ("framework.", "recipes.", "torch.optim.")

# Group node -> the registry whose entry (selected by the node's ``name``) owns its schema.
REGISTRY_GROUPS = {
    "model": registry.models,
    "data": registry.datasets,
    "task": registry.tasks,
    "sharding": registry.sharding,
    "splitter": registry.splitters,
    "precision": registry.precision,
    "checkpoint": registry.checkpoint,
    "logger": registry.loggers,
    "schedule": registry.schedules,
    "trainer": registry.trainers,
}
GROUPS = tuple(REGISTRY_GROUPS) + tuple(k for k in FIXED if k not in REGISTRY_GROUPS)
TOP_KEYS = tuple(f.name for f in dataclasses.fields(TopConfig))


@dataclasses.dataclass
class RunConfig:
    """The validated config: typed dataclass nodes per group plus the top-level keys."""

    recipe: str
    seed: int
    deterministic: bool
    device: str
    nodes: dict[str, Any]
    raw: DictConfig  # the composed config, resolved, for logging and checkpoints

    def __getattr__(self, name):
        nodes = self.__dict__.get("nodes", {})
        if name in nodes:
            return nodes[name]
        raise AttributeError(name)


def check_targets(node: Any, path: str = "") -> None:
    """Refuse any ``_target_`` outside the allowed prefixes, before anything is imported."""
    if isinstance(node, DictConfig):
        for key in node.keys():
            sub = f"{path}.{key}" if path else str(key)
            if key == "_target_":
                value = node._get_node(key)._value()  # unresolved: never evaluate an interpolation to check it
                value = str(value)
                if not value.startswith(ALLOWED_TARGET_PREFIXES):
                    raise ConfigError(
                        f"{sub}: target '{value}' is not allowed; targets must start with "
                        + ", ".join(ALLOWED_TARGET_PREFIXES))
                continue
            check_targets(node._get_node(key), sub)
    elif isinstance(node, ListConfig):
        for i in range(len(node)):
            check_targets(node._get_node(i), f"{path}[{i}]")


def _first_line(e: Exception) -> str:
    msg = str(e).strip().splitlines()
    return msg[0] if msg else type(e).__name__


def _typed(group: str, schema: type, node: DictConfig):
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), node)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or getattr(e, "key", None)
        where = ".".join(str(x) for x in (group, key) if x) or "config"
        raise ConfigError(f"{where}: {_first_line(e)}") from None
    missing = sorted(OmegaConf.missing_keys(merged))
    if missing:
        key = ".".join(x for x in (group, missing[0]) if x)
        raise ConfigError(f"{key}: missing value (set it on the command line: {key}=...)")
    try:
        return OmegaConf.to_object(merged)
    except Invalid as e:
        raise ConfigError(f"{'.'.join(x for x in (group, e.key) if x)}: {e.msg}") from None
    except OmegaConfBaseException as e:
        raise ConfigError(f"{group}: {_first_line(e)}") from None


def validate(cfg: DictConfig) -> RunConfig:
    check_targets(cfg)
    try:
        resolved = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        raise ConfigError(f"{key or 'config'}: {_first_line(e)}") from None
    resolved.pop("hydra", None)

    unknown = [k for k in resolved.keys() if k not in GROUPS and k not in TOP_KEYS]
    if unknown:
        raise ConfigError(f"{unknown[0]}: unknown top-level key; valid keys: "
                          + ", ".join(sorted(GROUPS + TOP_KEYS)))
    top = _typed("", TopConfig, OmegaConf.create({k: resolved[k] for k in TOP_KEYS if k in resolved}))

    schemas: dict[str, type] = {}
    for group in GROUPS:  # first every selection (unknown or not-yet-available options)...
        node = resolved.get(group)
        if not isinstance(node, DictConfig):
            raise ConfigError(f"{group}: missing config group (choose one with {group}=<option>)")
        if group in REGISTRY_GROUPS:
            name = node.get("name")
            if name is None:
                raise ConfigError(f"{group}.name: missing value")
            schemas[group] = REGISTRY_GROUPS[group].entry(str(name)).schema
        else:
            schemas[group] = FIXED[group]
    # ...then every value against its schema.
    nodes: dict[str, Any] = {g: _typed(g, schemas[g], resolved[g]) for g in GROUPS}
    # What is saved (checkpoints, exports, wandb) is the config as run: defaults included.
    for g in GROUPS:
        resolved[g] = OmegaConf.merge(OmegaConf.structured(schemas[g]), resolved[g])

    run = RunConfig(recipe=top.recipe, seed=top.seed, deterministic=top.deterministic,
                    device=top.device, nodes=nodes, raw=resolved)
    _check_combinations(run)
    return run


def _check_combinations(run: RunConfig) -> None:
    ck = run.checkpoint
    if ck.resume not in ("latest", "none") and not os.path.exists(ck.resume):
        raise ConfigError(f"checkpoint.resume: path does not exist: {ck.resume}")
    # Recipe-level consistency (grid vs model down-sampling, batch vs accumulation, ...).
    task = registry.tasks.entry(run.task.name)
    check = getattr(task.builder, "check_config", None)
    if check is not None:
        check(run)
