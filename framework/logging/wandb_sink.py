"""Weights & Biases sink (rank 0): offline by default, resumes the same run after a restart.

The run starts lazily, once the trainer knows its run id (restored from a checkpoint
on resume), so a requeued job continues the same wandb run.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from framework.errors import ConfigError

if TYPE_CHECKING:
    from wandb.sdk.wandb_run import Run


def _hydra_labels() -> tuple[str | None, str | None]:
    """(override string of this job, sweep dir name) when running under Hydra."""
    try:
        from hydra.core.hydra_config import HydraConfig

        if not HydraConfig.initialized():
            return None, None
        hc = HydraConfig.get()
        sweep = Path(hc.sweep.dir).name if hc.mode is not None and hc.mode.name == "MULTIRUN" else None
        return hc.job.override_dirname or None, sweep
    except Exception:
        return None, None


class WandbSink:
    def __init__(self, cfg, run, run_dir: Path):
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise ConfigError("logger=wandb needs the wandb package: pip install -e '.[wandb]'") from None
        self.cfg, self.run, self.run_dir = cfg, run, Path(run_dir)
        self.wb: Run | None = None

    def start(self, trainer) -> None:
        import wandb
        from omegaconf import OmegaConf

        name, sweep = _hydra_labels()
        os.environ.setdefault("WANDB_SILENT", "true")
        self.wb = wandb.init(
            project=self.cfg.project,
            entity=self.cfg.entity,
            group=self.cfg.group or sweep,
            job_type=self.run.recipe,
            name=name or self.run_dir.name,
            tags=list(getattr(self.run, "tags", ())) or None,  # the config's `tags`
            id=trainer.run_id,
            resume="allow",
            dir=str(self.run_dir),
            mode=self.cfg.mode,
            config=cast(dict[str, Any], OmegaConf.to_container(self.run.raw, resolve=True)),  # a DictConfig
        )

    def log(self, row: dict) -> None:
        if self.wb is None:
            return
        split = row.get("split", "train")
        data = {f"{split}/{k}": v for k, v in row.items() if k not in ("step", "split") and v is not None}
        self.wb.log(data, step=int(row["step"]))

    def log_images(self, step: int, images: dict) -> None:
        """``images``: name -> PNG path or array; shown under val/ in the dashboard."""
        if self.wb is None or not self.cfg.images:
            return
        import wandb

        self.wb.log({f"val/{k}": wandb.Image(v) for k, v in images.items()}, step=step)

    def close(self) -> None:
        if self.wb is not None:
            self.wb.finish()
            self.wb = None
