"""The contract every checkpoint format implements, and the one place a format is picked.

A backend owns the files of its format inside one checkpoint directory; the manager owns
everything around them (naming, RNG files, ``meta.json``, the manifest, the atomic
commit, discovery, retention). Readers that are not the manager (``framework.export``, a
recipe loading a trained stage) get a backend from :func:`for_checkpoint` and call
``verify`` then ``export_weights``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from framework.checkpoint import manifest as manifest_mod
from framework.checkpoint.manifest import META
from framework.errors import DataError


class PendingSave(Protocol):
    """An asynchronous save in flight (what ``save`` returns when it does not block)."""

    def wait_staged(self) -> None: ...  # the tensors have been copied: they may change now

    def done(self) -> bool: ...

    def wait(self) -> None: ...  # written everywhere (raises what the write raised)


@dataclass
class Verified:
    """What ``verify`` found: ``manifest`` is None for a checkpoint written before manifests
    (loadable, but nothing could be verified)."""

    meta: dict
    manifest: dict | None
    full: bool  # every checksum was checked (by this rank: its share)

    @property
    def verified(self) -> bool:
        return self.manifest is not None


@runtime_checkable
class CheckpointBackend(Protocol):
    format: str  # what meta.json records: "dcp" | "torch_save"
    full_state: bool  # save() wants gathered (full) state dicts (torch_save) or the live shards (dcp)

    def save(self, state: dict, directory: Path, env) -> PendingSave | None:
        """Write ``state`` (all parts but rng) into ``directory``, collectively; None once
        written, or a pending save (asynchronous backends)."""

    def load(self, directory: Path, env, template: Callable[[], dict]) -> dict:
        """The state of ``directory`` for this rank. ``template()`` returns the live state dicts
        of the parts to load (``model``, ``optimizer``; the excluded ones absent); a sharded
        backend fills them in place. Validates before reading any tensor data."""

    def read_meta(self, directory: Path) -> dict:
        """``meta.json``; one-line DataError if missing or unreadable."""

    def verify(self, directory: Path, *, full: bool = True, share: tuple[int, int] = (0, 1)) -> Verified:
        """Manifest (quick: sizes and meta.json; ``full``: every checksum, this rank's ``share``)
        and the format's own structure; one-line DataError on any mismatch."""

    def export_weights(
        self, directory: Path, expected: Mapping[str, torch.Tensor] | None = None
    ) -> dict[str, torch.Tensor]:
        """The model's state dict, plain contiguous CPU tensors, in one process without a
        process group. ``expected`` (name -> tensor of the right dtype and shape): refuse any
        other name, dtype or shape before reading data."""

    def close(self) -> None: ...


class Base:
    """read_meta and the manifest half of verify, shared by every format."""

    format = "?"
    full_state = False

    def read_meta(self, directory: Path) -> dict:
        return read_meta(directory)

    def verify(self, directory: Path, *, full: bool = True, share: tuple[int, int] = (0, 1)) -> Verified:
        directory = Path(directory)
        meta = self.read_meta(directory)
        found = manifest_mod.read(directory)
        if found is not None:
            manifest_mod.verify(directory, found, meta, full=full, share=share)
        self.check_structure(directory, found)
        return Verified(meta, found, full)

    def check_structure(self, directory: Path, manifest: dict | None) -> None:
        """The format's own files are there, consistent, and of the kind it reads."""

    def close(self) -> None:
        pass


def read_meta(path: Path) -> dict:
    """meta.json of a checkpoint; a missing or unreadable one is a clear one-line DataError."""
    from framework import untrusted
    from framework.checkpoint.io import first_line

    path = Path(path)
    f = path / META
    if not f.exists():
        why = "a save that did not finish" if path.name.startswith(".tmp-") else "not committed"
        raise DataError(f"checkpoint {path} is incomplete or corrupt: no {META} ({why})")
    try:  # untrusted: a named pipe or a link to /dev/zero is refused, not read without end
        meta = untrusted.read_json(f)
    except (OSError, ValueError) as e:  # ValueError: untrusted.BadFile (not a regular file, not JSON, ...)
        raise DataError(f"checkpoint {path} is corrupt: {META} cannot be read ({first_line(e)})") from None
    if not isinstance(meta, dict):
        raise DataError(f"checkpoint {path} is corrupt: {META} is not an object")
    return meta


def detect_format(directory: Path, meta: dict | None) -> str | None:
    fmt = (meta or {}).get("format")
    if fmt:
        return fmt
    directory = Path(directory)
    if (directory / "state.pt").is_file():
        return "torch_save"
    if (directory / ".metadata").is_file():
        return "dcp"
    return None


def for_format(fmt: str | None, *, prefer=None, what: str = "checkpoint") -> CheckpointBackend:
    """The backend that reads format ``fmt`` (``prefer``, the run's own, when it matches)."""
    if prefer is not None and fmt == getattr(prefer, "format", None):
        return prefer
    if fmt == "dcp":
        from framework.checkpoint.dcp import DcpBackend

        return DcpBackend()
    if fmt == "torch_save":
        from framework.checkpoint.torch_save import TorchSaveBackend

        return TorchSaveBackend()
    raise DataError(f"{what} has an unknown format {fmt!r}")


def for_checkpoint(directory: Path, meta: dict | None = None, *, prefer=None) -> CheckpointBackend:
    """The backend of checkpoint ``directory`` (from meta.json's ``format``, else its files)."""
    directory = Path(directory)
    if meta is None:
        meta = read_meta(directory)
    return for_format(detect_format(directory, meta), prefer=prefer, what=f"checkpoint {directory}")


def plain_weights(weights: object, directory: Path, expected: Mapping[str, torch.Tensor] | None) -> dict:
    """Check a model state dict read from ``directory`` (tensors only; ``expected``'s names,
    dtypes and shapes) and return plain contiguous CPU copies."""
    if not isinstance(weights, Mapping) or not weights:
        raise DataError(f"checkpoint {directory} holds no model weights")
    bad = next((k for k, v in weights.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)), None)
    if bad is not None:
        raise DataError(f"checkpoint {directory} is refused: model entry {bad!r} is not a tensor")
    if expected is not None:
        check_expected({k: (v.dtype, tuple(v.shape)) for k, v in weights.items()}, expected, directory)
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in weights.items()}


