"""Reading the data layout of NVIDIA PhysicsNeMo's StormCast recipe (names and paths in
:mod:`recipes.weather.layout`): the pieces :class:`recipes.weather.dataset.HrrrEra5Dataset`
needs beyond the native layout, with zarr alone (no xarray).

* :func:`detect_layout`: ``native`` or ``physicsnemo``, from what is under a root.
* :func:`discover_years`: ``**/<year>.zarr`` under a folder, found recursively.
* :func:`decode_hours`: a datetime64 coordinate (CF-encoded ``"<unit> since <date>"`` as
  xarray writes it, or a native datetime64 array) as whole hours since 1970-01-01 UTC.
* :func:`load_missing_hours`: the missing-samples file. The reference writes it with
  ``np.save`` of an object array of datetimes, i.e. a pickle. Data stores come from
  others, so it is never unpickled as such: a restricted unpickler admits only what a
  numpy array of datetimes or strings needs, and anything else is refused with one line
  naming the file. A ``datetime64`` (or ISO string) ``.npy``, which needs no pickle, is
  the safe alternative.
* :func:`sample_hour_bounds`: the reference's first/last-sample rules.
* :class:`LatLonBilinear`: the weights that interpolate a regular 1-D lat/lon grid
  linearly onto the HRRR region's 2-D latitude/longitude points (what the reference's
  ``xarray.interp(latitude=..., longitude=...)`` computes on every read), computed once;
  a band of rows reads only the ERA5 window those rows need.
"""

from __future__ import annotations

import datetime as _dt
import io
import os
import re
from pathlib import Path

import numpy as np

from framework import untrusted
from framework.errors import DataError
from framework.safe_unpickle import Refused, RestrictedUnpickler
from recipes.weather import layout

_EPOCH = np.datetime64("1970-01-01T00:00:00", "s")
_YEAR_STORE = re.compile(r"^(\d{4})\.zarr$")


# ----------------------------------------------------------------- detection and discovery


def detect_layout(root: str | Path, conus_dataset_name: str = layout.PN_CONUS_DATASET) -> str:
    """``native`` or ``physicsnemo`` from the files under ``root``; DataError if neither or both."""
    root = Path(root)
    native = [
        p
        for p in (layout.stats_file(root, layout.HRRR, "means"), layout.invariants_store(root), root / layout.HRRR)
        if p.exists()
    ]
    reference = [
        p
        for p in (
            layout.pn_stats_file(root, layout.ERA5, "means"),
            layout.pn_missing_samples_file(root, conus_dataset_name),
            layout.pn_invariants_store(root, conus_dataset_name),
        )
        if p.exists()
    ]
    if conus_dataset_name != layout.HRRR and layout.pn_hrrr_dir(root, conus_dataset_name).is_dir():
        reference.append(layout.pn_hrrr_dir(root, conus_dataset_name))
    if native and reference:
        raise DataError(
            f"{root}: holds both the native layout ({native[0]}) and the PhysicsNeMo layout "
            f"({reference[0]}); set data.layout=native or data.layout=physicsnemo"
        )
    if native:
        return layout.NATIVE
    if reference:
        return layout.PHYSICSNEMO
    raise DataError(
        f"{root}: no HRRR/ERA5 stores found: expected {root / layout.HRRR}/YYYY.zarr "
        f"(native layout) or {layout.pn_hrrr_dir(root, conus_dataset_name)}/**/YYYY.zarr and "
        f"{layout.pn_era5_dir(root)}/**/YYYY.zarr (PhysicsNeMo layout)"
    )


def discover_years(folder: Path, what: str) -> dict[int, Path]:
    """``{year: path}`` of every ``<year>.zarr`` below ``folder`` (any depth; zarr stores and
    hidden folders are not descended into). Two stores of one year: DataError naming both."""
    if not folder.is_dir():
        raise DataError(f"{folder}: {what} folder not found")
    found: dict[int, Path] = {}
    for dirpath, dirnames, _ in os.walk(folder):
        keep = []
        for name in sorted(dirnames):
            if name.startswith("."):
                continue
            if name.endswith(".zarr"):
                m = _YEAR_STORE.match(name)
                if m:
                    year, path = int(m.group(1)), Path(dirpath) / name
                    if year in found:
                        raise DataError(
                            f"{path}: a second {what} store for {year} (also {found[year]}); keep one per year"
                        )
                    found[year] = path
                continue  # never walk into a store's chunks
            keep.append(name)
        dirnames[:] = keep
    return found


