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
import re
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from framework.errors import DataError

PARTS = ("model", "optimizer", "schedule", "scaler", "rng", "data")
TENSOR_PARTS = ("model", "optimizer")  # sharded under FSDP2; the rest is small and replicated


# -- RNG ----------------------------------------------------------------------------------
def rng_state() -> dict:
    """This rank's RNG states as plain tensors/lists so they load under weights_only=True."""
    np_state = np.random.get_state(legacy=False)
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": "MT19937",
            "state": {"key": n["key"].numpy().astype(np.uint32), "pos": n["pos"]},
            "has_gauss": n["has_gauss"],
            "gauss": n["gauss"],
        }
    )
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
    out: dict[str, Any] = {}  # model and optimizer state dicts differ in shape
    if "model" not in exclude:
        out["model"] = get_model_state_dict(t.model, options=opts)
    if "optimizer" not in exclude:
        out["optimizer"] = get_optimizer_state_dict(t.model, t.optimizer, options=opts)
    return out


_RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


def check(t, state: dict, path, exclude=()) -> None:
    """What a checkpoint holds beyond tensors, checked before any of it is applied (one-line
    DataError). ``LambdaLR.load_state_dict`` copies the schedule's dict onto the scheduler and
    each ``lr_lambdas`` entry onto that factor's ``__dict__``: so the schedule may hold the live
    scheduler's own entries, each of the same type, and factor state only for fields the live
    factor has (ours are functions, saved as None); an entry the live one lacks is refused if
    it names one of its attributes (``optimizer``), else dropped (a field an older torch
    saved). The run id (wandb resumes that run) must be an id."""
    if "schedule" not in exclude:
        schedule, live = state.get("schedule"), t.scheduler.state_dict()
        if not isinstance(schedule, dict):
            raise DataError(f"checkpoint {path}: the LR schedule's state is a {type(schedule).__name__}, not a dict")
        for k, v in schedule.items():
            if k in live and type(v) is not type(live[k]):
                got, want = type(v).__name__, type(live[k]).__name__
                raise DataError(f"checkpoint {path}: the LR schedule's {k} is a {got}, expected a {want}")
            if k not in live and (not isinstance(k, str) or hasattr(t.scheduler, k)):
                raise DataError(f"checkpoint {path}: the LR schedule's state sets {str(k)[:80]!r}, which is not state")
        lambdas, mine = schedule.get("lr_lambdas", live.get("lr_lambdas")), live.get("lr_lambdas")
        if mine is not None and not _same_lambda_fields(lambdas, mine):
            raise DataError(f"checkpoint {path}: the LR schedule's lr_lambdas set fields this run's factors lack")
        state["schedule"] = {k: v for k, v in schedule.items() if k in live}
    meta = state.get("meta")
    run_id = meta.get("run_id") if isinstance(meta, dict) else None
    if run_id is not None and not (isinstance(run_id, str) and _RUN_ID.fullmatch(run_id)):
        raise DataError(f"checkpoint {path}: run id {_show(run_id)} is not a run id (letters, digits, _ and -)")
    if "data" not in exclude:
        data = state.get("data")
        step = data.get("step") if isinstance(data, dict) else None
        if step is None:
            raise DataError(f"checkpoint {path}: its data state holds no step")
        if type(step) is not int or step < 0:  # bool is not a step
            raise DataError(f"checkpoint {path}: its data step {_show(step)} is not a step (an integer >= 0)")
    # The tensors against the live objects: set_*_state_dict would fail with a traceback (or, for
    # an optimizer moment, train until the first step) on any other name, shape or group.
    live = template(t, exclude)
    if "model" in live:
        _check_model(state.get("model"), live["model"], path)
    if "optimizer" in live:
        _check_optimizer(state.get("optimizer"), live["optimizer"], get_model_state_dict(t.model), path)


def _check_model(model, live: dict, path) -> None:
    """The model state names this model's tensors, with their dtypes and (global) shapes (DCP's
    loader checked that already; a torch_save file is checked here)."""
    from framework.checkpoint.backend import check_expected

    if not isinstance(model, dict):
        raise DataError(f"checkpoint {path}: the model state is a {type(model).__name__}, not a dict")
    have = {k: (v.dtype, tuple(v.shape)) for k, v in model.items() if torch.is_tensor(v)}
    check_expected(have, {k: v for k, v in live.items() if torch.is_tensor(v)}, path)


