"""Load a trained model for inference or as a frozen stage: from an export, a checkpoint or a .mdlus.

``path`` may be an exported weights file (``python -m framework.export``; its ``.json``
lies beside it), one checkpoint directory (``.../checkpoints/step_XXXXXXXX``), a run
directory or its ``checkpoints/`` directory: then the checkpoint is the one
``framework.checkpoint.locator`` names, the same the run would resume from (the newest
commit of the run's lineage that verifies; never the highest step of an abandoned
branch). ``describe`` checks it quickly (manifest, sizes, meta.json); ``load`` verifies
every checksum and refuses, before reading any tensor, weights whose names, dtypes or
shapes differ from the model's. The model is rebuilt through the registry from the
run's own config, so it is exactly the trained architecture.

``path`` may also be a PhysicsNeMo ``.mdlus`` file (``recipes.weather.mdlus``: read as data,
``weights_only`` only). A .mdlus names no channels and records no input conventions, so
``describe`` / ``load`` take them from ``data`` (the caller's data config: the run's
``data`` node, or a dict with the channel lists and ``background_time``, ``invariant_norm``,
``dt``): the channel lists are recorded when their counts fit the model's, else left None, and
``check_channels`` then refuses the counts in one line.

Channel lists go under the keys of the data config they come from (``recipes.weather.layout.Naming``):
StormCast's ``hrrr_channels``, ``era5_channels``, ``invariants``, StormScope's ``state_channels``,
``background_channels``, ``invariants``. A model recorded under one recipe's keys is refused, in one
line, by a data config with the other's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from framework import registry
from framework.checkpoint.backend import first_non_finite
from framework.errors import ConfigError, DataError, first_line
from framework.untrusted import is_int, is_number, mapping, read_json, shown
from recipes.weather.layout import naming_of

log = logging.getLogger("framework")

CONVENTION_KEYS = ("background_time", "invariant_norm", "dt")


@dataclass
class ModelInfo:
    path: Path
    name: str  # the model registry name (songunet, dit)
    model: dict  # the model config node
    task: dict  # the task config node of the training run
    channels: dict  # the channel lists it was trained on, under its data config's keys (None: unknown, a .mdlus)
    grid: list[int]
    config: dict  # the whole export config (model_config of framework.export)
    checkpoint: Path | None = None  # the checkpoint directory ``path`` resolved to (None: a weights file)


def _checkpoint(path: Path, *, full: bool):
    """(checkpoint directory, Verified) that ``path`` names, through the locator; the full
    check (load) reports a fallback or an unverified checkpoint, the quick one (describe,
    run at config validation on every rank) stays quiet."""
    from framework.export import open_checkpoint

    return open_checkpoint(path, full=full, warn=log.warning if full else None)


def data_dict(data) -> dict | None:
    """The channel lists, input conventions and grid of ``data`` (a data config node or a dict) as a
    dict; the keys ``data`` lacks are left out. None for None."""
    if data is None:
        return None
    channel_keys = naming_of(data).channel_keys
    get = data.get if isinstance(data, dict) else lambda k: getattr(data, k, None)
    out = {k: get(k) for k in (*channel_keys, *CONVENTION_KEYS, "grid")}
    for k in (*channel_keys, "grid"):
        if out[k] is not None:
            out[k] = list(out[k])
    return {k: v for k, v in out.items() if v is not None}


def recorded_data(info: ModelInfo) -> dict | None:
    """The channel lists and input conventions the model at ``info`` was trained with; None
    when it does not name its channels (a .mdlus described without a data config)."""
    from recipes.weather.task import data_conventions

    keys = naming_of(info.channels).channel_keys
    if any(info.channels.get(k) is None for k in keys):
        return None
    return {**{k: list(info.channels[k]) for k in keys}, **data_conventions(info.config)}


def _model_io(config: dict, channels: dict) -> tuple[int, int]:
    """(in, out) channels the model of ``config`` has for ``channels``, by its task's rule."""
    task = registry.tasks.entry(config["task"]["name"]).builder
    names = {k: list(channels.get(k) or []) for k in naming_of(channels).channel_keys}
    return task.model_io(names, config["task"])


