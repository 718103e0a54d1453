"""Log sinks. metrics.jsonl and the console are always on (rank 0); ``logger=`` adds one."""

from __future__ import annotations

from typing import Protocol

from framework import registry
from framework.config.schema import LoggerConfig


class Sink(Protocol):
    """What the trainer calls on every sink; ``start``, ``advance`` and ``log_images`` are
    optional (looked up with hasattr)."""

    def log(self, row: dict) -> None: ...

    def close(self) -> None: ...


@registry.loggers.register("console", LoggerConfig)
def _console(cfg, **_):
    return None  # console + metrics.jsonl only


@registry.loggers.register("wandb", LoggerConfig)
def _wandb(cfg, *, run, run_dir, **_):
    from framework.logging.wandb_sink import WandbSink

    return WandbSink(cfg, run, run_dir)
