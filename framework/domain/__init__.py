"""Domain (spatial) parallelism: ShardTensor, halo exchange, the domain splitter."""

from framework import registry
from framework.config.schema import SplitterConfig


@registry.splitters.register("off", SplitterConfig)
def no_split(model, cfg, **_):
    return model


registry.splitters.add("shard_tensor", SplitterConfig, pending="issue 4, domain parallelism")
