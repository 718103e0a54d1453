"""Checkpoint manifests: a checksum of every file, the step, a hash of the config, the world.

``manifest.json`` is written by rank 0 as the last file of a checkpoint, once every rank
has written its part and after ``meta.json``, and before the directory is renamed into
place (the rename stays the commit). It lists every other file of the checkpoint with
its size and the digests of its 64 MiB chunks (chunks, so that one large file is hashed
and verified by several threads, or several ranks, at once)::

    {"version": 1, "algorithm": "blake2b", "chunk_bytes": 67108864, "step": 300,
     "committed_ns": ..., "parent": {"name": "step_00000200", "committed_ns": ...},
     "config_sha256": "...", "world": {"world_size": 4, "format": "dcp", "parallel": {...}},
     "files": {"meta.json": {"size": 2113, "chunks": ["9f2c..."]}, ...}}

Verification: ``quick`` checks the manifest itself, that every listed file is there with
its size, and the digest of ``meta.json`` (and the config hash): a few stat calls, no data
read. ``full`` also hashes every byte of every listed file. ``share=(r, n)`` hashes only
every n-th chunk from the r-th: n ranks verify one checkpoint together.

What this protects against: truncated or partially copied checkpoints, bit rot, a file
swapped between checkpoints, a hand-edited ``meta.json``. It is not a signature: whoever
can write a checkpoint can write a matching manifest. Loading never executes code
whatever the files hold (see docs/checkpointing.md, "Threat model").
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NoReturn

from framework import untrusted
from framework.checkpoint.io import write_durable
from framework.errors import DataError

MANIFEST = "manifest.json"
META = "meta.json"
VERSION = 1
ALGORITHM = "blake2b"  # 1.5-2x sha256 on CPUs without SHA extensions (benchmarks/checkpoint_io.py)
ALGORITHMS = ("blake2b", "sha256")
CHUNK = 64 << 20
# What a manifest read may declare: this framework writes CHUNK (tests 4 KiB). A crafted
# chunk_bytes of 1 would make every file that many chunks: the count is computed, never built,
# and the floor and the cap keep what verify iterates near what a real checkpoint holds.
MIN_CHUNK = 4096
MAX_CHUNKS = 1 << 22  # 256 TiB of 64 MiB chunks
_BLOCK = 8 << 20  # read size: one buffer per thread, reused
_HEX = re.compile(r"^[0-9a-f]{64}$")
_local = threading.local()


class CorruptCheckpoint(DataError):
    """A checkpoint whose files do not match its manifest (or whose manifest is unreadable)."""


def workers() -> int:
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover  (macOS)
        cpus = os.cpu_count() or 1
    return max(1, min(8, cpus))


def config_hash(config) -> str:
    """sha256 of the config as canonical JSON (sorted keys): equal configs, equal hashes."""
    text = json.dumps(config, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _hasher(algorithm: str):
    if algorithm == "blake2b":
        return hashlib.blake2b(digest_size=32)
    if algorithm == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown checksum algorithm {algorithm!r}")


def _buffer() -> memoryview:
    buf = getattr(_local, "buf", None)
    if buf is None:
        buf = _local.buf = memoryview(bytearray(_BLOCK))
    return buf


def hash_range(path: Path, offset: int, length: int, algorithm: str = ALGORITHM) -> str | None:
    """Digest of ``length`` bytes of ``path`` from ``offset``; None if the file is shorter."""
    h, buf = _hasher(algorithm), _buffer()
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        left = length
        while left:
            n = f.readinto(buf[: min(len(buf), left)])
            if not n:
                return None
            h.update(buf[:n])  # hashlib releases the GIL for large updates: threads scale
            left -= n
    return h.hexdigest()


def _count(size: int, chunk: int) -> int:
    """How many chunks ``_chunks(size, chunk)`` has, without building them (ceil in integers: a
    float division is inexact past 2**53)."""
    return -(-size // chunk) if size else 1


def _chunks(size: int, chunk: int) -> list[tuple[int, int]]:
    if size == 0:
        return [(0, 0)]
    return [(o, min(chunk, size - o)) for o in range(0, size, chunk)]


def _map(fn, items, threads: int):
    if threads <= 1 or len(items) <= 1:
        return [fn(*i) for i in items]
    with ThreadPoolExecutor(max_workers=min(threads, len(items)), thread_name_prefix="checkpoint-hash") as pool:
        return list(pool.map(lambda i: fn(*i), items))


def digest_files(
    directory: Path,
    names: list[str],
    *,
    algorithm: str = ALGORITHM,
    chunk: int | None = None,
    threads: int | None = None,
) -> dict[str, dict]:
    """``{name: {"size", "chunks"}}`` for files of ``directory`` (chunks hashed in parallel)."""
    directory, chunk = Path(directory), chunk or CHUNK
    sizes = {n: (directory / n).stat().st_size for n in names}
    items = [(n, o, ln) for n in names for o, ln in _chunks(sizes[n], chunk)]
    digests = _map(lambda n, o, ln: hash_range(directory / n, o, ln, algorithm), items, threads or workers())
    chunks: dict[str, list[str]] = {n: [] for n in names}
    for (n, _, _), d in zip(items, digests):
        if d is None:
            raise OSError(f"{directory / n} changed while it was hashed")
        chunks[n].append(d)
    return {n: {"size": sizes[n], "chunks": chunks[n]} for n in names}


def files_of(directory: Path) -> list[str]:
    """Every file under ``directory`` but the manifest, as sorted relative POSIX paths."""
    directory = Path(directory)
    return sorted(
        p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST
    )


def build(directory: Path, meta: dict, *, world: dict, algorithm: str = ALGORITHM, threads: int | None = None) -> dict:
    """The manifest of a checkpoint directory whose files (``meta.json`` included) are written."""
    return {
        "version": VERSION,
        "algorithm": algorithm,
        "chunk_bytes": CHUNK,
        "step": meta.get("step"),
        "committed_ns": meta.get("committed_ns"),
        "parent": meta.get("parent"),
        "config_sha256": config_hash(meta.get("config")),
        "world": world,
        "files": digest_files(directory, files_of(directory), algorithm=algorithm, chunk=CHUNK, threads=threads),
    }


def write(directory: Path, manifest: dict) -> None:
    write_durable(json.dumps(manifest, indent=1).encode(), Path(directory) / MANIFEST)


def read(directory: Path) -> dict | None:
    """The manifest of ``directory``; None if it has none (written before manifests)."""
    path = Path(directory) / MANIFEST
    try:  # untrusted: a named pipe or a link to /dev/zero is refused, not read without end
        m = untrusted.read_json(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise CorruptCheckpoint(
            f"checkpoint {directory} is corrupt: {MANIFEST} cannot be read ({e.strerror or e})"
        ) from None
    except ValueError as e:  # untrusted.BadFile: not a regular file, too large, not JSON, nested too deep
        raise CorruptCheckpoint(f"checkpoint {directory} is corrupt: {MANIFEST} cannot be read ({e})") from None
    _check_schema(directory, m)
    return m


def _safe_name(name) -> bool:
    if not isinstance(name, str) or not name or name.startswith("/") or "\\" in name:
        return False
    return all(part not in ("", ".", "..") for part in name.split("/"))


def _check_schema(directory, m) -> None:
    def bad(why) -> NoReturn:
        raise CorruptCheckpoint(f"checkpoint {directory} is corrupt: {MANIFEST} {why}")

    if not isinstance(m, dict):
        bad("is not an object")
    if m.get("version") != VERSION:
        bad(f"has version {m.get('version')!r}; this framework reads version {VERSION}")
    if m.get("algorithm") not in ALGORITHMS:
        bad(f"names an unknown checksum algorithm {m.get('algorithm')!r}")
    chunk = m.get("chunk_bytes")
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < MIN_CHUNK:
        bad(f"has no valid chunk_bytes (at least {MIN_CHUNK})")
    files = m.get("files")
    if not isinstance(files, dict) or META not in files:
        bad(f"lists no files (or not {META})")
    total = 0
    for name, entry in files.items():
        if not _safe_name(name):
            bad(f"lists a file outside the checkpoint: {name!r}")
        size = entry.get("size") if isinstance(entry, dict) else None
        chunks = entry.get("chunks") if isinstance(entry, dict) else None
        if (
            not isinstance(size, int)
            or isinstance(size, bool)
            or size < 0
            or not isinstance(chunks, list)
            or len(chunks) != _count(size, chunk)
            or not all(isinstance(c, str) and _HEX.match(c) for c in chunks)
        ):
            bad(f"has a malformed entry for {name}")
        total += len(chunks)
        if total > MAX_CHUNKS:
            bad(f"lists more than {MAX_CHUNKS} chunks")


def verify(
    directory: Path,
    manifest: dict,
    meta: dict | None,
    *,
    full: bool,
    share: tuple[int, int] = (0, 1),
    threads: int | None = None,
) -> None:
    """Check ``directory`` against ``manifest``; a mismatch is one-line CorruptCheckpoint.

    Always: every listed file exists with its size, ``meta.json`` matches its digest, the
    step and the config hash match ``meta``. ``full``: every chunk of every file (this
    rank's share of them when ``share=(rank, ranks)``).
    """
    directory = Path(directory)
    files, algorithm, chunk = manifest["files"], manifest["algorithm"], manifest["chunk_bytes"]
    for name, entry in sorted(files.items()):
        path = directory / name
        try:
            st = path.stat()
        except FileNotFoundError:
            raise CorruptCheckpoint(f"checkpoint {directory} is incomplete: {name} is missing") from None
        if not stat.S_ISREG(st.st_mode):  # a named pipe would block the hashing, a device never end
            raise CorruptCheckpoint(f"checkpoint {directory} is corrupt: {name} is not a regular file")
        have = st.st_size
        if have != entry["size"]:
            raise CorruptCheckpoint(
                f"checkpoint {directory} is corrupt: {name} has {have} bytes, its manifest says {entry['size']}"
            )
    items = [
        (name, i, o, ln)
        for name, entry in sorted(files.items())
        for i, (o, ln) in enumerate(_chunks(entry["size"], chunk))
    ]
    if full:
        rank, ranks = share
        mine = [it for k, it in enumerate(items) if k % ranks == rank]
    else:
        mine = [it for it in items if it[0] == META]
    if META not in [it[0] for it in mine]:
        mine += [it for it in items if it[0] == META]  # every rank checks meta.json: it reads it
    digests = _map(lambda n, i, o, ln: hash_range(directory / n, o, ln, algorithm), mine, threads or workers())
    for (name, i, o, ln), d in zip(mine, digests):
        if d != files[name]["chunks"][i]:
            where = f" (bytes {o}-{o + ln})" if len(files[name]["chunks"]) > 1 else ""
            raise CorruptCheckpoint(f"checkpoint {directory} is corrupt: {name} does not match its checksum{where}")
    if meta is not None:
        if manifest.get("step") != meta.get("step"):
            raise CorruptCheckpoint(
                f"checkpoint {directory} is corrupt: {MANIFEST} is of step "
                f"{manifest.get('step')}, {META} of step {meta.get('step')}"
            )
        if manifest.get("config_sha256") != config_hash(meta.get("config")):
            raise CorruptCheckpoint(
                f"checkpoint {directory} is corrupt: the config in {META} does not match the hash in {MANIFEST}"
            )


def listed(manifest: dict | None, name: str) -> bool:
    """``name`` is part of the checkpoint (always true without a manifest: nothing to check)."""
    return manifest is None or name in manifest["files"]
