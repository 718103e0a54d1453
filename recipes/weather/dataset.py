"""Paired HRRR/ERA5 samples for StormCast, read from either data layout of :mod:`recipes.weather.layout`
(and StormScope's state/background samples, read from the native layout under its names).

One sample is an hourly pair ``(t, t + dt)``:

* ``state``      ``(C_hrrr, H, W)``  HRRR at ``t``
* ``target``     ``(C_hrrr, H, W)``  HRRR at ``t + dt``
* ``background`` ``(C_era5, H, W)``  ERA5 at ``t`` (``background_time="input"``, the default and
  PhysicsNeMo's choice) or at ``t + dt`` (``background_time="target"``)
* ``invariants`` ``(C_inv, H, W)``
* ``index``      the sample index (int)

All tensors are float32.

Layouts (``layout``): ``native`` (ours: ``<root>/hrrr/<year>.zarr`` etc.) or ``physicsnemo``
(the layout NVIDIA PhysicsNeMo's StormCast recipe reads: year stores found recursively,
variables ``HRRR`` / ``data`` with xarray coordinates, ERA5 on a regular lat/lon grid
interpolated linearly onto the HRRR points, a missing-samples file, the region
``[0:H, 0:W]`` of a larger HRRR grid); ``auto`` (default) tells them apart by the files under
``root`` (:func:`recipes.weather.physicsnemo_layout.detect_layout`).

Which pairs exist. State hours ``t`` are taken from the stores of ``years`` (in the order
given, then by time); a pair is kept if the HRRR stores hold ``t + dt`` and the ERA5 stores
the background hour. In the ``physicsnemo`` layout, as in the reference, the target and the
background may come from the next year's store (found under the same folder even if that
year is not in ``years``), ``t`` runs from Jan 1 00:00 of the first year (Aug 1 01:00 for
2018) to Dec 31 23:00 of the last (Dec 15 00:00 for 2022), and ``t`` is skipped when ``t``
or ``t + dt`` is in the missing-samples file. In the ``native`` layout only the stores of
``years`` are opened, so a pair crosses a year boundary only between two listed years
whose hours are contiguous; gaps in the record drop the pairs that would span them.

StormScope (``naming=layout.STORMSCOPE``) reads the same native layout with its own names
(:class:`recipes.weather.layout.Naming`): the state from ``<root>/state/<year>.zarr`` (GOES
satellite and MRMS radar channels), the background from ``<root>/background/<year>.zarr``,
the statistics from ``<root>/stats/state_*.npy`` and ``background_*.npy``; below, read "HRRR"
as its state and "ERA5" as its background. The PhysicsNeMo layout is StormCast's only.

Channels are selected by name, in any order and any subset. With ``normalize=True`` HRRR
and ERA5 channels are z-scored with the per-channel statistics files (one value per *store*
channel, in store order); invariants follow ``invariant_norm``: ``zscore`` (each by its own
spatial mean and standard deviation over the region; a constant one is only centred) or
``none`` (raw, as PhysicsNeMo returns them). With ``normalize=False`` every field is
returned in store units.

Stores are opened lazily, on the first read in each process, and open handles (and the
interpolation weights, rebuilt from the coordinates) are dropped when pickling, so the
dataset travels cheaply to DataLoader workers (spawn or forkserver). The constructor calls
:meth:`validate`, which checks paths, channels, statistics, time axes, grids and coverage
without reading sample data. Unusable data raise :class:`framework.errors.DataError` with
one line naming the file and the variable.
"""

from __future__ import annotations

import io
import math
import operator
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import zarr
from torch.utils.data import Dataset

from framework import untrusted
from framework.errors import ConfigError, DataError, first_line
from recipes.weather import layout
from recipes.weather import physicsnemo_layout as pn
from recipes.weather.layout import LAYOUT_CHOICES, PHYSICSNEMO, STORMCAST

BACKGROUND_TIMES = ("input", "target")
INVARIANT_NORMS = ("zscore", "none")


def _open_group(path: Path, what: str):
    if not path.exists():
        raise DataError(f"{path}: {what} store not found")
    try:
        return zarr.open_group(str(path), mode="r")
    except Exception as exc:  # zarr raises several types for "not a group"
        raise DataError(f"{path}: cannot open the {what} store as a zarr group ({type(exc).__name__}: {exc})") from None


def checked_array(group, path: Path, name: str, ndim: int):
    """Variable ``name`` of ``group``: a zarr array of ``ndim`` dimensions whose declared chunks and
    grid a read can afford (``_check_chunks``, ``MAX_GRID_POINTS``); else one DataError line."""
    try:
        arr = group[name] if name in group else None
    except Exception as exc:
        raise DataError(f"{path}: cannot open variable '{name}' ({type(exc).__name__}: {exc})") from None
    if not isinstance(arr, zarr.Array):
        raise DataError(f"{path}: variable '{name}' not found")
    if arr.ndim != ndim:
        raise DataError(f"{path}: variable '{name}' has {arr.ndim} dimensions {arr.shape}, expected {ndim}")
    _check_chunks(arr, path, name)
    if ndim >= 2 and math.prod(arr.shape[-2:]) > MAX_GRID_POINTS:  # a region of it is read whole
        raise DataError(
            f"{path}: variable '{name}' has a grid of {tuple(arr.shape[-2:])} points (at most {MAX_GRID_POINTS})"
        )
    return arr


