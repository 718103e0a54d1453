"""Crafted (malicious or damaged) checkpoints for the safety and integrity tests.

An attacker who hands us a checkpoint controls every byte of it, the manifest included:
``reforge_manifest`` recomputes it, so these tests show that safety never rests on the
checksums.
"""

from __future__ import annotations

import io
import json
import pickle
from pathlib import Path

import torch


class Marker:
    """Unpickling this creates ``path`` (``open(path, "w")``): proof that a load ran code."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def evil_torch_file(marker: Path) -> bytes:
    """A torch.save file whose (weights_only=False) load creates ``marker``."""
    buf = io.BytesIO()
    torch.save({"model": Marker(marker)}, buf)
    return buf.getvalue()


def plant_bytes_entry(ckpt: Path, marker: Path, fqn: str | None = None, *, manifest: str = "reforge") -> str:
    """Turn one tensor entry of a DCP checkpoint into a ``BytesStorageMetadata`` entry whose
    payload is a pickle that creates ``marker`` when DCP reads it (``torch.load(weights_only=
    False)``). ``manifest``: "reforge" (recomputed, as an attacker would), "drop" (an older
    checkpoint without one). Returns the entry's name."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    ckpt = Path(ckpt)
    payload = evil_torch_file(marker)
    (ckpt / "__9_0.distcp").write_bytes(payload)
    with open(ckpt / ".metadata", "rb") as f:
        md = pickle.load(f)  # our own file, in a test
    fqn = fqn or next(k for k in md.state_dict_metadata if k.startswith("model."))
    md.state_dict_metadata[fqn] = BytesStorageMetadata()
    md.storage_data = {k: v for k, v in md.storage_data.items() if k.fqn != fqn}
    md.storage_data[MetadataIndex(fqn)] = _StorageInfo("__9_0.distcp", 0, len(payload))
    with open(ckpt / ".metadata", "wb") as f:
        pickle.dump(md, f)
    settle_manifest(ckpt, manifest)
    return fqn


def point_outside(ckpt: Path, target: str, *, manifest: str = "reforge") -> None:
    """Point every chunk of one DCP tensor at a file outside the checkpoint."""
    with open(ckpt / ".metadata", "rb") as f:
        md = pickle.load(f)
    for info in md.storage_data.values():
        info.relative_path = target
        break
    with open(ckpt / ".metadata", "wb") as f:
        pickle.dump(md, f)
    settle_manifest(ckpt, manifest)


def settle_manifest(ckpt: Path, how: str) -> None:
    if how == "reforge":
        reforge_manifest(ckpt)
    elif how == "drop":
        (Path(ckpt) / "manifest.json").unlink(missing_ok=True)
    elif how != "keep":
        raise ValueError(how)


def reforge_manifest(ckpt: Path) -> None:
    """Recompute ``manifest.json`` for the files as they are now (what an attacker can do)."""
    from framework.checkpoint import manifest

    ckpt = Path(ckpt)
    old = json.loads((ckpt / "manifest.json").read_text()) if (ckpt / "manifest.json").is_file() else {}
    meta = json.loads((ckpt / "meta.json").read_text())
    manifest.write(ckpt, manifest.build(ckpt, meta, world=old.get("world", {})))


def plant_pickle_as_tensor(ckpt: Path, marker: Path, *, manifest: str = "reforge") -> str:
    """Keep the entry a tensor in ``.metadata`` but point its data at a pickle that creates
    ``marker`` (DCP reads tensor data with weights_only=True: it must be refused there)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    ckpt = Path(ckpt)
    payload = evil_torch_file(marker)
    (ckpt / "__9_0.distcp").write_bytes(payload)
    with open(ckpt / ".metadata", "rb") as f:
        md = pickle.load(f)
    index = next(k for k in md.storage_data if k.fqn.startswith("model."))
    md.storage_data[index] = _StorageInfo("__9_0.distcp", 0, len(payload))
    with open(ckpt / ".metadata", "wb") as f:
        pickle.dump(md, f)
    settle_manifest(ckpt, manifest)
    return index.fqn
