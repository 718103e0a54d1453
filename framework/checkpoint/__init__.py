"""Checkpoint backends behind one manager (see manager.py and docs/checkpointing.md).

Every backend implements ``backend.CheckpointBackend`` (save, load, read_meta, verify,
export_weights); ``backend.for_checkpoint`` picks the one that reads an existing
checkpoint; ``locator`` decides which checkpoint a path means ("latest": the newest
commit of the run's lineage that verifies); ``manifest`` writes and checks the checksums.

- ``torch_save``: one consolidated file (rank 0 writes the gathered state);
- ``dcp``: torch.distributed.checkpoint, every rank writes its shards, reshards on load;
- ``dcp_async``: the same files, written in the background after a CPU staging copy;
- ``none``: no checkpoints.
"""

from framework import registry
from framework.config.schema import CheckpointConfig


@registry.checkpoint.register("torch_save", CheckpointConfig)
def _torch_save(cfg):
    from framework.checkpoint.torch_save import TorchSaveBackend

    return TorchSaveBackend()


@registry.checkpoint.register("dcp", CheckpointConfig)
def _dcp(cfg):
    from framework.checkpoint.dcp import DcpBackend

    return DcpBackend(cfg.io_threads)


@registry.checkpoint.register("dcp_async", CheckpointConfig)
def _dcp_async(cfg):
    from framework.checkpoint.dcp_async import AsyncDcpBackend

    return AsyncDcpBackend(cfg.io_threads)


@registry.checkpoint.register("none", CheckpointConfig)
def _none(cfg):
    return None