def check_expected(
    have: Mapping[str, tuple], expected: Mapping[str, torch.Tensor], directory: Path, prefix: str = ""
) -> None:
    """``have`` (name -> (dtype, shape)) names exactly ``expected``'s tensors, with their dtypes
    and (global) shapes; else one line saying what differs."""
    why = first_difference(have, {f"{prefix}{k}": v for k, v in expected.items()})
    if why:
        raise DataError(f"checkpoint {directory} cannot be loaded into this model: {why}")


def first_difference(
    have: Mapping[str, tuple],
    want: Mapping[str, torch.Tensor],
    *,
    dtypes: bool = True,
    there: str = "in the checkpoint",
) -> str | None:
    """What first differs between ``have`` (name -> (dtype, shape)) and the tensors ``want`` (a
    missing name, an extra one, a dtype (``dtypes``) or a shape), in words; None if nothing."""
    missing = sorted(set(want) - set(have))
    extra = sorted(set(have) - set(want))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        return f"it lacks {missing[0]}{more}"
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        return f"it holds {extra[0]}{more}, which this model does not have"
    for k, t in want.items():
        dtype, shape = have[k]
        if (dtypes and dtype != t.dtype) or tuple(shape) != tuple(t.shape):
            return f"{k} is {_describe(dtype, shape)} {there}, {_describe(t.dtype, t.shape)} here"
    return None


def first_non_finite(weights: Mapping[str, torch.Tensor]) -> str | None:
    """The first floating-point tensor of ``weights`` holding NaN or Inf, in words; None if none.
    Weights from others are checked before use: such a model only shows itself later, as a
    non-finite loss or forecast."""
    for k, t in weights.items():
        if torch.is_tensor(t) and t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return f"{k} holds non-finite values (NaN or Inf)"
    return None


def _describe(dtype, shape) -> str:
    return f"{str(dtype).replace('torch.', '')}{list(shape)}"