def array_dims(arr) -> tuple[str, ...] | None:
    """The dimension names of a zarr array: xarray's ``_ARRAY_DIMENSIONS`` (v2) or v3's own."""
    dims = arr.attrs.get(layout.PN_DIMS_ATTR)
    if dims is None:
        dims = getattr(arr.metadata, "dimension_names", None)
    return None if dims is None else tuple(str(d) for d in dims)


# ----------------------------------------------------------------- time


_UNIT_SECONDS = {
    "days": 86400,
    "day": 86400,
    "d": 86400,
    "hours": 3600,
    "hour": 3600,
    "hrs": 3600,
    "hr": 3600,
    "h": 3600,
    "minutes": 60,
    "minute": 60,
    "mins": 60,
    "min": 60,
    "seconds": 1,
    "second": 1,
    "secs": 1,
    "sec": 1,
    "s": 1,
    "milliseconds": 1e-3,
    "microseconds": 1e-6,
    "nanoseconds": 1e-9,
}
_CALENDARS = ("standard", "gregorian", "proleptic_gregorian")


def _parse_reference_date(text: str) -> np.datetime64:
    s = text.strip()
    for suffix in (" UTC", "UTC", "Z", "+00:00", " +00:00", "+0000", " 00:00"):
        if s.endswith(suffix) and len(s) > len(suffix) + 9:
            s = s[: -len(suffix)].strip()
    s = s.replace(" ", "T", 1)
    return np.datetime64(s, "s")


MAX_COORD_ENTRIES = 1 << 22  # 4194304: 478 years of hours, a 1-D coordinate of a 4 m grid round the globe
MAX_COORD_BYTES = 256 << 20  # fixed-width entries (e.g. '<U...' names) times their count
MAX_FILL_CHARS = 1024  # a string coordinate's fill value, repeated for every entry of an absent chunk


def coordinate_values(arr, path: Path, name: str, expected: int | None = None, kinds: str | None = None) -> np.ndarray:
    """The values of the 1-D coordinate ``arr``, read whole once its declared shape and type pass:
    ``expected`` entries (the data's length along its axis), at most ``MAX_COORD_ENTRIES`` of them
    and ``MAX_COORD_BYTES`` in all, a dtype of one of numpy's ``kinds`` ("iufM": numbers or datetimes)
    where given. A store from someone else can declare any of these, and zarr fills absent chunks
    with the fill value: a crafted coordinate would otherwise be an allocation of its declared size.
    (Variable-length strings are bounded by their chunks' bytes on disk, and by their fill value.)"""
    if len(arr.shape) != 1:
        raise DataError(f"{path}: variable '{name}' has shape {tuple(arr.shape)}, expected 1-D")
    n = int(arr.shape[0])
    if expected is not None and n != expected:
        raise DataError(f"{path}: coordinate '{name}' has {n} entries but the data has {expected} along its axis")
    if n > MAX_COORD_ENTRIES or n * arr.dtype.itemsize > MAX_COORD_BYTES:
        raise DataError(
            f"{path}: coordinate '{name}' has {n} entries of {arr.dtype.itemsize} bytes (at most "
            f"{MAX_COORD_ENTRIES} entries and {MAX_COORD_BYTES} bytes are read)"
        )
    if kinds is not None and np.dtype(arr.dtype).kind not in kinds:
        raise DataError(f"{path}: coordinate '{name}' has dtype {arr.dtype}, expected numbers or datetimes")
    fill = getattr(arr, "fill_value", None)
    if isinstance(fill, (str, bytes, np.str_, np.bytes_)) and len(fill) > MAX_FILL_CHARS:
        raise DataError(f"{path}: coordinate '{name}' has a fill value of {len(fill)} characters")
    return np.asarray(arr[...])


