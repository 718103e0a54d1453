"""Sharded checkpoints through torch.distributed.checkpoint (DCP), synchronous.

Every rank writes the shards it owns (``__<rank>_0.distcp``; replicated tensors once),
rank 0 writes DCP's ``.metadata`` and ``extra.pt`` (LR schedule, GradScaler, step, run
id, optimizer hyper-parameters). Loading fills the *current* model's sharded state
dicts in place, so a checkpoint written under one mesh and world size loads into any
other: DCP reads, per rank, exactly the slices its DTensors (or plain tensors) cover.

Only tensors go through DCP (DCP loads non-tensor items with ``weights_only=False``);
tensors are loaded by DCP with ``weights_only=True``, ``extra.pt`` by us with
``weights_only=True``, and DCP's pickled ``.metadata`` through an allow-list unpickler
that accepts DCP's own metadata classes, ``torch.Size`` and dtypes, nothing else.
"""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from framework.checkpoint.io import first_line as _first_line, save_durable
from framework.errors import DataError

# Single-process saves and loads are intended (no_dist); DCP warns about them anyway.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

EXTRA = "extra.pt"
# DCP reports failures as CheckpointException, a BaseException: catch it explicitly.
ERRORS = (Exception, CheckpointException)
METADATA = ".metadata"


class DcpBackend:
    format = "dcp"
    full_state = False  # each rank writes its own shards

    def __init__(self, io_threads: int = 1):
        self.io_threads = max(1, int(io_threads))

    # save ----------------------------------------------------------------------------------
    def split(self, state: dict, directory: Path, env) -> dict:
        """Write the small parts (rank 0) and return what DCP writes: tensors only."""
        if env.is_main:
            small = {k: v for k, v in state.items() if k not in ("model", "optimizer")}
            small["param_groups"] = state["optimizer"].get("param_groups", [])
            save_durable(small, Path(directory) / EXTRA)
        return {"model": state["model"], "optimizer": {"state": state["optimizer"].get("state", {})}}

    def writer(self, directory: Path) -> FileSystemWriter:
        return FileSystemWriter(str(directory), thread_count=self.io_threads, sync_files=True)

    def save(self, state: dict, directory: Path, env):
        tensors = self.split(state, directory, env)
        dcp.save(tensors, storage_writer=self.writer(directory), no_dist=not _distributed())
        return None  # written: nothing in flight

    # load ----------------------------------------------------------------------------------
    def load(self, directory: Path, env, template) -> dict:
        """Fill ``template()`` (the live sharded state dicts) from ``directory``."""
        directory = Path(directory)
        check_complete(directory)
        small = _load_extra(directory)
        live = template()
        wanted = {}
        if "model" in live:
            wanted["model"] = live["model"]
        if "optimizer" in live:
            wanted["optimizer"] = {"state": live["optimizer"].get("state", {})}
        try:
            dcp.load(wanted, storage_reader=SafeReader(str(directory)), no_dist=not _distributed())
        except ERRORS as e:
            raise DataError(f"checkpoint {directory} cannot be loaded into this model: {dcp_error(e)}") from None
        state = dict(small)
        if "model" in wanted:
            state["model"] = wanted["model"]
        if "optimizer" in wanted:
            state["optimizer"] = {"state": wanted["optimizer"]["state"], "param_groups": small["param_groups"]}
        return state

    def close(self) -> None:
        pass


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _load_extra(directory: Path) -> dict:
    path = directory / EXTRA
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise DataError(f"checkpoint {directory} is incomplete: no {EXTRA}") from None
    except Exception as e:
        raise DataError(f"checkpoint file {path} cannot be read: {_first_line(e)}") from None


# -- integrity and safe metadata -----------------------------------------------------------
_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                              "TensorProperties", "ChunkStorageMetadata", "MetadataIndex",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` and nothing else (no arbitrary callables)."""

    def find_class(self, module, name):
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        if name in _DCP_CLASSES.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")


def read_metadata(directory: Path):
    path = Path(directory) / METADATA
    try:
        with open(path, "rb") as f:
            return _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise DataError(f"checkpoint {directory} is incomplete: no DCP {METADATA} file") from None
    except Exception as e:
        raise DataError(f"checkpoint file {path} cannot be read: {_first_line(e)}") from None


class SafeReader(FileSystemReader):
    """DCP's file reader with the allow-list metadata unpickler."""

    def read_metadata(self, *args, **kwargs):
        if kwargs.get("rank") is not None:  # per-rank metadata (use_collectives=False): not ours
            raise DataError(f"checkpoint {self.path} has per-rank metadata, which this reader does not load")
        metadata = read_metadata(Path(self.path))
        from torch.distributed.checkpoint.metadata import StorageMeta

        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def check_complete(directory: Path):
    """Every data file DCP's metadata points at exists and is long enough; else one line."""
    directory = Path(directory)
    metadata = read_metadata(directory)
    need: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        rel = str(info.relative_path)
        need[rel] = max(need.get(rel, 0), int(info.offset) + int(info.length))
    for rel, size in sorted(need.items()):
        path = directory / rel
        if not path.is_file():
            raise DataError(f"checkpoint {directory} is incomplete: data file {rel} is missing")
        have = path.stat().st_size
        if have < size:
            raise DataError(f"checkpoint {directory} is corrupt: data file {rel} is truncated "
                            f"({have} of {size} bytes)")
    return metadata


def load_model_weights(directory: Path) -> dict[str, torch.Tensor]:
    """The full model state dict of a DCP checkpoint, in one process, no process group."""
    directory = Path(directory)
    metadata = check_complete(directory)
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    model = {}
    for key, md in metadata.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(md, TensorStorageMetadata):
            model[key[len("model."):]] = torch.empty(md.size, dtype=md.properties.dtype)
    if not model:
        raise DataError(f"checkpoint {directory} holds no model weights")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load({"model": model}, storage_reader=SafeReader(str(directory)), no_dist=True)
    except ERRORS as e:
        raise DataError(f"checkpoint {directory} cannot be read: {dcp_error(e)}") from None
    return model


def dcp_error(e: BaseException) -> str:
    """The first line of the first rank's failure (DCP wraps them all in one exception)."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        e = next(iter(failures.values()))
        if isinstance(e, tuple):  # (exception, traceback) on some versions
            e = e[0]
    return _first_line(e)

