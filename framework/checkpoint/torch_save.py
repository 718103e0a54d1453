"""One consolidated file per checkpoint, for small runs and export."""

from __future__ import annotations

from pathlib import Path

import torch

from framework.errors import DataError

FILE = "state.pt"


class TorchSaveBackend:
    full_state = True  # gathers sharded tensors: rank 0 writes everything

    def save(self, state: dict, directory: Path, env) -> None:
        if env.is_main:
            torch.save(state, directory / FILE)

    def load(self, directory: Path, env) -> dict:
        path = directory / FILE
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise DataError(f"checkpoint {directory} has no {FILE}: not a torch_save checkpoint") from None
        except Exception as e:  # a truncated or foreign file
            raise DataError(f"checkpoint file {path} cannot be read: {str(e).splitlines()[0]}") from None
