"""Schemas of the shared weather config nodes: zarr data (StormCast's; the base of StormScope's), the regression
and diffusion tasks."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from omegaconf import MISSING

from framework.config.schema import Invalid, non_negative, one_of, path_field, positive
from recipes.weather.layout import naming_of


@dataclass
class ZarrDataConfig:
    """What every data config of the zarr stores (docs/data.md) has: the root, grid, years,
    invariants and how samples are made. A subclass adds the state and background channel lists
    under its recipe's keys (``recipes.weather.layout.Naming``: StormCast's ``hrrr_channels`` /
    ``era5_channels``, StormScope's ``state_channels`` / ``background_channels``)."""

    name: str = MISSING
    root: str = path_field(MISSING)
    grid: list[int] = field(default_factory=lambda: [512, 640])
    train_years: list[int] = MISSING
    val_years: list[int] = MISSING
    invariants: list[str] = field(default_factory=list)
    dt: int = 1
    batch_size: int = 1  # global: summed over data-parallel ranks and accumulation steps
    num_workers: int = 0
    pin_memory: bool = True
    # the background's hour: input (t, as PhysicsNeMo's StormCast) | target (t + dt)
    background_time: str = "input"
    invariant_norm: str = "zscore"  # zscore (each by its spatial mean/std) | none (raw, as PhysicsNeMo)

    def __post_init__(self):
        keys = naming_of(self).channel_keys
        positive(self, "batch_size", "dt")
        non_negative(self, "num_workers")
        one_of(self, "background_time", ("input", "target"))
        one_of(self, "invariant_norm", ("zscore", "none"))
        if len(self.grid) != 2 or min(self.grid) <= 0:
            raise Invalid("grid", f"must be [rows, cols] > 0 (got {list(self.grid)})")
        for key in ("train_years", "val_years", keys[0]):
            if not getattr(self, key):
                raise Invalid(key, "must not be empty")
        for key in keys:
            names = list(getattr(self, key))
            dup = sorted({n for n in names if names.count(n) > 1})
            if dup:
                raise Invalid(key, f"lists {dup} more than once")
        self.check_root()

    def check_root(self):
        from framework.rundir import dir_problem

        problem = dir_problem(self.root)  # missing, not a directory, unreadable: one line
        if problem:
            raise Invalid("root", problem)


@dataclass
class HrrrEra5DataConfig(ZarrDataConfig):
    """StormCast's HRRR state and ERA5 background, in our layout or PhysicsNeMo's."""

    name: str = "hrrr_era5"
    hrrr_channels: list[str] = MISSING
    era5_channels: list[str] = MISSING
    # auto: detect from the files under root | native (ours) | physicsnemo (PhysicsNeMo's StormCast layout)
    layout: str = "auto"
    conus_dataset_name: str = "hrrr_v3"  # physicsnemo layout: the HRRR folder under root
    hrrr_stats: str = "stats_v3_2019_2021"  # physicsnemo layout: the HRRR stats folder in it

    def __post_init__(self):
        one_of(self, "layout", ("auto", "native", "physicsnemo"))
        for key in ("conus_dataset_name", "hrrr_stats"):
            name = getattr(self, key)
            if not name or "/" in name or name in (".", ".."):
                raise Invalid(key, f"must be a folder name (got {name!r})")
        super().__post_init__()


@dataclass
class SyntheticStores:
    """Mixed into a data config (first among its bases): synthetic stores of its channels, written
    under ``root`` on first use (``recipes.weather.synthetic``), and the small defaults of a CPU run."""

    grid: list[int] = field(default_factory=lambda: [32, 32])
    train_years: list[int] = field(default_factory=lambda: [2020])
    val_years: list[int] = field(default_factory=lambda: [2021])
    invariants: list[str] = field(default_factory=lambda: ["lsm", "orog"])
    hours_per_year: int = 360
    generator_seed: int = 0

    def __post_init__(self):
        super().__post_init__()
        positive(self, "hours_per_year")
        if self.hours_per_year <= self.dt:
            raise Invalid("hours_per_year", f"must exceed dt={self.dt} (got {self.hours_per_year})")

    @property
    def write_layout(self) -> str:
        """The layout the synthetic stores are written in: physicsnemo if asked for, else native."""
        return "physicsnemo" if getattr(self, "layout", "native") == "physicsnemo" else "native"

    def check_root(self):
        from framework.rundir import dir_problem

        problem = dir_problem(self.root, create=not os.path.isdir(self.root))  # written on first use
        if problem:
            raise Invalid("root", problem)


