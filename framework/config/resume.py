"""What may change when a run resumes from a checkpoint, and what may not.

:func:`check_resume` compares the config saved with the checkpoint (``meta.json``'s
``config``) with the config of the run that loads it, key by key (dotted paths; a list is
one value, so the order of a channel list counts), and classifies every difference by the
first rule whose pattern matches the key: the ``rules`` the caller passes (a recipe's own
keys, e.g. its schema's ``RESUME_RULES``), then :data:`RULES`:

* **may change** - how the run is driven, not what it learns: optimizer hyper-parameters
  (``optim.*`` but ``_target_``), the LR schedule (``schedule.*``: it continues from the
  saved step), the length and cadence of the run (``trainer.*`` but ``name``:
  ``max_steps``, ``log_every``, ``val_every``, ``val_batches``, ``progress``,
  ``grad_clip``, ``grad_accum`` (the global batch is unchanged), ``compile``,
  ``stop_before_end_min``), ``checkpoint.*``, ``logger.*``, ``cluster.*``, ``plan.*`` and
  ``mode`` (what a plan is for), where and how
  data is read (``data.root``: the same data elsewhere; ``data.num_workers``,
  ``data.pin_memory``), the layout (``parallel.*``, ``sharding.*``, ``splitter.*``:
  checkpoints move between layouts), ``precision.*`` (master weights and optimizer state
  are stored in fp32; the GradScaler state is restored only where both runs use fp16),
  ``device``, ``deterministic``;
* **may change if that part is not loaded** (``checkpoint.exclude``): ``optim._target_``
  with ``optimizer`` excluded; the data position (``seed``, ``data.batch_size``) with
  ``data`` excluded; everything tied to the model (below) with ``model`` excluded;
* **must not change** - what the weights mean: ``model.*``, ``task.*``, ``recipe``, every
  other ``data.*`` key (the data set, the grid, the channel lists and their order, the time
  step, the normalisation), ``trainer.name``; and any key no rule names.

A key only one side has is reported (``added`` / ``removed``: the code gained or lost a
field between the runs) and not refused. A refused change raises
:class:`~framework.errors.ConfigError` naming the key, the checkpoint's value and the new
one (and how many more were refused).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from framework.errors import ConfigError

MAY = "may change"
MUST_NOT = "must not change"

# (pattern, verdict, the part of checkpoint.exclude that frees it or None); first match wins.
RULES: tuple[tuple[str, str, str | None], ...] = (
    ("optim._target_", MUST_NOT, "optimizer"),
    ("optim.*", MAY, None),
    ("schedule.*", MAY, None),
    ("trainer.name", MUST_NOT, None),
    ("trainer.*", MAY, None),
    ("checkpoint.*", MAY, None),
    ("logger.*", MAY, None),
    ("cluster.*", MAY, None),
    ("plan.*", MAY, None),
    ("mode", MAY, None),
    ("parallel.*", MAY, None),
    ("sharding.*", MAY, None),
    ("splitter.*", MAY, None),
    ("precision.*", MAY, None),
    ("device", MAY, None),
    ("deterministic", MAY, None),
    ("data.root", MAY, None),
    ("data.num_workers", MAY, None),
    ("data.pin_memory", MAY, None),
    ("seed", MUST_NOT, "data"),
    ("data.batch_size", MUST_NOT, "data"),
    ("model.*", MUST_NOT, "model"),
    ("task.*", MUST_NOT, "model"),
    ("recipe", MUST_NOT, "model"),
    ("data.*", MUST_NOT, "model"),  # the data set, the grid, channel lists, time step, normalisation, ...
    ("*", MUST_NOT, None),
)


@dataclass(frozen=True)
class Change:
    key: str
    old: Any  # the checkpoint's value (None when added)
    new: Any  # this run's value (None when removed)
    kind: str  # changed | added | removed
    verdict: str  # MAY | MUST_NOT
    why: str  # the rule that decided

    def line(self) -> str:
        return f"{self.key}: {_show(self.old)} -> {_show(self.new)} ({self.kind}; {self.why})"


def flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted keys of nested dicts; lists and scalars are leaves."""
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for k, v in node.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        if not node and prefix:
            out[prefix] = {}
        return out
    return {prefix: node}


