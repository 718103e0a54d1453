"""Ensemble scores of a complete forecast store against its truth, per lead time and channel.

CRPS (the ensemble estimator of ``recipes.weather.metrics``, and the fair one: its pair term
divided by N(N-1) instead of N^2, unbiased in the ensemble size), the ensemble-mean RMSE, the
spread (sqrt((N+1)/N mean unbiased variance)), spread/skill, one member's RMSE, rank
histograms (where the truth falls among the sorted members) and radially averaged power
spectra of the members and the truth. All in the store's physical units.

The work is (start time, lead) pairs read back from the store in bands of rows, spread over
the job's ranks; per-channel sums are all-reduced, so any layout gives the same scores (up to
the order of float64 sums). The summary goes into the store's ``scores`` group (dims lead,
channel, rank, wavenumber), into ``<out>.report/scores.json`` and PNG plots beside it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger("framework")

BAND_ROWS = 256  # rows read at once: bounds the memory of one read to members x channels x 256 x W


def _sums(ens: torch.Tensor, truth: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-channel sums of one band: ``ens`` (N, C, h, W), ``truth`` (C, h, W), float64."""
    from recipes.weather import metrics

    n = ens.shape[0]
    if n == 1:  # one member: no spread (the unbiased variance of one value is undefined)
        out = metrics.ensemble_sums(ens.expand(2, *ens.shape[1:])[:, None], truth[None])  # twice: same sums
        out["var"] = torch.zeros_like(out["var"])
    else:
        out = metrics.ensemble_sums(ens[:, None], truth[None])  # as validation sums them (B = 1)
    out["abs_err"] = (ens - truth).abs().mean(0).sum((1, 2))  # the CRPS's skill term, for the fair CRPS
    below = (ens < truth).sum(0)  # the truth's rank among the members, 0..N
    out["rank_hist"] = torch.stack([(below == r).sum((1, 2)) for r in range(n + 1)], 1).double()
    return out


def score(group, env, *, fair: bool = True, spectra: list[str] | None = None) -> dict:
    """Scores of the store ``group`` (every rank of the job calls it; each gets the summary)."""
    from framework.distributed import collectives
    from recipes.weather.plots import radial_spectrum

    fc, truth = group["forecast"], group["truth"]
    members, n_init, n_lead, n_chan, h, w = fc.shape
    names = [str(c) for c in group["channel"][...]]
    spec_idx = [names.index(c) for c in (spectra or [])]
    n_k = min(h, w) // 2
    acc: dict[str, torch.Tensor] = {}
    spec_fc = torch.zeros(n_lead, len(spec_idx), n_k, dtype=torch.float64)
    spec_truth = torch.zeros_like(spec_fc)
    work = [(i, k) for i in range(n_init) for k in range(n_lead)]
    for i, k in work[env.rank :: env.world_size]:
        for r0 in range(0, h, BAND_ROWS):
            rows = slice(r0, min(h, r0 + BAND_ROWS))
            ens = torch.from_numpy(np.asarray(fc[:, i, k, :, rows, :], dtype=np.float64))
            y = torch.from_numpy(np.asarray(truth[i, k, :, rows, :], dtype=np.float64))
            for key, value in _sums(ens, y).items():
                acc.setdefault(key, torch.zeros(n_lead, *value.shape, dtype=torch.float64))[k] += value
        for s, c in enumerate(spec_idx):
            field = np.asarray(fc[:, i, k, c], dtype=np.float64)
            spec_fc[k, s] += torch.from_numpy(np.mean([radial_spectrum(f)[1] for f in field], 0))
            spec_truth[k, s] += torch.from_numpy(radial_spectrum(np.asarray(truth[i, k, c], dtype=np.float64))[1])
    if not acc:  # a rank without work still joins the sums
        zero = _sums(torch.zeros(members, n_chan, 1, 1, dtype=torch.float64), torch.ones(n_chan, 1, 1))
        acc = {key: torch.zeros(n_lead, *v.shape, dtype=torch.float64) for key, v in zero.items()}
    for key in sorted(acc):
        collectives.all_reduce_sum(acc[key])
    collectives.all_reduce_sum(spec_fc)
    collectives.all_reduce_sum(spec_truth)

    count = acc["count"][:, None]  # pixels per (lead, channel), summed over start times
    mse, var = acc["se_mean"] / count, acc["var"] / count
    skill, crps = acc["abs_err"] / count, acc["crps"] / count
    spread = (var * (members + 1) / members).sqrt()
    rmse = mse.sqrt()
    out = {
        "channels": names,
        "units": [str(u) for u in group["channel_units"][...]],
        "lead_hours": [int(v) for v in group["lead"][...]],
        "members": int(members),
        "start_times": int(n_init),
        "rmse": rmse,
        "rmse_member": (acc["se_member"] / count).sqrt(),
        "crps": crps,
        "rank_histogram": acc["rank_hist"] / acc["rank_hist"].sum(-1, keepdim=True).clamp_min(1),
        "spectrum_channels": [names[c] for c in spec_idx],
        "spectrum_forecast": spec_fc / n_init,
        "spectrum_truth": spec_truth / n_init,
    }
    if members > 1:
        out["spread"], out["spread_skill"] = spread, spread / rmse.clamp_min(1e-30)
    if fair and members > 1:  # fair = skill - pairs / (2 N (N - 1)); ensemble = skill - pairs / (2 N^2)
        out["crps_fair"] = skill - (skill - crps) * members / (members - 1)
    return out


