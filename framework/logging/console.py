"""Rank-0 console: a progress bar (step, loss, samples/s, ETA) and short event lines."""

from __future__ import annotations

import logging
import sys

from tqdm import tqdm

log = logging.getLogger("framework")


class ConsoleSink:
    def __init__(self, total_steps: int, start_step: int, enabled: bool = True):
        # A bar only on a terminal; in files (SLURM logs, CI) the logged rows say the same.
        self.bar = None
        if enabled and sys.stderr.isatty():
            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True, file=sys.stderr)

    def advance(self, step: int, loss: float | None, samples_per_s: float | None) -> None:
        if self.bar is None:
            return
        self.bar.update(step - self.bar.n)
        post = {}
        if loss is not None:
            post["loss"] = f"{loss:.4g}"
        if samples_per_s:
            post["samples/s"] = f"{samples_per_s:.1f}"
        self.bar.set_postfix(post, refresh=False)

    def log(self, row: dict) -> None:
        text = "  ".join(
            f"{k}={_fmt(v)}" for k, v in row.items() if "/" not in k
        )  # per-channel detail stays in metrics.jsonl
        if self.bar is not None:
            self.bar.write(text)  # above the bar on the terminal ...
            _to_log_files(text)  # ... and in framework.log all the same
        else:
            log.info(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _to_log_files(text: str) -> None:
    """``log.info(text)`` to the file handlers only (framework.log): the terminal has the line."""
    record = log.makeRecord(log.name, logging.INFO, __file__, 0, text, (), None)
    seen = set()
    logger: logging.Logger | None = log
    while logger is not None:
        for h in logger.handlers:
            if isinstance(h, logging.FileHandler) and id(h) not in seen and record.levelno >= h.level:
                seen.add(id(h))
                h.handle(record)
        logger = logger.parent if logger.propagate else None


def _fmt(v):
    return f"{v:.4g}" if isinstance(v, float) else str(v)
