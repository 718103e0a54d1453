"""Which checkpoint a path means: the one rule every reader follows.

Readers (resume in the manager, ``framework.export``, a recipe loading a trained stage
or running inference) accept a step directory (that checkpoint), a
``checkpoints/`` directory or a run directory. For the last two, "latest" is:

    the newest committed checkpoint on the run's current lineage that passes verification.

- *committed*: a ``step_XXXXXXXX`` directory with ``meta.json`` (or ``manifest.json``);
  ``.tmp-*`` directories are saves in progress or cut short, never read.
- *newest*: by commit time (``committed_ns``), not by step. After a resume from step 3 of
  a run that had reached 6, the new branch (4, 5, ...) is newer than the abandoned 6.
- *lineage*: each checkpoint records its ``parent`` (the checkpoint saved before it by the
  same run, or the one it resumed from; ``null`` for a fresh start). When the newest
  checkpoint is unusable the locator falls back along that chain, so it never lands on
  an abandoned branch. Checkpoints written before parents were recorded, and links to a
  parent that was pruned, fall back to commit order.
- *verification*: the caller's check (``quick``: manifest, sizes, meta.json digest;
  ``full``: every checksum). A checkpoint that fails is reported in one line and skipped;
  one recorded as non-finite (``meta["finite"] is False``) too.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from framework import untrusted
from framework.checkpoint.manifest import MANIFEST, META
from framework.errors import DataError, first_line

STEP = re.compile(r"^(?:\.old-)?step_(\d{8})$")


class _Unknown(enum.Enum):
    # a one-member enum, not object(): type checkers narrow ``link is UNKNOWN``
    UNKNOWN = "unknown"


UNKNOWN: Final = _Unknown.UNKNOWN  # parent not recorded (an older checkpoint, or unreadable metadata)
Link = tuple[str, int]  # a parent checkpoint: its canonical name, its committed_ns


@dataclass
class Entry:
    """One committed checkpoint directory, as discovery sees it (nothing verified yet)."""

    path: Path
    step: int
    committed_ns: int
    meta: dict | None = None
    problem: str | None = None  # meta.json / manifest.json unreadable: corrupt
    parent: Link | None | _Unknown = field(default=UNKNOWN, repr=False)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def key(self) -> tuple[str, int]:
        return _canonical(self.path.name), self.committed_ns


def _canonical(name: str) -> str:
    return name[len(".old-") :] if name.startswith(".old-") else name


def is_step_dir(path: Path) -> bool:
    path = Path(path)
    return (
        (path / META).is_file()
        or (path / MANIFEST).is_file()
        or bool(STEP.match(path.name))
        or path.name.startswith(".tmp-step_")
    )


def checkpoints_dir(path: Path) -> Path | None:
    """The ``checkpoints/`` directory ``path`` names (itself, or the one of a run dir)."""
    path = Path(path)
    if (path / "checkpoints").is_dir():
        return path / "checkpoints"
    if path.is_dir() and (path.name == "checkpoints" or any(STEP.match(p.name) for p in path.iterdir())):
        return path
    return None


def _link(value) -> Link | None | _Unknown:
    if value is None:
        return None
    if isinstance(value, dict) and isinstance(value.get("name"), str) and isinstance(value.get("committed_ns"), int):
        return _canonical(value["name"]), value["committed_ns"]
    return UNKNOWN


def _read_json(path: Path):
    try:  # untrusted: a named pipe or a link to /dev/zero is refused, not read without end
        value = untrusted.read_json(path)
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError) as e:  # ValueError: untrusted.BadFile (not a regular file, not JSON, ...)
        return None, f"{path.name} cannot be read ({first_line(e)})"
    if not isinstance(value, dict):
        return None, f"{path.name} is not an object"
    return value, None


def entry(path: Path, *, any_name: bool = False) -> Entry | None:
    """What discovery knows of ``path``; None if it is not a committed checkpoint (a directory
    named ``step_XXXXXXXX``, any name with ``any_name``, holding meta.json or manifest.json)."""
    path = Path(path)
    m = STEP.match(path.name)
    if (not m and not any_name) or not path.is_dir() or not ((path / META).is_file() or (path / MANIFEST).is_file()):
        return None
    meta, why = _read_json(path / META)
    manifest, why_manifest = _read_json(path / MANIFEST)
    problem = why or why_manifest
    if meta is None and why is None:
        problem = problem or f"no {META} (its manifest is there: the commit was tampered with)"
    order = None
    for source in (meta, manifest):
        value = (source or {}).get("committed_ns")
        if isinstance(value, int) and not isinstance(value, bool):
            order = value
            break
    if order is None:  # an old checkpoint without committed_ns, or unreadable metadata
        order = (path / META).stat().st_mtime_ns if (path / META).is_file() else path.stat().st_mtime_ns
    parent: Link | None | _Unknown = UNKNOWN
    for source in (meta, manifest):
        if isinstance(source, dict) and "parent" in source:
            parent = _link(source["parent"])
            break
    if problem:
        problem = f"checkpoint {path} is corrupt: {problem}"
    step = int(m.group(1)) if m else (meta or {}).get("step", -1)
    return Entry(path, step if isinstance(step, int) else -1, int(order), meta, problem, parent)


def scan(root: Path) -> list[Entry]:
    """Committed checkpoints under ``root`` (a ``checkpoints/`` directory), oldest commit first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        if p.name.startswith(".old-") and (root / p.name[len(".old-") :]).exists():
            continue  # replaced by a re-save of the same step (kept only if the rename was cut short)
        e = entry(p)
        if e is not None:
            found.append(e)
    return sorted(found, key=lambda e: (e.committed_ns, e.step, e.name))