_DIMS = {
    "rmse": ("lead", "channel"),
    "spread": ("lead", "channel"),
    "spread_skill": ("lead", "channel"),
    "rmse_member": ("lead", "channel"),
    "crps": ("lead", "channel"),
    "crps_fair": ("lead", "channel"),
    "rank_histogram": ("lead", "channel", "rank"),
    "spectrum_forecast": ("lead", "spectrum_channel", "wavenumber"),
    "spectrum_truth": ("lead", "spectrum_channel", "wavenumber"),
}
_LONG = {
    "rmse": "RMSE of the ensemble mean",
    "spread": "ensemble spread, sqrt((N+1)/N mean variance)",
    "spread_skill": "spread / RMSE of the ensemble mean (1: calibrated)",
    "rmse_member": "RMSE of member 0",
    "crps": "CRPS, ensemble estimator",
    "crps_fair": "CRPS, fair estimator",
    "rank_histogram": "share of pixels whose truth has this rank among the members",
    "spectrum_forecast": "radially averaged power spectrum, mean over members and start times",
    "spectrum_truth": "radially averaged power spectrum of the truth, mean over start times",
}


def write(group, summary: dict, out: Path) -> Path:
    """The ``scores`` group of the store, ``<out>.report/scores.json`` and the PNG plots."""
    sg = group.create_group("scores", overwrite=True, attributes={"members": summary["members"]})
    coords = {
        "lead": (np.asarray(summary["lead_hours"], dtype=np.int64), ("lead",), {"units": "hours"}),
        "channel": (np.asarray(summary["channels"], dtype=str), ("channel",), {}),
        "spectrum_channel": (np.asarray(summary["spectrum_channels"], dtype=str), ("spectrum_channel",), {}),
    }
    for key, dims in _DIMS.items():
        if key in summary:
            coords[key] = (summary[key].numpy(), dims, {"long_name": _LONG[key]})
    for name, (data, dims, attrs) in coords.items():
        if data.size == 0:
            continue
        arr = sg.create_array(
            name,
            shape=data.shape,
            chunks=data.shape,
            dtype=str if data.dtype.kind == "U" else data.dtype,
            dimension_names=dims,
            attributes=attrs,
        )
        arr[...] = data
    report = Path(str(out) + ".report")
    report.mkdir(parents=True, exist_ok=True)
    plain = {k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in summary.items()}
    path = report / "scores.json"
    path.write_text(json.dumps(plain, indent=1) + "\n")
    _plots(summary, report)
    log.info("scores: %s (CRPS at +%d h: %s)", path, summary["lead_hours"][-1], _last(summary, "crps"))
    return path


