"""Export a checkpoint to one weights file for inference.

    python -m framework.export outputs/.../checkpoints/step_00001000 model.pt

writes ``model.pt`` (the model's state dict: parameter name -> plain, contiguous CPU
tensor; no optimizer, no DTensor, no pickled code) and ``model.json`` beside it (the
model config, as the run's task specifies it (``Task.export_spec``): at least the model's
registry name, its config node and ``kwargs`` to build it). Works from ``torch_save`` and ``dcp`` /
``dcp_async`` checkpoints of any layout, in one process, without a process group.
Load it with plain torch::

    cfg = json.load(open("model.json"))
    model = MyModel(**cfg["kwargs"])  # the class registered as cfg["name"]
    model.load_state_dict(torch.load("model.pt", weights_only=True))

Other formats come from the run's task (``Task.export_writers``)::

    python -m framework.export outputs/my_run --format physicsnemo -o model.mdlus

writes one file in that format (an unknown format is refused, naming the valid ones, exit 2).

The checkpoint may also be a run directory or its ``checkpoints/`` directory: its latest
verified checkpoint (``framework.checkpoint.locator``; a fallback past a corrupt newer one
is reported on stderr). The checkpoint is verified against its manifest (every checksum)
and its files are checked before any tensor is read; nothing read from it executes code.
Bad input (not a checkpoint, incomplete, corrupt, crafted, no model config) ends with one
line on stderr and a non-zero exit code (3 for a bad checkpoint).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from framework.checkpoint.io import first_line
from framework.errors import ConfigError, DataError, FrameworkError

NATIVE = "native"  # the engine's own: the state dict (.pt) and its export spec (.json) beside it


def _task_class(config: dict | None):
    """The task class of the run whose saved config is ``config``."""
    from framework import registry

    task = config.get("task") if isinstance(config, dict) else None
    if not isinstance(task, dict) or not task.get("name"):
        raise DataError("checkpoint meta.json has no run config with a 'task' node")
    try:
        return registry.tasks.entry(str(task["name"])).builder
    except ConfigError as e:
        raise DataError(f"checkpoint meta.json: {e}") from None


def model_config(config: dict | None) -> dict:
    """What the weights file of a run with ``config`` records: its task's export spec."""
    return _task_class(config).export_spec(config)


def writer(config: dict | None, fmt: str):
    """The writer of format ``fmt`` for a run with ``config`` (None: the engine's own, ``native``);
    a ConfigError listing the valid formats when the run's task writes no such format."""
    if fmt == NATIVE:
        return None
    writers = _task_class(config).export_writers()
    if fmt not in writers:
        raise ConfigError(f"--format: unknown format {fmt!r}; valid: {', '.join([NATIVE, *sorted(writers)])}")
    return writers[fmt]


def model_weights(ckpt: Path, meta: dict | None = None, expected=None) -> dict[str, torch.Tensor]:
    """The model state dict of checkpoint ``ckpt`` through its backend (plain CPU tensors).

    ``expected`` (name -> tensor): refuse other names, dtypes or shapes before reading data.
    Verification is the caller's (see :func:`open_checkpoint`).
    """
    from framework.checkpoint.backend import for_checkpoint

    return for_checkpoint(ckpt, meta).export_weights(ckpt, expected)


def open_checkpoint(path: Path, *, full: bool = True, warn=None):
    """The checkpoint ``path`` names (a step, ``checkpoints/`` or run directory: see
    ``framework.checkpoint.locator``), verified (``full``: every checksum; else the quick
    check): ``(directory, Verified)``. Notes (a fallback, an unverified older checkpoint) go
    to ``warn``; failures are one-line DataErrors."""
    from framework.checkpoint import locator
    from framework.checkpoint.backend import for_checkpoint

    found = {}

    def check(e):
        found[e.path] = for_checkpoint(e.path).verify(e.path, full=full)

    located = locator.locate(Path(path), check, warn=warn, what=str(path))
    verified = found[located.path]
    if verified.manifest is None and warn is not None:
        warn(
            f"checkpoint {located.path} has no manifest.json (written by an older version): its files are not verified"
        )
    return located.path, verified


