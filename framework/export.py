"""Export a checkpoint to one weights file for inference.

    python -m framework.export outputs/.../checkpoints/step_00001000 songunet.pt

writes ``songunet.pt`` (the model's state dict: parameter name -> plain, contiguous CPU
tensor; no optimizer, no DTensor, no pickled code) and ``songunet.json`` beside it (the
model config: the ``model`` node of the run plus the channels and grid the task used,
and ``kwargs`` to build the model). Works from ``torch_save`` and ``dcp`` /
``dcp_async`` checkpoints of any layout, in one process, without a process group.
Load it with plain torch::

    cfg = json.load(open("songunet.json"))
    model = SongUNet(**cfg["kwargs"])
    model.load_state_dict(torch.load("songunet.pt", weights_only=True))

Bad input (not a checkpoint, incomplete, corrupt, no model config) ends with one line on
stderr and a non-zero exit code.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from framework.errors import DataError, FrameworkError


def model_config(config: dict | None) -> dict:
    """The model config of a run: its ``model`` node plus in/out channels and grid from ``data``."""
    if not isinstance(config, dict) or not isinstance(config.get("model"), dict) or \
            not isinstance(config.get("data"), dict):
        raise DataError("checkpoint meta.json has no run config with 'model' and 'data' nodes")
    model, data = dict(config["model"]), config["data"]
    try:
        in_channels = len(data["hrrr_channels"]) + len(data.get("era5_channels") or []) + \
            len(data.get("invariants") or [])
        out_channels = len(data["hrrr_channels"])
        grid = [int(g) for g in data["grid"]]
    except (KeyError, TypeError, ValueError) as e:
        raise DataError(f"checkpoint meta.json: data config lacks channels or grid ({e})") from None
    io = _task_io(config.get("task"))  # a task may feed its net more than the data's channels
    if io is not None:
        in_channels, out_channels = io(data, config["task"])
    kwargs = {k: v for k, v in model.items() if k != "name"}
    kwargs.update(img_resolution=grid, in_channels=in_channels, out_channels=out_channels)
    # The task node and channel names travel along: a consumer (the diffusion stage,
    # inference) checks it is fed the data the model was trained on.
    channels = {k: list(data.get(k) or []) for k in ("hrrr_channels", "era5_channels", "invariants")}
    return {"name": model.get("name"), "model": model, "in_channels": in_channels, "out_channels": out_channels,
            "img_resolution": grid, "kwargs": kwargs, "task": config.get("task"), "channels": channels,
            "seed": config.get("seed")}


def _task_io(task):
    from framework import registry
    from framework.errors import ConfigError

    if not isinstance(task, dict) or not task.get("name"):
        return None
    try:
        return getattr(registry.tasks.entry(task["name"]).builder, "model_io", None)
    except ConfigError:
        return None


def model_weights(ckpt: Path, meta: dict) -> dict[str, torch.Tensor]:
    fmt = meta.get("format") or ("torch_save" if (ckpt / "state.pt").is_file() else "dcp")
    if fmt == "torch_save":
        from framework.checkpoint.torch_save import read

        weights = read(ckpt).get("model")
        if not isinstance(weights, dict) or not weights:
            raise DataError(f"checkpoint {ckpt} holds no model weights")
    elif fmt == "dcp":
        from framework.checkpoint.dcp import load_model_weights

        weights = load_model_weights(ckpt)
    else:
        raise DataError(f"checkpoint {ckpt} has an unknown format {fmt!r}")
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in weights.items()}


def export(ckpt: Path, out: Path) -> tuple[Path, Path, dict]:
    from framework.checkpoint.manager import read_meta

    ckpt, out = Path(ckpt), Path(out)
    if not ckpt.is_dir():
        raise DataError(f"{ckpt} is not a checkpoint directory")
    if not (ckpt / "meta.json").exists():
        steps = sorted(p.name for p in ckpt.glob("step_*") if (p / "meta.json").is_file())
        steps += sorted(p.name for p in ckpt.glob("checkpoints/step_*") if (p / "meta.json").is_file())
        if steps:
            raise DataError(f"{ckpt} is not one checkpoint; name a step directory (newest by step: {steps[-1]})")
    meta = read_meta(ckpt)
    config = model_config(meta.get("config"))
    weights = model_weights(ckpt, meta)
    config["source"] = {"checkpoint": str(ckpt.resolve()), "step": meta.get("step"), "format": meta.get("format")}
    config["weights"] = out.name
    side = out.with_suffix(".json") if out.suffix != ".json" else out.with_name(out.name + ".config.json")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        for path, write in ((out, lambda f: torch.save(weights, f)),
                            (side, lambda f: f.write(json.dumps(config, indent=1).encode()))):
            tmp = path.with_name(f".{path.name}.tmp")
            with open(tmp, "wb") as f:
                write(f)
            os.replace(tmp, path)  # never a half-written file under the final name
    except OSError as e:
        raise DataError(f"cannot write {out}: {e.strerror or e}") from None
    return out, side, {"tensors": len(weights), "parameters": sum(v.numel() for v in weights.values()),
                       "step": meta.get("step")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m framework.export", description=__doc__.split("\n")[0])
    ap.add_argument("checkpoint", type=Path, help="a checkpoint directory (.../checkpoints/step_XXXXXXXX)")
    ap.add_argument("out", type=Path, help="the weights file to write (the config goes beside it as .json)")
    args = ap.parse_args(argv)
    try:
        out, side, info = export(args.checkpoint, args.out)
    except FrameworkError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    print(f"exported {info['tensors']} tensors ({info['parameters'] / 1e6:.3f} M parameters) of step "
          f"{info['step']} to {out} (config: {side})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
