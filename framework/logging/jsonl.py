"""metrics.jsonl: one JSON object per logged event, appended and flushed per line."""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

log = logging.getLogger("framework")


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/inf; keep the row parseable
    return v


class JsonlSink:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a", buffering=1)

    def start(self, trainer) -> None:
        """A run resumed at step k > 0: drop the rows of later steps (logged by the run that went
        on past that checkpoint and was cut short) before appending, so every step appears once."""
        if trainer.step <= 0:
            return
        self._f.close()
        dropped = _truncate(self.path, trainer.step)
        self._f = open(self.path, "a", buffering=1)
        if dropped:
            log.info("metrics.jsonl: dropped %d rows past step %d, where this run resumes", dropped, trainer.step)

    def log(self, row: dict) -> None:
        self._f.write(json.dumps({k: _clean(v) for k, v in row.items()}) + "\n")

    def close(self) -> None:
        self._f.close()


def _truncate(path: Path, step: int) -> int:
    """Keep the rows of steps <= ``step`` (and rows without one, and any line that does not parse:
    never lose what cannot be read); atomic. Returns how many rows were dropped."""
    kept, dropped = [], 0
    # surrogateescape: bytes that are not UTF-8 (a damaged disk block) pass through unchanged
    for line in path.read_bytes().decode("utf-8", "surrogateescape").splitlines(keepends=True):
        try:
            row = json.loads(line)
        except (ValueError, RecursionError):  # a line torn by a kill, or damaged: kept as it is
            row = None
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] > step:
            dropped += 1
            continue
        kept.append(line if line.endswith("\n") else line + "\n")
    if dropped:
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_bytes("".join(kept).encode("utf-8", "surrogateescape"))
        os.replace(tmp, path)
    return dropped


def read(path: Path, split: str | None = None) -> list[dict]:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [r for r in rows if split is None or r.get("split") == split]