def _show(v) -> str:
    """``v`` in a message: a short repr of a plain value, else its type (a crafted value may nest
    too deeply for repr)."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return repr(v)[:80]
    return f"a {type(v).__name__}"


def _kind(v, nested: bool = True) -> str:
    """What a hyper-parameter is: number, bool, str, None, tensor, or a sequence of those (one
    level: a crafted value may nest without end)."""
    if v is None or isinstance(v, (bool, str)):
        return type(v).__name__
    if isinstance(v, (int, float)):
        return "number"
    if torch.is_tensor(v):
        return "tensor"
    if isinstance(v, (list, tuple)):
        return "(" + ", ".join(_kind(x, False) for x in v[:16]) + ")" if nested else "sequence"
    return type(v).__name__


def _is_lr(v) -> bool:
    if torch.is_tensor(v):
        return v.numel() == 1 and v.is_floating_point()
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_optimizer(saved, live: dict, params: dict, path) -> None:
    """The optimizer state is what ``torch.optim`` loads into the live optimizer: as many param
    groups, each a dict naming the same parameters (by FQN) with an ``lr`` and the live group's
    value types (the config then sets the hyper-parameters); state only for those parameters,
    with the live state's entries (or, where the live optimizer holds none, tensors of the
    parameter's shape or scalars) of the same shapes."""
    where = f"checkpoint {path}: the optimizer state"
    if not isinstance(saved, dict) or not isinstance(saved.get("state"), dict):
        raise DataError(f"{where} is not a dict with a 'state' dict")
    groups, mine = saved.get("param_groups"), live["param_groups"]
    if not isinstance(groups, list):
        raise DataError(f"{where}: param_groups is a {type(groups).__name__}, not a list")
    if len(groups) != len(mine):
        raise DataError(f"{where} has {len(groups)} param groups, this optimizer {len(mine)}")
    names: set[str] = set()
    for i, (g, want) in enumerate(zip(groups, mine)):
        if not isinstance(g, dict):
            raise DataError(f"{where}: param group {i} is a {type(g).__name__}, not a dict")
        ps = g.get("params")
        if not isinstance(ps, list) or not all(isinstance(p, str) for p in ps) or sorted(ps) != sorted(want["params"]):
            raise DataError(f"{where}: param group {i} does not name this model's parameters of that group")
        names.update(ps)
        if not _is_lr(g.get("lr")):
            raise DataError(f"{where}: param group {i} has no learning rate (lr {_show(g.get('lr'))})")
        for k, v in want.items():
            if k in ("params", "lr") or k not in g or v is None or g[k] is None:
                continue  # a key an older torch lacked gets its default; None: any value (foreach, fused)
            if _kind(g[k]) != _kind(v):
                raise DataError(f"{where}: param group {i}'s {k} is {_kind(g[k])}, expected {_kind(v)}")
    for fqn, entry in saved["state"].items():
        if fqn not in names:
            raise DataError(f"{where} has state for {_show(fqn)}, which this optimizer does not hold")
        if not isinstance(entry, dict):
            raise DataError(f"{where} of {fqn} is a {type(entry).__name__}, not a dict")
        _check_entry(entry, live["state"].get(fqn), params.get(fqn), f"{where} of {fqn}")


def _check_entry(entry: dict, live: dict | None, param, where: str) -> None:
    """One parameter's optimizer state against the live optimizer's (``live``; None where it holds
    none for that parameter): each of the live entries, of its kind and shape (the optimizer's
    step would fail on a missing or other one); anything else a plain value, a scalar or a tensor
    of ``param``'s shape."""
    missing = sorted(set(live or ()) - set(entry))
    if missing:
        raise DataError(f"{where} lacks {missing[0]}")
    for k, v in entry.items():
        want = live.get(k) if live is not None else None
        if live is not None and k in live and not torch.is_tensor(want):
            ok, expected = _kind(v) == _kind(want), f"a {_kind(want)}"
        elif want is not None and want.dim() > 0:
            ok, expected = torch.is_tensor(v) and v.shape == want.shape, f"of shape {list(want.shape)}"
        elif want is not None:  # a scalar (Adam's step: a tensor; a number from an older torch)
            ok, expected = _kind(v) == "number" or torch.is_tensor(v) and v.dim() == 0, "a scalar"
        else:
            shapes = [(), *([tuple(param.shape)] if param is not None else [])]
            ok, expected = not torch.is_tensor(v) or tuple(v.shape) in shapes, f"of shape {list(shapes[-1])}"
        if not ok:
            got = f"a tensor of shape {list(v.shape)}" if torch.is_tensor(v) else f"a {type(v).__name__}"
            raise DataError(f"{where}: {k} is {got}, expected {expected}")


def _same_lambda_fields(saved, live) -> bool:
    """Each saved factor's state names only fields the live factor has (a plain function: none)."""
    if not isinstance(saved, list) or len(saved) != len(live):
        return False
    return all(
        s is None if f is None else isinstance(s, dict) and set(s) <= set(f) for s, f in zip(saved, live, strict=True)
    )


def restore(t, state: dict, *, exclude=(), full: bool) -> None:
    """Load ``state`` (all parts but ``rng``) into trainer ``t``, skipping ``exclude``.

    The optimizer's hyper-parameters (lr, betas, eps, weight_decay, ...) are those of the
    current config, not the checkpoint's: a resume with ``optim.lr=...`` trains at that
    rate. The checkpoint's state (moments, step counts) and the schedule's position are
    restored; the schedule's base learning rates follow the config, and the current
    learning rate is the schedule's factor at the restored step times the configured one.
    What differs from the checkpoint is logged.
    """
    configured = _hyper_parameters(t.optimizer)
    opts = StateDictOptions(full_state_dict=full, strict=True)
    if "model" not in exclude:
        set_model_state_dict(t.model, state["model"], options=opts)
    if "optimizer" not in exclude:
        set_optimizer_state_dict(t.model, t.optimizer, state["optimizer"], options=opts)
    if "schedule" not in exclude:
        t.scheduler.load_state_dict(state["schedule"])
    _apply_hyper_parameters(t, configured)
    scaler = t.precision.scaler
    if "scaler" not in exclude and scaler is not None and state.get("scaler"):
        scaler.load_state_dict(state["scaler"])
    if "data" not in exclude:
        t.step = int(state["data"]["step"])
    t.run_id = state.get("meta", {}).get("run_id") or t.run_id