def decode_hours(arr, path: Path, name: str, expected: int | None = None) -> np.ndarray:
    """The values of time coordinate ``arr`` as int64 whole hours since 1970-01-01 UTC (``expected``:
    its length, checked before it is read; see ``coordinate_values``)."""
    values = coordinate_values(arr, path, name, expected, kinds="iufM")
    if np.issubdtype(values.dtype, np.datetime64):
        seconds = (values.astype("datetime64[s]") - _EPOCH).astype(np.int64)
    elif np.issubdtype(values.dtype, np.number):
        units = arr.attrs.get("units")
        m = re.match(r"^\s*(\w+)\s+since\s+(.+?)\s*$", units) if isinstance(units, str) else None
        if m is None or m.group(1).lower() not in _UNIT_SECONDS:
            raise DataError(
                f"{path}: variable '{name}' has numeric values but no CF units attribute "
                f"'<unit> since <date>' (got {units!r})"
            )
        calendar = str(arr.attrs.get("calendar", "standard")).lower()
        if calendar not in _CALENDARS:
            raise DataError(f"{path}: variable '{name}' uses calendar {calendar!r}; only {', '.join(_CALENDARS)}")
        try:
            ref = _parse_reference_date(m.group(2))
        except ValueError:
            raise DataError(f"{path}: variable '{name}': cannot parse the reference date of units {units!r}") from None
        step = _UNIT_SECONDS[m.group(1).lower()]
        if np.issubdtype(values.dtype, np.integer) and float(step).is_integer():
            offset = values.astype(np.int64) * int(step)
        else:
            offset = np.rint(values.astype(np.float64) * step).astype(np.int64)
        seconds = (ref - _EPOCH).astype(np.int64) + offset
    else:
        raise DataError(
            f"{path}: variable '{name}' has dtype {values.dtype}, expected datetime64 or CF-encoded numbers"
        )
    if np.any(seconds % 3600):
        k = int(np.flatnonzero(seconds % 3600)[0])
        raise DataError(
            f"{path}: variable '{name}' entry {k} ({np.datetime64(int(seconds[k]), 's')}) is not on a whole hour"
        )
    hours = seconds // 3600
    if np.any(np.diff(hours) <= 0):
        k = int(np.flatnonzero(np.diff(hours) <= 0)[0])
        raise DataError(f"{path}: variable '{name}' is not strictly increasing at index {k + 1}")
    return hours


def hour_of(year: int, month: int = 1, day: int = 1, hour: int = 0) -> int:
    """Hours since 1970-01-01 UTC of a calendar hour."""
    return int(np.datetime64(f"{year:04d}-{month:02d}-{day:02d}T{hour:02d}", "h").astype(np.int64))


def sample_hour_bounds(years) -> tuple[int, int]:
    """The reference's first and last state hour for ``years``: Jan 1 00:00 of the first year
    (Aug 1 01:00 if it is 2018, when HRRR v3 starts) to Dec 31 23:00 of the last (Dec 15 00:00 if
    it is 2022, where the recipe's data end)."""
    first, last = min(years), max(years)
    start = hour_of(2018, 8, 1, 1) if first == 2018 else hour_of(first)
    end = hour_of(2022, 12, 15, 0) if last == 2022 else hour_of(last, 12, 31, 23)
    return start, end


# ----------------------------------------------------------------- the missing-samples file


def _guarded_scalar(real):
    def scalar(dtype, *args):
        if not isinstance(dtype, np.dtype) or dtype.kind not in "MmUS":
            raise Refused(f"a numpy scalar of dtype {dtype!r} is not allowed")
        return real(dtype, *args)

    return scalar


def _guarded_reconstruct(real):
    """numpy pickles an array as ``_reconstruct(ndarray, (0,), b"b")`` then its state (BUILD):
    only that empty start is made here; the contents come from the checked state."""

    def reconstruct(subtype, shape, typecode):
        if subtype is not np.ndarray or shape != (0,) or typecode != b"b":
            raise Refused(f"an array made as {subtype!r}, {shape!r}, {typecode!r} is not allowed")
        return real(subtype, shape, typecode)

    return reconstruct


