"""The toy recipe's registry entries: model, dataset schema, task."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from framework import registry
from framework.errors import DataError
from framework.task import Task


@dataclass
class ToyCNNConfig:
    name: str = "toy_cnn"
    channels: int = 8


@dataclass
class ToyFieldConfig:
    name: str = "toy_field"
    size: int = 16  # rows and columns of the field
    samples: int = 64
    batch_size: int = 8  # the engine's keys: global batch, loader workers, pinning
    num_workers: int = 0
    pin_memory: bool = False


@dataclass
class ToyTaskConfig:
    name: str = "toy_smooth"


class ToyCNN(torch.nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.inp = torch.nn.Conv2d(1, channels, 3, padding=1)
        self.out = torch.nn.Conv2d(channels, 1, 3, padding=1)

    def forward(self, x):
        return self.out(F.silu(self.inp(x)))


class FieldDataset(torch.utils.data.Dataset):
    """Sample i: a seeded random field and its 3x3 box blur (what the model must learn)."""

    def __init__(self, size: int, samples: int, offset: int):
        self.size, self.samples, self.offset = size, samples, offset

    def __len__(self):
        return self.samples

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(self.offset + i)
        x = torch.randn(1, self.size, self.size, generator=g)
        y = F.avg_pool2d(x[None], 3, stride=1, padding=1, count_include_pad=False)[0]
        return {"x": x, "y": y, "index": i}


class ToySmoothTask(Task):
    @classmethod
    def export_spec(cls, config: dict) -> dict:
        model = (config or {}).get("model")
        if not isinstance(model, dict):
            raise DataError("run config has no 'model' node")
        return {"name": model.get("name"), "model": model, "kwargs": {"channels": model.get("channels")}}

    def train_dataset(self):
        return FieldDataset(self.run.data.size, self.run.data.samples, offset=0)

    def val_dataset(self):
        return FieldDataset(self.run.data.size, 16, offset=10_000)

    def build_model(self):
        return registry.models.build(self.run.model.name, self.run.model)

    def loss(self, model, batch):
        return F.mse_loss(model(batch["x"]), batch["y"])

    def val_step(self, model, batch):
        err = ((model(batch["x"]) - batch["y"]) ** 2).sum().double()
        return {"se": err, "n": torch.tensor(float(batch["y"].numel()), dtype=torch.float64)}

    def val_summary(self, sums):
        return {"loss": float(sums["se"] / sums["n"])}

    def summary_lines(self, val_row):
        return [f"toy validation MSE {val_row['loss']:.4g}"]


@registry.models.register("toy_cnn", ToyCNNConfig)
def build_toy_cnn(cfg: ToyCNNConfig):
    return ToyCNN(cfg.channels)


registry.datasets.add("toy_field", ToyFieldConfig, ToySmoothTask)
registry.tasks.add("toy_smooth", ToyTaskConfig, ToySmoothTask)
