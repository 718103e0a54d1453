"""Validation figures: truth, prediction and error of one channel, in physical units."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def field_figure(path: Path, channel: str, truth: np.ndarray, pred: np.ndarray, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # no display on clusters
    import matplotlib.pyplot as plt

    err = pred - truth
    lo, hi = np.percentile(truth, [1, 99])
    lim = float(np.percentile(np.abs(err), 99)) or 1.0
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6), constrained_layout=True)
    for ax, data, name, kw in (
        (axes[0], truth, "truth", dict(vmin=lo, vmax=hi, cmap="viridis")),
        (axes[1], pred, "prediction", dict(vmin=lo, vmax=hi, cmap="viridis")),
        (axes[2], err, "error", dict(vmin=-lim, vmax=lim, cmap="RdBu_r")),
    ):
        im = ax.imshow(data, origin="lower", **kw)
        ax.set_title(f"{channel} {name}")
        ax.set_xticks([])
        ax.set_yticks([])
        fig.colorbar(im, ax=ax, shrink=0.8)
    fig.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def radial_spectrum(field: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Radially averaged power spectrum of a 2-D field: (wavenumber, power)."""
    f = np.fft.fftshift(np.fft.fft2(field - field.mean()))
    power = np.abs(f) ** 2
    h, w = field.shape
    y, x = np.indices((h, w))
    r = np.hypot(y - h // 2, x - w // 2).astype(int)
    counts = np.bincount(r.ravel())
    spectrum = np.bincount(r.ravel(), power.ravel()) / np.maximum(counts, 1)
    k = np.arange(len(spectrum))
    keep = (k > 0) & (k <= min(h, w) // 2)
    return k[keep], spectrum[keep]


def spectra_figure(path: Path, channel: str, fields: dict[str, np.ndarray], title: str) -> Path:
    """Radially averaged power spectra of named fields (truth, prediction, members...) on one plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.5, 3.6), constrained_layout=True)
    for name, data in fields.items():
        k, p = radial_spectrum(data)
        ax.loglog(k, np.maximum(p, 1e-30), label=name)
    ax.set_xlabel("wavenumber")
    ax.set_ylabel("power")
    ax.set_title(f"{channel} spectrum")
    ax.legend()
    fig.suptitle(title, fontsize=9)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