def _latin1(text, encoding="utf-8"):
    """Pickle protocol 2 writes bytes as ``_codecs.encode(text, "latin1")``; other codecs (hex
    doubles its input at each call) are refused."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise Refused(f"encoding with {encoding!r} is not allowed")
    return text.encode("latin-1")


def _allowed_globals() -> tuple[dict, list]:
    """What the pickle may name, and what of that it may call (not ``ndarray`` itself: made over
    a raw buffer, an object array reads file bytes as object pointers)."""
    try:
        from numpy._core import multiarray as ma
    except ImportError:  # numpy 1.x
        from numpy.core import multiarray as ma
    scalar, reconstruct = _guarded_scalar(ma.scalar), _guarded_reconstruct(ma._reconstruct)
    datetimes = {("datetime", n): getattr(_dt, n) for n in ("datetime", "date", "timedelta", "timezone")}
    allowed = {("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): np.dtype, ("_codecs", "encode"): _latin1}
    allowed.update(datetimes)
    for module in ("numpy.core.multiarray", "numpy._core.multiarray"):
        allowed[(module, "_reconstruct")] = reconstruct
        allowed[(module, "scalar")] = scalar
    return allowed, [np.dtype, _latin1, scalar, reconstruct, *datetimes.values()]


def _check_built(obj) -> None:
    """A dtype's pickled state can rewrite its flags: an object dtype without its "holds
    objects" flag makes numpy read the array's raw bytes as object pointers. Every dtype built
    must equal numpy's own for its type string, flags included."""
    if isinstance(obj, np.dtype):
        own = np.dtype(obj.str)
        if obj.kind not in "OMmUS" or obj != own or obj.flags != own.flags or obj.itemsize != own.itemsize:
            raise Refused(f"a dtype with altered state ({obj.str}, flags {obj.flags}) is not allowed")


def _safe_unpickler(fp):
    """Only numpy arrays (object, datetime or string dtypes) and datetime objects."""
    allowed, callables = _allowed_globals()
    return RestrictedUnpickler(fp, allowed, callables, (np.ndarray, np.dtype), _check_built)


def _read_npy_header(fp, path: Path):
    from numpy.lib import format as npy

    try:
        version = npy.read_magic(fp)
        if version == (1, 0):
            shape, fortran, dtype = npy.read_array_header_1_0(fp)
        elif version == (2, 0):
            shape, fortran, dtype = npy.read_array_header_2_0(fp)
        else:
            shape, fortran, dtype = npy._read_array_header(fp, version)
    except Exception as exc:
        raise DataError(f"{path}: not a .npy file ({type(exc).__name__}: {exc})") from None
    return shape, fortran, dtype