def export(ckpt: Path, out: Path, warn=None, fmt: str = NATIVE) -> tuple[Path, Path | None, dict]:
    """Export the checkpoint ``ckpt`` names (a step, ``checkpoints/`` or run directory) to ``out``
    in format ``fmt``: (out, the JSON spec beside it or None, a summary)."""
    ckpt, out = Path(ckpt), Path(out)
    if not ckpt.exists():
        raise DataError(f"{ckpt}: no such file or directory")
    if not ckpt.is_dir():
        raise DataError(f"{ckpt} is not a checkpoint directory")
    if fmt != NATIVE:  # a format the task does not write is refused before any checksum is computed
        writer(open_checkpoint(ckpt, full=False)[1].meta.get("config"), fmt)
    ckpt, verified = open_checkpoint(ckpt, full=True, warn=warn)
    meta = verified.meta
    write = writer(meta.get("config"), fmt)
    weights = model_weights(ckpt, meta)
    config = model_config(meta.get("config"))
    config["source"] = {
        "checkpoint": str(ckpt.resolve()),
        "step": meta.get("step"),
        "format": meta.get("format"),
        "verified": verified.verified,
    }
    summary = {
        "tensors": len(weights),
        "parameters": sum(v.numel() for v in weights.values()),
        "step": meta.get("step"),
        "checkpoint": ckpt,
    }
    if write is not None:  # the writer writes atomically and raises DataError on failure
        try:
            write(weights, config, out)
        except DataError as e:
            raise DataError(f"--format {fmt}: {ckpt}: {first_line(e)}") from None
        return out, None, summary
    config["weights"] = out.name
    side = out.with_suffix(".json") if out.suffix != ".json" else out.with_name(out.name + ".config.json")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        for path, write in (
            (out, lambda f: torch.save(weights, f)),
            (side, lambda f: f.write(json.dumps(config, indent=1).encode())),
        ):
            tmp = path.with_name(f".{path.name}.tmp")
            with open(tmp, "wb") as f:
                write(f)
            os.replace(tmp, path)  # never a half-written file under the final name
    except OSError as e:
        raise DataError(f"cannot write {out}: {e.strerror or e}") from None
    return out, side, summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m framework.export", description=__doc__.split("\n")[0])
    ap.add_argument(
        "checkpoint",
        type=Path,
        help="a checkpoint (.../checkpoints/step_XXXXXXXX), or a run or "
        "checkpoints directory: its latest verified checkpoint",
    )
    ap.add_argument("out", type=Path, nargs="?", help="the file to write (native: the config goes beside it as .json)")
    ap.add_argument("-o", "--out", dest="out_flag", type=Path, help="the file to write (instead of OUT)")
    ap.add_argument(
        "--format",
        default=NATIVE,
        help=f"{NATIVE} (default: the state dict and its .json) or a format the run's task writes "
        "(e.g. physicsnemo: a PhysicsNeMo .mdlus)",
    )
    args = ap.parse_args(argv)
    if (args.out is None) == (args.out_flag is None):
        ap.error("give the file to write once: OUT or -o OUT")  # usage error: exit 2
    out_path = args.out or args.out_flag
    notes: list[str] = []
    try:
        out, side, info = export(args.checkpoint, out_path, warn=notes.append, fmt=args.format)
    except FrameworkError as e:  # one line: what failed (the notes on the way are not repeated)
        print(f"error: {first_line(e)}", file=sys.stderr, flush=True)
        return e.exit_code
    for note in notes:
        print(f"warning: {note}", file=sys.stderr, flush=True)
    print(
        f"exported {info['tensors']} tensors ({info['parameters'] / 1e6:.3f} M parameters) of step "
        f"{info['step']} ({info['checkpoint']}) to {out} "
        + (f"(config: {side})" if side is not None else f"(format {args.format})")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
