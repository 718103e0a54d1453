"""On-disk layout of the weather data (StormCast's HRRR/ERA5, StormScope's state/background), in one place.

The layout mirrors the one NVIDIA's StormCast recipe reads (one zarr store per
year and source, an invariants store, per-channel statistics as ``.npy``),
simplified to plain zarr v3 groups so that no xarray is needed (shown with
StormCast's names)::

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
                                ``recipes.weather.synthetic``: the parameters
                                they were written with (also marks the store as
                                complete)

StormScope's stores are the same but for the names of the two time-series sources
(:class:`Naming`): ``<root>/state/<year>.zarr`` holds the nowcast state (GOES ABI brightness
temperatures, MRMS reflectivity), ``<root>/background/<year>.zarr`` the coarse background on
the same grid, and the statistics are ``<root>/stats/state_{means,stds}.npy`` and
``background_{means,stds}.npy``.

Chunking: the time-series ``data`` arrays are chunked ``(1, channel_chunk, row_chunk, x)``
(``row_chunk`` defaults to 16, ``channel_chunk`` to 1), so one sample of a channel is a few
whole-row chunks and a domain-parallel rank that owns a band of rows reads only that
band's chunks. The synthetic writer puts all of a store's channels in one chunk: its
tiny samples would otherwise cost more in zarr's per-chunk overhead than in reading.
The invariants are chunked
``(1, row_chunk, x)``; ``time`` is a single chunk. Writers may group those
chunks into zarr v3 shards (the synthetic writer does, to keep the file count
low); a shard never changes what a reader sees, and a row-band read still
fetches only the inner chunks it needs (by byte range).

Every name and path a reader or writer needs comes from this module, for both
layouts the dataset reads: this one (``native``) and the one NVIDIA PhysicsNeMo's
StormCast recipe writes (``physicsnemo``, at the end of the module; StormCast's names only).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

HRRR = "hrrr"
ERA5 = "era5"
SOURCES = (HRRR, ERA5)


@dataclass(frozen=True)
class Naming:
    """What a recipe calls the two time-series sources of a sample: the state (the field the model
    predicts) and the coarse background that forces it. The dataset, the synthetic writer and the
    tasks are one code for both; this says which data config keys hold the channel lists (also the
    keys of an export's ``channels`` and of a synthetic manifest), which folders under the root
    hold the year stores (also the prefixes of the statistics files) and what messages call them."""

    recipe: str
    keys: tuple[str, str]  # data config keys of the state and background channel lists
    stores: tuple[str, str]  # their folders under the root
    labels: tuple[str, str]  # their names in messages

    @property
    def channel_keys(self) -> tuple[str, str, str]:
        return (*self.keys, "invariants")

    def label(self, store: str) -> str:
        return self.labels[self.stores.index(store)]


STORMCAST = Naming("StormCast", ("hrrr_channels", "era5_channels"), (HRRR, ERA5), ("HRRR", "ERA5"))
# StormScope: GOES satellite + MRMS radar channels as the nowcast state, the coarse background
STORMSCOPE = Naming(
    "StormScope", ("state_channels", "background_channels"), ("state", "background"), ("state", "background")
)
NAMINGS = (STORMCAST, STORMSCOPE)
STORES = tuple(s for n in NAMINGS for s in n.stores)


def naming_of(data) -> Naming:
    """The naming whose state key ``data`` has: a data config node (dataclass or DictConfig), a dict
    (a checkpoint's ``data`` node, an export's ``channels``, a synthetic manifest). StormCast's when
    it has neither (what every config recorded before StormScope had its own keys)."""
    has = data.__contains__ if isinstance(data, Mapping) else lambda k: hasattr(data, k)
    return STORMSCOPE if has(STORMSCOPE.keys[0]) else STORMCAST


def channel_lists(data) -> dict[str, list[str]]:
    """``{"state": [...], "background": [...], "invariants": [...]}`` of ``data`` (as for
    :func:`naming_of`) under its naming's keys; an absent background or invariants list is empty,
    an absent state list a KeyError."""
    state, background, invariants = naming_of(data).channel_keys
    get = data.get if isinstance(data, Mapping) else lambda k, d=None: getattr(data, k, d)
    if get(state) is None:
        raise KeyError(state)
    return {
        "state": list(get(state)),
        "background": list(get(background) or []),
        "invariants": list(get(invariants) or []),
    }


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
    """``<root>/<source>/<year>.zarr`` for ``source`` in :data:`STORES` (a naming's store folder)."""
    if source not in STORES:
        raise ValueError(f"unknown source {source!r}; expected one of {STORES}")
    return Path(root) / source / f"{int(year)}.zarr"


def invariants_store(root: str | Path) -> Path:
    """``<root>/invariants.zarr``."""
    return Path(root) / INVARIANTS_STORE


def stats_file(root: str | Path, source: str, kind: str) -> Path:
    """``<root>/stats/<source>_<kind>.npy``, ``source`` in :data:`STORES`, ``kind`` in ``("means", "stds")``."""
    if source not in STORES:
        raise ValueError(f"unknown source {source!r}; expected one of {STORES}")
    if kind not in STAT_KINDS:
        raise ValueError(f"unknown stats kind {kind!r}; expected one of {STAT_KINDS}")
    return Path(root) / STATS_DIR / f"{source}_{kind}.npy"


def manifest_file(root: str | Path) -> Path:
    """``<root>/synthetic.json`` (synthetic stores only)."""
    return Path(root) / SYNTHETIC_MANIFEST


def time_series_chunks(
    height: int, width: int, row_chunk: int = DEFAULT_ROW_CHUNK, channel_chunk: int = 1
) -> tuple[int, int, int, int]:
    """Chunk shape of a ``(time, channel, y, x)`` data array."""
    return (1, max(1, int(channel_chunk)), max(1, min(int(row_chunk), int(height))), int(width))


def invariants_chunks(height: int, width: int, row_chunk: int = DEFAULT_ROW_CHUNK) -> tuple[int, int, int]:
    """Chunk shape of the ``(channel, y, x)`` invariants array."""
    return (1, max(1, min(int(row_chunk), int(height))), int(width))


# ----------------------------------------------------------------- layouts

NATIVE = "native"
PHYSICSNEMO = "physicsnemo"
LAYOUTS = (NATIVE, PHYSICSNEMO)
LAYOUT_CHOICES = ("auto",) + LAYOUTS

# ----------------------------------------------------------------- the PhysicsNeMo layout
#
# What PhysicsNeMo's StormCast recipe (``HrrrEra5Dataset``) reads under its
# ``location``; the reader is :mod:`recipes.weather.physicsnemo_layout`::
#
#     <root>/era5/stats/means.npy, stds.npy        1-D, one value per ERA5 store channel
#     <root>/era5/**/<year>.zarr                   found recursively (train/, valid/)
#         data       (time, channel, latitude, longitude)  on a regular 1-D lat/lon grid
#         time       datetime64 coordinate (CF-encoded: "<unit> since <date>")
#         channel    string coordinate; latitude, longitude 1-D coordinates
#     <root>/<conus_dataset_name>/                 default "hrrr_v3"
#         invariants.zarr     HRRR_invariants (channel, y, x), string coordinate channel
#         <hrrr_stats>/means.npy, stds.npy         default "stats_v3_2019_2021"; 1-D, HRRR store order
#         **/<year>.zarr      HRRR (time, channel, y, x); time, channel; latitude, longitude (y, x)
#     <root>/missing_samples_<conus_dataset_name>.npy   hours to skip: an object array of
#                                                      datetimes (a pickle) or datetime64
#
# Stores are zarr v2 with consolidated metadata and xarray's ``_ARRAY_DIMENSIONS``
# attribute naming each array's dimensions.

PN_ERA5_DIR = "era5"
PN_STATS_DIR = "stats"
PN_CONUS_DATASET = "hrrr_v3"
PN_HRRR_STATS = "stats_v3_2019_2021"
PN_HRRR_VAR = "HRRR"
PN_ERA5_VAR = "data"
PN_INVARIANTS_STORE = "invariants.zarr"
PN_INVARIANTS_VAR = "HRRR_invariants"
PN_TIME = "time"
PN_CHANNEL = "channel"
PN_LAT = "latitude"
PN_LON = "longitude"
PN_DIMS_ATTR = "_ARRAY_DIMENSIONS"
PN_HRRR_DIMS = ("time", "channel", "y", "x")
PN_ERA5_DIMS = ("time", "channel", "latitude", "longitude")
PN_INVARIANTS_DIMS = ("channel", "y", "x")
PN_TRAIN_DIR = "train"
PN_VALID_DIR = "valid"


def pn_hrrr_dir(root: str | Path, conus_dataset_name: str = PN_CONUS_DATASET) -> Path:
    """``<root>/<conus_dataset_name>``: the HRRR year stores (in any sub-folder), invariants, stats."""
    return Path(root) / conus_dataset_name


def pn_era5_dir(root: str | Path) -> Path:
    """``<root>/era5``: the ERA5 year stores (in any sub-folder) and ``stats/``."""
    return Path(root) / PN_ERA5_DIR


def pn_invariants_store(root: str | Path, conus_dataset_name: str = PN_CONUS_DATASET) -> Path:
    return pn_hrrr_dir(root, conus_dataset_name) / PN_INVARIANTS_STORE


def pn_stats_file(
    root: str | Path,
    source: str,
    kind: str,
    conus_dataset_name: str = PN_CONUS_DATASET,
    hrrr_stats: str = PN_HRRR_STATS,
) -> Path:
    """``<root>/era5/stats/<kind>.npy`` or ``<root>/<conus_dataset_name>/<hrrr_stats>/<kind>.npy``."""
    if kind not in STAT_KINDS:
        raise ValueError(f"unknown stats kind {kind!r}; expected one of {STAT_KINDS}")
    if source == HRRR:
        return pn_hrrr_dir(root, conus_dataset_name) / hrrr_stats / f"{kind}.npy"
    if source == ERA5:
        return pn_era5_dir(root) / PN_STATS_DIR / f"{kind}.npy"
    raise ValueError(f"unknown source {source!r}; expected one of {SOURCES}")


def pn_missing_samples_file(root: str | Path, conus_dataset_name: str = PN_CONUS_DATASET) -> Path:
    """``<root>/missing_samples_<conus_dataset_name>.npy`` (optional)."""
    return Path(root) / f"missing_samples_{conus_dataset_name}.npy"
