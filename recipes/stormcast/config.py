"""Schemas of the StormCast recipe's config nodes (model, data, task)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from omegaconf import MISSING

from framework.config.schema import Invalid, non_negative, one_of, positive


@dataclass
class SongUNetConfig:
    name: str = "songunet"
    model_channels: int = 128
    channel_mult: list[int] = field(default_factory=lambda: [1, 2, 2, 2, 2])
    channel_mult_emb: int = 4
    num_blocks: int = 4
    attn_resolutions: list[int] = field(default_factory=list)
    dropout: float = 0.0
    embedding_type: str = "zero"  # zero | positional
    additive_pos_embed: bool = False
    checkpoint_level: int = 0

    def __post_init__(self):
        positive(self, "model_channels", "channel_mult_emb", "num_blocks")
        non_negative(self, "checkpoint_level")
        if not self.channel_mult or any(m <= 0 for m in self.channel_mult):
            raise Invalid("channel_mult", f"must be a non-empty list of positive ints (got {list(self.channel_mult)})")
        if not 0 <= self.dropout < 1:
            raise Invalid("dropout", f"must be in [0, 1) (got {self.dropout})")
        one_of(self, "embedding_type", ("zero", "positional"))

    @property
    def downsample_factor(self) -> int:
        return 2 ** (len(self.channel_mult) - 1)


@dataclass
class HrrrEra5DataConfig:
    name: str = "hrrr_era5"
    root: str = MISSING
    grid: list[int] = field(default_factory=lambda: [512, 640])
    train_years: list[int] = MISSING
    val_years: list[int] = MISSING
    hrrr_channels: list[str] = MISSING
    era5_channels: list[str] = MISSING
    invariants: list[str] = field(default_factory=list)
    dt: int = 1
    batch_size: int = 1  # global: summed over data-parallel ranks and accumulation steps
    num_workers: int = 0
    pin_memory: bool = True

    def __post_init__(self):
        positive(self, "batch_size", "dt")
        non_negative(self, "num_workers")
        if len(self.grid) != 2 or min(self.grid) <= 0:
            raise Invalid("grid", f"must be [rows, cols] > 0 (got {list(self.grid)})")
        for key in ("train_years", "val_years", "hrrr_channels"):
            if not getattr(self, key):
                raise Invalid(key, "must not be empty")
        for key in ("hrrr_channels", "era5_channels", "invariants"):
            names = list(getattr(self, key))
            dup = sorted({n for n in names if names.count(n) > 1})
            if dup:
                raise Invalid(key, f"lists {dup} more than once")
        self.check_root()

    def check_root(self):
        if not os.path.isdir(self.root):
            raise Invalid("root", f"directory does not exist: {self.root}")


@dataclass
class SyntheticDataConfig(HrrrEra5DataConfig):
    name: str = "synthetic"
    root: str = "data/synthetic"
    grid: list[int] = field(default_factory=lambda: [32, 32])
    train_years: list[int] = field(default_factory=lambda: [2020])
    val_years: list[int] = field(default_factory=lambda: [2021])
    hrrr_channels: list[str] = field(default_factory=lambda: ["u10m", "v10m", "t2m", "msl"])
    era5_channels: list[str] = field(default_factory=lambda: ["u850", "v850", "t850"])
    invariants: list[str] = field(default_factory=lambda: ["lsm", "orog"])
    hours_per_year: int = 360
    generator_seed: int = 0

    def __post_init__(self):
        super().__post_init__()
        positive(self, "hours_per_year")
        if self.hours_per_year <= self.dt:
            raise Invalid("hours_per_year", f"must exceed dt={self.dt} (got {self.hours_per_year})")

    def check_root(self):
        pass  # written on first use


@dataclass
class RegressionTaskConfig:
    name: str = "stormcast_regression"
    residual: bool = False  # predict state(t+dt) - state(t) instead of state(t+dt)