Rule = tuple[str, str, "str | None"]


def rule_for(key: str, exclude: Iterable[str] = (), rules: Iterable[Rule] = ()) -> tuple[str, str]:
    """(verdict, why) for a changed key: the first of ``rules``, then of :data:`RULES`, that matches."""
    exclude = set(exclude)
    for pattern, verdict, freed_by in (*rules, *RULES):
        if verdict not in (MAY, MUST_NOT):
            raise ValueError(f"resume rule {pattern!r}: verdict must be {MAY!r} or {MUST_NOT!r}")
        if fnmatch.fnmatchcase(key, pattern):
            if verdict == MUST_NOT and freed_by is not None and freed_by in exclude:
                return MAY, f"{pattern}: {freed_by} is not loaded (checkpoint.exclude)"
            if verdict == MUST_NOT and freed_by is not None:
                return MUST_NOT, f"{pattern} must match the checkpoint unless checkpoint.exclude has {freed_by}"
            return verdict, f"{pattern} {verdict} on resume"
    return MUST_NOT, "no rule"


def diff(saved: dict, current: dict, exclude: Iterable[str] = (), rules: Iterable[Rule] = ()) -> list[Change]:
    """Every difference between the checkpoint's config and this run's, classified."""
    rules = tuple(rules)
    old, new = flatten(saved or {}), flatten(current or {})
    out = []
    for key in sorted(set(old) | set(new)):
        if key in old and key in new:
            if _same(old[key], new[key]):
                continue
            verdict, why = rule_for(key, exclude, rules)
            out.append(Change(key, old[key], new[key], "changed", verdict, why))
        elif key in new:
            out.append(Change(key, None, new[key], "added", MAY, "not in the checkpoint's config"))
        else:
            out.append(Change(key, old[key], None, "removed", MAY, "not in this run's config"))
    return out


def check_resume(saved: dict, current: dict, exclude: Iterable[str] = (), rules: Iterable[Rule] = ()) -> list[Change]:
    """The differences that may change (to log); raises ConfigError on the first that may not.

    ``rules``: (pattern, MAY | MUST_NOT, the checkpoint part that frees it or None), tried
    before :data:`RULES`, for a recipe's own keys (see :func:`schema_rules`).
    """
    changes = diff(saved, current, exclude, rules)
    refused = [c for c in changes if c.verdict == MUST_NOT]
    if refused:
        c = refused[0]
        more = (
            f" (+{len(refused) - 1} more: {', '.join(r.key for r in refused[1:4])}"
            f"{', ...' if len(refused) > 4 else ''})"
            if len(refused) > 1
            else ""
        )
        raise ConfigError(
            f"{c.key}: cannot change when resuming (checkpoint: {_show(c.old)}, now: {_show(c.new)}); "
            f"{c.why}; start over with checkpoint.resume=none or another run dir{more}"
        )
    return changes


def schema_rules(run) -> tuple[Rule, ...]:
    """The ``RESUME_RULES`` that a run's schemas declare (class attribute of a group's dataclass,
    keys relative to the group: ``RESUME_RULES = (("val_years", MAY, None),)`` on a data schema)."""
    out: list[Rule] = []
    for group, node in getattr(run, "nodes", {}).items():
        for pattern, verdict, freed_by in getattr(type(node), "RESUME_RULES", ()):
            out.append((f"{group}.{pattern}", verdict, freed_by))
    return tuple(out)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or a == b and type(a) is type(b)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a) == float(b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _show(v: Any) -> str:
    text = repr(v) if isinstance(v, str) else str(v)
    return text if len(text) <= 80 else text[:77] + "..."