def _last(summary: dict, key: str) -> str:
    return ", ".join(f"{c} {float(v):.4g}" for c, v in zip(summary["channels"], summary[key][-1]))


def _figure(path: Path, title: str, xlabel: str, draw, ylabel: str | None = None) -> None:
    """One small figure: ``draw(ax)`` plots, this labels and saves it."""
    import matplotlib

    matplotlib.use("Agg")  # no display on clusters
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.6), constrained_layout=True)
    draw(ax)
    ax.set_xlabel(xlabel)
    if ylabel:
        ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.savefig(path, dpi=80)
    plt.close(fig)


def _plots(summary: dict, report: Path) -> None:
    leads = summary["lead_hours"]
    metrics = [k for k in ("rmse", "spread", "crps", "crps_fair", "rmse_member") if k in summary]
    for c, name in enumerate(summary["channels"]):
        per_lead = lambda ax: [ax.plot(leads, summary[k][:, c].numpy(), marker="o", label=k) for k in metrics]
        _figure(
            report / f"scores_{name}.png",
            f"{name}: scores by lead ({summary['members']} members)",
            "lead (h)",
            per_lead,
        )
        hist = summary["rank_histogram"][:, c].numpy()

        def ranks(ax):
            for k, lead in enumerate(leads):
                ax.plot(np.arange(hist.shape[1]), hist[k], marker="o", label=f"+{lead} h")
            ax.axhline(1 / hist.shape[1], color="k", lw=0.8, ls="--")

        _figure(report / f"rank_histogram_{name}.png", f"{name}: rank histogram", "rank of the truth", ranks, "share")

    def ratio(ax):
        for c, name in enumerate(summary["channels"]):
            ax.plot(leads, summary["spread_skill"][:, c].numpy(), marker="o", label=name)
        ax.axhline(1.0, color="k", lw=0.8, ls="--")

    if "spread_skill" in summary:
        _figure(report / "spread_skill.png", "spread / skill (1: calibrated)", "lead (h)", ratio)
    for s, name in enumerate(summary["spectrum_channels"]):
        k = np.arange(1, summary["spectrum_forecast"].shape[-1] + 1)

        def spectra(ax):
            for j, lead in enumerate(leads):
                (line,) = ax.loglog(
                    k, np.maximum(summary["spectrum_forecast"][j, s].numpy(), 1e-30), label=f"+{lead} h"
                )
                ax.loglog(
                    k, np.maximum(summary["spectrum_truth"][j, s].numpy(), 1e-30), ls="--", color=line.get_color()
                )

        title = f"{name} spectrum: members (solid), truth (dashed)"
        _figure(report / f"spectrum_{name}.png", title, "wavenumber", spectra, "power")


def frames(group, report: Path, channels: list[str]) -> None:
    """Truth, member 0 and error of the first start time, one PNG per channel and lead."""
    from recipes.weather.forecast_store import iso
    from recipes.weather.plots import field_figure

    names = [str(c) for c in group["channel"][...]]
    valid = group["valid_time"][0]
    members = group["forecast"].shape[0]
    for name in channels:
        c = names.index(name)
        for k, lead in enumerate(int(v) for v in group["lead"][...]):
            title = f"{name}, +{lead} h, valid {iso(int(valid[k]))} (member 0 of {members})"
            field_figure(
                report / "frames" / f"{name}_{lead:03d}.png",
                name,
                np.asarray(group["truth"][0, k, c]),
                np.asarray(group["forecast"][0, 0, k, c]),
                title,
            )
