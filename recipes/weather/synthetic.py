"""Small synthetic HRRR/ERA5 stores in the StormCast layout (or StormScope's), with learnable dynamics.

``write_synthetic(root)`` writes the layout described in
:mod:`recipes.weather.layout` and returns ``root``. The data follow a known
rule, so a small network (or even a linear stencil) can beat persistence:

* ERA5 background ``B_j(t, y, x)`` (dimensionless, ``|B| <= 1``): a few
  low-wavenumber travelling waves per channel with periods of 12-48 hours,
  i.e. smooth in space and slowly changing compared with the hourly step.
* Invariants: a land-sea mask in ``[0, 1]`` and a non-negative orography (m),
  built from smooth random fields; other names get a smooth random field.
* HRRR anomalies ``q_c`` (dimensionless) are integrated hour by hour on the
  periodic grid::

      q <- q - upwind(u, v) . grad q + kappa * lap q + r_c (F_c - q) + noise

  where the steering wind ``(u, v)`` in grid cells per hour is an affine
  function of the first two ERA5 channels (``|u| + |v| <= 0.55``), ``kappa =
  0.04`` and ``r_c`` in ``[0.10, 0.20]``; the scheme (first-order upwind plus
  explicit diffusion plus relaxation) is monotone, hence stable, because the
  centre coefficient stays positive. The forcing ``F_c`` is a fixed linear mix
  of the ERA5 background and the standardised invariants; the noise is white
  with standard deviation 0.003 (small next to the deterministic change, so
  the hourly change is mostly learnable). Each year is spun up for 48 hours first.
* Stored values are ``mean + scale * field`` with per-channel physical
  ``(mean, scale)`` guessed from the name (:func:`physical_scale`): e.g.
  temperatures ~280 +- 10 K, winds ~0 +- 5 m/s, pressures ~101325 +- 1000 Pa,
  so normalisation matters.

Given ``state_channels`` / ``background_channels`` (``--state-channels`` /
``--background-channels``) instead of ``hrrr_channels`` / ``era5_channels``, the same fields are
written under StormScope's names (:data:`recipes.weather.layout.STORMSCOPE`): ``state/`` and
``background/`` year stores, ``stats/state_*.npy`` and ``background_*.npy``, a manifest with
those keys.

Writing is atomic: everything goes to a temporary directory next to ``root``
which is then renamed into place, so a reader never sees a half-written store.
If ``root`` already holds a complete synthetic store written with the same
parameters nothing is written; a concurrent writer that loses the rename race
discards its copy and uses the winner's. The time-series arrays are chunked
``(1, channel_chunk, row_chunk, x)`` (all of a store's channels by default: a tiny sample's
channel chunks would cost more in zarr's per-chunk overhead than in bytes) and grouped into
shards of 24 hours x those channels x all rows, which keeps the file count (and write time) low.

CLI::

    python -m recipes.weather.synthetic --root DIR --height 64 --width 64 \\
        --years 2020 2021 --hours-per-year 200 \\
        --hrrr-channels u10m v10m t2m msl --era5-channels u850 v850 t850
    python -m recipes.weather.synthetic --root DIR --state-channels abi08 abi13 refc \\
        --background-channels u850 v850 t850          # StormScope's stores
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import zarr

from framework import untrusted
from framework.errors import Terminated, sigterm_raises
from recipes.weather import layout

DEFAULT_HRRR_CHANNELS = ("u10m", "v10m", "t2m", "msl")
DEFAULT_ERA5_CHANNELS = ("u850", "v850", "t850")
DEFAULT_INVARIANTS = ("lsm", "orog")
DEFAULT_HOURS_PER_YEAR = 360  # data=synthetic's: a store the CLI writes is the one that config asks for
DEFAULT_HRRR_SPACING = 0.25  # degrees between HRRR grid points (latlon / physicsnemo stores)
DEFAULT_ERA5_SPACING = 1.0  # degrees of the coarser regular ERA5 grid

SHARD_HOURS = 24  # hours per shard of the time-series arrays
BLOCK_HOURS = 24  # hours generated at a time (at most)
SPINUP_HOURS = 48
KAPPA = 0.04  # diffusion, grid cells^2 per hour
NOISE_STD = 0.003  # dimensionless, per hour
FORCING_GAIN = 2.0  # scales the forcing (and so the fields' variability)
WIND_DRIFT = (0.10, -0.05)  # mean steering wind (u, v), grid cells per hour
WIND_GAIN = 0.20  # steering wind per unit of the dimensionless background

_MANIFEST_FORMAT = 1


def physical_scale(name: str) -> tuple[float, float]:
    """``(mean, scale)`` that turns a dimensionless field into channel ``name``'s units.

    Chosen from the name's prefix: ``u*``/``v*`` winds (m/s), ``t*`` temperatures
    (K), ``msl``/``sp``/``p*`` pressures (Pa), ``z*`` geopotential (m^2/s^2),
    ``q*`` specific humidity (kg/kg), ``refc`` reflectivity (dBZ), ``abi*`` satellite
    brightness temperatures (K, StormScope's GOES bands); otherwise ``(0, 1)``.
    """
    n = name.lower()
    if n.startswith("refc"):
        return 10.0, 8.0
    if n.startswith("abi"):
        return 250.0, 20.0
    if n.startswith("u"):
        return 2.0, 5.0
    if n.startswith("v"):
        return 0.0, 5.0
    if n.startswith("t"):
        return 280.0, 10.0
    if n in ("msl", "sp") or n.startswith(("msl", "p")):
        return 101325.0, 1000.0
    if n.startswith("z"):
        return 55000.0, 1500.0
    if n.startswith("q"):
        return 0.008, 0.003
    return 0.0, 1.0


# ----------------------------------------------------------------- fields


def _grid(height: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    y = np.arange(height, dtype=np.float64)[:, None] / height
    x = np.arange(width, dtype=np.float64)[None, :] / width
    return y, x


_WAVEVECTORS = ((1, 0), (0, 1), (1, 1), (1, -1), (2, 0), (0, 2), (2, 1), (1, 2), (2, -1))


def _smooth_field(rng: np.random.Generator, height: int, width: int, n_modes: int = 5) -> np.ndarray:
    """A periodic, smooth random field with zero mean and unit standard deviation."""
    y, x = _grid(height, width)
    field = np.zeros((height, width))
    picks = rng.choice(len(_WAVEVECTORS), size=n_modes, replace=False)
    for p in picks:
        kx, ky = _WAVEVECTORS[p]
        field += rng.uniform(0.5, 1.0) * np.cos(2 * np.pi * (kx * x + ky * y) + rng.uniform(0, 2 * np.pi))
    field -= field.mean()
    std = field.std()
    return field / std if std > 0 else field


def _invariant(name: str, rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    base = _smooth_field(rng, height, width)
    n = name.lower()
    if n == "lsm" or "land" in n:
        return 1.0 / (1.0 + np.exp(-3.0 * base))
    if n.startswith("orog") or n in ("z", "zsfc", "hgt"):
        return 400.0 * np.maximum(base + 0.3, 0.0) ** 1.5
    return base


class _Background:
    """Travelling low-wavenumber waves: ``B_j(t) = sum_m a_jm cos(2 pi k_m . x + phi_jm - w_jm t)``.

    Separable in space and time (``cos(P - wt) = cos P cos wt + sin P sin wt``),
    so fields at many hours are one small matrix product.
    """

    def __init__(
        self,
        rng: np.random.Generator,
        n_channels: int,
        height: int,
        width: int,
        n_modes: int = 4,
        points: tuple[np.ndarray, np.ndarray] | None = None,
    ):
        # points: (y, x) in units of the HRRR domain (row / height, col / width), any 2-D shape
        # (the ERA5 lat/lon grid); default the HRRR grid itself
        y, x = _grid(height, width) if points is None else points
        y, x = np.broadcast_arrays(y, x)
        self.shape = (n_channels,) + y.shape
        self.patterns = np.zeros((n_channels, 2 * n_modes, y.size))  # (C, 2M, points)
        self.amps = np.zeros((n_channels, n_modes))
        self.omegas = np.zeros((n_channels, n_modes))
        for j in range(n_channels):
            picks = rng.choice(len(_WAVEVECTORS), size=n_modes, replace=False)
            amps = rng.uniform(0.5, 1.0, size=n_modes)
            self.amps[j] = amps / amps.sum()  # |B| <= 1
            periods = rng.uniform(12.0, 48.0, size=n_modes) * rng.choice([-1.0, 1.0], size=n_modes)
            self.omegas[j] = 2 * np.pi / periods
            phases = rng.uniform(0, 2 * np.pi, size=n_modes)
            for m, p in enumerate(picks):
                kx, ky = _WAVEVECTORS[p]
                arg = 2 * np.pi * (kx * x + ky * y) + phases[m]
                self.patterns[j, m] = np.cos(arg).ravel()
                self.patterns[j, n_modes + m] = np.sin(arg).ravel()

    def _coefficients(self, hours: np.ndarray) -> np.ndarray:
        wt = np.asarray(hours, dtype=np.float64)[:, None, None] * self.omegas[None]  # (T, C, M)
        return np.concatenate([self.amps * np.cos(wt), self.amps * np.sin(wt)], axis=-1)  # (T, C, 2M)

    def __call__(self, hours: np.ndarray) -> np.ndarray:
        """Fields at absolute ``hours`` (1-D): shape ``(T, C, H, W)``."""
        coef = self._coefficients(hours)
        out = np.einsum("tjm,jmp->tjp", coef, self.patterns)
        return out.reshape((len(coef),) + self.shape)

    def mix(self, hours: np.ndarray, weights: np.ndarray) -> np.ndarray:
        """``sum_j weights[c, j] * B_j`` at ``hours``: shape ``(T, C_out, H, W)``."""
        n_out = weights.shape[0]
        n_time = len(hours)
        c, h, w = self.shape
        if c == 0:
            return np.zeros((n_time, n_out, h, w))
        coef = self._coefficients(hours).reshape(n_time, -1)  # (T, C*2M)
        mixed = weights.T[:, None, :, None] * self.patterns[:, :, None, :]  # (C, 2M, C_out, HW)
        return (coef @ mixed.reshape(coef.shape[1], -1)).reshape(n_time, n_out, h, w)


def _steering_wind(background: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(u, v) in grid cells per hour from a dimensionless background ``(..., C, H, W)``."""
    c = background.shape[-3]
    shape = background.shape[:-3] + background.shape[-2:]
    u = WIND_DRIFT[0] + (WIND_GAIN * background[..., 0, :, :] if c >= 1 else np.zeros(shape))
    v = WIND_DRIFT[1] + (WIND_GAIN * background[..., 1, :, :] if c >= 2 else np.zeros(shape))
    return u, v


class _Geometry:
    """2-D HRRR latitude/longitude (a rotated, regular grid round the middle of CONUS, longitudes
    in -180..180) and a coarser regular ERA5 grid covering it with a margin (latitudes
    descending, longitudes in 0..360, as ERA5 has them); ``era5_points`` are the ERA5 nodes in
    units of the HRRR domain, where the background waves are evaluated."""

    CENTRE = (38.5, -97.5)
    ROTATION_DEG = 8.0

    def __init__(self, height: int, width: int, hrrr_spacing: float, era5_spacing: float):
        th = np.deg2rad(self.ROTATION_DEG)
        # (dlat, dlon) per (di, dj)
        self.rot = np.array([[np.cos(th), np.sin(th)], [-np.sin(th), np.cos(th)]]) * hrrr_spacing
        self.centre = np.array([(height - 1) / 2, (width - 1) / 2])
        i, j = np.meshgrid(np.arange(height, dtype=np.float64), np.arange(width, dtype=np.float64), indexing="ij")
        d = np.stack([i - self.centre[0], j - self.centre[1]])  # (2, H, W)
        self.lat2d = self.CENTRE[0] + self.rot[0, 0] * d[0] + self.rot[0, 1] * d[1]
        self.lon2d = self.CENTRE[1] + self.rot[1, 0] * d[0] + self.rot[1, 1] * d[1]
        s = float(era5_spacing)
        margin = 2 * s
        lat_hi = np.ceil((self.lat2d.max() + margin) / s) * s
        lat_lo = np.floor((self.lat2d.min() - margin) / s) * s
        lon_lo = np.floor((self.lon2d.min() + 360.0 - margin) / s) * s
        lon_hi = np.ceil((self.lon2d.max() + 360.0 + margin) / s) * s
        self.lat1d = np.round(np.arange(lat_hi, lat_lo - s / 2, -s), 6)
        self.lon1d = np.round(np.arange(lon_lo, lon_hi + s / 2, s), 6)
        # ERA5 nodes -> fractional HRRR (i, j) -> domain units (i / H, j / W)
        glat, glon = np.meshgrid(self.lat1d, self.lon1d - 360.0, indexing="ij")
        ij = np.linalg.solve(self.rot, np.stack([glat.ravel() - self.CENTRE[0], glon.ravel() - self.CENTRE[1]]))
        self.era5_points = (
            (ij[0] + self.centre[0]).reshape(glat.shape) / height,
            (ij[1] + self.centre[1]).reshape(glat.shape) / width,
        )


def _step(q: np.ndarray, u: np.ndarray, v: np.ndarray, relax: np.ndarray, forcing: np.ndarray) -> np.ndarray:
    """One explicit hour: upwind advection + diffusion + relaxation (no noise). x is axis -1, y axis -2.

    The domain is periodic while the model pads with zeros, and this is kept on purpose: every
    field here is a sum of smooth periodic modes, so a field continues smoothly across the wrap
    and the value carried in from the opposite edge is what the edge's own neighbourhood predicts.
    Open (zero-gradient) edges were tried and left the model's error ring along the edges as it
    was (docs/stormcast.md, "Figures"): the ring is the zero-padded network learning its edges.
    """
    west = np.roll(q, 1, axis=-1)
    east = np.roll(q, -1, axis=-1)
    south = np.roll(q, 1, axis=-2)
    north = np.roll(q, -1, axis=-2)
    up, un = np.maximum(u, 0.0), np.minimum(u, 0.0)
    vp, vn = np.maximum(v, 0.0), np.minimum(v, 0.0)
    advection = up * (q - west) + un * (east - q) + vp * (q - south) + vn * (north - q)
    laplacian = west + east + south + north - 4.0 * q
    return q - advection + KAPPA * laplacian + relax * (forcing - q)


def _year_start_hours(year: int) -> int:
    return int(np.datetime64(f"{int(year):04d}-01-01T00", "h").astype(np.int64))


# ----------------------------------------------------------------- writing


def _naming(hrrr_channels, era5_channels, state_channels, background_channels):
    """(naming, state channels, background channels): StormScope's names when its channel lists are
    given, else StormCast's (its lists defaulting to DEFAULT_HRRR_CHANNELS, DEFAULT_ERA5_CHANNELS)."""
    if state_channels is None and background_channels is None:
        hrrr = DEFAULT_HRRR_CHANNELS if hrrr_channels is None else hrrr_channels
        return layout.STORMCAST, hrrr, DEFAULT_ERA5_CHANNELS if era5_channels is None else era5_channels
    if hrrr_channels is not None or era5_channels is not None:
        raise ValueError(
            "give hrrr_channels/era5_channels (StormCast's stores) or state_channels/background_channels "
            "(StormScope's), not both"
        )
    return layout.STORMSCOPE, state_channels or (), background_channels or ()


def _normalise_params(
    height,
    width,
    hrrr_channels,
    era5_channels,
    state_channels,
    background_channels,
    invariants,
    years,
    hours_per_year,
    seed,
    row_chunk,
    channel_chunk=0,
    layout_=layout.NATIVE,
    latlon=False,
    hrrr_spacing=DEFAULT_HRRR_SPACING,
    era5_spacing=DEFAULT_ERA5_SPACING,
    missing=None,
) -> dict:
    naming, state, background = _naming(hrrr_channels, era5_channels, state_channels, background_channels)
    params = {
        "format": _MANIFEST_FORMAT,
        "height": int(height),
        "width": int(width),
        naming.keys[0]: [str(c) for c in state],
        naming.keys[1]: [str(c) for c in background],
        "invariants": [str(c) for c in invariants],
        "years": [int(y) for y in years],
        "hours_per_year": int(hours_per_year),
        "seed": int(seed),
        "row_chunk": int(row_chunk),
        "channel_chunk": int(channel_chunk),
    }
    if params["height"] < 2 or params["width"] < 2:
        raise ValueError(f"height and width must be >= 2, got {params['height']}x{params['width']}")
    if params["hours_per_year"] < 1:
        raise ValueError(f"hours_per_year must be >= 1, got {params['hours_per_year']}")
    if params["row_chunk"] < 1:
        raise ValueError(f"row_chunk must be >= 1, got {params['row_chunk']}")
    if params["channel_chunk"] < 0:
        raise ValueError(f"channel_chunk must be >= 0 (0: all of a store's channels), got {params['channel_chunk']}")
    if not params[naming.keys[0]]:
        raise ValueError(f"need at least one {naming.labels[0]} channel")
    if not params["years"]:
        raise ValueError("need at least one year")
    for key in (*naming.channel_keys, "years"):
        if len(set(params[key])) != len(params[key]):
            raise ValueError(f"duplicate entries in {key}: {params[key]}")
    if layout_ not in layout.LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(layout.LAYOUTS)}, got {layout_!r}")
    if layout_ == layout.PHYSICSNEMO and naming is not layout.STORMCAST:
        raise ValueError(f"the physicsnemo layout is StormCast's; write {naming.recipe}'s stores in the native one")
    # keys beyond the original ones only when they differ from the defaults, so the manifest of
    # a store written before they existed still matches
    if layout_ == layout.PHYSICSNEMO or latlon:
        if not 0 < float(hrrr_spacing) < float(era5_spacing) <= 10:
            raise ValueError(f"need 0 < hrrr_spacing < era5_spacing <= 10 degrees, got {hrrr_spacing}, {era5_spacing}")
        params.update(latlon=True, hrrr_spacing=float(hrrr_spacing), era5_spacing=float(era5_spacing))
    if layout_ == layout.PHYSICSNEMO:
        if missing is None:
            missing = [f"{params['years'][0]:04d}-01-01T05"]
        hours = []
        for m in missing:
            try:
                hours.append(str(np.datetime64(str(m), "h")))
            except ValueError:
                raise ValueError(f"missing: {m!r} is not an ISO date and hour") from None
        params.update(layout=layout_, missing=sorted(set(hours)))
    elif missing:
        raise ValueError("missing samples are a feature of the physicsnemo layout")
    return params


