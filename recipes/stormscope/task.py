"""The StormScope task: StormCast's EDM diffusion task on StormScope's data config."""

from __future__ import annotations

from framework.errors import ConfigError
from recipes.weather import layout
from recipes.weather.diffusion import DiffusionTask


class StormScopeTask(DiffusionTask):
    DATA_NAMING = layout.STORMSCOPE  # the data keys it reads (recipes.weather.weights checks models by it too)

    @staticmethod
    def check_config(run) -> None:
        have, want = layout.naming_of(run.data), StormScopeTask.DATA_NAMING
        if have is not want:
            raise ConfigError(
                f"data: data={run.data.name} is a {have.recipe} data config (data.{have.keys[0]}, "
                f"data.{have.keys[1]}); task {run.task.name} reads {want.recipe}'s (data.{want.keys[0]}, "
                f"data.{want.keys[1]}): use data=stormscope or data=stormscope_synthetic"
            )
        DiffusionTask.check_config(run)
