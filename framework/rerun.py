"""Rerunning a run directory: the overrides it was launched with, the new ones on top, and
the history of every invocation.

``python -m framework hydra.run.dir=RUN trainer.max_steps=20`` on a directory that holds a
run continues that run: the task overrides its last accepted invocation ran with are the
base, the command line's are applied on top (:func:`merge`), and Hydra runs the result.
``checkpoint.resume=none`` on the command line starts over with the command line alone.

The record of a run dir, :data:`HISTORY` (``.hydra/override_history.jsonl``), is appended
to by the main rank of every invocation and never rewritten: one JSON object per line, a
``start`` (time, the overrides passed, the effective ones, the checkpoint it resumes from)
and, when the process ends, an ``end`` (exit code, step reached). One ``write`` of a whole
line on an ``O_APPEND`` descriptor, fsynced; a line a crash cut short is skipped when read
and the next entry starts on a line of its own, so earlier entries are never lost. A run
dir without a history (written by an older version) is read from Hydra's
``.hydra/overrides.yaml``, which Hydra rewrites on every run.

Both files are untrusted input: read with ``json`` / ``yaml.safe_load``, size-capped,
type-checked (a list of strings), refused if they hold Hydra settings (a run dir records
only the job's overrides), passed through :func:`framework.config.security.check_overrides`,
and the composed result goes through the whole precheck like any command line. Anything
wrong is one :class:`~framework.errors.ConfigError` line naming the file (exit 2).

Torch-free: the precheck reads this before anything heavy is imported.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from framework import untrusted
from framework.errors import ConfigError

HISTORY = Path(".hydra") / "override_history.jsonl"
HYDRA_OVERRIDES = Path(".hydra") / "overrides.yaml"
# Where this invocation starts from, never carried over: a rerun resumes the run dir's own
# latest checkpoint, not the checkpoint another run was once started from.
NOT_REUSED = ("checkpoint.resume",)
MAX_BYTES = 16 * 2**20  # a record larger than this is not a record of ours


# -- the command line's overrides over the recorded ones --------------------------------------------
@dataclass
class Merge:
    effective: list[str]  # the task overrides Hydra runs
    reused: list[str]  # recorded overrides kept as they were
    replaced: list[tuple[str, str]]  # (recorded, new)
    dropped: list[str]  # recorded overrides a ~key removed
    not_reused: list[str]  # recorded overrides of NOT_REUSED keys


def _parse(overrides: list[str], what: str) -> list:
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        return OverridesParser.create().parse_overrides(list(overrides))
    except HydraException as e:
        from framework.config.compose import hydra_message

        raise ConfigError(f"{what}: {hydra_message(e)}") from None


def _key(o) -> tuple[str, str | None]:
    return o.key_or_group, o.package


def merge(recorded: list[str], passed: list[str]) -> Merge:
    """``passed`` (task overrides) over ``recorded``: a new value for a key replaces the recorded
    one in place (a plain ``key=v`` over a recorded ``+key=`` keeps the ``+``: the key exists only
    because of it); ``~key`` removes the recorded overrides of ``key`` (back to the config's
    value), or, if none was recorded, is passed on (Hydra deletes the key); anything else is
    appended in order."""
    from hydra.core.override_parser.types import OverrideType

    # one slot per override: [key, type, text, the recorded text it started as (None: new)]
    out: list[list[Any]] = []
    not_reused = []
    for o in _parse(recorded, "recorded overrides"):
        if o.key_or_group in NOT_REUSED:
            not_reused.append(o.input_line)
        else:
            out.append([_key(o), o.type, o.input_line, o.input_line])
    dropped: list[str] = []
    for o in _parse(passed, "command line"):
        k = _key(o)
        found = [slot for slot in out if slot[0] == k]
        if o.type == OverrideType.DEL and found:
            dropped += [slot[3] for slot in found if slot[3] is not None]
            out = [slot for slot in out if slot[0] != k]
            continue
        text = o.input_line
        if not found:
            out.append([k, o.type, text, None])
            continue
        first = found[0]
        if o.type == OverrideType.CHANGE and first[1] in (OverrideType.ADD, OverrideType.FORCE_ADD):
            text = ("+" if first[1] == OverrideType.ADD else "++") + text
        else:
            first[1] = o.type
        first[2] = text
        out = [slot for slot in out if slot[0] != k or slot is first]
    effective = [slot[2] for slot in out]
    reused = [slot[2] for slot in out if slot[3] == slot[2]]
    replaced = [(slot[3], slot[2]) for slot in out if slot[3] is not None and slot[3] != slot[2]]
    return Merge(effective, reused, replaced, dropped, not_reused)


# -- the record of a run dir -------------------------------------------------------------------
@dataclass
class Record:
    source: Path  # the file it was read from
    overrides: list[str]  # the task overrides of the last accepted invocation


def _read_text(path: Path) -> str:
    try:
        size = path.stat().st_size
        if size > MAX_BYTES:
            raise ConfigError(f"{path}: {size} bytes, more than a record of overrides can be ({MAX_BYTES}); refused")
        return untrusted.read_bytes(path, MAX_BYTES).decode("utf-8")  # a named pipe: refused, not waited on
    except (OSError, ValueError) as e:  # ValueError: BadFile, UnicodeDecodeError
        raise ConfigError(f"{path}: cannot be read ({getattr(e, 'strerror', None) or e})") from None


def _strings(value: Any, where: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        got = type(value).__name__ if not isinstance(value, list) else "a list with a non-string item"
        raise ConfigError(f"{where}: not a list of override strings (got {got}); refused")
    return list(value)


def history_entries(path: Path) -> list[dict]:
    """The entries of a history file; lines that do not parse (cut short by a crash) are skipped,
    a line that parses to anything but an object with the expected fields is refused."""
    out = []
    for n, line in enumerate(_read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except (ValueError, RecursionError):
            continue  # a torn write, or damaged past parsing
        where = f"{path}: line {n}"
        if not isinstance(entry, dict) or entry.get("event") not in ("start", "end"):
            raise ConfigError(f"{where}: not an entry of an override history; refused")
        if entry["event"] == "start":
            _strings(entry.get("effective"), f"{where}: effective")
        elif not isinstance(entry.get("exit"), (int, type(None))):
            raise ConfigError(f"{where}: exit is not an exit code; refused")
        out.append(entry)
    return out


def read_record(run_dir: Path, launch: str | None = None) -> Record | None:
    """The task overrides of the run dir's last accepted invocation, or None if it records none.

    From the history: the newest ``start`` not made by this very launch (the ranks of a
    torchrun or srun launch read it while their main rank writes) and not refused as a config
    error (exit 2: it never trained, its changes are in no checkpoint). Else from Hydra's
    ``overrides.yaml``."""
    run_dir = Path(run_dir)
    hist = run_dir / HISTORY
    if hist.is_file():
        entries = history_entries(hist)
        refused = {e.get("id") for e in entries if e["event"] == "end" and e.get("exit") == 2}
        starts = [e for e in entries if e["event"] == "start"]
        for e in reversed(starts):
            if e.get("id") in refused or (launch is not None and e.get("launch") == launch):
                continue
            return Record(hist, list(e["effective"]))
        if starts:
            return None  # every invocation so far was refused: nothing was run to continue
    path = run_dir / HYDRA_OVERRIDES
    if not path.is_file():
        return None
    import yaml  # type: ignore[import-untyped]

    try:
        value = yaml.safe_load(_read_text(path))
    except yaml.YAMLError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"{path}: not valid YAML ({first}); refused") from None
    except RecursionError:  # safe_load composes nested nodes recursively
        raise ConfigError(f"{path}: nests too deeply to be a list of overrides; refused") from None
    return Record(path, _strings([] if value is None else value, str(path)))


def check_record(record: Record) -> None:
    """The recorded overrides pass the command line's checks; Hydra settings are refused (Hydra
    records only the job's overrides, and so does the history: one there was put there)."""
    from framework.config import security

    for o in _parse(record.overrides, str(record.source)):
        if o.is_hydra_override():
            raise ConfigError(
                f"{record.source}: {o.input_line}: a run dir records only the job's overrides, never Hydra's "
                "settings; refused"
            )
    try:
        security.check_overrides(record.overrides)
    except ConfigError as e:
        raise ConfigError(f"{record.source}: {e}") from None


