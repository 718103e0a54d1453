"""Paired HRRR/ERA5 samples for StormCast, read from the layout in :mod:`recipes.stormcast.layout`.

One sample is an hourly pair ``(t, t + dt)`` inside one year:

* ``state``      ``(C_hrrr, H, W)``  HRRR at ``t``
* ``target``     ``(C_hrrr, H, W)``  HRRR at ``t + dt``
* ``background`` ``(C_era5, H, W)``  ERA5 at ``t + dt`` (the target time, as
  StormCast conditions on the background valid at the time it predicts)
* ``invariants`` ``(C_inv, H, W)``
* ``index``      the sample index (int)

All tensors are float32. A pair never crosses a year boundary, and is kept only
if the HRRR store has both hours (``time[t + dt] - time[t] == dt``, so gaps in
the record drop the pairs that would span them) and the ERA5 store of that
year has the hour ``t + dt``. Samples are numbered year by year (in the order
given) and by ``t`` within a year.

Channels are selected by name, in any order and any subset. With
``normalize=True`` HRRR and ERA5 channels are z-scored with the per-channel
statistics in ``<root>/stats`` (which hold one value per *store* channel, in
store channel order), and each invariant by its own spatial mean and standard
deviation, computed once when the stores are opened (a constant invariant is
only centred). With ``normalize=False`` every field is returned in store units.

Stores are opened lazily, on the first read in each process, and the open
handles are dropped when pickling, so the dataset travels cheaply to DataLoader
workers (spawn or forkserver). The constructor calls :meth:`validate`, which
checks paths, channels, statistics, time axes and grids without reading sample
data. Unusable data raise :class:`framework.errors.DataError` with one line
naming the file and the variable.
"""

from __future__ import annotations

import operator
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import zarr
from torch.utils.data import Dataset

from framework.errors import ConfigError, DataError
from recipes.stormcast import layout


def _open_group(path: Path, what: str):
    if not path.exists():
        raise DataError(f"{path}: {what} store not found")
    try:
        return zarr.open_group(str(path), mode="r")
    except Exception as exc:  # zarr raises several types for "not a group"
        raise DataError(f"{path}: cannot open the {what} store as a zarr group ({type(exc).__name__}: {exc})") from None


def _array(group, path: Path, name: str, ndim: int):
    try:
        arr = group[name] if name in group else None
    except Exception as exc:
        raise DataError(f"{path}: cannot open variable '{name}' ({type(exc).__name__}: {exc})") from None
    if not isinstance(arr, zarr.Array):
        raise DataError(f"{path}: variable '{name}' not found")
    if arr.ndim != ndim:
        raise DataError(f"{path}: variable '{name}' has {arr.ndim} dimensions {arr.shape}, expected {ndim}")
    return arr


def _store_channels(group, path: Path, n_data_channels: int) -> list[str]:
    names = group.attrs.get(layout.CHANNELS_ATTR)
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise DataError(f"{path}: group attribute '{layout.CHANNELS_ATTR}' missing or not a list of names")
    if len(names) != n_data_channels:
        raise DataError(
            f"{path}: attribute '{layout.CHANNELS_ATTR}' names {len(names)} channels but variable "
            f"'{layout.DATA_VAR}' has {n_data_channels}"
        )
    if len(set(names)) != len(names):
        raise DataError(f"{path}: attribute '{layout.CHANNELS_ATTR}' has duplicate names: {names}")
    return names


def _select(requested: Sequence[str], available: Sequence[str], path: Path) -> np.ndarray:
    index = []
    for name in requested:
        if name not in available:
            raise DataError(
                f"{path}: channel '{name}' not in variable '{layout.DATA_VAR}'; available: {', '.join(available)}"
            )
        index.append(available.index(name))
    return np.asarray(index, dtype=np.int64)


