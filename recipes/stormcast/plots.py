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
    for ax, data, name, kw in ((axes[0], truth, "truth", dict(vmin=lo, vmax=hi, cmap="viridis")),
                               (axes[1], pred, "prediction", dict(vmin=lo, vmax=hi, cmap="viridis")),
                               (axes[2], err, "error", dict(vmin=-lim, vmax=lim, cmap="RdBu_r"))):
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
