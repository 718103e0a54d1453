"""Sharded checkpoints through torch.distributed.checkpoint (DCP), synchronous.

Every rank writes the shards it owns (``__<rank>_0.distcp``; replicated tensors once),
rank 0 writes DCP's ``.metadata`` and ``extra.pt`` (LR schedule, GradScaler, step, run
id, optimizer hyper-parameters). Loading fills the *current* model's sharded state
dicts in place, so a checkpoint written under one mesh and world size loads into any
other: DCP reads, per rank, exactly the slices its DTensors (or plain tensors) cover.

Nothing read from a checkpoint executes code:

- only tensors go through DCP (a non-tensor value of the model or optimizer state goes
  to ``extra.pt``): DCP would pickle such values, and unpickle them on load with
  ``weights_only=False``;
- DCP's pickled ``.metadata`` is read through an allow-list unpickler (DCP's metadata
  classes, ``torch.Size``, dtypes; no other callable; only instances of its dataclasses
  filled in, so the file cannot patch a class for the process);
- every ``.metadata`` entry is then checked before DCP reads any data: tensor entries
  only (a ``BytesStorageMetadata`` entry, which DCP would read with
  ``torch.load(weights_only=False)``, is refused), under ``model.`` / ``optimizer.state.``,
  chunks inside the tensor, data files inside the checkpoint directory, no storage
  transforms, and against the live state: the same names, dtypes and global shapes;
- tensor data is read by DCP with ``weights_only=True``, ``extra.pt`` by us likewise.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
import re
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._nested_dict import flatten_state_dict, unflatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException

from framework.checkpoint.backend import Base, check_expected, plain_weights
from framework.checkpoint.io import first_line as _first_line
from framework.checkpoint.io import load_plain, save_durable
from framework.checkpoint.manifest import listed
from framework.errors import DataError
from framework.safe_unpickle import Refused, RestrictedUnpickler
from framework.untrusted import open_regular

# Single-process saves and loads are intended (no_dist); DCP warns about them anyway.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

EXTRA = "extra.pt"
PLAIN = "plain"  # extra.pt: non-tensor values of the model/optimizer state, by flat DCP key
# DCP reports failures as CheckpointException, a BaseException: catch it explicitly.
ERRORS = (Exception, CheckpointException)
METADATA = ".metadata"
PREFIXES = {"model": "model.", "optimizer": "optimizer.state."}
_DATA_FILE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")  # a plain file name inside the checkpoint


class DcpBackend(Base):
    format = "dcp"
    full_state = False  # each rank writes its own shards

    def __init__(self, io_threads: int = 1):
        self.io_threads = max(1, int(io_threads))

    # save ----------------------------------------------------------------------------------
    def split(self, state: dict, directory: Path, env) -> dict:
        """Write the small parts (rank 0) and return what DCP writes: tensors only, flat.

        DCP would pickle any non-tensor value (and unpickle it with ``weights_only=False`` on
        load): such values of the model or optimizer state go to ``extra.pt`` instead.
        """
        flat, mapping = flatten_state_dict(
            {"model": state["model"], "optimizer": {"state": state["optimizer"].get("state", {})}}
        )
        tensors = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}
        if env.is_main:
            small = {k: v for k, v in state.items() if k not in ("model", "optimizer")}
            small["param_groups"] = state["optimizer"].get("param_groups", [])
            plain = [(tuple(mapping[k]), v) for k, v in flat.items() if k not in tensors]
            if plain:
                small[PLAIN] = plain
            save_durable(small, Path(directory) / EXTRA)
        return tensors

    def writer(self, directory: Path) -> FileSystemWriter:
        return FileSystemWriter(str(directory), thread_count=self.io_threads, sync_files=True)

    def save(self, state: dict, directory: Path, env):
        tensors = self.split(state, directory, env)
        dcp.save(tensors, storage_writer=self.writer(directory), no_dist=not _distributed())
        return None  # written: nothing in flight

    # load ----------------------------------------------------------------------------------
    def load(self, directory: Path, env, template) -> dict:
        """Fill ``template()`` (the live sharded state dicts) from ``directory``.

        Before DCP reads anything, every entry of ``.metadata`` is checked against what the
        live state expects: tensors only (no pickled objects), the same names, dtypes and
        global shapes, data files inside the checkpoint and long enough.
        """
        directory = Path(directory)
        metadata = check_complete(directory)
        small = _load_extra(directory)
        live = template()
        wanted = {}
        if "model" in live:
            wanted["model"] = live["model"]
        if "optimizer" in live:
            wanted["optimizer"] = {"state": live["optimizer"].get("state", {})}
        flat, mapping = flatten_state_dict(wanted)
        tensors = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}
        prefixes = tuple(PREFIXES[p] for p in wanted)
        check_entries(metadata, directory, expected=tensors, prefixes=prefixes)
        if tensors:
            try:
                dcp.load(tensors, storage_reader=SafeReader(str(directory), metadata), no_dist=not _distributed())
            except ERRORS as e:
                raise DataError(f"checkpoint {directory} cannot be loaded into this model: {dcp_error(e)}") from None
        loaded = unflatten_state_dict(tensors, mapping) if tensors else {}
        for path, value in _plain(small, directory):
            if path[0] in wanted:
                set_element(loaded, path, value)
        state = dict(small)
        state.pop(PLAIN, None)
        if "model" in wanted:
            state["model"] = loaded.get("model", {})
        if "optimizer" in wanted:
            opt = loaded.get("optimizer", {})
            state["optimizer"] = {"state": opt.get("state", {}), "param_groups": small.get("param_groups", [])}
        return state

    def check_structure(self, directory: Path, manifest: dict | None) -> None:
        metadata = check_complete(directory, manifest)
        check_entries(metadata, directory)
        if not (Path(directory) / EXTRA).is_file():
            raise DataError(f"checkpoint {directory} is incomplete: no {EXTRA}")

    def export_weights(self, directory: Path, expected=None) -> dict[str, torch.Tensor]:
        return plain_weights(load_model_weights(directory, expected), directory, None)

    def close(self) -> None:
        pass


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


_MAX_LIST_INDEX = 1 << 12  # DCP's set_element pads a list up to the index: a crafted 10**9 is memory


def _plain(small: dict, directory: Path) -> list[tuple[tuple, object]]:
    """The non-tensor values of the model/optimizer state (``extra.pt``): (path, value)."""
    plain = small.get(PLAIN) or []
    ok = isinstance(plain, list) and all(
        isinstance(p, tuple)
        and len(p) == 2
        and isinstance(p[0], tuple)
        and p[0]
        and all(isinstance(k, str) or (type(k) is int and 0 <= k < _MAX_LIST_INDEX) for k in p[0])
        for p in plain
    )
    if not ok:
        raise DataError(f"checkpoint file {directory / EXTRA} cannot be read: malformed '{PLAIN}' entry")
    return plain


def _load_extra(directory: Path) -> dict:
    path = directory / EXTRA
    try:
        extra = load_plain(path)
    except FileNotFoundError:
        raise DataError(f"checkpoint {directory} is incomplete: no {EXTRA}") from None
    if not isinstance(extra, dict):
        raise DataError(f"checkpoint file {path} cannot be read: it holds a {type(extra).__name__}, not a dict")
    return extra


# -- integrity and safe metadata -----------------------------------------------------------
_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "TensorProperties",
        "ChunkStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
}


@functools.cache
def _metadata_globals() -> tuple[dict, list, tuple[type, ...]]:
    """What DCP's ``.metadata`` may name (its classes, ``torch.Size``, dtypes), what of that it
    may call (all but the dtypes), and the classes whose instances it may fill in (its
    dataclasses). Dtypes are looked up in ``vars(torch)``: ``getattr`` would import whichever
    lazy submodule of torch the file names."""
    allowed: dict = {("torch", "Size"): torch.Size}
    allowed.update({("torch", k): v for k, v in vars(torch).items() if isinstance(v, torch.dtype)})
    for module, names in _DCP_CLASSES.items():
        mod = importlib.import_module(module)
        allowed.update({(module, n): getattr(mod, n) for n in names})
    dcp_classes = [v for (m, _), v in allowed.items() if m.startswith("torch.distributed.checkpoint")]
    buildable = tuple(v for v in dcp_classes if isinstance(v, type) and dataclasses.is_dataclass(v))
    return allowed, [v for v in allowed.values() if callable(v)], buildable


def _metadata_unpickler(f):
    """Unpickles DCP's ``.metadata`` and nothing else: no callables beyond its own classes, and
    only their instances filled in (:mod:`framework.safe_unpickle`).

    ``BytesStorageMetadata`` is a plain marker class and may be unpickled; an entry of that
    kind is then refused by :func:`check_entries`, by name, before anything reads it.
    """
    return RestrictedUnpickler(f, *_metadata_globals())


def read_metadata(directory: Path):
    from torch.distributed.checkpoint.metadata import Metadata

    path = Path(directory) / METADATA
    try:
        with open_regular(path) as f:
            metadata = _metadata_unpickler(f).load()
    except FileNotFoundError:
        raise DataError(f"checkpoint {directory} is incomplete: no DCP {METADATA} file") from None
    except Refused as e:
        raise DataError(f"checkpoint file {path} cannot be read: {e} in checkpoint metadata") from None
    except Exception as e:  # truncated or not a pickle at all
        raise DataError(f"checkpoint file {path} cannot be read: not DCP metadata ({_first_line(e)})") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise DataError(f"checkpoint file {path} cannot be read: not DCP metadata")
    return metadata


class SafeReader(FileSystemReader):
    """DCP's file reader, handed the metadata that was read (allow-list unpickler) and checked."""

    def __init__(self, path, metadata=None):
        super().__init__(path)
        self._checked = metadata

    def read_metadata(self, *args, **kwargs):
        if kwargs.get("rank") is not None:  # per-rank metadata (use_collectives=False): not ours
            raise DataError(f"checkpoint {self.path} has per-rank metadata, which this reader does not load")
        metadata = self._checked
        if metadata is None:
            metadata = read_metadata(Path(self.path))
            check_entries(metadata, Path(self.path))
        from torch.distributed.checkpoint.metadata import StorageMeta

        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def check_complete(directory: Path, manifest: dict | None = None):
    """The metadata, once every data file it points at is a plain file of the checkpoint
    (listed in ``manifest`` when there is one), present and long enough; else one line."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    directory = Path(directory)
    metadata = read_metadata(directory)
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        raise DataError(f"checkpoint {directory} is corrupt: {METADATA} has no storage index")
    need: dict[str, int] = {}
    for index, info in storage.items():
        fqn = getattr(index, "fqn", None)
        if not isinstance(info, _StorageInfo) or not isinstance(fqn, str):
            raise DataError(f"checkpoint {directory} is corrupt: {METADATA} has a malformed storage entry")
        rel, offset, length = info.relative_path, info.offset, info.length
        if not isinstance(rel, str) or not _DATA_FILE.match(rel) or rel in (METADATA, EXTRA):
            raise DataError(
                f"checkpoint {directory} is refused: {METADATA} points {fqn} at {rel!r}, "
                "which is not a data file inside the checkpoint"
            )
        if not _natural(offset) or not _natural(length):
            raise DataError(f"checkpoint {directory} is corrupt: {METADATA} has a bad offset or length for {fqn}")
        transforms = getattr(info, "transform_descriptors", None)
        if transforms:
            raise DataError(
                f"checkpoint {directory} is refused: {fqn} is stored through transforms "
                f"{list(transforms)}, which this framework never writes"
            )
        need[rel] = max(need.get(rel, 0), offset + length)
    for rel, size in sorted(need.items()):
        path = directory / rel
        if not path.is_file():
            raise DataError(f"checkpoint {directory} is incomplete: data file {rel} is missing")
        if not listed(manifest, rel):
            raise DataError(f"checkpoint {directory} is refused: data file {rel} is not in its manifest")
        have = path.stat().st_size
        if have < size:
            raise DataError(f"checkpoint {directory} is corrupt: data file {rel} is truncated ({have} of {size} bytes)")
    return metadata


def _natural(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _shape(x) -> bool:
    return isinstance(x, tuple) and all(_natural(d) for d in x)


def check_entries(metadata, directory: Path, *, expected: dict | None = None, prefixes: tuple[str, ...] = ()) -> None:
    """Every entry of DCP's ``metadata`` before any data is read; one line naming the first
    problem.

    - tensors only: a ``BytesStorageMetadata`` entry (a pickled object, which DCP would
      load with ``weights_only=False``: arbitrary code) is refused, whatever its name;
    - names under ``model.`` or ``optimizer.state.``; a dtype; a global shape; chunks of
      that rank that lie inside it; a storage location for each;
    - ``expected`` (flat DCP key -> live tensor): the entries under ``prefixes`` are exactly
      those names, with the same dtypes and global shapes.
    """
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, ChunkStorageMetadata, TensorStorageMetadata

    directory = Path(directory)
    entries = metadata.state_dict_metadata
    stored = {getattr(k, "fqn", None) for k in (metadata.storage_data or {})}
    have: dict[str, tuple] = {}
    for fqn, md in entries.items():
        name = fqn if isinstance(fqn, str) else repr(fqn)
        if isinstance(md, BytesStorageMetadata):
            raise DataError(
                f"checkpoint {directory} is refused: entry {name} of {METADATA} is a pickled Python "
                "object (BytesStorageMetadata), which loading would execute; this framework writes "
                "only tensors through DCP"
            )
        if not isinstance(md, TensorStorageMetadata) or not isinstance(fqn, str):
            raise DataError(f"checkpoint {directory} is refused: entry {name} of {METADATA} is not a tensor")
        if not fqn.startswith(tuple(PREFIXES.values())):
            raise DataError(
                f"checkpoint {directory} is refused: {METADATA} holds {fqn}, which is neither model nor optimizer state"
            )
        dtype = getattr(md.properties, "dtype", None)
        size = md.size
        if not isinstance(dtype, torch.dtype) or not _shape(size) or not isinstance(md.chunks, list):
            raise DataError(f"checkpoint {directory} is corrupt: {METADATA} describes {fqn} badly")
        for c in md.chunks:
            if (
                not isinstance(c, ChunkStorageMetadata)
                or not _shape(c.offsets)
                or not _shape(c.sizes)
                or len(c.offsets) != len(size)
                or len(c.sizes) != len(size)
                or any(o + n > d for o, n, d in zip(c.offsets, c.sizes, size))
            ):
                raise DataError(
                    f"checkpoint {directory} is corrupt: {METADATA} has a chunk of {fqn} outside its shape {list(size)}"
                )
        if md.chunks and fqn not in stored:
            raise DataError(f"checkpoint {directory} is corrupt: {METADATA} has no storage for {fqn}")
        have[fqn] = (dtype, tuple(size))
    _check_declared_bytes(metadata, directory, have)
    if expected is None:
        return
    for prefix in prefixes:
        check_expected(
            {k: v for k, v in have.items() if k.startswith(prefix)},
            {k: v for k, v in expected.items() if k.startswith(prefix)},
            directory,
        )


def _check_declared_bytes(metadata, directory: Path, have: dict[str, tuple]) -> None:
    """Every element of every tensor is written once at least, so the tensors cannot hold more
    bytes than the data files: a crafted shape would otherwise be allocated in full (export and
    ``init_from`` allocate what the metadata declares) before any data is read. A sparse data
    file claims a size it does not hold; what it makes allocated is then untouched memory, and
    the read that follows finds no tensor in it."""
    declared = sum(math.prod(shape) * dtype.itemsize for dtype, shape in have.values())
    files = {info.relative_path for info in metadata.storage_data.values()}
    on_disk = sum((directory / rel).stat().st_size for rel in files if (directory / rel).is_file())
    if declared > on_disk:
        raise DataError(
            f"checkpoint {directory} is corrupt: {METADATA} declares {declared} bytes of tensors, "
            f"its data files hold {on_disk}"
        )


def load_model_weights(directory: Path, expected=None) -> dict[str, torch.Tensor]:
    """The full model state dict of a DCP checkpoint, in one process, no process group.

    ``expected`` (name -> tensor): refuse a checkpoint whose model entries differ in name,
    dtype or shape, before any data is read.
    """
    directory = Path(directory)
    metadata = check_complete(directory)
    flat_expected = None if expected is None else {f"model.{k}": v for k, v in expected.items()}
    check_entries(metadata, directory, expected=flat_expected, prefixes=("model.",))
    try:  # bounded by the data files' sizes (check_entries); a sparse file can still claim more
        model = {
            key: torch.empty(md.size, dtype=md.properties.dtype)
            for key, md in metadata.state_dict_metadata.items()
            if key.startswith("model.")
        }
    except (RuntimeError, MemoryError) as e:
        raise DataError(f"checkpoint {directory}: its model weights cannot be allocated ({_first_line(e)})") from None
    if not model:
        raise DataError(f"checkpoint {directory} holds no model weights")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(model, storage_reader=SafeReader(str(directory), metadata), no_dist=True)
    except ERRORS as e:
        raise DataError(f"checkpoint {directory} cannot be read: {dcp_error(e)}") from None
    return {k[len("model.") :]: v for k, v in model.items()}


def dcp_error(e: BaseException) -> str:
    """The first line of the first rank's failure (DCP wraps them all in one exception)."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        e = next(iter(failures.values()))
        if isinstance(e, tuple):  # (exception, traceback) on some versions
            e = e[0]
    return _first_line(e)
