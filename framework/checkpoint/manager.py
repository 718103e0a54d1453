"""One manager over every backend: naming, atomic commit, discovery, pruning.

Layout: ``<run_dir>/checkpoints/step_00000100/`` holds the backend's files plus
``meta.json``. A save writes into ``.tmp-step_00000100`` and is committed by a rename
once every rank is done, so a visible ``step_*`` directory is always complete and a
crash mid-save leaves the previous one untouched.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from framework.checkpoint import state as ckpt_state
from framework.config.schema import CheckpointConfig
from framework.errors import ConfigError, DataError

_NAME = re.compile(r"^step_(\d{8})$")
META = "meta.json"


class CheckpointManager:
    def __init__(self, cfg: CheckpointConfig, backend, run_dir: Path, env, barrier=lambda: None):
        self.cfg, self.backend, self.env, self.barrier = cfg, backend, env, barrier
        self.root = Path(run_dir) / "checkpoints"

    # discovery -------------------------------------------------------------------------
    def complete(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.iterdir() if _NAME.match(p.name) and (p / META).is_file()]
        return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)))

    def latest(self) -> Path | None:
        done = self.complete()
        return done[-1] if done else None

    def resume_path(self) -> Path | None:
        if self.cfg.resume == "none":
            return None
        if self.cfg.resume == "latest":
            return self.latest()
        path = Path(self.cfg.resume)
        if not (path / META).is_file():
            raise ConfigError(f"checkpoint.resume: {path} is not a complete checkpoint (no {META})")
        return path

    # save / load -----------------------------------------------------------------------
    def due(self, step: int, last: bool) -> bool:
        if last:
            return self.cfg.save_final
        return self.cfg.every > 0 and step % self.cfg.every == 0

    def save(self, trainer, config: dict) -> Path:
        step = trainer.step
        final = self.root / f"step_{step:08d}"
        tmp = self.root / f".tmp-{final.name}"
        if self.env.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        self.barrier()
        state = ckpt_state.capture(trainer, full=self.backend.full_state)
        self.backend.save(state, tmp, self.env)
        self.barrier()  # every rank has written its part
        if self.env.is_main:
            meta = {"step": step, "backend": type(self.backend).__name__, "config": config}
            (tmp / META).write_text(json.dumps(meta, indent=1, default=str))
            if final.exists():  # re-saving a step (e.g. after a resume): replace it whole
                shutil.rmtree(final)
            os.replace(tmp, final)
            self._fsync_dir(self.root)
            self.prune()
        self.barrier()
        return final

    def load(self, path: Path, trainer) -> None:
        if not (path / META).is_file():
            raise DataError(f"checkpoint {path} is incomplete or corrupt (no {META})")
        state = self.backend.load(path, self.env)
        missing = [p for p in ckpt_state.PARTS if p not in state and p not in self.cfg.exclude]
        if missing:
            raise DataError(f"checkpoint {path} lacks {', '.join(missing)}")
        ckpt_state.restore(trainer, state, exclude=tuple(self.cfg.exclude), full=self.backend.full_state)

    def before_optimizer_step(self) -> None:
        """Called before every optimizer step (sync backends: nothing in flight)."""

    def finish(self) -> None:
        """Called when training ends: wait for any save still in flight."""

    def prune(self) -> None:
        done = self.complete()
        for old in done[: max(0, len(done) - self.cfg.keep)]:
            shutil.rmtree(old, ignore_errors=True)
        for stale in self.root.glob(".tmp-step_*"):  # left by a crash mid-save
            shutil.rmtree(stale, ignore_errors=True)

    @staticmethod
    def _fsync_dir(path: Path) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