def _read_manifest(root: Path) -> dict | None:
    """The manifest's parameters; None when there is none or it cannot be one (any JSON, any depth)."""
    path = layout.manifest_file(root)
    try:
        return untrusted.mapping(untrusted.read_json(path), str(path))
    except (OSError, ValueError):
        return None


# How the bytes are chunked changes no sample: a store written with another chunking (or
# before the key existed) serves the same request.
_STORAGE_ONLY = ("channel_chunk",)


def _identity(params: dict) -> dict:
    return {k: v for k, v in params.items() if k not in _STORAGE_ONLY}


def _check_existing(root: Path, params: dict) -> bool:
    """True if ``root`` holds the complete store for ``params``; raise if it holds something else."""
    if not root.exists():
        return False
    manifest = _read_manifest(root)
    if manifest is None:
        if root.is_dir() and not any(root.iterdir()):
            return False  # an empty directory: the rename replaces it
        raise FileExistsError(
            f"{root} exists but is not a complete synthetic store (no valid {layout.SYNTHETIC_MANIFEST}); "
            "refusing to overwrite it"
        )
    if _identity(manifest) != _identity(params):
        diff = {k: (manifest.get(k), v) for k, v in _identity(params).items() if manifest.get(k) != v}
        raise FileExistsError(
            f"{root} already holds a synthetic store written with other parameters (existing, requested): {diff}"
        )
    return True