def lineage(entries: list[Entry]) -> list[Entry]:
    """``entries`` (oldest commit first) in the order "latest" tries them: the newest commit,
    then its ancestors; commit order where the chain is unknown or cut."""
    if not entries:
        return []
    by_key = {e.key: e for e in entries}
    out, seen = [], set()
    cur: Entry | None = entries[-1]
    while cur is not None and id(cur) not in seen:
        out.append(cur)
        seen.add(id(cur))
        link = cur.parent
        if link is None:  # a fresh start: nothing older is on this lineage
            break
        if link is not UNKNOWN and link in by_key:
            cur = by_key[link]
            continue
        # unknown parent: the previous commit; a parent that is gone (pruned, replaced): the
        # newest commit before it (its own ancestors were committed before it)
        before = cur.committed_ns if link is UNKNOWN else link[1]
        older = [e for e in entries if e.committed_ns < before and id(e) not in seen]
        cur = older[-1] if older else None
    return out


def latest(
    root: Path, check: Callable[[Entry], object], *, warn: Callable[[str], None] | None = None, what: str = "latest"
) -> Entry | None:
    """The newest committed checkpoint of the lineage under ``root`` that ``check`` accepts
    (``check`` raises DataError to refuse one; what it returns is ignored). None when there
    is no committed checkpoint at all; a DataError when there are some and none is usable."""
    entries = scan(root)
    if not entries:
        return None
    skipped: list[str] = []
    for e in lineage(entries):
        why = e.problem
        if why is None and isinstance(e.meta, dict) and e.meta.get("finite") is False:
            why = f"checkpoint {e.path} is recorded as holding non-finite values"
        if why is None:
            try:
                check(e)
            except DataError as err:
                why = str(err)
        if why is None:
            if skipped and warn is not None:
                warn(
                    f"{what}: falling back to {e.path} (step {e.step}), the newest verified checkpoint of "
                    f"this run; {len(skipped)} newer one(s) skipped"
                )
            return e
        skipped.append(why)
        if warn is not None:
            warn(f"{why}; skipped")
    raise DataError(
        f"{what}: no usable checkpoint in {root} ({len(skipped)} committed, none verified; the newest: {skipped[0]})"
    )


@dataclass
class Located:
    path: Path
    explicit: bool  # a step directory was named (a failed check is an error, no fallback)


def locate(path: Path, check: Callable[[Entry], object], *, warn=None, what: str = "checkpoint") -> Located:
    """The checkpoint ``path`` names: a step directory itself (checked; a failure raises), or
    the latest of a ``checkpoints/`` or run directory. One-line DataError when there is none."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: no such file or directory")
    if is_step_dir(path):
        e = entry(path, any_name=True)
        if path.name.startswith(".tmp-"):  # even with a meta.json: cut short before its commit
            e = None
        if e is None:
            why = "a save that did not finish" if path.name.startswith(".tmp-") else "not committed"
            raise DataError(f"checkpoint {path} is incomplete or corrupt: no {META} ({why})")
        if e.problem:
            raise DataError(e.problem)
        check(e)
        return Located(path, True)
    root = checkpoints_dir(path)
    if root is None:
        raise DataError(f"{path} is neither a checkpoint, a checkpoints directory nor a run directory")
    found = latest(root, check, warn=warn, what=what)
    if found is None:
        raise DataError(f"{path} holds no committed checkpoint")
    return Located(found.path, False)
