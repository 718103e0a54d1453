"""metrics.jsonl: one JSON object per logged event, appended and flushed per line."""

from __future__ import annotations

import json
import math
from pathlib import Path


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/inf; keep the row parseable
    return v


class JsonlSink:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a", buffering=1)

    def log(self, row: dict) -> None:
        self._f.write(json.dumps({k: _clean(v) for k, v in row.items()}) + "\n")

    def close(self) -> None:
        self._f.close()


def read(path: Path, split: str | None = None) -> list[dict]:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [r for r in rows if split is None or r.get("split") == split]
