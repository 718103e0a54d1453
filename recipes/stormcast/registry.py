"""Registry entries of the StormCast recipe: its model, datasets and tasks."""

import recipes.weather.registry  # noqa: F401  (the datasets StormCast trains on)
from framework import registry
from recipes.stormcast.config import SongUNetConfig
from recipes.stormcast.parallelize import PLAN as SONGUNET_SPLIT_PLAN  # how the SongUNet splits over rows
from recipes.weather.config import DiffusionTaskConfig, RegressionTaskConfig
from recipes.weather.diffusion import DiffusionTask
from recipes.weather.task import RegressionTask


@registry.models.register("songunet", SongUNetConfig, split_plan=SONGUNET_SPLIT_PLAN)
def build_songunet(cfg: SongUNetConfig, *, in_channels: int, out_channels: int, img_resolution):
    from recipes.stormcast.songunet import SongUNet

    return SongUNet(
        img_resolution=tuple(img_resolution),
        in_channels=in_channels,
        out_channels=out_channels,
        model_channels=cfg.model_channels,
        channel_mult=list(cfg.channel_mult),
        channel_mult_emb=cfg.channel_mult_emb,
        num_blocks=cfg.num_blocks,
        attn_resolutions=list(cfg.attn_resolutions),
        dropout=cfg.dropout,
        embedding_type=cfg.embedding_type,
        additive_pos_embed=cfg.additive_pos_embed,
        checkpoint_level=cfg.checkpoint_level,
        compiled_norm=cfg.compiled_norm,
        recompute_norm_levels=list(cfg.recompute_norm_levels),
    )


registry.tasks.add("stormcast_regression", RegressionTaskConfig, RegressionTask)
registry.tasks.add("stormcast_diffusion", DiffusionTaskConfig, DiffusionTask)
