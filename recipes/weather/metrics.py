"""Ensemble scores as per-channel sums, so they add up over batches, ranks and domain bands.

CRPS is the ensemble (empirical-distribution) estimator, as properscoring's
``crps_ensemble``: mean_i |x_i - y| - 1/(2 N^2) sum_ij |x_i - x_j|. The spread/skill
ratio is sqrt((N + 1)/N * mean unbiased ensemble variance) / RMSE of the ensemble mean,
1 for an ensemble whose members are exchangeable with the truth.
"""

from __future__ import annotations

import math

import torch


def crps_ensemble(ens: torch.Tensor, truth: torch.Tensor) -> torch.Tensor:
    """Per-element CRPS of an ensemble ``ens`` (N, ...) against ``truth`` (...)."""
    n = ens.shape[0]
    skill = (ens - truth).abs().mean(0)
    # sum_ij |x_i - x_j| = 2 sum_i (2i - N + 1) x_(i) over the sorted members: O(N log N).
    ranks = torch.arange(n, dtype=ens.dtype, device=ens.device).reshape(-1, *([1] * (ens.dim() - 1)))
    pairs = 2 * ((2 * ranks - n + 1) * ens.sort(0).values).sum(0)
    return skill - pairs / (2 * n * n)


def ensemble_sums(ens: torch.Tensor, truth: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-channel sums over batch and pixels; ``ens`` (N, B, C, H, W), ``truth`` (B, C, H, W)."""
    ens, truth = ens.double(), truth.double()
    dims = (0, 2, 3)
    mean = ens.mean(0)
    return {
        "se_mean": ((mean - truth) ** 2).sum(dims),
        "var": ens.var(0, unbiased=True).sum(dims),
        "crps": crps_ensemble(ens, truth).sum(dims),
        "se_member": ((ens[0] - truth) ** 2).sum(dims),
        "count": torch.tensor(float(truth.numel() // truth.shape[1]), dtype=torch.float64, device=truth.device),
    }


def ensemble_summary(sums: dict[str, torch.Tensor], names: list[str], stds: torch.Tensor, members: int) -> dict:
    """Means over channels in normalized units, then per channel in physical units."""
    count = sums["count"].cpu()
    mse = sums["se_mean"].cpu() / count
    var = sums["var"].cpu() / count
    crps = sums["crps"].cpu() / count
    spread = (var * (members + 1) / members).sqrt()
    rmse = mse.sqrt()
    ratio = spread / rmse.clamp_min(1e-30)
    row = {
        "rmse": float(rmse.mean()),
        "crps": float(crps.mean()),
        "spread": float(spread.mean()),
        "spread_skill": float(ratio.mean()),
        "rmse_member": float((sums["se_member"].cpu() / count).sqrt().mean()),
        "rmse_persistence": float((sums["se_persistence"].cpu() / count).sqrt().mean()),
    }
    if "se_regression" in sums:
        row["rmse_regression"] = float((sums["se_regression"].cpu() / count).sqrt().mean())
    for i, name in enumerate(names):
        s = float(stds[i])
        row[f"rmse/{name}"] = float(rmse[i]) * s
        row[f"crps/{name}"] = float(crps[i]) * s
        row[f"spread_skill/{name}"] = float(ratio[i]) if math.isfinite(float(ratio[i])) else float("nan")
    return row