MAX_GRID_POINTS = 1 << 30  # rows x cols: 32768 x 32768, a 1.2 km grid round the globe
MAX_CHUNK_BYTES = 4 << 30  # one chunk, decoded whole by every read that touches it
MAX_CHUNKS_PER_SHARD = 1 << 24  # a shard's index (16 bytes per chunk) is read whole


def _check_chunks(arr, path: Path, name: str) -> None:
    """A read decodes every chunk it touches whole (and a shard's chunk index whole): a store from
    someone else can declare any chunk shape, so one that would make a read allocate more than
    ``MAX_CHUNK_BYTES`` is refused in one line before any read."""
    chunk = math.prod(arr.chunks) * arr.dtype.itemsize
    if chunk > MAX_CHUNK_BYTES:
        raise DataError(
            f"{path}: variable '{name}' has chunks {tuple(arr.chunks)} of {chunk} bytes each (at most "
            f"{MAX_CHUNK_BYTES} are decoded per chunk; rechunk the store)"
        )
    shards = getattr(arr, "shards", None)  # zarr >= 3: the outer chunks of a sharded array
    if shards is not None and math.prod(shards) // max(math.prod(arr.chunks), 1) > MAX_CHUNKS_PER_SHARD:
        raise DataError(
            f"{path}: variable '{name}' has shards {tuple(shards)} of more than {MAX_CHUNKS_PER_SHARD} chunks "
            f"{tuple(arr.chunks)} each"
        )


def _store_channels(group, path: Path, n_data_channels: int) -> list[str]:
    names = group.attrs.get(layout.CHANNELS_ATTR)
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise DataError(f"{path}: group attribute '{layout.CHANNELS_ATTR}' missing or not a list of names")
    if len(names) != n_data_channels:
        raise DataError(
            f"{path}: attribute '{layout.CHANNELS_ATTR}' names {len(names)} channels but variable "
            f"'{layout.DATA_VAR}' has {n_data_channels}"
        )
    _check_names(names, path, f"attribute '{layout.CHANNELS_ATTR}'")
    if len(set(names)) != len(names):
        raise DataError(f"{path}: attribute '{layout.CHANNELS_ATTR}' has duplicate names: {names}")
    return names


def _check_names(names: list[str], path: Path, what: str) -> None:
    """Channel names go into error lines and logs: one line each, no control characters."""
    bad = next((n for n in names if not n.isprintable() or len(n) > 256), None)
    if bad is not None:
        raise DataError(f"{path}: {what} holds a channel name that is not a short printable string: {bad[:64]!r}")


def _coord_channels(group, path: Path, var: str, n_data_channels: int) -> list[str]:
    arr = checked_array(group, path, layout.PN_CHANNEL, 1)
    if arr.shape[0] != n_data_channels:  # before it is read: its declared shape can be anything
        raise DataError(
            f"{path}: coordinate '{layout.PN_CHANNEL}' names {arr.shape[0]} channels but variable "
            f"'{var}' has {n_data_channels}"
        )
    values = pn.coordinate_values(arr, path, layout.PN_CHANNEL)
    names = [v.decode(errors="replace") if isinstance(v, bytes) else str(v) for v in values.tolist()]
    _check_names(names, path, f"coordinate '{layout.PN_CHANNEL}'")
    if len(set(names)) != len(names):
        raise DataError(f"{path}: coordinate '{layout.PN_CHANNEL}' has duplicate names: {names}")
    return names


def _select(requested: Sequence[str], available: Sequence[str], path: Path, var: str = layout.DATA_VAR) -> np.ndarray:
    index = []
    for name in requested:
        if name not in available:
            raise DataError(f"{path}: channel '{name}' not in variable '{var}'; available: {', '.join(available)}")
        index.append(available.index(name))
    return np.asarray(index, dtype=np.int64)


def _load_stats(
    paths: dict[str, Path], store: Path, var: str, n_channels: int, names: Sequence[str]
) -> tuple[np.ndarray, np.ndarray]:
    out = []
    for kind in layout.STAT_KINDS:
        path = paths[kind]
        if not path.exists():
            raise DataError(f"{path}: statistics file not found")
        try:
            # a regular file of bounded size (a named pipe or a link to a device would hang or fill memory)
            values = np.load(io.BytesIO(untrusted.read_bytes(path)), allow_pickle=False)
        except Exception as exc:
            raise DataError(f"{path}: cannot read statistics ({type(exc).__name__}: {exc})") from None
        if not isinstance(values, np.ndarray):  # np.load reads a zip (.npz) as an archive of arrays
            raise DataError(f"{path}: expected a .npy array, found a {type(values).__name__}")
        if values.ndim > 1 and values.size == values.shape[0]:  # (C, 1, 1): one value per channel too
            values = values.reshape(-1)
        if values.ndim != 1 or not np.issubdtype(values.dtype, np.number):
            raise DataError(f"{path}: expected a 1-D numeric array, got shape {values.shape} dtype {values.dtype}")
        if len(values) != n_channels:
            raise DataError(f"{path}: has {len(values)} values but {store} variable '{var}' has {n_channels} channels")
        values = values.astype(np.float64)
        bad = ~np.isfinite(values) if kind == "means" else ~(np.isfinite(values) & (values > 0))
        if bad.any():
            c = int(np.flatnonzero(bad)[0])
            what = "non-finite" if kind == "means" else "non-positive or non-finite"
            raise DataError(f"{path}: {what} value {values[c]} for channel '{names[c]}'")
        out.append(values)
    return out[0], out[1]


