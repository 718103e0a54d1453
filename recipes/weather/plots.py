"""Validation and forecast figures, in physical units.

``field_figure``: truth, prediction and persistence of one channel on one colour scale, with the
errors of the prediction and of persistence below them on one symmetric scale; ``spectra_figure``:
radially averaged power spectra of named fields. Colour bars carry the channel's unit
(:func:`channel_units`), the wavenumber axis cycles per km when the grid spacing is known
(:func:`grid_spacing_km`) and cycles per grid cell otherwise, and titles the valid time and lead
(:func:`valid_label`). Both draw with matplotlib's Agg backend: they run inside validation.
"""

from __future__ import annotations

import datetime as dt
import re
from pathlib import Path

import numpy as np

# SI units of the channel names StormCast (HRRR state, ERA5 background), StormScope and
# PhysicsNeMo / Earth2Studio use. A name not listed, or listed ambiguously, gets no unit:
# better none than a wrong one.
UNITS = {
    "msl": "Pa",
    "mslp": "Pa",
    "sp": "Pa",
    "tcwv": "kg m⁻²",  # total column water vapour (HRRR's precipitable water)
    "refc": "dBZ",  # composite radar reflectivity (HRRR, MRMS)
    "orog": "m",
    "d2m": "K",
    "r2m": "%",
}
# <variable><level>: u10m, u80m, t2m (heights above ground, "m"), u850, q500 (pressure levels, hPa),
# u1 .. u30, p1 .. p20 (HRRR's hybrid model levels, as PhysicsNeMo's StormCast names them).
_LEVEL = re.compile(r"^([a-z]+?)(\d+)(m?)$")
LEVEL_UNITS = {
    "u": "m s⁻¹",
    "v": "m s⁻¹",
    "t": "K",
    "q": "kg kg⁻¹",  # specific humidity
    "r": "%",  # relative humidity
    "p": "Pa",  # pressure on a model level
}
# Geopotential on pressure levels (ERA5's z, Earth2Studio's HRRR z: height times g). Below 50 the
# numbers are HRRR's hybrid model levels, whose stores may hold geopotential height (m) instead.
_Z_MIN_LEVEL = 50
# GOES ABI bands 7-16 are infrared brightness temperatures; 1-6 reflectances (no unit).
_ABI_INFRARED = range(7, 17)

HRRR_SPACING_KM = 3.0  # HRRR's grid (Lambert conformal, 3 km), which StormCast's stores hold


def channel_units(name: str) -> str | None:
    """SI unit of channel ``name`` (``"m s⁻¹"`` for ``u10m``), or None when the name does not say."""
    n = name.lower()
    if n in UNITS:
        return UNITS[n]
    m = _LEVEL.match(n)
    if m is None:
        return None
    var, level, above_ground = m.group(1), int(m.group(2)), bool(m.group(3))
    if var == "abi" and not above_ground:
        return "K" if level in _ABI_INFRARED else None
    if var == "z" and not above_ground:
        return "m² s⁻²" if level >= _Z_MIN_LEVEL else None
    if above_ground and var not in ("u", "v", "t", "q", "r"):
        return None
    return LEVEL_UNITS.get(var)


def label(name: str, unit: str | None) -> str:
    """``"t2m [K]"``, or the bare name without a unit."""
    return f"{name} [{unit}]" if unit else name


def grid_spacing_km(root, naming) -> float | None:
    """Kilometres between grid points of the stores under ``root``: HRRR's 3 km for StormCast's
    stores; None (unknown: per grid cell) for synthetic stores, whose grid has no physical size,
    and for StormScope's, whose grid the stores do not record."""
    from recipes.weather import layout

    if naming is not layout.STORMCAST or layout.manifest_file(root).exists():
        return None
    return HRRR_SPACING_KM


_EPOCH = dt.datetime(1970, 1, 1)


def valid_label(valid_hour: int, lead_hours: int) -> str:
    """``"valid 2021-03-04 06:00 UTC, +1 h"`` from hours since 1970-01-01 UTC and the lead in hours."""
    when = _EPOCH + dt.timedelta(hours=int(valid_hour))
    return f"valid {when:%Y-%m-%d %H:%M} UTC, +{int(lead_hours)} h"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display on clusters
    import matplotlib.pyplot as plt

    return plt


def _rmse(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(x))))


def field_figure(path: Path, *args, **kwargs) -> Path:
    """:func:`make_field_figure` (the same arguments), written to ``path`` (PNG)."""
    return _save(make_field_figure(*args, **kwargs), path)


