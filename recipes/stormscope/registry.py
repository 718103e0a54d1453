"""Registry entries of the StormScope recipe: its data, the DiT model and the diffusion-only task."""

from framework import registry
from recipes.stormscope.config import (
    DiTConfig,
    StormScopeDataConfig,
    StormScopeSyntheticDataConfig,
    StormScopeTaskConfig,
)
from recipes.stormscope.parallelize import PLAN as DIT_SPLIT_PLAN  # how the DiT splits over patch rows
from recipes.stormscope.task import StormScopeTask

# The same zarr dataset as StormCast's, read under StormScope's names (recipes.weather.layout.Naming);
# the task builds it.
registry.datasets.add("stormscope", StormScopeDataConfig, StormScopeTask)
registry.datasets.add("stormscope_synthetic", StormScopeSyntheticDataConfig, StormScopeTask)


@registry.models.register("dit", DiTConfig, split_plan=DIT_SPLIT_PLAN)
def build_dit(cfg: DiTConfig, *, in_channels: int, out_channels: int, img_resolution):
    from recipes.stormscope import fused_natten
    from recipes.stormscope.dit import DiT

    fused_natten.use_run_tiles(cfg.attn_tiles)  # (per process: the kernels read the module's tiles)

    return DiT(
        tuple(img_resolution),
        in_channels,
        out_channels,
        patch_size=cfg.patch_size,
        hidden_size=cfg.hidden_size,
        depth=cfg.depth,
        num_heads=cfg.num_heads,
        mlp_ratio=cfg.mlp_ratio,
        attn_kernel=cfg.attn_kernel,
        pos_embed=cfg.pos_embed,
        num_scalar_conditions=cfg.num_scalar_conditions,
        mask_token=cfg.mask_token,
        checkpoint_blocks=cfg.checkpoint_blocks,
        attn_impl=cfg.attn_impl,
        attn_block=cfg.attn_block,
        mlp_impl=cfg.mlp_impl,
        residual_impl=cfg.residual_impl,
    )


# The same EDM task as StormCast's diffusion stage, with StormScope's conditions and data config.
registry.tasks.add("stormscope", StormScopeTaskConfig, StormScopeTask)