def _mdlus_config(path: Path, data) -> dict:
    """The model config of a .mdlus, with the channels and conventions of ``data`` where they fit."""
    from recipes.weather.mdlus import describe_mdlus

    cfg = describe_mdlus(path)
    known = data_dict(data)
    if known is None:
        return cfg
    keys = naming_of(known).channel_keys
    names = {k: list(known.get(k) or []) for k in keys}
    # else unknown, under the data config's keys: check_channels names the counts
    fits = _model_io(cfg, names) == (cfg["in_channels"], cfg["out_channels"])
    cfg["channels"] = names if fits else dict.fromkeys(keys)
    cfg["data"] = {k: known[k] for k in CONVENTION_KEYS if k in known}
    return cfg


def _strings(v) -> bool:
    return isinstance(v, list) and all(isinstance(s, str) for s in v)


def _positives(v) -> bool:
    return isinstance(v, list) and v != [] and all(is_number(x) and x > 0 for x in v)


def _channel_lists(v) -> bool:  # None: a list a .mdlus does not name
    return isinstance(v, dict) and v != {} and all(x is None or _strings(x) for x in v.values())


def _grid(v) -> bool:
    return isinstance(v, list) and len(v) == 2 and all(is_int(x) and x > 0 for x in v)


def _is_dict(v) -> bool:
    return isinstance(v, dict)


# What each field of a model config that its readers use must be (an export's .json is another's
# file: JSON hands over any type). Fields outside _REQUIRED may be absent.
_FIELDS = (
    ("name", "a string", lambda v: isinstance(v, str)),
    ("model", "an object", _is_dict),
    ("task", "an object", _is_dict),
    ("task.name", "a string", lambda v: isinstance(v, str)),
    ("task.conditions", "a list of strings", _strings),
    ("task.edm", "an object", _is_dict),
    ("task.edm.sigma_data", "a non-empty list of positive numbers", _positives),
    ("channels", "an object of channel lists", _channel_lists),
    ("img_resolution", "[rows, cols] of positive ints", _grid),
    ("in_channels", "a positive int", lambda v: is_int(v) and v > 0),
    ("out_channels", "a positive int", lambda v: is_int(v) and v > 0),
    ("data", "an object or null", lambda v: v is None or _is_dict(v)),
)
_REQUIRED = ("name", "model", "task", "task.name", "channels", "img_resolution", "in_channels", "out_channels")


def _check_fields(cfg: dict, where) -> None:
    """One DataError line naming ``where`` and the first field of ``cfg`` missing or of another type."""
    for field, kind, ok in _FIELDS:
        node, *keys = field.split(".")
        value, present = cfg.get(node), node in cfg
        for k in keys:
            present = present and isinstance(value, dict) and k in value
            value = value.get(k) if present else None
        if not present:
            if field in _REQUIRED:
                raise DataError(f"{where}: its model config has no {field!r} (exported by an older version?)")
            continue
        if not ok(value):
            raise DataError(f"{where}: its model config's {field!r} must be {kind} (got {shown(value)})")


def describe(path, *, data=None) -> ModelInfo:
    """What the model at ``path`` is, from its config alone (no weights read): cheap, for checks.
    ``data``: the caller's data config, for what a .mdlus does not record (see the module doc)."""
    from framework.export import model_config
    from recipes.weather.mdlus import is_mdlus

    path = source = Path(path)  # source: the file a field comes from (an export's .json)
    if is_mdlus(path):
        cfg, ckpt = _mdlus_config(path, data), None
    elif path.is_file():
        side = path.with_suffix(".json")
        if not side.is_file():
            raise DataError(f"{path}: no {side.name} beside it (write both with python -m framework.export)")
        try:  # another's file: never a blocking read, unbounded memory or recursion
            cfg = mapping(read_json(side), "its top level")
        except (OSError, ValueError) as e:
            raise DataError(f"{side}: unreadable model config ({first_line(e)})") from None
        ckpt, source = None, side
    elif path.is_dir():
        ckpt, verified = _checkpoint(path, full=False)
        cfg = model_config(verified.meta.get("config"))
    else:
        raise DataError(f"{path}: no such file or directory")
    _check_fields(cfg, source)  # task, its name and the channels among them
    return ModelInfo(
        path, cfg["name"], cfg["model"], cfg["task"], cfg["channels"], list(cfg["img_resolution"]), cfg, ckpt
    )