def _load_stats(root: Path, source: str, store: Path, n_channels: int, names: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    out = []
    for kind in layout.STAT_KINDS:
        path = layout.stats_file(root, source, kind)
        if not path.exists():
            raise DataError(f"{path}: statistics file not found")
        try:
            values = np.load(path, allow_pickle=False)
        except Exception as exc:
            raise DataError(f"{path}: cannot read statistics ({type(exc).__name__}: {exc})") from None
        if values.ndim != 1 or not np.issubdtype(values.dtype, np.number):
            raise DataError(f"{path}: expected a 1-D numeric array, got shape {values.shape} dtype {values.dtype}")
        if len(values) != n_channels:
            raise DataError(
                f"{path}: has {len(values)} values but {store} variable '{layout.DATA_VAR}' has {n_channels} channels"
            )
        values = values.astype(np.float64)
        bad = ~np.isfinite(values) if kind == "means" else ~(np.isfinite(values) & (values > 0))
        if bad.any():
            c = int(np.flatnonzero(bad)[0])
            what = "non-finite" if kind == "means" else "non-positive or non-finite"
            raise DataError(f"{path}: {what} value {values[c]} for channel '{names[c]}'")
        out.append(values)
    return out[0], out[1]


def _check_time(group, path: Path, n_data_times: int, year: int, dt: int) -> np.ndarray:
    arr = _array(group, path, layout.TIME_VAR, 1)
    if not np.issubdtype(arr.dtype, np.integer):
        raise DataError(f"{path}: variable '{layout.TIME_VAR}' has dtype {arr.dtype}, expected integer hours since 1970")
    hours = np.asarray(arr[...], dtype=np.int64)
    if len(hours) != n_data_times:
        raise DataError(
            f"{path}: variable '{layout.TIME_VAR}' has {len(hours)} entries but '{layout.DATA_VAR}' has {n_data_times} times"
        )
    if len(hours) < dt + 1:
        raise DataError(
            f"{path}: variable '{layout.TIME_VAR}' has only {len(hours)} hours for year {year}; need at least dt+1={dt + 1}"
        )
    if np.any(np.diff(hours) <= 0):
        k = int(np.flatnonzero(np.diff(hours) <= 0)[0])
        raise DataError(f"{path}: variable '{layout.TIME_VAR}' is not strictly increasing at index {k + 1}")
    return hours


class HrrrEra5Dataset(Dataset):
    """HRRR state/target pairs with the ERA5 background and invariants (see the module docstring).

    Args:
        root: store root (layout in :mod:`recipes.stormcast.layout`).
        years: years to use, in sample order.
        hrrr_channels, era5_channels, invariants: channel names to select, in
            the order wanted.
        dt: lead time in hours (target is ``t + dt``).
        normalize: z-score the fields (see the module docstring).
    """

    def __init__(
        self,
        root: str | Path,
        years: Sequence[int],
        hrrr_channels: Sequence[str],
        era5_channels: Sequence[str],
        invariants: Sequence[str],
        dt: int = 1,
        normalize: bool = True,
    ):
        self.root = Path(root)
        if isinstance(years, (int, np.integer)):
            years = [years]
        self.years = [int(y) for y in years]
        self.dt = int(dt)
        self.normalize = bool(normalize)
        self._names = {
            "hrrr": [str(c) for c in hrrr_channels],
            "era5": [str(c) for c in era5_channels],
            "invariants": [str(c) for c in invariants],
        }
        if not self.years:
            raise ConfigError("HrrrEra5Dataset: no years given")
        if len(set(self.years)) != len(self.years):
            raise ConfigError(f"HrrrEra5Dataset: duplicate years {self.years}")
        if self.dt < 1:
            raise ConfigError(f"HrrrEra5Dataset: dt must be >= 1 hour, got {dt}")
        if not self._names["hrrr"]:
            raise ConfigError("HrrrEra5Dataset: no HRRR channels selected")
        for kind, names in self._names.items():
            if len(set(names)) != len(names):
                raise ConfigError(f"HrrrEra5Dataset: duplicate {kind} channels {names}")
        self._handles = None
        self.validate()

    # ------------------------------------------------------------ metadata

    def validate(self) -> None:
        """Check paths, channels, statistics, time axes and grids; read no sample data.

        Raises :class:`framework.errors.DataError`. Also (re)builds the sample index.
        """
        root = self.root
        self._paths = {src: [layout.year_store(root, src, y) for y in self.years] for src in layout.SOURCES}
        self._paths["invariants"] = layout.invariants_store(root)
        grid = None
        grid_path = None
        store_channels = {}
        self._times = {layout.HRRR: [], layout.ERA5: []}
        self._index = {}
        for src in layout.SOURCES:
            for year, path in zip(self.years, self._paths[src]):
                group = _open_group(path, f"{src.upper()} {year}")
                data = _array(group, path, layout.DATA_VAR, 4)
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

        if self._names["invariants"]:
            path = self._paths["invariants"]
            group = _open_group(path, "invariants")
            data = _array(group, path, layout.DATA_VAR, 3)
            names = _store_channels(group, path, data.shape[0])
            self._index["invariants"] = _select(self._names["invariants"], names, path)
            if tuple(data.shape[-2:]) != grid:
                raise DataError(
                    f"{path}: variable '{layout.DATA_VAR}' grid {tuple(data.shape[-2:])} differs from the grid "
                    f"{grid} of {grid_path}"
                )
        else:
            self._index["invariants"] = np.zeros(0, dtype=np.int64)
        self.grid = (int(grid[0]), int(grid[1]))

        self._stats = {}
        for src in layout.SOURCES:
            names, path = store_channels[src]
            means, stds = _load_stats(root, src, path, len(names), names)
            idx = self._index[src]
            self._stats[src] = (means[idx].astype(np.float32), stds[idx].astype(np.float32))

        # sample index: (year position, HRRR time index of t, ERA5 time index of t + dt)
        pos, t_idx, e_idx = [], [], []
        for k, year in enumerate(self.years):
            th, te = self._times[layout.HRRR][k], self._times[layout.ERA5][k]
            t = np.arange(len(th) - self.dt)
            target_hours = th[t + self.dt]
            ok = target_hours - th[t] == self.dt
            e = np.minimum(np.searchsorted(te, target_hours), len(te) - 1)
            ok &= te[e] == target_hours
            if not ok.any():
                raise DataError(
                    f"{self._paths[layout.HRRR][k]}: variable '{layout.TIME_VAR}' has no (t, t+{self.dt}h) pair "
                    f"whose target hour is also in {self._paths[layout.ERA5][k]}"
                )
            pos.append(np.full(int(ok.sum()), k, dtype=np.int32))
            t_idx.append(t[ok])
            e_idx.append(e[ok])
        self._pair_year = np.concatenate(pos)
        self._pair_t = np.concatenate(t_idx).astype(np.int64)
        self._pair_era5 = np.concatenate(e_idx).astype(np.int64)
        self._handles = None

    @property
    def channel_names(self) -> dict[str, list[str]]:
        """``{"hrrr": [...], "era5": [...], "invariants": [...]}``, the selected names in output order."""
        return {k: list(v) for k, v in self._names.items()}

    @property
    def hrrr_means(self) -> np.ndarray:
        return self._stats[layout.HRRR][0].copy()

    @property
    def hrrr_stds(self) -> np.ndarray:
        return self._stats[layout.HRRR][1].copy()

    @property
    def era5_means(self) -> np.ndarray:
        return self._stats[layout.ERA5][0].copy()

    @property
    def era5_stds(self) -> np.ndarray:
        return self._stats[layout.ERA5][1].copy()

    def __len__(self) -> int:
        return len(self._pair_t)

    def locate(self, i: int) -> tuple[int, int]:
        """``(year, t)``: the year of sample ``i`` and the index of its state hour in that year's stores."""
        i = self._check_index(i)
        return self.years[self._pair_year[i]], int(self._pair_t[i])

    def sample_times(self, i: int) -> tuple[int, int]:
        """Hours since 1970-01-01 UTC of the state and of the target of sample ``i``."""
        i = self._check_index(i)
        th = self._times[layout.HRRR][self._pair_year[i]]
        t = int(self._pair_t[i])
        return int(th[t]), int(th[t + self.dt])

    def __repr__(self) -> str:
        return (
            f"HrrrEra5Dataset(root={str(self.root)!r}, years={self.years}, dt={self.dt}, samples={len(self)}, "
            f"grid={self.grid}, channels={self._names})"
        )

    # ------------------------------------------------------------ pickling / opening

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_handles"] = None  # zarr handles and cached invariants stay behind
        return state

    def _open(self) -> dict:
        handles = self._handles
        if handles is not None and handles["pid"] == os.getpid():
            return handles
        handles = {"pid": os.getpid()}
        for src in layout.SOURCES:
            arrays = []
            for path in self._paths[src]:
                arrays.append(_array(_open_group(path, src.upper()), path, layout.DATA_VAR, 4))
            handles[src] = arrays
        h, w = self.grid
        idx = self._index["invariants"]
        if len(idx):
            path = self._paths["invariants"]
            arr = _array(_open_group(path, "invariants"), path, layout.DATA_VAR, 3)
            inv = np.asarray(arr.oindex[idx, :, :], dtype=np.float32)
            inv_t = torch.from_numpy(inv)
            finite = torch.isfinite(inv_t).flatten(1).all(1)
            if not bool(finite.all()):
                name = self._names["invariants"][int((~finite).nonzero()[0, 0])]
                raise DataError(f"{path}: variable '{layout.DATA_VAR}' channel '{name}' has non-finite values (NaN or inf)")
            if self.normalize:
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

    def _read_field(self, src: str, k: int, t: int, rows: slice) -> torch.Tensor:
        arr = self._handles[src][k]
        idx = self._index[src]
        if len(idx) == 0:
            return torch.zeros((0, rows.stop - rows.start, self.grid[1]), dtype=torch.float32)
        order = np.argsort(idx, kind="stable")
        sorted_idx = idx[order]
        lo, hi = int(sorted_idx[0]), int(sorted_idx[-1]) + 1
        if hi - lo == len(sorted_idx):  # a contiguous block: basic indexing
            raw = arr[t, lo:hi, rows, :]
        else:
            raw = arr.oindex[t, sorted_idx, rows, :]
        out = np.empty_like(raw, dtype=np.float32)
        out[order] = raw
        x = torch.from_numpy(out)
        finite = torch.isfinite(x).flatten(1).all(1)
        if not bool(finite.all()):
            name = self._names[src][int((~finite).nonzero()[0, 0])]
            hour = int(self._times[src][k][t])
            raise DataError(
                f"{self._paths[src][k]}: variable '{layout.DATA_VAR}' channel '{name}' has non-finite values "
                f"(NaN or inf) at time index {t} (hour {hour} since 1970-01-01)"
            )
        if self.normalize:
            mean, std = self._stats[src]
            x = (x - torch.from_numpy(mean)[:, None, None]) / torch.from_numpy(std)[:, None, None]
        return x

    def read(self, i: int, rows: slice | None = None) -> dict:
        """Sample ``i`` restricted to the rows ``rows`` of y (all rows if None).

        Reads only the chunks that hold those rows, one channel at a time, so
        ``read(i, rows)`` equals ``read(i)`` sliced along y at a fraction of the I/O.
        """
        i = self._check_index(i)
        rows = self._check_rows(rows)
        self._open()
        k = int(self._pair_year[i])
        t = int(self._pair_t[i])
        return {
            "state": self._read_field(layout.HRRR, k, t, rows),
            "target": self._read_field(layout.HRRR, k, t + self.dt, rows),
            "background": self._read_field(layout.ERA5, k, int(self._pair_era5[i]), rows),
            "invariants": self._handles["invariants"][:, rows, :].clone(),
            "index": i,
        }

    def __getitem__(self, i: int) -> dict:
        return self.read(i)
