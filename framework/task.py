"""The Task contract: the only way the engine learns about a recipe.

A recipe registers a ``Task`` subclass in ``registry.tasks``; the engine builds it with
the validated run config and calls nothing but the methods below. Everything about the
data, the science and the scores lives behind them, so the engine stays free of any
domain knowledge. Class methods run before any process group or data access (config
checks, the domain split, exports); instance methods during a run.

The trainer's use, in order: ``train_dataset`` / ``val_dataset`` (once, to fail early),
``build_model`` (a plain ``nn.Module``; the engine splits, compiles and shards it),
``init_weights`` (``checkpoint.init_from``, on a fresh start only), ``flops_per_sample``,
then per step ``loss(model, batch)``; at validation ``val_step`` per batch, the engine
sums its tensors over every rank, ``val_summary(sums)`` turns them into the logged row
and ``val_figures`` draws; at the end ``summary_lines(last_val_row)``.
``python -m framework.export --format F`` asks ``export_writers`` for the writer of F.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


class Task(abc.ABC):
    """Base class of every recipe task; the abstract methods are the ones a task must write."""

    def __init__(self, run, env, device: torch.device, *, barrier=lambda: None, domain=None):
        """``run``: the validated config; ``env``: rank and world; ``barrier()``: all ranks meet;
        ``domain``: the :class:`framework.domain.comm.DomainGroup` when the domain is split
        (this rank then reads and computes only its band of rows), else None."""
        self.run, self.env, self.device, self.barrier, self.domain = run, env, device, barrier, domain

    # -- before the run (no process group, no data) ------------------------------------------
    @classmethod
    def check_config(cls, run) -> None:
        """Raise ConfigError (one line, naming the key) on a combination the task cannot run."""
        return None  # an optional hook: nothing to check by default

    @classmethod
    def domain_rows(cls, run) -> tuple[int, int]:
        """(rows of the field split over the domain axis, the multiple every band must be)."""
        raise NotImplementedError(f"task {cls.__name__} does not support domain parallelism")

    @classmethod
    @abc.abstractmethod
    def export_spec(cls, config: dict) -> dict:
        """What a weights file of a run with ``config`` (the saved run config, plain dict) must
        record to rebuild its model: at least ``name`` (model registry entry), ``model`` (its
        config node) and ``kwargs`` (the builder's keyword arguments besides the config).
        Raise DataError when ``config`` does not describe such a run."""

    @classmethod
    def export_writers(cls) -> dict[str, Callable[[dict, dict, Path], Any]]:
        """Formats ``python -m framework.export --format`` writes besides the engine's own
        (``native``: the state dict and its ``export_spec`` as JSON): {name: writer}, where
        ``writer(weights, spec, out)`` writes the model's state dict (plain CPU tensors) and
        its export spec to the file ``out``, raising DataError when the model has no
        counterpart in that format. None besides it by default."""
        return {}

    # -- data and model ---------------------------------------------------------------------
    @abc.abstractmethod
    def train_dataset(self) -> torch.utils.data.Dataset:
        """Samples as dicts of tensors (and an ``index``), this rank's rows only when split."""

    @abc.abstractmethod
    def val_dataset(self) -> torch.utils.data.Dataset: ...

    @abc.abstractmethod
    def build_model(self) -> torch.nn.Module:
        """The plain model, on CPU, knowing nothing of distribution."""

    def init_weights(self, model: torch.nn.Module, path: Path) -> dict:
        """``checkpoint.init_from=<path>``: load trained weights into the fresh ``model`` (just
        built by ``build_model``, not yet split or sharded; a fresh start only, never on resume)
        and return a small JSON-able record of what was loaded (kept in the run's checkpoints).
        The default reads the engine's own formats (a run, ``checkpoints/`` or step directory;
        an exported weights file); override to accept others. Names or shapes that differ from
        the model's: ConfigError naming the file and the first difference
        (``framework.checkpoint.init_from.apply``)."""
        from framework.checkpoint.init_from import load_own

        return load_own(model, path)

    def flops_per_sample(self) -> float | None:
        """Model FLOPs of one training sample when the model states them, else None (counted)."""
        return None

    # -- steps ------------------------------------------------------------------------------
    @abc.abstractmethod
    def loss(self, model: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        """Scalar loss of one (micro-)batch; ``batch["step"]`` is the global step."""

    @abc.abstractmethod
    def val_step(self, model: torch.nn.Module, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Tensors to be summed over batches and ranks (sums, counts), not means."""

    @abc.abstractmethod
    def val_summary(self, sums: dict[str, torch.Tensor]) -> dict[str, float]:
        """The logged validation row (``loss`` at least) from the summed ``val_step`` tensors."""

    def val_figures(self, out_dir, step: int) -> dict[str, str]:
        """{name: png path} drawn after a validation (on the main rank); none by default."""
        return {}

    def summary_lines(self, val_row: dict) -> list[str]:
        """Closing lines about the last validation (e.g. the verdict against a baseline)."""
        return []

    # -- planning (``mode=plan``, ``parallel=auto``: framework/plan.py) --------------------
    def example_batch(self, batch_size: int, empty: Callable[..., torch.Tensor]) -> dict[str, Any] | None:
        """A batch of ``batch_size`` samples shaped as this rank would load it (its band of rows
        when split), so the planner can trace a step without reading data: make each field with
        ``empty(shape, dtype=torch.float32)`` (no memory behind it) and the small values the
        loss reads as numbers (sample indices) as ordinary tensors. None (the default): the
        plan gives no activation or data figures."""
        return None