def _check_time(group, path: Path, n_data_times: int, year: int, dt: int) -> np.ndarray:
    arr = checked_array(group, path, layout.TIME_VAR, 1)
    if not np.issubdtype(arr.dtype, np.integer):
        raise DataError(
            f"{path}: variable '{layout.TIME_VAR}' has dtype {arr.dtype}, expected integer hours since 1970"
        )
    if arr.shape[0] != n_data_times:  # before it is read: its declared shape can be anything
        raise DataError(
            f"{path}: variable '{layout.TIME_VAR}' has {arr.shape[0]} entries but '{layout.DATA_VAR}' has "
            f"{n_data_times} times"
        )
    hours = pn.coordinate_values(arr, path, layout.TIME_VAR).astype(np.int64)  # integer: checked above
    if len(hours) < dt + 1:
        raise DataError(
            f"{path}: variable '{layout.TIME_VAR}' has only {len(hours)} hours for year {year}; "
            f"need at least dt+1={dt + 1}"
        )
    if np.any(np.diff(hours) <= 0):
        k = int(np.flatnonzero(np.diff(hours) <= 0)[0])
        raise DataError(f"{path}: variable '{layout.TIME_VAR}' is not strictly increasing at index {k + 1}")
    return hours


def _check_dims(arr, path: Path, var: str, expected: tuple[str, ...], strict_from: int) -> None:
    """xarray's dimension names, when present, must be ``expected`` (all of them from index
    ``strict_from`` on; the names before it may be anything, e.g. HRRR's y/x)."""
    dims = pn.array_dims(arr)
    if dims is None:
        return
    if len(dims) != len(expected) or dims[:strict_from] != expected[:strict_from]:
        raise DataError(f"{path}: variable '{var}' has dimensions {list(dims)}, expected {list(expected)}")