def make_field_figure(
    channel: str,
    truth: np.ndarray,
    pred: np.ndarray,
    title: str,
    *,
    persistence: np.ndarray | None = None,
    units: str | None = None,
    shown: str = "prediction",
):
    """Truth, ``shown`` (the prediction) and, given it, persistence on the truth's colour scale;
    below them the prediction's and persistence's errors on one symmetric scale (so their sizes
    compare at a glance), and their RMSE and bias. Colour bars are labelled with ``units``."""
    plt = _pyplot()
    fields = [("truth", truth), (shown, pred)]
    errors = [(shown, pred - truth)]
    if persistence is not None:
        fields.append(("persistence", persistence))
        errors.append(("persistence", persistence - truth))
    lo, hi = (float(v) for v in np.percentile(truth, [1, 99]))
    if hi <= lo:  # a constant field: any small range shows it
        lo, hi = lo - 0.5, hi + 0.5
    lim = float(np.percentile(np.abs(np.concatenate([e.ravel() for _, e in errors])), 99)) or 1.0
    cols = len(fields)
    fig, axes = plt.subplots(2, cols, figsize=(4 * cols, 6.8), constrained_layout=True, squeeze=False)
    for ax, (name, data) in zip(axes[0], fields):
        im = ax.imshow(data, origin="lower", vmin=lo, vmax=hi, cmap="viridis")
        ax.set_title(f"{channel} {name}")
        fig.colorbar(im, ax=ax, shrink=0.8, label=label(channel, units))
    # the error of each field sits under it; the truth's column holds the scores
    for ax, (name, err) in zip(axes[1, 1:], errors):
        im = ax.imshow(err, origin="lower", vmin=-lim, vmax=lim, cmap="RdBu_r")
        ax.set_title(f"{name} − truth")
        fig.colorbar(im, ax=ax, shrink=0.8, label=label(f"{channel} error", units))
    # short lines: a wide text would widen the truth's column
    unit = f" [{units}]" if units else ""
    lines = [f"RMSE{unit}"] + [f"  {name}: {_rmse(err):.3g}" for name, err in errors]
    lines += [f"bias{unit}"] + [f"  {name}: {float(np.mean(err)):+.2g}" for name, err in errors]
    score = axes[1, 0]
    score.text(0.05, 0.5, "\n".join(lines), transform=score.transAxes, va="center", family="monospace")
    for ax in axes.ravel():
        ax.set_xticks([])
        ax.set_yticks([])
    score.set_axis_off()
    fig.suptitle(title)
    return fig


def _save(fig, path: Path) -> Path:
    """Write ``fig`` as a PNG whose text chunks hold its title and each panel's title and colour
    bar label (what a reader, or a test, can check without looking), then free it."""
    plt = _pyplot()
    panels = []
    for ax in fig.axes:
        if not ax.get_title():  # colour bars, the scores
            continue
        bar = getattr(ax.images[0], "colorbar", None) if ax.images else None
        what = bar.ax.get_ylabel() if bar is not None else f"x {ax.get_xlabel()}, y {ax.get_ylabel()}"
        panels.append(f"{ax.get_title()}: {what}")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80, metadata={"Title": fig.get_suptitle(), "Description": "; ".join(panels)})
    plt.close(fig)
    return path


def radial_spectrum(field: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Radially averaged power spectrum of a 2-D field: (wavenumber in cycles per grid cell, power).

    Power is the variance per Fourier mode (|FFT|^2 / (H W)^2, averaged over each ring), in the
    field's unit squared; rings are 1 / min(H, W) wide and go up to the shorter axis' Nyquist, 0.5.
    """
    h, w = field.shape
    power = np.abs(np.fft.fft2(field - field.mean()) / (h * w)) ** 2
    fy, fx = np.meshgrid(np.fft.fftfreq(h), np.fft.fftfreq(w), indexing="ij")  # cycles per grid cell
    n = min(h, w)
    ring = np.rint(np.hypot(fy, fx) * n).astype(int).ravel()
    counts = np.bincount(ring)
    spectrum = np.bincount(ring, power.ravel()) / np.maximum(counts, 1)
    idx = np.arange(len(spectrum))
    keep = (idx > 0) & (idx <= n // 2)
    return idx[keep] / n, spectrum[keep]


def spectra_figure(path: Path, *args, **kwargs) -> Path:
    """:func:`make_spectra_figure` (the same arguments), written to ``path`` (PNG)."""
    return _save(make_spectra_figure(*args, **kwargs), path)


def make_spectra_figure(
    channel: str,
    fields: dict[str, np.ndarray],
    title: str,
    *,
    units: str | None = None,
    spacing_km: float | None = None,
):
    """Radially averaged power spectra of named fields (truth, prediction, members...) on one plot;
    wavenumbers in cycles per km when ``spacing_km`` is known, else per grid cell, with the
    wavelength on the top axis."""
    plt = _pyplot()
    from matplotlib.ticker import NullFormatter

    scale, per = (1.0 / spacing_km, "km") if spacing_km else (1.0, "grid cell")
    fig, ax = plt.subplots(figsize=(5, 3.8), constrained_layout=True)
    for name, data in fields.items():
        k, p = radial_spectrum(data)
        ax.loglog(k * scale, np.maximum(p, 1e-30), label=name)
    ax.set_xlabel(f"wavenumber [cycles per {per}]")
    squared = f"({units})²" if units and " " in units else f"{units}²"
    ax.set_ylabel(f"power [{squared}]" if units else "power")
    inverse = lambda x: 1.0 / np.maximum(x, 1e-12)  # noqa: E731
    top = ax.secondary_xaxis("top", functions=(inverse, inverse))
    top.set_xlabel("wavelength [km]" if spacing_km else "wavelength [grid cells]")
    for axis in (ax.xaxis, top.xaxis):  # labelled minor ticks of a short decade overlap
        axis.set_minor_formatter(NullFormatter())
    ax.set_title(f"{channel} spectrum")
    ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    return fig