def _to_hours(values: np.ndarray, path: Path) -> np.ndarray:
    flat = values.reshape(-1)
    if np.issubdtype(flat.dtype, np.datetime64):
        seconds = (flat.astype("datetime64[s]") - _EPOCH).astype(np.int64)
    else:
        seconds = np.empty(len(flat), dtype=np.int64)
        for k, v in enumerate(flat.tolist() if flat.dtype.kind in "US" else flat):
            if isinstance(v, _dt.datetime):
                if v.tzinfo is not None:
                    v = v.astimezone(_dt.UTC).replace(tzinfo=None)
                s = np.datetime64(v, "s")
            elif isinstance(v, _dt.date):
                s = np.datetime64(v, "s")
            elif isinstance(v, np.datetime64):
                s = v.astype("datetime64[s]")
            elif isinstance(v, (str, bytes)):
                try:
                    s = _parse_reference_date(v.decode() if isinstance(v, bytes) else v)
                except ValueError:
                    raise DataError(f"{path}: entry {k} ({v!r}) is not a date and time") from None
            else:
                raise DataError(f"{path}: entry {k} is a {type(v).__name__}, expected a datetime")
            if np.isnat(s):
                raise DataError(f"{path}: entry {k} is NaT")
            seconds[k] = (s - _EPOCH).astype(np.int64)
    seconds = seconds[seconds % 3600 == 0]  # an hour that is not whole matches no sample
    return np.unique(seconds // 3600)


def load_missing_hours(path: str | Path) -> np.ndarray:
    """The hours (int64 since 1970-01-01 UTC, sorted, unique) listed in a missing-samples ``.npy``.

    Accepts a ``datetime64`` or ISO-string array (no pickle), or the reference's object array of
    ``datetime`` objects (a pickle), read with a restricted unpickler: a pickle that names anything
    but numpy's array reconstruction and ``datetime`` types is refused (DataError, one line naming
    the file) before any of it runs.
    """
    path = Path(path)
    try:
        raw = untrusted.read_bytes(path)  # a regular file of bounded size: never a pipe's wait or /dev/zero
    except OSError as exc:
        raise DataError(f"{path}: cannot read the missing-samples file ({exc.strerror or exc})") from None
    except untrusted.BadFile as exc:
        raise DataError(f"cannot read the missing-samples file: {exc}") from None
    fp = io.BytesIO(raw)
    shape, fortran, dtype = _read_npy_header(fp, path)
    if not dtype.hasobject:
        try:
            values = np.load(io.BytesIO(raw), allow_pickle=False)
        except Exception as exc:
            raise DataError(f"{path}: cannot read the missing-samples array ({type(exc).__name__}: {exc})") from None
        if values.dtype.kind not in "MUS":
            raise DataError(
                f"{path}: missing samples have dtype {values.dtype}; expected datetime64, "
                f"ISO strings or datetime objects"
            )
        return _to_hours(values, path)
    try:
        values = _safe_unpickler(fp).load()
    except Refused as exc:
        raise DataError(
            f"{path}: refused to unpickle the missing-samples file: {exc}; only "
            f"numpy arrays of datetimes or strings are allowed (save it as datetime64: "
            f"np.save(path, np.array(times, dtype='datetime64[h]')))"
        ) from None
    except Exception as exc:
        raise DataError(f"{path}: cannot unpickle the missing-samples array ({type(exc).__name__}: {exc})") from None
    if not isinstance(values, np.ndarray):
        raise DataError(f"{path}: the pickle holds a {type(values).__name__}, expected a numpy array of datetimes")
    return _to_hours(values, path)


# ----------------------------------------------------------------- interpolation


def _axis_weights(coord: np.ndarray, points: np.ndarray, periodic: bool, what: str, path: Path):
    """Bracketing indices ``(a, b)`` and weight ``w`` of ``b`` for ``points`` on a monotone 1-D ``coord``:
    value = (1 - w) v[a] + w v[b]. ``periodic`` (a global longitude) wraps past the last point."""
    n = len(coord)
    c = np.asarray(coord, dtype=np.float64)
    descending = n > 1 and c[-1] < c[0]
    if descending:
        c = c[::-1]
    if n < 2 or np.any(np.diff(c) <= 0):
        raise DataError(f"{path}: coordinate '{what}' is not strictly monotonic with >= 2 points")
    if periodic:
        c = np.append(c, c[0] + 360.0)
    p = np.asarray(points, dtype=np.float64)
    k = np.clip(np.searchsorted(c, p, side="right") - 1, 0, len(c) - 2)
    w = (p - c[k]) / (c[k + 1] - c[k])
    bad = ~((w >= -1e-9) & (w <= 1 + 1e-9))
    if bad.any():
        v = float(p.reshape(-1)[int(np.flatnonzero(bad.reshape(-1))[0])])
        raise DataError(
            f"{path}: coordinate '{what}' spans [{c[0]:.4f}, {c[-1]:.4f}] but the HRRR region needs "
            f"{v:.4f}: the ERA5 grid does not cover the region"
        )
    w = np.clip(w, 0.0, 1.0)
    a, b = k, k + 1
    if periodic:
        b = b % n
    if descending:
        a, b = n - 1 - a, n - 1 - b
    return a.astype(np.int64), b.astype(np.int64), w


class LatLonBilinear:
    """Linear interpolation from a regular 1-D (latitude, longitude) grid onto 2-D points.

    Built once from the coordinates: per point the two bracketing latitude and longitude
    indices and the four bilinear weights. Longitudes are compared modulo 360 (HRRR in
    -180..180 against ERA5 in 0..360 is fine); a grid whose longitudes go round the globe
    wraps past its last column. A point outside the grid is a DataError naming the store.

    :meth:`band` gives what a band of rows needs: the ERA5 window (lat and lon index
    ranges) and, per point, the flat indices into that window and the weights; :meth:`apply`
    evaluates it on a ``(C, window lat, window lon)`` array. The arithmetic per point does not
    depend on the window, so a band equals the same rows of the whole grid bit for bit.
    """

    def __init__(self, lat1d, lon1d, lat2d, lon2d, path: Path):
        lat1d = np.asarray(lat1d, dtype=np.float64)
        lon1d = np.asarray(lon1d, dtype=np.float64)
        lat2d = np.asarray(lat2d, dtype=np.float64)
        lon2d = np.asarray(lon2d, dtype=np.float64)
        if lat2d.shape != lon2d.shape or lat2d.ndim != 2:
            raise ValueError(f"latitude {lat2d.shape} and longitude {lon2d.shape} must be one 2-D shape")
        if not (np.isfinite(lat2d).all() and np.isfinite(lon2d).all()):
            raise DataError(f"{path}: non-finite HRRR latitude/longitude")
        self.shape = lat2d.shape
        self.n_lat, self.n_lon = len(lat1d), len(lon1d)
        step = np.abs(np.diff(lon1d)).mean() if len(lon1d) > 1 else 0.0
        periodic = len(lon1d) > 1 and abs(step * len(lon1d) - 360.0) < 0.5 * step
        lon_min = lon1d.min()
        lon_pts = lon_min + np.mod(lon2d - lon_min, 360.0)  # into [lon_min, lon_min + 360)
        if not periodic:  # a regional grid: a point just past its east edge wraps to the west
            lon_pts = np.where(lon_pts > lon1d.max() + 1e-9, lon_pts - 360.0, lon_pts)
        self.lat_a, self.lat_b, wy = _axis_weights(lat1d, lat2d, False, layout.PN_LAT, path)
        self.lon_a, self.lon_b, wx = _axis_weights(lon1d, lon_pts, periodic, layout.PN_LON, path)
        # value = w_aa v[a, a] + w_ab v[a, b] + w_ba v[b, a] + w_bb v[b, b]   (lat index first)
        self.weights = np.stack([(1 - wy) * (1 - wx), (1 - wy) * wx, wy * (1 - wx), wy * wx]).astype(np.float32)
        self._bands: dict[tuple[int, int], tuple] = {}

    def band(self, rows: slice):
        """``(lat slice, lon slice, flat indices (4, n), weights (4, n))`` for ``rows`` (cached)."""
        key = (rows.start, rows.stop)
        hit = self._bands.get(key)
        if hit is not None:
            return hit
        la, lb = self.lat_a[rows], self.lat_b[rows]
        ja, jb = self.lon_a[rows], self.lon_b[rows]
        y0, y1 = int(min(la.min(), lb.min())), int(max(la.max(), lb.max())) + 1
        x0, x1 = int(min(ja.min(), jb.min())), int(max(ja.max(), jb.max())) + 1
        width = x1 - x0
        idx = np.stack(
            [
                (la - y0) * width + (ja - x0),
                (la - y0) * width + (jb - x0),
                (lb - y0) * width + (ja - x0),
                (lb - y0) * width + (jb - x0),
            ]
        ).reshape(4, -1)
        w = np.ascontiguousarray(self.weights[:, rows].reshape(4, -1))
        hit = (slice(y0, y1), slice(x0, x1), idx, w)
        if len(self._bands) < 64:
            self._bands[key] = hit
        return hit

    @staticmethod
    def apply(window: np.ndarray, idx: np.ndarray, w: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
        """Interpolate ``window`` (C, lat, lon) float32 at the band's points: (C, rows, cols) float32."""
        flat = window.reshape(window.shape[0], -1)
        out = flat[:, idx[0]] * w[0]
        out += flat[:, idx[1]] * w[1]
        out += flat[:, idx[2]] * w[2]
        out += flat[:, idx[3]] * w[3]
        return out.reshape((window.shape[0],) + tuple(shape))

    def __call__(self, field: np.ndarray, rows: slice | None = None) -> np.ndarray:
        """Interpolate a whole (C, n_lat, n_lon) field at the points of ``rows`` (all if None)."""
        rows = slice(0, self.shape[0]) if rows is None else rows
        ys, xs, idx, w = self.band(rows)
        window = np.ascontiguousarray(np.asarray(field, dtype=np.float32)[:, ys, xs])
        return self.apply(window, idx, w, (rows.stop - rows.start, self.shape[1]))
