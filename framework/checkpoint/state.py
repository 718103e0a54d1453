"""What a checkpoint holds, gathered from and restored into live training objects.

Model and optimizer go through torch.distributed.checkpoint.state_dict, which names
optimizer state by parameter FQN: the same file loads into any layout.
"""

from __future__ import annotations

import random

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
    set_optimizer_state_dict)

PARTS = ("model", "optimizer", "schedule", "scaler", "rng", "data")


def rng_state() -> dict:
    """RNG states as plain tensors/lists so they load under weights_only=True."""
    np_state = np.random.get_state(legacy=False)
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {"key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
                  "pos": int(np_state["state"]["pos"]),
                  "has_gauss": int(np_state["has_gauss"]), "gauss": float(np_state["gauss"])},
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state({"bit_generator": "MT19937",
                         "state": {"key": n["key"].numpy().astype(np.uint32), "pos": n["pos"]},
                         "has_gauss": n["has_gauss"], "gauss": n["gauss"]})
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def capture(t, *, full: bool) -> dict:
    """State of trainer ``t``; ``full`` gathers sharded tensors (consolidated backends)."""
    opts = StateDictOptions(full_state_dict=full, cpu_offload=full)
    return {
        "model": get_model_state_dict(t.model, options=opts),
        "optimizer": get_optimizer_state_dict(t.model, t.optimizer, options=opts),
        "schedule": t.scheduler.state_dict(),
        "scaler": t.precision.scaler.state_dict() if t.precision.scaler else {},
        "rng": rng_state(),
        "data": {"step": t.step},
        "meta": {"step": t.step, "run_id": t.run_id},
    }


def restore(t, state: dict, *, exclude=(), full: bool) -> None:
    opts = StateDictOptions(full_state_dict=full, strict=True)
    if "model" not in exclude:
        set_model_state_dict(t.model, state["model"], options=opts)
    if "optimizer" not in exclude:
        set_optimizer_state_dict(t.model, t.optimizer, state["optimizer"], options=opts)
    if "schedule" not in exclude:
        t.scheduler.load_state_dict(state["schedule"])
    if "scaler" not in exclude and t.precision.scaler and state["scaler"]:
        t.precision.scaler.load_state_dict(state["scaler"])
    if "rng" not in exclude:
        set_rng_state(state["rng"])
    if "data" not in exclude:
        t.step = int(state["data"]["step"])
    t.run_id = state["meta"].get("run_id") or t.run_id