_NOT_HYPER = ("params", "lr", "initial_lr")
# How the live optimizer computes, not what it computes: taken from it without a word (a
# checkpoint from before ``optim.fused: null`` meant the fused kernel on CUDA resumes fused).
_IMPLEMENTATION = ("fused", "foreach", "capturable", "differentiable")


def _hyper_parameters(optimizer) -> list[dict]:
    """Per param group, the configured hyper-parameters of the live (fresh) optimizer; ``lr`` is
    the configured base rate (the schedule's ``initial_lr``, else the group's ``lr``, else
    ``optimizer.defaults``)."""
    out = []
    for g in optimizer.param_groups:
        values = {k: v for k, v in g.items() if k not in _NOT_HYPER}
        values["lr"] = g.get("initial_lr", g.get("lr", optimizer.defaults.get("lr")))
        out.append(values)
    return out


def _same(a, b) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        try:
            return bool(torch.as_tensor(a).cpu().eq(torch.as_tensor(b).cpu()).all())
        except Exception:
            return False
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _apply_hyper_parameters(t, configured: list[dict]) -> None:
    import logging

    log = logging.getLogger("framework")
    groups, sched = t.optimizer.param_groups, t.scheduler
    if len(groups) != len(configured):  # a different grouping: nothing to map by position
        log.warning(
            "optimizer: the checkpoint has %d param groups, the config %d; hyper-parameters kept from the checkpoint",
            len(groups),
            len(configured),
        )
        return
    changed = []
    bases = list(getattr(sched, "base_lrs", []) or [])
    for i, (g, want) in enumerate(zip(groups, configured)):
        for k, v in want.items():
            if k == "lr":  # the base rate: the schedule's, and the group's initial_lr
                seen = [x for x in (bases[i] if i < len(bases) else None, g.get("initial_lr")) if x is not None]
                seen = seen or [g.get("lr")]
                have = next((x for x in seen if not _same(x, v)), seen[0])
            else:
                have = g.get(k)
            if not _same(have, v) and k not in _IMPLEMENTATION:
                changed.append((i, k, have, v))
            if k != "lr":
                g[k] = v
    _place_steps(t.optimizer)
    lr_changed = {i for i, k, _, _ in changed if k == "lr"}
    if lr_changed:
        factors = _schedule_factors(sched, groups, bases)
        for i in lr_changed:
            base = configured[i]["lr"]
            if i < len(bases):
                bases[i] = base
            g = groups[i]
            if "initial_lr" in g:
                g["initial_lr"] = base
            g["lr"] = base * factors[i] if factors[i] is not None else base
        if bases:
            sched.base_lrs = bases
        if hasattr(sched, "_last_lr"):
            sched._last_lr = [g["lr"] for g in groups]
    if changed:
        text = ", ".join(
            f"{k} {_fmt(a)} -> {_fmt(b)}" + (f" (group {i})" if len(groups) > 1 else "") for i, k, a, b in changed
        )
        log.info("resume: optimizer hyper-parameters from the config, not the checkpoint: %s", text)


def _place_steps(optimizer) -> None:
    """Adam's step counts live beside their parameters (float32) for its fused and capturable
    kernels and on the CPU otherwise. torch's load places them by the checkpoint's flags; the
    live optimizer's, applied after it, may differ."""
    for g in optimizer.param_groups:
        on_device = bool(g.get("fused") or g.get("capturable"))
        for p in g["params"]:
            state = optimizer.state.get(p)
            step = state.get("step") if state else None
            where = p.device if on_device else torch.device("cpu")
            if torch.is_tensor(step) and step.device != where:
                state["step"] = step.to(where, torch.float32) if on_device else step.to(where)


def _schedule_factors(sched, groups, bases) -> list[float | None]:
    """The schedule's multiplier of the base rate at its restored step, per group."""
    lambdas = getattr(sched, "lr_lambdas", None)
    if lambdas is not None and len(lambdas) == len(groups):  # LambdaLR: exact, as its step computes it
        return [float(f(sched.last_epoch)) for f in lambdas]
    out = []
    for i, g in enumerate(groups):  # any other scheduler: the ratio it had reached
        base = bases[i] if i < len(bases) else None
        out.append(float(g["lr"]) / float(base) if base else None)
    return out


def _fmt(v) -> str:
    if torch.is_tensor(v):
        v = v.tolist()
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, (list, tuple)):
        return "(" + ", ".join(_fmt(x) for x in v) + ")"
    return repr(v)
