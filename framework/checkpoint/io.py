"""Small file helpers shared by the backends: durable writes, directory fsync, one-line errors."""

from __future__ import annotations

import os
from pathlib import Path

import torch


def save_durable(obj, path: Path) -> None:
    """torch.save + fsync: the bytes are on disk before the checkpoint is committed."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
