"""Registry entries of the shared weather pieces: the zarr datasets (a recipe plugin)."""

from framework import registry
from recipes.weather.config import HrrrEra5DataConfig, SyntheticDataConfig
from recipes.weather.task import RegressionTask

# Datasets are built by the task (it knows which years and channels); the entries carry
# the schemas and keep options and entries one to one.
registry.datasets.add("synthetic", SyntheticDataConfig, RegressionTask)
registry.datasets.add("hrrr_era5", HrrrEra5DataConfig, RegressionTask)
