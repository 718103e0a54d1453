"""One consolidated file per checkpoint, for small runs and export.

``state.pt`` holds the full (gathered) model and optimizer state plus the small parts;
rank 0 writes it, every rank reads all of it on load (``weights_only=True``: tensors and
plain values, never code). RNG states live beside it, one file per rank (written by the
manager).
"""

from __future__ import annotations

from pathlib import Path

from framework.checkpoint.backend import Base, plain_weights
from framework.checkpoint.io import load_plain, save_durable
from framework.errors import DataError

FILE = "state.pt"


class TorchSaveBackend(Base):
    format = "torch_save"
    full_state = True  # gathers sharded tensors: rank 0 writes everything

    def save(self, state: dict, directory: Path, env):
        if env.is_main:
            save_durable(state, Path(directory) / FILE)
        return None  # written: nothing in flight

    def load(self, directory: Path, env, template=None) -> dict:
        return read(directory)

    def check_structure(self, directory: Path, manifest: dict | None) -> None:
        if not (Path(directory) / FILE).is_file():
            raise DataError(f"checkpoint {directory} has no {FILE}: not a torch_save checkpoint")

    def export_weights(self, directory: Path, expected=None):
        return plain_weights(read(directory).get("model"), directory, expected)


def read(directory: Path) -> dict:
    path = Path(directory) / FILE
    try:
        state = load_plain(path)
    except FileNotFoundError:
        raise DataError(f"checkpoint {directory} has no {FILE}: not a torch_save checkpoint") from None
    if not isinstance(state, dict):
        raise DataError(f"checkpoint file {path} cannot be read: it holds a {type(state).__name__}, not a dict")
    return state
