"""Domain (spatial) parallelism: ShardTensor, halo exchange, the domain splitter."""

from framework import registry
from framework.config.schema import SplitterConfig


@registry.splitters.register("off", SplitterConfig)
def no_split(model, cfg, **_):
    return model


@registry.splitters.register("shard_tensor", SplitterConfig)
def shard_tensor_split(model, cfg, *, domain=None, **_):
    """Split activations along rows over the domain axis (see framework.domain.splitter)."""
    if domain is None or domain.size == 1:
        return model
    from framework.domain.splitter import split

    return split(model, domain)