def _weights(info: ModelInfo, expected: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if info.config.get("format") == "physicsnemo":
        from recipes.weather.mdlus import read_mdlus

        return read_mdlus(info.path)[1]  # every name and shape checked against the model of its args.json
    if info.path.is_file():
        from framework.checkpoint.io import load_weights_file

        return load_weights_file(info.path)
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


def _check_size(info: ModelInfo) -> None:
    """The model is rebuilt at the size its recorded config says, before its weights are read:
    refuse (one line) a config whose model needs more bytes of weights than the export file or
    the checkpoint's files hold, before building it for real (a crafted config is memory, not a
    model). The meta-device build costs no memory. A .mdlus is not checked here: ``load`` reads
    its model.pt (at most 16 GiB) first, compared tensor by tensor with a meta-device build of its
    args.json's model."""
    if info.config.get("format") == "physicsnemo":
        return
    files = [f for f in info.checkpoint.rglob("*") if f.is_file()] if info.checkpoint is not None else [info.path]
    have = sum(f.stat().st_size for f in files)
    with torch.device("meta"):
        model = build(info)
    need = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    if need > have:
        raise DataError(
            f"{info.path}: its config describes a {info.name} model of {need} bytes of weights, but its "
            f"weights hold {have} bytes"
        )


def load(path, device="cpu", *, data=None) -> tuple[torch.nn.Module, ModelInfo]:
    """The trained model at ``path`` in eval mode with its weights, and what it is (``data``: see
    ``describe``)."""
    info = describe(path, data=data)
    _check_size(info)
    # a .mdlus's weights come first: read_mdlus checks every name and shape against a meta-device
    # build of its args.json's model, so a crafted args.json (a huge model) fails there, unbuilt
    mdlus = _weights(info, {}) if info.config.get("format") == "physicsnemo" else None
    model = build(info)
    weights = mdlus if mdlus is not None else _weights(info, model.state_dict())
    missing, unexpected = model.state_dict().keys() - weights.keys(), weights.keys() - model.state_dict().keys()
    if missing or unexpected:
        raise DataError(
            f"{info.path}: weights do not fit the {info.name} model: missing {sorted(missing)[:3]}, "
            f"unexpected {sorted(unexpected)[:3]}"
        )
    bad = first_non_finite(weights) if mdlus is None else None  # (read_mdlus checked each tensor it read)
    if bad:
        raise DataError(f"{info.path}: weight {bad}")
    try:
        model.load_state_dict(weights)
    except RuntimeError as e:
        raise DataError(
            f"{info.path}: weights do not fit the {info.name} model: {str(e).splitlines()[-1].strip()}"
        ) from None
    return model.to(device).eval(), info


def check_channels(info: ModelInfo, data, what: str, *, grid: bool = True) -> None:
    """A ConfigError naming the first channel list or grid (``grid``, when ``data`` has one) that
    differs from ``data``'s (a config node or a dict), or the recipes when the model records its
    channels under the other recipe's keys or its task reads the other recipe's data (StormCast's
    weights, a StormScope data config; a StormScope .mdlus, a StormCast data config). A list
    the model does not record (None: a .mdlus) is not compared, but the channel counts ``data``
    makes must be the model's."""
    known = data_dict(data) or {}
    given = naming_of(known)
    trained = naming_of(info.channels)  # a .mdlus: the keys it was described with, so the task's
    if trained is given:
        trained = getattr(registry.tasks.entry(info.task.get("name")).builder, "DATA_NAMING", given)
    if trained is not given:
        raise ConfigError(
            f"{what}: {info.path} is a {trained.recipe} model (channels in {', '.join(trained.keys)}) but this "
            f"is a {given.recipe} data config ({', '.join(given.keys)})"
        )
    unknown = False
    for key in given.channel_keys:
        have = info.channels.get(key)
        if have is None:
            unknown = True
            continue
        want, have = list(known.get(key) or []), list(have)
        if want != have:
            raise ConfigError(f"{what}: {info.path} was trained with {key}={have} but data.{key} is {want}")
    if unknown:
        want = _model_io(info.config, known)
        have = (info.config["in_channels"], info.config["out_channels"])
        if want != have:
            counts = ", ".join(f"{len(known.get(k) or [])} {k}" for k in given.channel_keys)
            raise ConfigError(
                f"{what}: {info.path} maps {have[0]} -> {have[1]} channels but the data config's "
                f"channels ({counts}) make {want[0]} -> {want[1]}"
            )
    if grid and "grid" in known and known["grid"] != list(info.grid):
        raise ConfigError(f"{what}: {info.path} was trained on grid {info.grid} but data.grid is {known['grid']}")
