"""Small file helpers shared by the backends: durable writes, directory fsync, safe loads,
one-line errors."""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from framework.errors import DataError
from framework.untrusted import open_regular

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_GLOBAL = re.compile(r"Unsupported global: GLOBAL ([\w.]+)")


def save_durable(obj, path: Path) -> None:
    """torch.save + fsync: the bytes are on disk before the checkpoint is committed."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def write_durable(data: bytes, path: Path) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def first_line(e: BaseException) -> str:
    """The first line of an error, never torch's advice to load with ``weights_only=False``.

    torch's weights-only unpickler answers a file that holds anything but tensors and plain
    values with several paragraphs whose first line recommends re-running with
    ``weights_only=False`` (which would execute whatever the file holds). That advice is
    wrong for an untrusted checkpoint: report what was refused instead.
    """
    text = _ANSI.sub("", str(e)).strip()
    if "Weights only load failed" in text or "weights_only" in text:
        found = _GLOBAL.search(text)
        what = f" ({found.group(1)})" if found else ""
        return (
            f"it holds a pickled Python object{what}, not only tensors and plain values; "
            "refused (checkpoints are loaded without executing code)"
        )
    return text.splitlines()[0] if text else type(e).__name__


def load_plain(path: Path, what: str | None = None):
    """``torch.load(weights_only=True)``: tensors and plain Python values only, never code.

    Any failure is one line naming the file (``what`` overrides the name).
    """
    path = Path(path)
    try:
        with open_regular(path) as f:
            return torch.load(f, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as e:  # a truncated, foreign or crafted file
        raise DataError(f"{what or f'checkpoint file {path}'} cannot be read: {first_line(e)}") from None


def load_weights_file(path: Path) -> dict[str, torch.Tensor]:
    """A weights file (``python -m framework.export``): a dict of name -> tensor, loaded without code."""
    weights = load_plain(path, what=f"{path}: weights")
    if not isinstance(weights, dict) or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in weights.items()):
        raise DataError(f"{path}: not a weights file (a dict of tensors)")
    return weights
