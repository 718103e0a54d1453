"""What a checkpoint holds, gathered from and restored into live training objects.

Model and optimizer go through torch.distributed.checkpoint.state_dict, which names
parameters and optimizer state by FQN (no ``module.``/``_orig_mod.`` prefixes, no FSDP
wrappers): the same checkpoint loads into any layout. Every part is either tensors or
plain Python values (numbers, strings, lists, tuples, dicts), so every file loads with
``weights_only=True``.

Parts: ``model``, ``optimizer``, ``schedule``, ``scaler``, ``rng`` (one state per rank,
kept by the manager in ``rng/rank_<r>.pt``), ``data`` (the global step, which is the
sampler's position). ``meta`` (step, run id) is always restored.
"""

from __future__ import annotations

import hashlib
import random

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
    set_optimizer_state_dict)


PARTS = ("model", "optimizer", "schedule", "scaler", "rng", "data")
TENSOR_PARTS = ("model", "optimizer")  # sharded under FSDP2; the rest is small and replicated


# -- RNG ----------------------------------------------------------------------------------
def rng_state() -> dict:
    """This rank's RNG states as plain tensors/lists so they load under weights_only=True."""
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


def reseed(seed: int, step: int, rank: int) -> int:
    """Deterministic fresh RNG state for a rank the checkpoint has no state for."""
    digest = hashlib.sha256(f"{seed}/{step}/{rank}".encode()).digest()
    value = int.from_bytes(digest[:4], "little")
    random.seed(value)
    np.random.seed(value)
    torch.manual_seed(value)  # also seeds every CUDA device
    return value


# -- capture / restore ----------------------------------------------------------------------
def capture(t, *, full: bool) -> dict:
    """State of trainer ``t`` (all parts but ``rng``); ``full`` gathers sharded tensors.

    ``full=False`` returns the live (sharded) tensors themselves, no copy: a writer must
    finish reading them (or stage a copy) before the next optimizer step.
    """
    opts = StateDictOptions(full_state_dict=full, cpu_offload=full)
    return {
        "model": get_model_state_dict(t.model, options=opts),
        "optimizer": get_optimizer_state_dict(t.model, t.optimizer, options=opts),
        **capture_small(t),
    }


def capture_small(t) -> dict:
    """The non-tensor parts: identical on every rank, a few kilobytes."""
    scaler = t.precision.scaler
    return {
        "schedule": t.scheduler.state_dict(),
        "scaler": scaler.state_dict() if scaler is not None and scaler.is_enabled() else {},
        "data": {"step": int(t.step)},
        "meta": {"step": int(t.step), "run_id": t.run_id},
    }


def template(t, exclude=()) -> dict:
    """Sharded state dicts of the live objects, for a loader to fill in place (any layout).

    An optimizer that has not stepped yet gets its state initialised (a zero-lr step) so
    there is something to load into; it is skipped when the optimizer is excluded.
    """
    opts = StateDictOptions(full_state_dict=False)
    out = {}
    if "model" not in exclude:
        out["model"] = get_model_state_dict(t.model, options=opts)
    if "optimizer" not in exclude:
        out["optimizer"] = get_optimizer_state_dict(t.model, t.optimizer, options=opts)
    return out


def restore(t, state: dict, *, exclude=(), full: bool) -> None:
    """Load ``state`` (all parts but ``rng``) into trainer ``t``, skipping ``exclude``."""
    opts = StateDictOptions(full_state_dict=full, strict=True)
    if "model" not in exclude:
        set_model_state_dict(t.model, state["model"], options=opts)
    if "optimizer" not in exclude:
        set_optimizer_state_dict(t.model, t.optimizer, state["optimizer"], options=opts)
    if "schedule" not in exclude:
        t.scheduler.load_state_dict(state["schedule"])
    scaler = t.precision.scaler
    if "scaler" not in exclude and scaler is not None and state.get("scaler"):
        scaler.load_state_dict(state["scaler"])
    if "data" not in exclude:
        t.step = int(state["data"]["step"])
    t.run_id = state.get("meta", {}).get("run_id") or t.run_id