def _create_time_series(group, data: np.ndarray, hours: np.ndarray, row_chunk: int, channel_chunk: int) -> None:
    n_time, n_chan, height, width = data.shape
    chunks = layout.time_series_chunks(height, width, row_chunk, min(channel_chunk or n_chan, max(n_chan, 1)))
    rows_per_shard = -(-height // chunks[2]) * chunks[2]
    shards = (min(SHARD_HOURS, n_time), chunks[1], rows_per_shard, width)
    arr = group.create_array(
        layout.DATA_VAR,
        shape=data.shape,
        dtype="float32",
        chunks=chunks,
        shards=shards,
        compressors=None,
        fill_value=float("nan"),
        dimension_names=layout.TIME_SERIES_DIMS,
    )
    arr[...] = data
    tarr = group.create_array(
        layout.TIME_VAR,
        shape=hours.shape,
        dtype="int64",
        chunks=hours.shape,
        compressors=None,
        fill_value=0,
        dimension_names=(layout.TIME_SERIES_DIMS[0],),
        attributes={"units": layout.TIME_UNITS},
    )
    tarr[...] = hours


def _v2_array(group, name: str, values: np.ndarray, dims: Sequence[str], chunks=None, attributes=None):
    """An xarray-style zarr v2 array: dimension names in ``_ARRAY_DIMENSIONS``, no compression."""
    values = np.asarray(values)
    attrs = {layout.PN_DIMS_ATTR: list(dims), **(attributes or {})}
    if values.dtype.kind in "OT":  # variable-length strings (xarray's object-dtype coordinates)
        arr = group.create_array(name, shape=values.shape, dtype=str, chunks=values.shape, attributes=attrs)
    else:
        arr = group.create_array(
            name,
            shape=values.shape,
            dtype=values.dtype,
            chunks=chunks or values.shape,
            compressors=None,
            attributes=attrs,
        )
    arr[...] = values
    return arr


def _pn_year_folder(year: int, years: Sequence[int]) -> str:
    """train/ for all but the last year, valid/ for the last (as the reference's stores sit)."""
    return layout.PN_VALID_DIR if len(years) > 1 and year == max(years) else layout.PN_TRAIN_DIR


def _write_pn_year(
    out: Path, source: str, year: int, years, data: np.ndarray, hours: np.ndarray, names, geo, row_chunk: int
) -> None:
    folder = layout.pn_hrrr_dir(out) if source == layout.HRRR else layout.pn_era5_dir(out)
    store = folder / _pn_year_folder(year, years) / f"{year}.zarr"
    store.parent.mkdir(parents=True, exist_ok=True)
    group = zarr.create_group(str(store), zarr_format=2)
    n_time, _, h, w = data.shape
    if source == layout.HRRR:
        # CF-encoded datetime64, as xarray writes it; fixed-width string channel names
        _v2_array(
            group,
            layout.PN_HRRR_VAR,
            data,
            layout.PN_HRRR_DIMS,
            chunks=layout.time_series_chunks(h, w, row_chunk),
            attributes={"coordinates": f"{layout.PN_LAT} {layout.PN_LON}"},
        )
        _v2_array(
            group,
            layout.PN_TIME,
            hours - _year_start_hours(year),
            ("time",),
            attributes={"units": f"hours since {year:04d}-01-01 00:00:00", "calendar": "proleptic_gregorian"},
        )
        _v2_array(group, layout.PN_CHANNEL, np.array(names, dtype=str), ("channel",))
        _v2_array(group, layout.PN_LAT, geo.lat2d, ("y", "x"))
        _v2_array(group, layout.PN_LON, geo.lon2d, ("y", "x"))
    else:
        _v2_array(group, layout.PN_ERA5_VAR, data, layout.PN_ERA5_DIMS, chunks=(1, 1, h, w))
        _v2_array(
            group,
            layout.PN_TIME,
            hours,
            ("time",),
            attributes={"units": "hours since 1970-01-01", "calendar": "proleptic_gregorian"},
        )
        _v2_array(group, layout.PN_CHANNEL, np.array(names, dtype=object), ("channel",))  # variable-length
        _v2_array(group, layout.PN_LAT, geo.lat1d, ("latitude",), attributes={"units": "degrees_north"})
        _v2_array(group, layout.PN_LON, geo.lon1d, ("longitude",), attributes={"units": "degrees_east"})
    zarr.consolidate_metadata(str(store))


def _write_contents(out: Path, p: dict) -> None:
    """Write the whole layout under ``out`` (a fresh directory)."""
    from recipes.weather.physicsnemo_layout import LatLonBilinear

    height, width, row_chunk = p["height"], p["width"], p["row_chunk"]
    naming = layout.naming_of(p)
    state, background_src = naming.stores  # StormCast: hrrr, era5
    hrrr_names, era5_names, inv_names = (p[k] for k in naming.channel_keys)
    n_h, n_e = len(hrrr_names), len(era5_names)
    fmt, latlon = p.get("layout", layout.NATIVE), p.get("latlon", False)
    rng = np.random.default_rng(p["seed"])

    # invariants (physical units) and their standardised versions for the forcing
    inv = (
        np.stack([_invariant(n, rng, height, width) for n in inv_names]) if inv_names else np.zeros((0, height, width))
    )
    inv_std = inv.std(axis=(1, 2), keepdims=True)
    inv_hat = (inv - inv.mean(axis=(1, 2), keepdims=True)) / np.where(inv_std > 0, inv_std, 1.0)

    geo = interp = None
    if latlon:  # the background lives on a coarse lat/lon grid; the dynamics see it interpolated
        geo = _Geometry(height, width, p["hrrr_spacing"], p["era5_spacing"])
        background = _Background(rng, n_e, height, width, points=geo.era5_points)
        interp = LatLonBilinear(geo.lat1d, geo.lon1d, geo.lat2d, geo.lon2d, out)
    else:
        background = _Background(rng, n_e, height, width)
    w_bg = rng.normal(0.0, 0.3, size=(n_h, n_e))
    for c, hn in enumerate(hrrr_names):  # couple like to like (u10m <- u850, t2m <- t850)
        for j, en in enumerate(era5_names):
            if hn[:1].lower() == en[:1].lower():
                w_bg[c, j] += 0.8
    w_inv = rng.normal(0.0, 0.4, size=(n_h, len(inv_names)))
    const = rng.normal(0.0, 0.3, size=(n_h, 1, 1))
    relax = rng.uniform(0.10, 0.20, size=(n_h, 1, 1))
    w_bg *= FORCING_GAIN
    w_inv *= FORCING_GAIN
    inv_forcing = np.tensordot(w_inv, inv_hat, axes=1) + const if inv_names else np.zeros((n_h, height, width)) + const

    hrrr_scale = np.array([physical_scale(n) for n in hrrr_names], dtype=np.float64).reshape(n_h, 2)
    era5_scale = np.array([physical_scale(n) for n in era5_names], dtype=np.float64).reshape(n_e, 2)
    sums = {state: np.zeros((n_h, 2)), background_src: np.zeros((n_e, 2))}
    count = {state: 0, background_src: 0}
    era5_time_sum = None

    def on_hrrr_grid(fields: np.ndarray) -> np.ndarray:
        """(T, C, lat, lon) -> (T, C, H, W), interpolated as the dataset does."""
        t, c = fields.shape[:2]
        return interp(fields.reshape((t * c,) + fields.shape[2:])).reshape(t, c, height, width)

    for year in p["years"]:
        year_rng = np.random.default_rng([p["seed"], year])
        n_time = p["hours_per_year"]
        start = _year_start_hours(year)
        hours_all = np.arange(start - SPINUP_HOURS, start + n_time, dtype=np.int64)
        hrrr = np.empty((n_time, n_h, height, width), dtype=np.float32)
        era5_blocks = []
        q = None
        # a block of hours at a time: memory bounded by ~256 MB of float64 forcing
        block_hours = max(1, min(BLOCK_HOURS, int(256e6 // (8 * max(n_h, 1) * height * width))))
        for b0 in range(0, len(hours_all), block_hours):
            block = hours_all[b0 : b0 + block_hours]
            bg = background(block)  # (B, C_e, H, W), or (B, C_e, lat, lon) on the ERA5 grid
            if latlon:
                bg_h = on_hrrr_grid(bg.astype(np.float32)).astype(np.float64)
                u, v = _steering_wind(bg_h)
                forcing = np.einsum("cj,tjhw->tchw", w_bg, bg_h) if n_e else np.zeros((len(block), n_h, height, width))
                del bg_h
            else:
                u, v = _steering_wind(bg)
                forcing = background.mix(block, w_bg)
            forcing += inv_forcing
            if q is None:
                q = forcing[0] + 0.5 * np.stack([_smooth_field(year_rng, height, width) for _ in range(n_h)])
            for k in range(len(block)):
                if b0 + k >= SPINUP_HOURS:
                    hrrr[b0 + k - SPINUP_HOURS] = q
                q = _step(q, u[k], v[k], relax, forcing[k])
                noise = year_rng.standard_normal((n_h, height, width), dtype=np.float32)
                noise *= NOISE_STD
                q += noise
            keep = max(0, SPINUP_HOURS - b0)
            if keep < len(block):
                era5_blocks.append(bg[keep:].astype(np.float32))
            del bg, forcing, u, v

        hours = hours_all[SPINUP_HOURS:]
        era5 = np.concatenate(era5_blocks)
        del era5_blocks
        for source, data, names, scale in (
            (state, hrrr, hrrr_names, hrrr_scale),
            (background_src, era5, era5_names, era5_scale),
        ):
            # to physical units, in place: mean + scale * field
            data *= scale[:, 1].astype(np.float32)[:, None, None]
            data += scale[:, 0].astype(np.float32)[:, None, None]
            # statistics over the stored grid (ERA5's own lat/lon grid when it has one), about the
            # nominal mean (no cancellation in float64)
            for c in range(len(names)):
                x = data[:, c].astype(np.float64) - scale[c, 0]
                sums[source][c, 0] += x.sum()
                sums[source][c, 1] += np.dot(x.ravel(), x.ravel())
            count[source] += data.shape[0] * data.shape[2] * data.shape[3]
            if fmt == layout.PHYSICSNEMO:
                _write_pn_year(out, source, year, p["years"], data, hours, names, geo, row_chunk)
                continue
            if source == background_src and latlon:
                data = on_hrrr_grid(data)  # the native layout holds ERA5 on the HRRR grid
            store = layout.year_store(out, source, year)
            store.parent.mkdir(parents=True, exist_ok=True)
            group = zarr.create_group(str(store), attributes={layout.CHANNELS_ATTR: list(names)})
            _create_time_series(group, data, hours, row_chunk, p["channel_chunk"])
        if fmt == layout.PHYSICSNEMO:
            era5_time_sum = era5.sum(axis=0, dtype=np.float64) + (0 if era5_time_sum is None else era5_time_sum)

    means, stds = {}, {}
    for source, s in sums.items():
        ref = (hrrr_scale if source == state else era5_scale)[:, 0]
        shift = s[:, 0] / count[source]
        stds[source] = np.sqrt(np.maximum(s[:, 1] / count[source] - shift**2, 0.0)).astype(np.float32)
        means[source] = (ref + shift).astype(np.float32)

    if fmt == layout.PHYSICSNEMO:
        _write_pn_static(out, p, inv, inv_names, geo, means, stds, era5_time_sum, row_chunk)
    else:
        group = zarr.create_group(str(layout.invariants_store(out)), attributes={layout.CHANNELS_ATTR: list(inv_names)})
        arr = group.create_array(
            layout.DATA_VAR,
            shape=inv.shape,
            dtype="float32",
            chunks=layout.invariants_chunks(height, width, row_chunk),
            compressors=None,
            fill_value=float("nan"),
            dimension_names=layout.INVARIANTS_DIMS,
        )
        if inv_names:
            arr[...] = inv.astype(np.float32)
        for source in sums:
            path = layout.stats_file(out, source, "means")
            path.parent.mkdir(parents=True, exist_ok=True)
            np.save(path, means[source])
            np.save(layout.stats_file(out, source, "stds"), stds[source])

    # the manifest goes last: a directory holding it is complete
    layout.manifest_file(out).write_text(json.dumps(p, indent=1) + "\n")


def _write_pn_static(out: Path, p: dict, inv, inv_names, geo, means, stds, era5_time_sum, row_chunk) -> None:
    """Invariants, statistics and the missing-samples file of the PhysicsNeMo layout."""
    import datetime

    store = layout.pn_invariants_store(out)
    store.parent.mkdir(parents=True, exist_ok=True)
    group = zarr.create_group(str(store), zarr_format=2)
    _v2_array(
        group,
        layout.PN_INVARIANTS_VAR,
        inv.astype(np.float32),
        layout.PN_INVARIANTS_DIMS,
        chunks=layout.invariants_chunks(p["height"], p["width"], row_chunk),
    )
    _v2_array(
        group,
        layout.PN_CHANNEL,
        np.array(inv_names, dtype=str) if inv_names else np.zeros(0, dtype="<U1"),
        ("channel",),
    )
    _v2_array(group, layout.PN_LAT, geo.lat2d, ("y", "x"))
    _v2_array(group, layout.PN_LON, geo.lon2d, ("y", "x"))
    zarr.consolidate_metadata(str(store))
    for source in layout.SOURCES:
        for kind, values in (("means", means[source]), ("stds", stds[source])):
            path = layout.pn_stats_file(out, source, kind)
            path.parent.mkdir(parents=True, exist_ok=True)
            np.save(path, values)
    n_hours = p["hours_per_year"] * len(p["years"])
    if era5_time_sum is not None:  # the reference ships an (unused) time-mean field too
        np.save(
            layout.pn_era5_dir(out) / layout.PN_STATS_DIR / "time_means.npy",
            (era5_time_sum / n_hours).astype(np.float32)[None],
        )
    # the reference's format: an object array of datetimes, saved with pickle
    missing = np.array([datetime.datetime.fromisoformat(m) for m in p["missing"]] or [], dtype=object)
    np.save(layout.pn_missing_samples_file(out), missing, allow_pickle=True)


# zarr's config is process-global: writers in threads of one process take turns
_CONFIG_LOCK = threading.Lock()


def _build(tmp: Path, params: dict) -> None:
    with _CONFIG_LOCK:
        # the default codec batch size of 1 chunk makes many small chunks slow
        # to write; writing empty (e.g. all-zero) chunks keeps every shard whole
        with zarr.config.set({"codec_pipeline.batch_size": 256, "array.write_empty_chunks": True}):
            _write_contents(tmp, params)


def _publish(tmp: Path, root: Path, params: dict) -> bool:
    """Rename ``tmp`` to ``root``; False if a concurrent writer got there first."""
    try:
        os.rename(tmp, root)  # atomic; replaces an empty dir, fails on a non-empty one
    except OSError:
        if _check_existing(root, params):
            return False
        raise
    return True


def _write(root, **kwargs) -> tuple[Path, bool]:
    root = Path(root)
    params = _normalise_params(**kwargs)
    if _check_existing(root, params):
        return root, False
    root.parent.mkdir(parents=True, exist_ok=True)
    prefix = _tmp_prefix(root)
    _remove_dead_writers(root.parent, prefix)
    # SIGTERM (a scheduler's cancel, torchrun stopping its workers) raises here, so that the
    # partial copy is removed; kill -9 leaves it (a hidden .tmp- sibling, never read), and the
    # next write beside it on this host removes it
    with sigterm_raises(f"writing the synthetic stores at {root} (the partial copy was removed)"):
        tmp = Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=root.parent))
        try:
            _build(tmp, params)
            return root, _publish(tmp, root, params)
        finally:
            _remove(tmp)


def _tmp_prefix(root: Path) -> str:
    """A partial copy's name up to its writer's pid: the host names it, since on a shared file
    system only this host can tell whether one of its processes is still alive. The host as a
    digest of fixed length: no two hosts share a prefix, nor does one begin another's (node-1's
    would begin node-12's, and node.1 and node-1 would read alike with their dots replaced). The
    pid namespace is part of it: containers of one host name may number their processes apart."""
    try:
        pid_ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:  # not Linux
        pid_ns = 0
    host = hashlib.sha256(f"{socket.gethostname()}:{pid_ns}".encode()).hexdigest()[:16]
    return f".{root.name}.tmp-{host}-"


def _remove_dead_writers(parent: Path, prefix: str) -> None:
    """Remove the partial copies (``prefix``: this host's, ``_tmp_prefix``) that writers on this
    host left in ``parent`` when they were killed (kill -9, the OOM killer): those whose pid no
    longer runs. A live writer's copy is never touched."""
    try:
        leftovers = [p for p in parent.iterdir() if p.name.startswith(prefix)]
    except OSError:  # no parent yet: nothing left over
        return
    for tmp in leftovers:
        pid = tmp.name[len(prefix) :].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)) and tmp.is_dir() and not tmp.is_symlink():
            shutil.rmtree(tmp, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):  # another user's process, or not a pid
        return True
    return True


