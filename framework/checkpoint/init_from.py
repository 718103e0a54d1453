"""``checkpoint.init_from``: a fresh run starts from trained weights (fine-tuning).

The runtime calls ``Task.init_weights(model, path)`` right after ``build_model``, before the
model is split, compiled or sharded, and only when the run does not resume (a resumed run
continues from its own checkpoint, whose weights win). The default there is :func:`load_own`:
the engine's own formats, read as ``python -m framework.export`` reads them:

- a step directory (that checkpoint), a ``checkpoints/`` or a run directory (the locator's
  latest: ``framework.checkpoint.locator``), every checksum verified, only the model part read;
- an exported weights file (a dict of tensors, ``weights_only=True``).

A task reads other formats by overriding ``init_weights`` and handing its state dict to
:func:`apply`. Weights whose names or shapes differ from the model's are refused before any
is copied, with one line naming the file and the first difference (a ConfigError: exit 2).
What was loaded is returned as a small record that the checkpoints of the run keep
(``meta.json``'s ``init_from``), so a resumed run knows where it started and never loads it again.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from framework.errors import ConfigError

log = logging.getLogger("framework")

WHAT = "checkpoint.init_from"


def read_own(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """(state dict, record) of the weights at ``path`` in the engine's own formats."""
    from framework.checkpoint.io import load_weights_file
    from framework.export import model_weights, open_checkpoint

    path = Path(path)
    if path.is_file():
        return load_weights_file(path), {"path": str(path), "format": "weights file"}
    if not path.is_dir():
        raise ConfigError(f"{WHAT}: {path} does not exist")
    ckpt, verified = open_checkpoint(path, full=True, warn=log.warning)
    weights = model_weights(ckpt, verified.meta)
    record = {"path": str(path), "format": "checkpoint", "checkpoint": str(ckpt), "step": verified.meta.get("step")}
    return weights, record


def apply(model: torch.nn.Module, weights: dict[str, torch.Tensor], source, what: str = WHAT) -> int:
    """Copy ``weights`` into ``model`` after checking that names and shapes are exactly the
    model's (dtypes may differ: the copy casts) and that they are finite; returns the number of
    tensors. A difference is one ConfigError line naming ``source`` and the first name that
    differs; nothing is copied."""
    from framework.checkpoint.backend import first_difference, first_non_finite

    have = {k: (v.dtype, tuple(v.shape)) for k, v in weights.items()}
    why = first_difference(have, model.state_dict(), dtypes=False, there="there") or first_non_finite(weights)
    if why:
        raise ConfigError(f"{what}: {source} does not fit the model: {why}")
    with torch.no_grad():
        model.load_state_dict(weights, strict=True)
    return len(weights)


def load_own(model: torch.nn.Module, path: Path) -> dict:
    """``Task.init_weights``'s default: the engine's own formats (see the module docstring)."""
    weights, record = read_own(path)
    record["tensors"] = apply(model, weights, path)
    return record
