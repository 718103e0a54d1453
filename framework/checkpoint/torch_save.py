"""One consolidated file per checkpoint, for small runs and export.

``state.pt`` holds the full (gathered) model and optimizer state plus the small parts;
rank 0 writes it, every rank reads all of it on load. RNG states live beside it, one
file per rank (written by the manager).
"""

from __future__ import annotations

from pathlib import Path

import torch

from framework.checkpoint.io import first_line as _first_line, save_durable
from framework.errors import DataError

FILE = "state.pt"


class TorchSaveBackend:
    format = "torch_save"
    full_state = True  # gathers sharded tensors: rank 0 writes everything

    def save(self, state: dict, directory: Path, env):
        if env.is_main:
            save_durable(state, directory / FILE)
        return None  # written: nothing in flight

    def load(self, directory: Path, env, template=None) -> dict:
        return read(directory)

    def close(self) -> None:
        pass


def read(directory: Path) -> dict:
    path = Path(directory) / FILE
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise DataError(f"checkpoint {directory} has no {FILE}: not a torch_save checkpoint") from None
    except Exception as e:  # a truncated or foreign file
        raise DataError(f"checkpoint file {path} cannot be read: {_first_line(e)}") from None

