"""Small synthetic HRRR/ERA5 stores in the StormCast layout, with learnable dynamics.

``write_synthetic(root)`` writes the layout described in
:mod:`recipes.stormcast.layout` and returns ``root``. The data follow a known
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

Writing is atomic: everything goes to a temporary directory next to ``root``
which is then renamed into place, so a reader never sees a half-written store.
If ``root`` already holds a complete synthetic store written with the same
parameters nothing is written; a concurrent writer that loses the rename race
discards its copy and uses the winner's. The time-series arrays are chunked
``(1, 1, row_chunk, x)`` and grouped into shards of 24 hours x 1 channel x all
rows, which keeps the file count (and write time) low.

CLI::

    python -m recipes.stormcast.synthetic --root DIR --height 64 --width 64 \\
        --years 2020 2021 --hours-per-year 200 \\
        --hrrr-channels u10m v10m t2m msl --era5-channels u850 v850 t850
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import zarr

from recipes.stormcast import layout

DEFAULT_HRRR_CHANNELS = ("u10m", "v10m", "t2m", "msl")
DEFAULT_ERA5_CHANNELS = ("u850", "v850", "t850")
DEFAULT_INVARIANTS = ("lsm", "orog")
DEFAULT_HOURS_PER_YEAR = 240

SHARD_HOURS = 24  # hours per shard of the time-series arrays
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

    def __init__(self, rng: np.random.Generator, n_channels: int, height: int, width: int, n_modes: int = 4):
        y, x = _grid(height, width)
        self.shape = (n_channels, height, width)
        self.patterns = np.zeros((n_channels, 2 * n_modes, height * width))  # (C, 2M, HW)
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


def _step(q: np.ndarray, u: np.ndarray, v: np.ndarray, relax: np.ndarray, forcing: np.ndarray) -> np.ndarray:
    """One explicit hour: upwind advection + diffusion + relaxation (no noise). x is axis -1, y axis -2."""
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


def _normalise_params(height, width, hrrr_channels, era5_channels, invariants, years, hours_per_year, seed, row_chunk) -> dict:
    params = {
        "format": _MANIFEST_FORMAT,
        "height": int(height),
        "width": int(width),
        "hrrr_channels": [str(c) for c in hrrr_channels],
        "era5_channels": [str(c) for c in era5_channels],
        "invariants": [str(c) for c in invariants],
        "years": [int(y) for y in years],
        "hours_per_year": int(hours_per_year),
        "seed": int(seed),
        "row_chunk": int(row_chunk),
    }
    if params["height"] < 2 or params["width"] < 2:
        raise ValueError(f"height and width must be >= 2, got {params['height']}x{params['width']}")
    if params["hours_per_year"] < 1:
        raise ValueError(f"hours_per_year must be >= 1, got {params['hours_per_year']}")
    if params["row_chunk"] < 1:
        raise ValueError(f"row_chunk must be >= 1, got {params['row_chunk']}")
    if not params["hrrr_channels"]:
        raise ValueError("need at least one HRRR channel")
    if not params["years"]:
        raise ValueError("need at least one year")
    for key in ("hrrr_channels", "era5_channels", "invariants", "years"):
        if len(set(params[key])) != len(params[key]):
            raise ValueError(f"duplicate entries in {key}: {params[key]}")
    return params


def _read_manifest(root: Path) -> dict | None:
    try:
        return json.loads(layout.manifest_file(root).read_text())
    except (OSError, ValueError):
        return None


def _check_existing(root: Path, params: dict) -> bool:
    """True if ``root`` holds the complete store for ``params``; raise if it holds something else."""
    if not root.exists():
        return False
    manifest = _read_manifest(root)
    if manifest is None:
        if root.is_dir() and not any(root.iterdir()):
            return False  # an empty directory: the rename replaces it
        raise FileExistsError(f"{root} exists but is not a complete synthetic store (no valid {layout.SYNTHETIC_MANIFEST}); refusing to overwrite it")
    if manifest != params:
        diff = {k: (manifest.get(k), v) for k, v in params.items() if manifest.get(k) != v}
        raise FileExistsError(f"{root} already holds a synthetic store written with other parameters (existing, requested): {diff}")
    return True


def _create_time_series(group, data: np.ndarray, hours: np.ndarray, row_chunk: int) -> None:
    n_time, _, height, width = data.shape
    chunks = layout.time_series_chunks(height, width, row_chunk)
    rows_per_shard = -(-height // chunks[2]) * chunks[2]
    shards = (min(SHARD_HOURS, n_time), 1, rows_per_shard, width)
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


def _write_contents(out: Path, p: dict) -> None:
    """Write the whole layout under ``out`` (a fresh directory)."""
    height, width, row_chunk = p["height"], p["width"], p["row_chunk"]
    hrrr_names, era5_names, inv_names = p["hrrr_channels"], p["era5_channels"], p["invariants"]
    n_h, n_e = len(hrrr_names), len(era5_names)
    rng = np.random.default_rng(p["seed"])

    # invariants (physical units) and their standardised versions for the forcing
    inv = np.stack([_invariant(n, rng, height, width) for n in inv_names]) if inv_names else np.zeros((0, height, width))
    inv_std = inv.std(axis=(1, 2), keepdims=True)
    inv_hat = (inv - inv.mean(axis=(1, 2), keepdims=True)) / np.where(inv_std > 0, inv_std, 1.0)

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
    sums = {layout.HRRR: np.zeros((n_h, 2)), layout.ERA5: np.zeros((n_e, 2))}
    count = 0

    for year in p["years"]:
        year_rng = np.random.default_rng([p["seed"], year])
        n_time = p["hours_per_year"]
        start = _year_start_hours(year)
        hours_all = np.arange(start - SPINUP_HOURS, start + n_time, dtype=np.int64)
        bg = background(hours_all)  # (S+T, C_e, H, W)
        u, v = _steering_wind(bg)
        forcing = background.mix(hours_all, w_bg)
        forcing += inv_forcing

        q = forcing[0] + 0.5 * np.stack([_smooth_field(year_rng, height, width) for _ in range(n_h)])
        hrrr = np.empty((n_time, n_h, height, width), dtype=np.float32)
        noise = year_rng.standard_normal((len(hours_all), n_h, height, width), dtype=np.float32)
        noise *= NOISE_STD
        for k in range(len(hours_all)):
            if k >= SPINUP_HOURS:
                hrrr[k - SPINUP_HOURS] = q
            q = _step(q, u[k], v[k], relax, forcing[k])
            q += noise[k]

        hours = hours_all[SPINUP_HOURS:]
        era5 = bg[SPINUP_HOURS:].astype(np.float32)
        for source, data, names, scale in (
            (layout.HRRR, hrrr, hrrr_names, hrrr_scale),
            (layout.ERA5, era5, era5_names, era5_scale),
        ):
            # to physical units, in place: mean + scale * field
            data *= scale[:, 1].astype(np.float32)[:, None, None]
            data += scale[:, 0].astype(np.float32)[:, None, None]
            store = layout.year_store(out, source, year)
            store.parent.mkdir(parents=True, exist_ok=True)
            group = zarr.create_group(str(store), attributes={layout.CHANNELS_ATTR: list(names)})
            _create_time_series(group, data, hours, row_chunk)
            # statistics, accumulated about the nominal mean (no cancellation in float64)
            for c in range(len(names)):
                x = data[:, c].astype(np.float64) - scale[c, 0]
                sums[source][c, 0] += x.sum()
                sums[source][c, 1] += np.dot(x.ravel(), x.ravel())
        count += n_time * height * width

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

    for source, s in sums.items():
        ref = (hrrr_scale if source == layout.HRRR else era5_scale)[:, 0]
        shift = s[:, 0] / count
        std = np.sqrt(np.maximum(s[:, 1] / count - shift**2, 0.0))
        mean = ref + shift
        path = layout.stats_file(out, source, "means")
        path.parent.mkdir(parents=True, exist_ok=True)
        np.save(path, mean.astype(np.float32))
        np.save(layout.stats_file(out, source, "stds"), std.astype(np.float32))

    # the manifest goes last: a directory holding it is complete
    layout.manifest_file(out).write_text(json.dumps(p, indent=1) + "\n")


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
    tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.tmp-", dir=root.parent))
    try:
        _build(tmp, params)
        return root, _publish(tmp, root, params)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def write_synthetic(
    root: str | Path,
    *,
    height: int = 32,
    width: int = 32,
    hrrr_channels: Sequence[str] = DEFAULT_HRRR_CHANNELS,
    era5_channels: Sequence[str] = DEFAULT_ERA5_CHANNELS,
    invariants: Sequence[str] = DEFAULT_INVARIANTS,
    years: Sequence[int] = (2020, 2021),
    hours_per_year: int = DEFAULT_HOURS_PER_YEAR,
    seed: int = 0,
    row_chunk: int = layout.DEFAULT_ROW_CHUNK,
) -> Path:
    """Write a synthetic store at ``root`` (atomically; no-op if already there) and return ``root``.

    Each year holds ``hours_per_year`` consecutive hours from Jan 1 00:00 UTC.
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
        invariants=invariants,
        years=years,
        hours_per_year=hours_per_year,
        seed=seed,
        row_chunk=row_chunk,
    )
    return path


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m recipes.stormcast.synthetic", description=__doc__.split("\n")[0])
    ap.add_argument("--root", required=True, help="directory to create (the store root)")
    ap.add_argument("--height", type=int, default=32)
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--years", type=int, nargs="+", default=[2020, 2021])
    ap.add_argument("--hours-per-year", type=int, default=DEFAULT_HOURS_PER_YEAR)
    ap.add_argument("--hrrr-channels", nargs="+", default=list(DEFAULT_HRRR_CHANNELS))
    ap.add_argument("--era5-channels", nargs="*", default=list(DEFAULT_ERA5_CHANNELS))
    ap.add_argument("--invariants", nargs="*", default=list(DEFAULT_INVARIANTS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--row-chunk", type=int, default=layout.DEFAULT_ROW_CHUNK)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    try:
        root, wrote = _write(
            args.root,
            height=args.height,
            width=args.width,
            hrrr_channels=args.hrrr_channels,
            era5_channels=args.era5_channels,
            invariants=args.invariants,
            years=args.years,
            hours_per_year=args.hours_per_year,
            seed=args.seed,
            row_chunk=args.row_chunk,
        )
    except (ValueError, FileExistsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    elapsed = time.perf_counter() - t0
    verb = "wrote" if wrote else "already complete, nothing written:"
    print(f"{verb} {root} in {elapsed:.2f} s")
    print(f"  grid {args.height}x{args.width}, {args.hours_per_year} hours/year, years {' '.join(map(str, args.years))}, seed {args.seed}")
    for year in args.years:
        for source in layout.SOURCES:
            print(f"  {layout.year_store(root, source, year)}")
    print(f"  {layout.invariants_store(root)}")
    for source in layout.SOURCES:
        for kind in layout.STAT_KINDS:
            print(f"  {layout.stats_file(root, source, kind)}")
    print(f"  hrrr channels: {' '.join(args.hrrr_channels)}")
    print(f"  era5 channels: {' '.join(args.era5_channels)}")
    print(f"  invariants:    {' '.join(args.invariants)}")
    print(f"  chunks (1, 1, {min(args.row_chunk, args.height)}, {args.width}) per (time, channel, y, x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