@dataclass
class SyntheticDataConfig(SyntheticStores, HrrrEra5DataConfig):
    name: str = "synthetic"
    root: str = path_field("data/synthetic")
    hrrr_channels: list[str] = field(default_factory=lambda: ["u10m", "v10m", "t2m", "msl"])
    era5_channels: list[str] = field(default_factory=lambda: ["u850", "v850", "t850"])


@dataclass
class RegressionTaskConfig:
    name: str = "stormcast_regression"
    residual: bool = False  # predict state(t+dt) - state(t) instead of state(t+dt)


CONDITIONS = ("state", "background", "regression", "invariants")


@dataclass
class EDMConfig:
    sigma_data: list[float] = field(default_factory=lambda: [0.5])  # one value, or one per channel
    sigma_distribution: str = "lognormal"  # lognormal (EDM) | loguniform
    p_mean: float = -1.2
    p_std: float = 1.2
    sigma_min: float = 0.002  # log-uniform range
    sigma_max: float = 800.0

    def __post_init__(self):
        one_of(self, "sigma_distribution", ("lognormal", "loguniform"))
        if not self.sigma_data or min(self.sigma_data) <= 0:
            raise Invalid("sigma_data", f"must be one or more positive values (got {list(self.sigma_data)})")
        positive(self, "p_std")
        if not 0 < self.sigma_min < self.sigma_max:
            raise Invalid("sigma_min", f"need 0 < sigma_min < sigma_max (got {self.sigma_min}, {self.sigma_max})")


@dataclass
class SamplerConfig:
    num_steps: int = 18
    sigma_min: float = 0.002
    sigma_max: float = 800.0
    rho: float = 7.0
    s_churn: float = 0.0  # > 0: stochastic sampling
    s_min: float = 0.0
    s_max: float = math.inf
    s_noise: float = 1.0

    def __post_init__(self):
        positive(self, "num_steps", "rho")
        non_negative(self, "s_churn")
        if not 0 < self.sigma_min < self.sigma_max:
            raise Invalid("sigma_min", f"need 0 < sigma_min < sigma_max (got {self.sigma_min}, {self.sigma_max})")

    def kwargs(self) -> dict:
        return dict(
            num_steps=self.num_steps,
            sigma_min=self.sigma_min,
            sigma_max=self.sigma_max,
            rho=self.rho,
            s_churn=self.s_churn,
            s_min=self.s_min,
            s_max=self.s_max,
            s_noise=self.s_noise,
        )


@dataclass
class DiffusionTaskConfig:
    """EDM diffusion on [conditions] -> state(t+dt) (or its residual over the regression stage)."""

    name: str = "stormcast_diffusion"
    # Stacked along channels after the noisy latent, in this order. StormCast's hybrid:
    # [state, regression, invariants]; nowcasting without background: [state, invariants];
    # downscaling: [background, invariants].
    conditions: list[str] = field(default_factory=lambda: ["state", "regression", "invariants"])
    residual: bool = True  # learn state(t+dt) minus the regression output
    regression: str | None = path_field()  # exported weights, checkpoint or run dir of the regression stage
    edm: EDMConfig = field(default_factory=EDMConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    val_members: int = 4  # ensemble size at validation (CRPS, spread/skill)
    plot_channels: list[str] = field(default_factory=list)  # figures and spectra; default: the first

    def __post_init__(self):
        bad = [c for c in self.conditions if c not in CONDITIONS]
        if bad:
            raise Invalid("conditions", f"unknown condition {bad[0]!r}; valid: {', '.join(CONDITIONS)}")
        if len(set(self.conditions)) != len(self.conditions):
            raise Invalid("conditions", f"lists a condition twice: {list(self.conditions)}")
        if self.val_members < 2:
            raise Invalid("val_members", f"must be >= 2 for spread and CRPS (got {self.val_members})")
        if self.needs_regression and not self.regression:
            why = "residual=true" if self.residual else "conditions include 'regression'"
            raise Invalid(
                "regression",
                f"{why} needs the regression stage's weights: set task.regression="
                "<exported .pt | checkpoint dir | run dir>",
            )

    @property
    def needs_regression(self) -> bool:
        return self.residual or "regression" in self.conditions