# -- a rerun -----------------------------------------------------------------------------------
@dataclass
class Rerun:
    run_dir: Path
    record: Record
    passed: list[str]  # every override of the command line
    merge: Merge | None  # None: checkpoint.resume=none, nothing reused
    hydra: list[str] = field(default_factory=list)  # the command line's Hydra overrides, as passed

    @property
    def overrides(self) -> list[str]:
        """What Hydra is to run: the command line's Hydra overrides and the effective task ones."""
        if self.merge is None:
            return list(self.passed)
        return [*self.hydra, *self.merge.effective]

    def log_lines(self) -> list[str]:
        if self.merge is None:
            return [
                f"rerun of {self.run_dir}: checkpoint.resume=none, a fresh start with the command line's "
                f"overrides only (those in {self.record.source} are not reused)"
            ]
        m = self.merge
        lines = [
            f"rerun of {self.run_dir}: {len(m.reused)} override(s) reused from {self.record.source}: "
            + (" ".join(m.reused) or "none")
        ]
        new = [f"{new} (was {old})" for old, new in m.replaced]
        new += [t for t in m.effective if t not in m.reused and t not in {n for _, n in m.replaced}]
        new += [f"~{t.lstrip('+~').split('=', 1)[0]} (dropped {t})" for t in m.dropped]
        lines.append("rerun: new overrides applied: " + (" ".join(new) or "none"))
        if m.not_reused:
            lines.append(f"rerun: not reused (this invocation decides where it starts): {' '.join(m.not_reused)}")
        return lines

    def blame(self, message: str) -> str:
        """``message`` (an error of the composed config), saying so if a reused override caused it."""
        if self.merge is None:
            return message
        for text in self.merge.reused:
            key = text.lstrip("+~").split("=", 1)[0]
            if message.startswith(key) or text in message or f"'{key}'" in message:
                return f"{message} (an override reused from {self.record.source}; drop it with ~{key})"
        return message


