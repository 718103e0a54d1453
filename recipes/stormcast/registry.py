"""Registry entries of the StormCast recipe: its model, datasets and tasks."""

from framework import registry
from recipes.stormcast.config import (DiffusionTaskConfig, HrrrEra5DataConfig, RegressionTaskConfig,
                                      SongUNetConfig, SyntheticDataConfig)
from recipes.stormcast.diffusion import DiffusionTask
from recipes.stormcast import parallelize  # noqa: F401  (domain rules of the SongUNet layers)
from recipes.stormcast.task import RegressionTask


@registry.models.register("songunet", SongUNetConfig)
def build_songunet(cfg: SongUNetConfig, *, in_channels: int, out_channels: int, img_resolution):
    from recipes.stormcast.songunet import SongUNet

    return SongUNet(img_resolution=tuple(img_resolution), in_channels=in_channels, out_channels=out_channels,
                    model_channels=cfg.model_channels, channel_mult=list(cfg.channel_mult),
                    channel_mult_emb=cfg.channel_mult_emb, num_blocks=cfg.num_blocks,
                    attn_resolutions=list(cfg.attn_resolutions), dropout=cfg.dropout,
                    embedding_type=cfg.embedding_type, additive_pos_embed=cfg.additive_pos_embed,
                    checkpoint_level=cfg.checkpoint_level)


# Datasets are built by the task (it knows which years and channels); the entries carry
# the schemas and keep options and entries one to one.
registry.datasets.add("synthetic", SyntheticDataConfig, RegressionTask)
registry.datasets.add("hrrr_era5", HrrrEra5DataConfig, RegressionTask)

registry.tasks.add("stormcast_regression", RegressionTaskConfig, RegressionTask)
registry.tasks.add("stormcast_diffusion", DiffusionTaskConfig, DiffusionTask)
