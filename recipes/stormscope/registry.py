"""Registry entries of the StormScope recipe: the DiT model and the diffusion-only task."""

from framework import registry
from recipes.stormcast.diffusion import DiffusionTask
from recipes.stormscope import parallelize  # noqa: F401  (domain rules of the DiT layers)
from recipes.stormscope.config import DiTConfig, StormScopeTaskConfig


@registry.models.register("dit", DiTConfig)
def build_dit(cfg: DiTConfig, *, in_channels: int, out_channels: int, img_resolution):
    from recipes.stormscope.dit import DiT

    return DiT(tuple(img_resolution), in_channels, out_channels, patch_size=cfg.patch_size,
               hidden_size=cfg.hidden_size, depth=cfg.depth, num_heads=cfg.num_heads, mlp_ratio=cfg.mlp_ratio,
               attn_kernel=cfg.attn_kernel, pos_embed=cfg.pos_embed, num_scalar_conditions=cfg.num_scalar_conditions,
               mask_token=cfg.mask_token, checkpoint_blocks=cfg.checkpoint_blocks, attn_impl=cfg.attn_impl)


# The same EDM task as StormCast's diffusion stage, with StormScope's conditions.
registry.tasks.add("stormscope", StormScopeTaskConfig, DiffusionTask)