def _remove(tmp: Path) -> None:
    if not tmp.exists():
        return  # published
    # A write an interrupt cut short still runs on zarr's own event loop and its threads, which
    # would recreate folders in tmp: stop them first (zarr starts new ones when next used).
    try:
        from zarr.core import sync as zarr_sync

        zarr_sync.cleanup_resources()
    except Exception:  # noqa: BLE001, S110  (another zarr: the passes below still remove what they can)
        pass
    for _ in range(3):
        shutil.rmtree(tmp, ignore_errors=True)
        if not tmp.exists():
            return
        time.sleep(0.5)


def write_synthetic(
    root: str | Path,
    *,
    height: int = 32,
    width: int = 32,
    hrrr_channels: Sequence[str] | None = None,
    era5_channels: Sequence[str] | None = None,
    state_channels: Sequence[str] | None = None,
    background_channels: Sequence[str] | None = None,
    invariants: Sequence[str] = DEFAULT_INVARIANTS,
    years: Sequence[int] = (2020, 2021),
    hours_per_year: int = DEFAULT_HOURS_PER_YEAR,
    seed: int = 0,
    row_chunk: int = layout.DEFAULT_ROW_CHUNK,
    channel_chunk: int = 0,
    layout: str = "native",
    latlon: bool = False,
    hrrr_spacing: float = DEFAULT_HRRR_SPACING,
    era5_spacing: float = DEFAULT_ERA5_SPACING,
    missing: Sequence[str] | None = None,
) -> Path:
    """Write a synthetic store at ``root`` (atomically; no-op if already there) and return ``root``.

    Each year holds ``hours_per_year`` consecutive hours from Jan 1 00:00 UTC. The native
    time series are chunked ``(1, channel_chunk, row_chunk, width)``; ``channel_chunk=0`` (the
    default) puts all of a store's channels in one chunk.

    The channel lists are named as in the data configs: ``hrrr_channels`` and ``era5_channels``
    (default :data:`DEFAULT_HRRR_CHANNELS`, :data:`DEFAULT_ERA5_CHANNELS`) write StormCast's
    stores (``hrrr/``, ``era5/``); ``state_channels`` and ``background_channels`` write
    StormScope's (``state/``, ``background/``, native layout only). Not both.

    ``layout="physicsnemo"`` writes PhysicsNeMo's StormCast layout instead of ours (zarr v2
    with consolidated metadata and xarray-style coordinates, the years under ``train/`` and
    the last one under ``valid/``, ERA5 on a coarser regular lat/lon grid, a pickled
    missing-samples file listing ``missing`` (ISO hours; default: 05:00 on Jan 1 of the first
    year)). ``latlon=True`` gives the native layout the same geography: HRRR points with 2-D
    latitudes/longitudes ``hrrr_spacing`` degrees apart, the background generated on an ERA5
    grid ``era5_spacing`` degrees apart and stored interpolated onto the HRRR grid exactly as the
    dataset interpolates it, so ``latlon=True`` native and ``physicsnemo`` stores written with
    the same arguments give the same samples.

    Raises ``FileExistsError`` if ``root`` holds anything else (a non-empty
    directory without the manifest, or a synthetic store with other parameters)
    and ``ValueError`` for bad arguments.
    """
    path, _ = _write(
        root,
        height=height,
        width=width,
        hrrr_channels=hrrr_channels,
        era5_channels=era5_channels,
        state_channels=state_channels,
        background_channels=background_channels,
        invariants=invariants,
        years=years,
        hours_per_year=hours_per_year,
        seed=seed,
        row_chunk=row_chunk,
        channel_chunk=channel_chunk,
        layout_=layout,
        latlon=latlon,
        hrrr_spacing=hrrr_spacing,
        era5_spacing=era5_spacing,
        missing=missing,
    )
    return path


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m recipes.weather.synthetic", description=__doc__.split("\n")[0])
    ap.add_argument("--root", required=True, help="directory to create (the store root)")
    ap.add_argument("--height", type=int, default=32)
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--years", type=int, nargs="+", default=[2020, 2021])
    ap.add_argument("--hours-per-year", type=int, default=DEFAULT_HOURS_PER_YEAR)
    ap.add_argument("--hrrr-channels", nargs="+", help=f"StormCast's state (default {' '.join(DEFAULT_HRRR_CHANNELS)})")
    ap.add_argument("--era5-channels", nargs="*", help=f"its background (default {' '.join(DEFAULT_ERA5_CHANNELS)})")
    ap.add_argument("--state-channels", nargs="+", help="StormScope's stores instead (state/): its state channels")
    ap.add_argument("--background-channels", nargs="*", help="StormScope's background channels (background/)")
    ap.add_argument("--invariants", nargs="*", default=list(DEFAULT_INVARIANTS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--row-chunk", type=int, default=layout.DEFAULT_ROW_CHUNK)
    ap.add_argument("--channel-chunk", type=int, default=0, help="channels per chunk (0: all of a store's)")
    ap.add_argument(
        "--layout",
        choices=layout.LAYOUTS,
        default=layout.NATIVE,
        help="native (ours) or physicsnemo (PhysicsNeMo's StormCast layout)",
    )
    ap.add_argument(
        "--latlon",
        action="store_true",
        help="native layout: ERA5 generated on a lat/lon grid, "
        "stored interpolated (the same samples as --layout physicsnemo)",
    )
    ap.add_argument("--hrrr-spacing", type=float, default=DEFAULT_HRRR_SPACING, help="degrees (latlon/physicsnemo)")
    ap.add_argument("--era5-spacing", type=float, default=DEFAULT_ERA5_SPACING, help="degrees (latlon/physicsnemo)")
    ap.add_argument(
        "--missing",
        nargs="*",
        default=None,
        help="physicsnemo: ISO hours for the missing-samples file (default: Jan 1 05:00 of the first year)",
    )
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    try:
        root, wrote = _write(
            args.root,
            height=args.height,
            width=args.width,
            hrrr_channels=args.hrrr_channels,
            era5_channels=args.era5_channels,
            state_channels=args.state_channels,
            background_channels=args.background_channels,
            invariants=args.invariants,
            years=args.years,
            hours_per_year=args.hours_per_year,
            seed=args.seed,
            row_chunk=args.row_chunk,
            channel_chunk=args.channel_chunk,
            layout_=args.layout,
            latlon=args.latlon,
            hrrr_spacing=args.hrrr_spacing,
            era5_spacing=args.era5_spacing,
            missing=args.missing,
        )
    except (ValueError, FileExistsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Terminated as exc:
        print(f"{exc.prefix}: {exc}", file=sys.stderr)
        return exc.exit_code
    elapsed = time.perf_counter() - t0
    params = _read_manifest(root)  # what was written (or found): channel lists under its naming's keys
    naming = layout.naming_of(params)
    verb = "wrote" if wrote else "already complete, nothing written:"
    print(f"{verb} {root} in {elapsed:.2f} s")
    print(
        f"  grid {args.height}x{args.width}, {args.hours_per_year} hours/year, "
        f"years {' '.join(map(str, args.years))}, seed {args.seed}"
    )
    if args.layout == layout.PHYSICSNEMO:
        print(
            f"  layout physicsnemo: {layout.pn_hrrr_dir(root)}/{{train,valid}}/<year>.zarr, "
            f"{layout.pn_era5_dir(root)}/{{train,valid}}/<year>.zarr"
        )
        print(f"  {layout.pn_invariants_store(root)}")
        for source in layout.SOURCES:
            print(f"  {layout.pn_stats_file(root, source, 'means').parent}/")
        print(f"  {layout.pn_missing_samples_file(root)}")
    else:
        for year in args.years:
            for source in naming.stores:
                print(f"  {layout.year_store(root, source, year)}")
        print(f"  {layout.invariants_store(root)}")
        for source in naming.stores:
            for kind in layout.STAT_KINDS:
                print(f"  {layout.stats_file(root, source, kind)}")
    for source, key in zip(naming.stores, naming.keys):
        print(f"  {source} channels: {' '.join(params[key])}")
    print(f"  invariants:    {' '.join(args.invariants)}")
    print(f"  chunks (1, 1, {min(args.row_chunk, args.height)}, {args.width}) per (time, channel, y, x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