def explicit_run_dir(overrides: list[str]) -> Path | None:
    """The ``hydra.run.dir`` the command line names literally (the last one), or None."""
    try:
        parsed = _parse(overrides, "command line")
    except ConfigError:
        return None  # composition reports the syntax error
    values = [o.value() for o in parsed if o.key_or_group == "hydra.run.dir" and not o.is_delete()]
    if not values or not isinstance(values[-1], str) or "${" in values[-1]:
        return None
    return Path(os.path.abspath(values[-1]))


def plan(passed: list[str], run_dir: Path | None, launch: str | None = None) -> Rerun | None:
    """The rerun of ``run_dir`` with the command line ``passed``, or None when the run dir records
    no run. Raises ConfigError (naming the file) for a record that is unreadable or refused."""
    if run_dir is None or not Path(run_dir).is_dir():
        return None
    record = read_record(Path(run_dir), launch)
    if record is None:
        return None
    check_record(record)
    parsed = _parse(passed, "command line")
    hydra = [o.input_line for o in parsed if o.is_hydra_override()]
    task = [o.input_line for o in parsed if not o.is_hydra_override()]
    fresh = any(o.key_or_group == "checkpoint.resume" and not o.is_delete() and o.value() == "none" for o in parsed)
    return Rerun(Path(run_dir), record, list(passed), None if fresh else merge(record.overrides, task), hydra)


# -- the history -------------------------------------------------------------------------------
def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def append(path: Path, entry: dict) -> None:
    """One line, one write on an O_APPEND descriptor, fsynced; after a torn last line the entry
    starts on a line of its own."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = (json.dumps(entry, sort_keys=True) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        if size:
            with open(path, "rb") as f:
                f.seek(size - 1)
                if f.read(1) != b"\n":
                    data = b"\n" + data
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


class History:
    """The main rank's entries for this invocation: :meth:`start` once, :meth:`end` once."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / HISTORY
        self.id: str | None = None

    def start(
        self, *, passed: list[str], effective: list[str], reused: Record | None, resumes_from: dict | None
    ) -> None:
        from framework.rundir import launch_id

        self.id = uuid.uuid4().hex
        append(
            self.path,
            {
                "event": "start",
                "id": self.id,
                "time": _now(),
                "passed": list(passed),
                "effective": list(effective),
                "reused_from": str(reused.source) if reused is not None else None,
                "resumes_from": resumes_from,
                "launch": launch_id(),
                "host": os.uname().nodename,
                "pid": os.getpid(),
                "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            },
        )

    def end(self, exit_code: int, step: int | None = None) -> None:
        if self.id is None:
            return
        entry = {"event": "end", "id": self.id, "time": _now(), "exit": int(exit_code), "step": step}
        self.id = None
        try:
            append(self.path, entry)
        except OSError:
            pass  # the run's own outcome stands; a missing end reads as "ran"


def resume_point(resume: str, run_dir: Path) -> dict | None:
    """The checkpoint ``checkpoint.resume`` points at now, as the locator finds it without hashing
    (the resume verifies it fully and may fall back past it): {"step", "checkpoint"} or None."""
    if resume == "none":
        return None
    from framework.checkpoint import locator
    from framework.errors import DataError

    try:
        if resume == "latest":
            found = locator.latest(Path(run_dir) / "checkpoints", lambda e: None)
            path, step = (found.path, found.step) if found is not None else (None, None)
        else:
            located = locator.locate(Path(resume), lambda e: None)
            path, step = located.path, locator.entry(located.path, any_name=True).step  # type: ignore[union-attr]
    except (DataError, OSError, AttributeError):
        return None
    return None if path is None else {"step": step, "checkpoint": str(path)}