class _Lookup:
    """Where each hour of a source is: (store slot, time index), over all its open stores."""

    def __init__(self, times: list[np.ndarray], paths: list[Path], var: str):
        hours = np.concatenate(times) if times else np.zeros(0, dtype=np.int64)
        slot = np.concatenate([np.full(len(t), k, dtype=np.int64) for k, t in enumerate(times)])
        tidx = np.concatenate([np.arange(len(t), dtype=np.int64) for t in times])
        order = np.argsort(hours, kind="stable")
        self.hours, self.slot, self.tidx = hours[order], slot[order], tidx[order]
        dup = np.flatnonzero(np.diff(self.hours) == 0)
        if len(dup):
            k = dup[0]
            a, b = paths[int(self.slot[k])], paths[int(self.slot[k + 1])]
            when = np.datetime64(int(self.hours[k]), "h")
            raise DataError(f"{b}: variable '{var}' holds hour {when}, which {a} holds too")

    def find(self, hours: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(found mask, slot, time index) of ``hours``."""
        pos = np.minimum(np.searchsorted(self.hours, hours), max(len(self.hours) - 1, 0))
        if not len(self.hours):
            return np.zeros(len(hours), dtype=bool), pos, pos
        ok = self.hours[pos] == hours
        return ok, self.slot[pos], self.tidx[pos]


class HrrrEra5Dataset(Dataset):
    """HRRR state/target pairs with the ERA5 background and invariants (see the module docstring).

    Args:
        root: store root (either layout of :mod:`recipes.weather.layout`).
        years: years of the state hours, in sample order.
        state_channels, background_channels, invariants: channel names to select, in the order wanted
            (StormCast's HRRR and ERA5 channels, StormScope's state and background channels).
        dt: lead time in hours (target is ``t + dt``).
        normalize: z-score the fields (see the module docstring).
        layout: ``auto`` (detect), ``native`` or ``physicsnemo``.
        background_time: ``input`` (ERA5 at ``t``) or ``target`` (ERA5 at ``t + dt``).
        grid: ``(rows, cols)`` of the training region. ``physicsnemo``: the region ``[0:rows,
            0:cols]`` of the HRRR grid (None: all of it); ``native``: must equal the stores' grid.
        invariant_norm: ``zscore`` or ``none`` (raw).
        conus_dataset_name, hrrr_stats: the ``physicsnemo`` layout's HRRR folder and its stats
            folder (the reference's defaults).
        naming: whose names the stores and messages use (:data:`recipes.weather.layout.STORMCAST`,
            the default, or ``STORMSCOPE``).
    """

    def __init__(
        self,
        root: str | Path,
        years: Sequence[int],
        state_channels: Sequence[str],
        background_channels: Sequence[str],
        invariants: Sequence[str],
        dt: int = 1,
        normalize: bool = True,
        *,
        layout: str = "auto",
        background_time: str = "input",
        grid: Sequence[int] | None = None,
        invariant_norm: str = "zscore",
        conus_dataset_name: str = layout.PN_CONUS_DATASET,
        hrrr_stats: str = layout.PN_HRRR_STATS,
        naming: layout.Naming = layout.STORMCAST,
    ):
        self.root = Path(root)
        if isinstance(years, (int, np.integer)):
            years = [years]
        self.years = [int(y) for y in years]
        self.dt = int(dt)
        self.normalize = bool(normalize)
        self.requested_layout = str(layout)
        self.background_time = str(background_time)
        self.invariant_norm = str(invariant_norm)
        self.conus_dataset_name = str(conus_dataset_name)
        self.hrrr_stats = str(hrrr_stats)
        self.naming = naming
        self._state, self._background = self._sources = naming.stores  # the two time-series sources
        self._grid_request = None if grid is None else (int(grid[0]), int(grid[1]))
        self._names = {
            self._state: [str(c) for c in state_channels],
            self._background: [str(c) for c in background_channels],
            "invariants": [str(c) for c in invariants],
        }
        if not self.years:
            raise ConfigError("HrrrEra5Dataset: no years given")
        if len(set(self.years)) != len(self.years):
            raise ConfigError(f"HrrrEra5Dataset: duplicate years {self.years}")
        if self.dt < 1:
            raise ConfigError(f"HrrrEra5Dataset: dt must be >= 1 hour, got {dt}")
        if not self._names[self._state]:
            raise ConfigError(f"HrrrEra5Dataset: no {naming.label(self._state)} channels selected")
        for kind, names in self._names.items():
            if len(set(names)) != len(names):
                raise ConfigError(f"HrrrEra5Dataset: duplicate {kind} channels {names}")
        for key, value, choices in (
            ("layout", self.requested_layout, LAYOUT_CHOICES),
            ("background_time", self.background_time, BACKGROUND_TIMES),
            ("invariant_norm", self.invariant_norm, INVARIANT_NORMS),
        ):
            if value not in choices:
                raise ConfigError(f"HrrrEra5Dataset: {key} must be one of {', '.join(choices)} (got {value!r})")
        if naming is not STORMCAST and self.requested_layout == PHYSICSNEMO:  # (``layout`` is the argument here)
            raise ConfigError(
                f"HrrrEra5Dataset: the {PHYSICSNEMO} layout is StormCast's; {naming.recipe} reads the native one"
            )
        if self._grid_request is not None and min(self._grid_request) <= 0:
            raise ConfigError(f"HrrrEra5Dataset: grid must be positive, got {list(grid)}")
        self._handles = None
        self._interp = None
        self.validate()

    @classmethod
    def from_config(cls, data, years: Sequence[int], **overrides) -> HrrrEra5Dataset:
        """The dataset a ``data`` config node (:class:`recipes.weather.config.HrrrEra5DataConfig`)
        describes, for ``years``, under the names of its channel keys (StormCast's or StormScope's);
        keyword ``overrides`` replace constructor arguments."""
        naming, channels = layout.naming_of(data), layout.channel_lists(data)
        kwargs = dict(
            root=data.root,
            years=list(years),
            state_channels=channels["state"],
            background_channels=channels["background"],
            invariants=channels["invariants"],
            dt=data.dt,
            layout=getattr(data, "layout", "auto"),
            background_time=getattr(data, "background_time", "input"),
            grid=list(data.grid),
            invariant_norm=getattr(data, "invariant_norm", "zscore"),
            conus_dataset_name=getattr(data, "conus_dataset_name", layout.PN_CONUS_DATASET),
            hrrr_stats=getattr(data, "hrrr_stats", layout.PN_HRRR_STATS),
            naming=naming,
        )
        kwargs.update(overrides)
        return cls(**kwargs)

    # ------------------------------------------------------------ metadata

    def validate(self) -> None:
        """Check paths, channels, statistics, time axes, grids and coverage; read no sample data.

        Raises :class:`framework.errors.DataError` (or ConfigError for a grid that does not
        match ``grid``). Also (re)builds the sample index.
        """
        if self.requested_layout == "auto" and self.naming is layout.STORMCAST:
            self.layout = pn.detect_layout(self.root, self.conus_dataset_name)
        elif self.requested_layout == "auto":
            self.layout = layout.NATIVE
        else:
            self.layout = self.requested_layout
        self._interp = None
        self._handles = None
        if self.layout == layout.NATIVE:
            self._validate_native()
        else:
            self._validate_physicsnemo()
        self._build_index()

    def _validate_native(self) -> None:
        root = self.root
        self._var = {src: layout.DATA_VAR for src in self._sources}
        self._paths = {src: [layout.year_store(root, src, y) for y in self.years] for src in self._sources}
        self._slot_years = {src: list(self.years) for src in self._sources}
        grid = None
        grid_path = None
        store_channels = {}
        self._times = {src: [] for src in self._sources}
        self._index = {}
        for src in self._sources:
            for year, path in zip(self.years, self._paths[src]):
                group = _open_group(path, f"{self.naming.label(src)} {year}")
                data = checked_array(group, path, layout.DATA_VAR, 4)
                if not np.issubdtype(data.dtype, np.floating):
                    raise DataError(f"{path}: variable '{layout.DATA_VAR}' has dtype {data.dtype}, expected float")
                names = _store_channels(group, path, data.shape[1])
                if src not in store_channels:
                    store_channels[src] = (names, path)
                    self._index[src] = _select(self._names[src], names, path)
                elif names != store_channels[src][0]:
                    first = store_channels[src][1]
                    raise DataError(
                        f"{path}: attribute '{layout.CHANNELS_ATTR}' {names} differs from {first} "
                        f"{store_channels[src][0]} (the statistics assume one channel order)"
                    )
                if grid is None:
                    grid, grid_path = tuple(data.shape[-2:]), path
                elif tuple(data.shape[-2:]) != grid:
                    raise DataError(
                        f"{path}: variable '{layout.DATA_VAR}' grid {tuple(data.shape[-2:])} differs from the grid "
                        f"{grid} of {grid_path}"
                    )
                self._times[src].append(_check_time(group, path, data.shape[0], year, self.dt))

        self._inv = (layout.invariants_store(root), layout.DATA_VAR)
        if self._names["invariants"]:
            path = self._inv[0]
            group = _open_group(path, "invariants")
            data = checked_array(group, path, layout.DATA_VAR, 3)
            names = _store_channels(group, path, data.shape[0])
            self._index["invariants"] = _select(self._names["invariants"], names, path)
            if tuple(data.shape[-2:]) != grid:
                raise DataError(
                    f"{path}: variable '{layout.DATA_VAR}' grid {tuple(data.shape[-2:])} differs from the grid "
                    f"{grid} of {grid_path}"
                )
        else:
            self._index["invariants"] = np.zeros(0, dtype=np.int64)
        self.store_grid = (int(grid[0]), int(grid[1]))
        if self._grid_request is not None and self._grid_request != self.store_grid:
            raise ConfigError(
                f"data.grid: config says {list(self._grid_request)} but the stores under {root} "
                f"hold {list(self.store_grid)}"
            )
        self.grid = self.store_grid

        self._stats = {}
        for src in self._sources:
            names, path = store_channels[src]
            files = {kind: layout.stats_file(root, src, kind) for kind in layout.STAT_KINDS}
            means, stds = _load_stats(files, path, layout.DATA_VAR, len(names), names)
            idx = self._index[src]
            self._stats[src] = (means[idx].astype(np.float32), stds[idx].astype(np.float32))
        self._missing = np.zeros(0, dtype=np.int64)
        self._bounds = None

    def _validate_physicsnemo(self) -> None:
        root, conus = self.root, self.conus_dataset_name
        self._var = {layout.HRRR: layout.PN_HRRR_VAR, layout.ERA5: layout.PN_ERA5_VAR}
        folders = {layout.HRRR: layout.pn_hrrr_dir(root, conus), layout.ERA5: layout.pn_era5_dir(root)}
        self._paths, self._slot_years, self._times, self._index, self._stats = {}, {}, {}, {}, {}
        shapes = {}
        for src in layout.SOURCES:
            var = self._var[src]
            found = pn.discover_years(folders[src], f"{src.upper()}")
            missing = [y for y in self.years if y not in found]
            if missing:
                raise DataError(
                    f"{folders[src]}/**/{missing[0]}.zarr: {src.upper()} store for {missing[0]} not found "
                    f"(found years: {', '.join(map(str, sorted(found))) or 'none'})"
                )
            # the stores of the years asked for, then the next years (targets and backgrounds of
            # pairs that cross into them, as the reference reads)
            slot_years = list(self.years) + sorted({y + 1 for y in self.years if y + 1 in found} - set(self.years))
            self._paths[src] = [found[y] for y in slot_years]
            self._slot_years[src] = slot_years
            self._times[src] = []
            first_names = first_path = None
            for year, path in zip(slot_years, self._paths[src]):
                group = _open_group(path, f"{src.upper()} {year}")
                data = checked_array(group, path, var, 4)
                if not np.issubdtype(data.dtype, np.floating):
                    raise DataError(f"{path}: variable '{var}' has dtype {data.dtype}, expected float")
                expected = layout.PN_HRRR_DIMS if src == layout.HRRR else layout.PN_ERA5_DIMS
                _check_dims(data, path, var, expected, 2 if src == layout.HRRR else 4)
                names = _coord_channels(group, path, var, data.shape[1])
                if first_names is None:
                    first_names, first_path = names, path
                    self._index[src] = _select(self._names[src], names, path, var)
                    shapes[src] = (tuple(data.shape[-2:]), path)
                elif names != first_names:
                    raise DataError(
                        f"{path}: coordinate '{layout.PN_CHANNEL}' {names} differs from {first_path} "
                        f"{first_names} (the statistics assume one channel order)"
                    )
                elif tuple(data.shape[-2:]) != shapes[src][0]:
                    raise DataError(
                        f"{path}: variable '{var}' grid {tuple(data.shape[-2:])} differs from the grid "
                        f"{shapes[src][0]} of {shapes[src][1]}"
                    )
                times = checked_array(group, path, layout.PN_TIME, 1)
                hours = pn.decode_hours(times, path, layout.PN_TIME, data.shape[0])
                self._times[src].append(hours)
            files = {kind: layout.pn_stats_file(root, src, kind, conus, self.hrrr_stats) for kind in layout.STAT_KINDS}
            means, stds = _load_stats(files, first_path, var, len(first_names), first_names)
            idx = self._index[src]
            self._stats[src] = (means[idx].astype(np.float32), stds[idx].astype(np.float32))

        store_grid, hrrr_path = shapes[layout.HRRR]
        self.store_grid = (int(store_grid[0]), int(store_grid[1]))
        self.grid = self._grid_request or self.store_grid
        if self.grid[0] > self.store_grid[0] or self.grid[1] > self.store_grid[1]:
            raise ConfigError(
                f"data.grid: config says {list(self.grid)} but the HRRR stores under {root} hold only "
                f"{list(self.store_grid)} ({hrrr_path}); the region is [0:rows, 0:cols] of it"
            )

        self._inv = (layout.pn_invariants_store(root, conus), layout.PN_INVARIANTS_VAR)
        if self._names["invariants"]:
            path, var = self._inv
            group = _open_group(path, "invariants")
            data = checked_array(group, path, var, 3)
            _check_dims(data, path, var, layout.PN_INVARIANTS_DIMS, 1)
            names = _coord_channels(group, path, var, data.shape[0])
            self._index["invariants"] = _select(self._names["invariants"], names, path, var)
            if data.shape[1] < self.grid[0] or data.shape[2] < self.grid[1]:
                raise DataError(
                    f"{path}: variable '{var}' grid {tuple(data.shape[-2:])} is smaller than the region {self.grid}"
                )
        else:
            self._index["invariants"] = np.zeros(0, dtype=np.int64)

        self._era5_grid = shapes[layout.ERA5][0]
        self._interp = self._build_interp()  # checks coverage now; rebuilt lazily after pickling

        missing = layout.pn_missing_samples_file(root, conus)
        self._missing = pn.load_missing_hours(missing) if missing.exists() else np.zeros(0, dtype=np.int64)
        self._bounds = pn.sample_hour_bounds(self.years)

    def _build_interp(self) -> pn.LatLonBilinear:
        h, w = self.grid
        hpath, epath = self._paths[layout.HRRR][0], self._paths[layout.ERA5][0]
        hgroup = _open_group(hpath, "HRRR")
        coords = []
        for name in (layout.PN_LAT, layout.PN_LON):
            source, group = hpath, hgroup
            if name not in hgroup and self._inv[0].exists():  # some stores keep them with the invariants
                source, group = self._inv[0], _open_group(self._inv[0], "invariants")
            arr = checked_array(group, source, name, 2)
            if arr.shape[0] < h or arr.shape[1] < w:
                raise DataError(
                    f"{source}: coordinate '{name}' has shape {arr.shape}, smaller than the region {self.grid}"
                )
            coords.append(np.asarray(arr[:h, :w], dtype=np.float64))
        egroup = _open_group(epath, "ERA5")
        lat = checked_array(egroup, epath, layout.PN_LAT, 1)
        lon = checked_array(egroup, epath, layout.PN_LON, 1)
        if (lat.shape[0], lon.shape[0]) != tuple(self._era5_grid):
            raise DataError(
                f"{epath}: coordinates '{layout.PN_LAT}', '{layout.PN_LON}' have {lat.shape[0]} x "
                f"{lon.shape[0]} points but '{self._var[layout.ERA5]}' is {tuple(self._era5_grid)}"
            )
        lat, lon = (
            pn.coordinate_values(a, epath, n, kinds="iuf") for a, n in ((lat, layout.PN_LAT), (lon, layout.PN_LON))
        )
        return pn.LatLonBilinear(lat, lon, coords[0], coords[1], epath)

    def _build_index(self) -> None:
        """Sample index: the slots and time indices of state, target and background."""
        state, background = self._sources
        hrrr = _Lookup(self._times[state], self._paths[state], self._var[state])
        era5 = _Lookup(self._times[background], self._paths[background], self._var[background])
        cols = {k: [] for k in ("s_slot", "s_t", "t_slot", "t_t", "b_slot", "b_t")}
        for k in range(len(self.years)):  # slot k holds year k in both sources
            th = self._times[state][k]
            t_idx = np.arange(len(th), dtype=np.int64)
            keep = np.ones(len(th), dtype=bool)
            if self._bounds is not None:
                keep &= (th >= self._bounds[0]) & (th <= self._bounds[1])
            ok_t, t_slot, t_t = hrrr.find(th + self.dt)
            keep &= ok_t
            bg_hours = th if self.background_time == "input" else th + self.dt
            ok_b, b_slot, b_t = era5.find(bg_hours)
            keep &= ok_b
            if len(self._missing):
                keep &= ~np.isin(th, self._missing) & ~np.isin(th + self.dt, self._missing)
            if self.layout == layout.NATIVE and not keep.any():
                raise DataError(
                    f"{self._paths[state][k]}: variable '{layout.TIME_VAR}' has no (t, t+{self.dt}h) pair "
                    f"whose {'state' if self.background_time == 'input' else 'target'} hour is also in "
                    f"{self._paths[background][k]}"
                )
            for key, values in (
                ("s_slot", np.full(len(th), k)),
                ("s_t", t_idx),
                ("t_slot", t_slot),
                ("t_t", t_t),
                ("b_slot", b_slot),
                ("b_t", b_t),
            ):
                cols[key].append(np.asarray(values, dtype=np.int64)[keep])
        self._samples = {k: np.concatenate(v) for k, v in cols.items()}
        if not len(self._samples["s_t"]):
            raise DataError(
                f"{self._paths[state][0]}: no (t, t+{self.dt}h) pair in years {self.years} has its target "
                f"in the {self.naming.label(state)} stores, its background in the "
                f"{self.naming.label(background)} stores and is not missing"
            )

    @property
    def channel_names(self) -> dict[str, list[str]]:
        """The selected names in output order, by source: ``{"hrrr": [...], "era5": [...], "invariants":
        [...]}`` (StormScope: ``{"state": ..., "background": ..., "invariants": ...}``)."""
        return {k: list(v) for k, v in self._names.items()}

    @property
    def state_means(self) -> np.ndarray:
        return self._stats[self._state][0].copy()

    @property
    def state_stds(self) -> np.ndarray:
        return self._stats[self._state][1].copy()

    @property
    def background_means(self) -> np.ndarray:
        return self._stats[self._background][0].copy()

    @property
    def background_stds(self) -> np.ndarray:
        return self._stats[self._background][1].copy()

    # StormCast's names for them
    hrrr_means, hrrr_stds, era5_means, era5_stds = state_means, state_stds, background_means, background_stds

    def __len__(self) -> int:
        return len(self._samples["s_t"])

    def locate(self, i: int) -> tuple[int, int]:
        """``(year, t)``: the year of sample ``i``'s state store and the index of its state hour in it."""
        i = self._check_index(i)
        return self.years[int(self._samples["s_slot"][i])], int(self._samples["s_t"][i])

    def sample_times(self, i: int) -> tuple[int, int]:
        """Hours since 1970-01-01 UTC of the state and of the target of sample ``i``."""
        i = self._check_index(i)
        s = self._samples
        th = self._times[self._state]
        return int(th[s["s_slot"][i]][s["s_t"][i]]), int(th[s["t_slot"][i]][s["t_t"][i]])

    def background_hour(self, i: int) -> int:
        """Hours since 1970-01-01 UTC of the background (ERA5) of sample ``i``."""
        i = self._check_index(i)
        s = self._samples
        return int(self._times[self._background][s["b_slot"][i]][s["b_t"][i]])

    def __repr__(self) -> str:
        return (
            f"HrrrEra5Dataset(root={str(self.root)!r}, layout={self.layout}, years={self.years}, dt={self.dt}, "
            f"background_time={self.background_time}, samples={len(self)}, grid={self.grid}, channels={self._names})"
        )

    # ------------------------------------------------------------ pickling / opening

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_handles"] = None  # zarr handles and cached invariants stay behind
        state["_interp"] = None  # rebuilt from the coordinates where it is needed
        return state

    def _open(self) -> dict:
        handles = self._handles
        if handles is not None and handles["pid"] == os.getpid():
            return handles
        handles = {"pid": os.getpid()}
        for src in self._sources:
            var = self._var[src]
            handles[src] = [
                checked_array(_open_group(path, self.naming.label(src)), path, var, 4) for path in self._paths[src]
            ]
        if self.layout == layout.PHYSICSNEMO and self._interp is None:
            self._interp = self._build_interp()
        h, w = self.grid
        idx = self._index["invariants"]
        if len(idx):
            path, var = self._inv
            arr = checked_array(_open_group(path, "invariants"), path, var, 3)
            inv = np.asarray(arr.oindex[idx, :h, :w], dtype=np.float32)
            inv_t = torch.from_numpy(inv)
            finite = torch.isfinite(inv_t).flatten(1).all(1)
            if not bool(finite.all()):
                name = self._names["invariants"][int((~finite).nonzero()[0, 0])]
                raise DataError(f"{path}: variable '{var}' channel '{name}' has non-finite values (NaN or inf)")
            if self.normalize and self.invariant_norm == "zscore":
                mean = inv_t.double().mean(dim=(1, 2), keepdim=True)
                std = inv_t.double().std(dim=(1, 2), unbiased=False, keepdim=True)
                std = torch.where(std > 0, std, torch.ones_like(std))
                inv_t = ((inv_t.double() - mean) / std).float()
            handles["invariants"] = inv_t.contiguous()
        else:
            handles["invariants"] = torch.zeros((0, h, w), dtype=torch.float32)
        self._handles = handles
        return handles

    # ------------------------------------------------------------ reading

    def _check_index(self, i) -> int:
        i = operator.index(i)
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"sample index {i} out of range for {n} samples")
        return i

    def _check_rows(self, rows: slice | None) -> slice:
        h = self.grid[0]
        if rows is None:
            return slice(0, h)
        if not isinstance(rows, slice):
            raise TypeError(f"rows must be a slice or None, got {type(rows).__name__}")
        start, stop, step = rows.indices(h)
        if step != 1:
            raise ValueError(f"rows must be a contiguous slice (step 1), got step {step}")
        if stop <= start:
            raise ValueError(f"rows {rows} selects no rows of a grid with {h} rows")
        return slice(start, stop)

    @staticmethod
    def _read_channels(arr, ts: np.ndarray, idx: np.ndarray, ys: slice, xs: slice) -> np.ndarray:
        """``arr[ts, idx, ys, xs]`` as float32 (times ascending), reading the channels in store order."""
        order = np.argsort(idx, kind="stable")
        sorted_idx = idx[order]
        lo, hi = int(sorted_idx[0]), int(sorted_idx[-1]) + 1
        chans = slice(lo, hi) if hi - lo == len(sorted_idx) else sorted_idx  # a contiguous block, or a list
        if len(ts) == 1 and isinstance(chans, slice):
            raw = arr[int(ts[0]) : int(ts[0]) + 1, chans, ys, xs]
        else:
            raw = arr.oindex[ts, chans, ys, xs]
        out = np.empty(raw.shape, dtype=np.float32)
        out[:, order] = raw
        return out

    def _read_fields(self, src: str, k: int, ts: np.ndarray, rows: slice) -> torch.Tensor:
        """Times ``ts`` (ascending) of store ``k`` of ``src``, rows ``rows``: (len(ts), C, h, W),
        checked finite and normalised, in one zarr selection (its chunks fetched concurrently)."""
        arr = self._handles[src][k]
        idx = self._index[src]
        h, w = rows.stop - rows.start, self.grid[1]
        if len(idx) == 0:
            return torch.zeros((len(ts), 0, h, w), dtype=torch.float32)
        interp = src == self._background and self.layout == layout.PHYSICSNEMO
        ys, xs, flat, weights = self._interp.band(rows) if interp else (rows, slice(0, w), None, None)
        try:
            raw = self._read_channels(arr, ts, idx, ys, xs)
        except (ValueError, RuntimeError, OSError, EOFError) as e:  # a chunk zarr cannot decode (a checksum, a codec)
            raise DataError(
                f"{self._paths[src][k]}: variable '{self._var[src]}' cannot be read at time indices "
                f"{int(ts[0])}-{int(ts[-1])} (a damaged chunk? {type(e).__name__}: {first_line(e)})"
            ) from None
        if interp:
            x = torch.from_numpy(np.stack([pn.LatLonBilinear.apply(win, flat, weights, (h, w)) for win in raw]))
        else:
            x = torch.from_numpy(raw)
        finite = torch.isfinite(x).flatten(2).all(2)
        if not bool(finite.all()):
            j, c = (int(v) for v in (~finite).nonzero()[0])
            t = int(ts[j])
            hour = int(self._times[src][k][t])
            raise DataError(
                f"{self._paths[src][k]}: variable '{self._var[src]}' channel '{self._names[src][c]}' has "
                f"non-finite values (NaN or inf) at time index {t} (hour {hour} since 1970-01-01)"
            )
        if self.normalize:
            mean, std = self._stats[src]
            x = (x - torch.from_numpy(mean)[:, None, None]) / torch.from_numpy(std)[:, None, None]
        return x

    def read(self, i: int, rows: slice | None = None) -> dict:
        """Sample ``i`` restricted to the rows ``rows`` of y (all rows if None).

        Reads only the chunks that hold those rows (the state), or the background window those
        rows' points need (``physicsnemo``), so ``read(i, rows)`` equals ``read(i)`` sliced along
        y at a fraction of the I/O.
        """
        return self.read_many([i], rows)[0]

    def read_many(self, indices: Sequence[int], rows: slice | None = None) -> list[dict]:
        """Samples ``indices`` (as ``read``) with one zarr selection per source and year store
        for all of them: zarr fetches a batch's chunks concurrently, and pays its per-call
        overhead (milliseconds, more than a small sample's decoding) once per store, not per field."""
        picked = [self._check_index(i) for i in indices]
        rows = self._check_rows(rows)
        self._open()
        s = self._samples
        parts = {  # field: (source, slot column, time column)
            "state": (self._state, "s_slot", "s_t"),
            "target": (self._state, "t_slot", "t_t"),
            "background": (self._background, "b_slot", "b_t"),
        }
        wanted: dict[tuple[str, int], set[int]] = {}
        for src, slot, t in parts.values():
            for i in picked:
                wanted.setdefault((src, int(s[slot][i])), set()).add(int(s[t][i]))
        got: dict[tuple[str, int, int], torch.Tensor] = {}
        for (src, k), times in wanted.items():
            ts = np.array(sorted(times), dtype=np.int64)
            for t, x in zip(ts.tolist(), self._read_fields(src, k, ts, rows)):
                got[src, k, t] = x
        inv = self._handles["invariants"][:, rows, :]
        out = []
        for i in picked:
            sample = {f: got[src, int(s[slot][i]), int(s[t][i])].clone() for f, (src, slot, t) in parts.items()}
            out.append({**sample, "invariants": inv.clone(), "index": i})
        return out

    def __getitem__(self, i: int) -> dict:
        return self.read(i)

    def __getitems__(self, indices: list[int]) -> list[dict]:  # DataLoader's batched fetch
        return self.read_many(indices)
