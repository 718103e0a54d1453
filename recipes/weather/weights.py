"""Load a trained model for inference or as a frozen stage: from an export or a checkpoint.

``path`` may be an exported weights file (``python -m framework.export``; its ``.json``
lies beside it), one checkpoint directory (``.../checkpoints/step_XXXXXXXX``), a run
directory or its ``checkpoints/`` directory: then the checkpoint is the one
``framework.checkpoint.locator`` names, the same the run would resume from (the newest
commit of the run's lineage that verifies; never the highest step of an abandoned
branch). ``describe`` checks it quickly (manifest, sizes, meta.json); ``load`` verifies
every checksum and refuses, before reading any tensor, weights whose names, dtypes or
shapes differ from the model's. The model is rebuilt through the registry from the
run's own config, so it is exactly the trained architecture.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from framework import registry
from framework.errors import ConfigError, DataError

log = logging.getLogger("framework")


@dataclass
class ModelInfo:
    path: Path
    name: str  # the model registry name (songunet, dit)
    model: dict  # the model config node
    task: dict  # the task config node of the training run
    channels: dict  # hrrr_channels, era5_channels, invariants it was trained on
    grid: list[int]
    config: dict  # the whole export config (model_config of framework.export)
    checkpoint: Path | None = None  # the checkpoint directory ``path`` resolved to (None: a weights file)


def _checkpoint(path: Path, *, full: bool):
    """(checkpoint directory, Verified) that ``path`` names, through the locator; the full
    check (load) reports a fallback or an unverified checkpoint, the quick one (describe,
    run at config validation on every rank) stays quiet."""
    from framework.export import open_checkpoint

    return open_checkpoint(path, full=full, warn=log.warning if full else None)


def describe(path) -> ModelInfo:
    """What the model at ``path`` is, from its config alone (no weights read): cheap, for checks."""
    from framework.export import model_config

    path = Path(path)
    if path.is_file():
        side = path.with_suffix(".json")
        if not side.is_file():
            raise DataError(f"{path}: no {side.name} beside it (write both with python -m framework.export)")
        try:
            cfg = json.loads(side.read_text())
        except (OSError, ValueError) as e:
            raise DataError(f"{side}: unreadable model config ({e})") from None
        ckpt = None
    elif path.is_dir():
        ckpt, verified = _checkpoint(path, full=False)
        cfg = model_config(verified.meta.get("config"))
    else:
        raise DataError(f"{path}: no such file or directory")
    if not cfg.get("task") or not cfg.get("channels"):
        raise DataError(f"{path}: its config names no task or channels (exported by an older version?)")
    return ModelInfo(
        path, cfg["name"], cfg["model"], cfg["task"], cfg["channels"], list(cfg["img_resolution"]), cfg, ckpt
    )


def _weights(info: ModelInfo, expected: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if info.path.is_file():
        from framework.checkpoint.io import load_plain

        weights = load_plain(info.path, what=f"{info.path}: weights")
        if not isinstance(weights, dict) or not all(isinstance(v, torch.Tensor) for v in weights.values()):
            raise DataError(f"{info.path}: not a weights file (a dict of tensors)")
        return weights
    from framework.export import model_weights

    ckpt, verified = _checkpoint(info.path, full=True)
    if info.checkpoint is not None and ckpt != info.checkpoint:  # its data failed the full check
        log.warning("%s: loading %s, not %s (which failed verification)", info.path, ckpt, info.checkpoint)
        info.checkpoint = ckpt
    return model_weights(ckpt, verified.meta, expected)  # refuses other names, dtypes, shapes first


def build(info: ModelInfo) -> torch.nn.Module:
    """The model of ``info`` as its task builds it (e.g. the EDM preconditioner around the net)."""
    entry = registry.models.entry(info.name)
    schema = entry.schema
    try:
        cfg = schema(**info.model)
    except (TypeError, ValueError) as e:
        raise DataError(f"{info.path}: model config does not fit model '{info.name}': {e}") from None
    net = entry.builder(
        cfg,
        in_channels=info.config["in_channels"],
        out_channels=info.config["out_channels"],
        img_resolution=tuple(info.grid),
    )
    task_cls = registry.tasks.entry(info.task["name"]).builder
    wrap = getattr(task_cls, "wrap_net", None)
    return wrap(net, info.task) if wrap is not None else net


def load(path, device="cpu") -> tuple[torch.nn.Module, ModelInfo]:
    """The trained model at ``path`` in eval mode with its weights, and what it is."""
    info = describe(path)
    model = build(info)
    weights = _weights(info, model.state_dict())
    missing, unexpected = model.state_dict().keys() - weights.keys(), weights.keys() - model.state_dict().keys()
    if missing or unexpected:
        raise DataError(
            f"{info.path}: weights do not fit the {info.name} model: missing {sorted(missing)[:3]}, "
            f"unexpected {sorted(unexpected)[:3]}"
        )
    try:
        model.load_state_dict(weights)
    except RuntimeError as e:
        raise DataError(
            f"{info.path}: weights do not fit the {info.name} model: {str(e).splitlines()[-1].strip()}"
        ) from None
    return model.to(device).eval(), info


def check_channels(info: ModelInfo, data, what: str) -> None:
    """A ConfigError naming the first channel list or grid that differs from ``data``'s."""
    for key in ("hrrr_channels", "era5_channels", "invariants"):
        want, have = list(getattr(data, key)), list(info.channels.get(key) or [])
        if want != have:
            raise ConfigError(f"{what}: {info.path} was trained with {key}={have} but data.{key} is {want}")
    if list(data.grid) != list(info.grid):
        raise ConfigError(f"{what}: {info.path} was trained on grid {info.grid} but data.grid is {list(data.grid)}")
