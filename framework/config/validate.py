"""Start-up validation: the composed config against the schemas, one readable line per error.

Runs before any process group, allocation or dataset access. Every failure is a
:class:`ConfigError` (exit code 2) whose message names the offending key.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from framework import registry
from framework.config.schema import FIXED, Invalid, TopConfig
from framework.config.security import Trust, check_targets_resolved, check_targets_unresolved, target_prefixes
from framework.errors import ConfigError, first_line

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
OPTIONAL = ("plan", "paths")  # fixed groups whose schema defaults apply when a config has no node


@dataclasses.dataclass
class RunConfig:
    """The validated config: typed dataclass nodes per group plus the top-level keys."""

    recipe: str
    seed: int
    deterministic: bool
    device: str
    nodes: dict[str, Any]
    raw: DictConfig  # the composed config, resolved, for logging and checkpoints
    mode: str = "train"  # train | plan
    tags: tuple[str, ...] = ()  # saved with the config, the run's tags in wandb
    objective: str = "val/loss"  # what the job returns to a sweeper (schema.TopConfig.objective)

    def __getattr__(self, name):
        nodes = self.__dict__.get("nodes", {})
        if name in nodes:
            return nodes[name]
        raise AttributeError(name)


def check_targets(cfg: DictConfig, trust: Trust | None = None) -> None:
    """Refuse any ``_target_`` outside the allowed prefixes, unresolved and resolved (see security.py)."""
    allowed = target_prefixes(trust)
    check_targets_unresolved(cfg, allowed)
    try:
        plain = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        raise ConfigError(f"{key or 'config'}: {first_line(e)}") from None
    check_targets_resolved(plain, allowed, skip=("hydra",))


def _typed(group: str, schema: type, node: DictConfig):
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), node)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or getattr(e, "key", None)
        where = ".".join(str(x) for x in (group, key) if x) or "config"
        raise ConfigError(f"{where}: {first_line(e)}") from None
    missing = sorted(OmegaConf.missing_keys(merged))
    if missing:
        key = ".".join(x for x in (group, missing[0]) if x)
        raise ConfigError(f"{key}: missing value (set it on the command line: {key}=...)")
    try:
        return OmegaConf.to_object(merged)
    except Invalid as e:
        raise ConfigError(f"{'.'.join(x for x in (group, e.key) if x)}: {e.msg}") from None
    except OmegaConfBaseException as e:
        raise ConfigError(f"{group}: {first_line(e)}") from None


def validate(cfg: DictConfig, trust: Trust | None = None) -> RunConfig:
    """The typed run config; ``trust`` is what the primary config file grants (security.Trust)."""
    allowed = target_prefixes(trust)
    check_targets_unresolved(cfg, allowed)  # before anything is resolved or imported
    try:
        plain = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        raise ConfigError(f"{key or 'config'}: {first_line(e)}") from None
    assert isinstance(plain, dict)  # a DictConfig converts to a dict
    plain.pop("hydra", None)
    plain.pop("trust", None)  # checked against the primary config file by framework.cli
    check_targets_resolved(plain, allowed)  # also the _target_s an interpolation produced
    resolved = OmegaConf.create(plain)

    unknown = [str(k) for k in resolved.keys() if k not in GROUPS and k not in TOP_KEYS]
    if unknown:
        raise ConfigError(f"{unknown[0]}: unknown top-level key; valid keys: " + ", ".join(sorted(GROUPS + TOP_KEYS)))
    top = _typed("", TopConfig, OmegaConf.create({k: resolved[k] for k in TOP_KEYS if k in resolved}))

    schemas: dict[str, type] = {}
    for group in GROUPS:  # first every selection (unknown or not-yet-available options)...
        if group in OPTIONAL and group not in resolved:
            resolved[group] = {}  # a primary config of the user's own may leave it out
        node = resolved.get(group)
        if not isinstance(node, DictConfig):
            raise ConfigError(f"{group}: missing config group (choose one with {group}=<option>)")
        if group in REGISTRY_GROUPS:
            name = node.get("name")
            if name is None:
                raise ConfigError(f"{group}.name: missing value")
            schema = REGISTRY_GROUPS[group].entry(str(name)).schema
            if schema is None:  # registered without one: nothing to check the node against
                raise ConfigError(f"{group}.name: {name!r} is registered without a config schema")
            schemas[group] = schema
        else:
            schemas[group] = FIXED[group]
    # ...then every value against its schema.
    nodes: dict[str, Any] = {g: _typed(g, schemas[g], resolved[g]) for g in GROUPS}
    # What is saved (checkpoints, exports, wandb) is the config as run: defaults included, and
    # paths absolute (a later stage, inference or a resume from elsewhere reads them).
    for g in GROUPS:
        resolved[g] = OmegaConf.merge(OmegaConf.structured(schemas[g]), resolved[g])
        for f in dataclasses.fields(nodes[g]):
            value = getattr(nodes[g], f.name)
            if f.metadata.get("path") and isinstance(value, str) and value and value not in f.metadata["tokens"]:
                setattr(nodes[g], f.name, os.path.abspath(value))
                resolved[g][f.name] = getattr(nodes[g], f.name)

    run = RunConfig(
        recipe=top.recipe,
        seed=top.seed,
        deterministic=top.deterministic,
        device=top.device,
        nodes=nodes,
        raw=resolved,
        mode=top.mode,
        tags=tuple(top.tags),
        objective=top.objective,
    )
    _check_combinations(run)
    return run


def _check_combinations(run: RunConfig) -> None:
    ck = run.checkpoint
    if ck.resume not in ("latest", "none") and not os.path.exists(ck.resume):
        raise ConfigError(f"checkpoint.resume: path does not exist: {ck.resume}")
    # Recipe-level consistency (grid vs model down-sampling, batch vs accumulation, ...).
    registry.tasks.entry(run.task.name).builder.check_config(run)
