"""Checkpoint backends behind one manager (see manager.py)."""

from framework import registry
from framework.config.schema import CheckpointConfig


@registry.checkpoint.register("torch_save", CheckpointConfig)
def _torch_save(cfg):
    from framework.checkpoint.torch_save import TorchSaveBackend

    return TorchSaveBackend()


@registry.checkpoint.register("none", CheckpointConfig)
def _none(cfg):
    return None


registry.checkpoint.add("dcp", CheckpointConfig, pending="issue 5, sharded checkpoints")
registry.checkpoint.add("dcp_async", CheckpointConfig, pending="issue 5, sharded checkpoints")
