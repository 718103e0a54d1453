"""On-disk layout of the StormCast HRRR/ERA5 data, in one place.

The layout mirrors the one NVIDIA's StormCast recipe reads (one zarr store per
year and source, an invariants store, per-channel statistics as ``.npy``),
simplified to plain zarr v3 groups so that no xarray is needed::

    <root>/hrrr/<year>.zarr     zarr group
        data   float32 (time, channel, y, x)   HRRR state
        time   int64   (time,)                 hours since 1970-01-01 00:00 UTC,
                                               strictly increasing
        attrs  {"channels": [name, ...]}       one name per data channel, in order
    <root>/era5/<year>.zarr     same layout; the ERA5 background already
                                regridded onto the HRRR grid (same y, x)
    <root>/invariants.zarr      zarr group
        data   float32 (channel, y, x)
        attrs  {"channels": [name, ...]}
    <root>/stats/hrrr_means.npy, hrrr_stds.npy, era5_means.npy, era5_stds.npy
                                1-D float arrays, one value per *store* channel,
                                in store channel order (the order of the
                                "channels" attribute)
    <root>/synthetic.json       only in stores written by
                                ``recipes.stormcast.synthetic``: the parameters
                                they were written with (also marks the store as
                                complete)

Chunking: the time-series ``data`` arrays are chunked ``(1, 1, row_chunk, x)``
(``row_chunk`` defaults to 16), so one sample of one channel is a few whole-row
chunks and a domain-parallel rank that owns a band of rows reads only that
band's chunks, one channel at a time. The invariants are chunked
``(1, row_chunk, x)``; ``time`` is a single chunk. Writers may group those
chunks into zarr v3 shards (the synthetic writer does, to keep the file count
low); a shard never changes what a reader sees, and a row-band read still
fetches only the inner chunks it needs (by byte range).

Every name and path a reader or writer needs comes from this module.
"""

from __future__ import annotations

from pathlib import Path

HRRR = "hrrr"
ERA5 = "era5"
SOURCES = (HRRR, ERA5)

DATA_VAR = "data"
TIME_VAR = "time"
CHANNELS_ATTR = "channels"
TIME_UNITS = "hours since 1970-01-01 00:00:00 UTC"

INVARIANTS_STORE = "invariants.zarr"
STATS_DIR = "stats"
STAT_KINDS = ("means", "stds")
SYNTHETIC_MANIFEST = "synthetic.json"

DEFAULT_ROW_CHUNK = 16

TIME_SERIES_DIMS = ("time", "channel", "y", "x")
INVARIANTS_DIMS = ("channel", "y", "x")


def year_store(root: str | Path, source: str, year: int) -> Path:
    """``<root>/<source>/<year>.zarr`` for ``source`` in :data:`SOURCES`."""
    if source not in SOURCES:
        raise ValueError(f"unknown source {source!r}; expected one of {SOURCES}")
    return Path(root) / source / f"{int(year)}.zarr"


def invariants_store(root: str | Path) -> Path:
    """``<root>/invariants.zarr``."""
    return Path(root) / INVARIANTS_STORE


def stats_file(root: str | Path, source: str, kind: str) -> Path:
    """``<root>/stats/<source>_<kind>.npy``, ``kind`` in ``("means", "stds")``."""
    if source not in SOURCES:
        raise ValueError(f"unknown source {source!r}; expected one of {SOURCES}")
    if kind not in STAT_KINDS:
        raise ValueError(f"unknown stats kind {kind!r}; expected one of {STAT_KINDS}")
    return Path(root) / STATS_DIR / f"{source}_{kind}.npy"


def manifest_file(root: str | Path) -> Path:
    """``<root>/synthetic.json`` (synthetic stores only)."""
    return Path(root) / SYNTHETIC_MANIFEST


def time_series_chunks(height: int, width: int, row_chunk: int = DEFAULT_ROW_CHUNK) -> tuple[int, int, int, int]:
    """Chunk shape of a ``(time, channel, y, x)`` data array."""
    return (1, 1, max(1, min(int(row_chunk), int(height))), int(width))


def invariants_chunks(height: int, width: int, row_chunk: int = DEFAULT_ROW_CHUNK) -> tuple[int, int, int]:
    """Chunk shape of the ``(channel, y, x)`` invariants array."""
    return (1, max(1, min(int(row_chunk), int(height))), int(width))
