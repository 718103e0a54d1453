"""Ensemble scores: CRPS against the O(N^2) definition and the Gaussian closed form, sums that
add up over any split, spread/skill of calibrated and under-dispersed ensembles."""

from __future__ import annotations

import math

import pytest
import torch

from recipes.weather import metrics


def _crps_brute(ens: torch.Tensor, truth: torch.Tensor) -> torch.Tensor:
    """mean_i |x_i - y| - 1/(2 N^2) sum_ij |x_i - x_j|, literally."""
    n = ens.shape[0]
    skill = sum((ens[i] - truth).abs() for i in range(n)) / n
    pairs = sum((ens[i] - ens[j]).abs() for i in range(n) for j in range(n))
    return skill - pairs / (2 * n * n)


def _crps_gaussian(mean: torch.Tensor, std: float, y: torch.Tensor) -> torch.Tensor:
    """Closed form CRPS(N(mean, std^2), y) (Gneiting et al. 2005)."""
    z = (y - mean) / std
    pdf = torch.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)
    return std * (z * (2 * torch.special.ndtr(z) - 1) + 2 * pdf - 1 / math.sqrt(math.pi))


# -- crps_ensemble -----------------------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 3, 7, 16])
def test_crps_equals_the_pairwise_definition(n):
    g = torch.Generator().manual_seed(n)
    ens = torch.randn(n, 3, 4, 5, generator=g, dtype=torch.float64) * 2 + 0.5
    truth = torch.randn(3, 4, 5, generator=g, dtype=torch.float64)
    ens[1, 0] = ens[0, 0]  # ties among members
    got = metrics.crps_ensemble(ens, truth)
    assert got.shape == truth.shape
    torch.testing.assert_close(got, _crps_brute(ens, truth), rtol=1e-12, atol=1e-12)
    assert bool((got >= -1e-12).all())


def test_crps_by_hand_for_two_members():
    ens = torch.tensor([[1.0], [4.0]], dtype=torch.float64)
    truth = torch.tensor([2.0], dtype=torch.float64)
    # (|1-2| + |4-2|)/2 - (2 |1-4|)/(2*4) = 1.5 - 0.75
    assert metrics.crps_ensemble(ens, truth).item() == pytest.approx(0.75, abs=1e-15)


def test_crps_of_a_single_member_is_the_absolute_error():
    g = torch.Generator().manual_seed(0)
    ens = torch.randn(1, 2, 6, 6, generator=g, dtype=torch.float64)
    truth = torch.randn(2, 6, 6, generator=g, dtype=torch.float64)
    torch.testing.assert_close(metrics.crps_ensemble(ens, truth), (ens[0] - truth).abs(), rtol=0, atol=1e-15)


def test_crps_is_invariant_to_member_order_and_homogeneous():
    g = torch.Generator().manual_seed(1)
    ens = torch.randn(9, 50, generator=g, dtype=torch.float64)
    truth = torch.randn(50, generator=g, dtype=torch.float64)
    ref = metrics.crps_ensemble(ens, truth)
    perm = torch.randperm(9, generator=g)
    torch.testing.assert_close(metrics.crps_ensemble(ens[perm], truth), ref, rtol=1e-12, atol=1e-14)
    # In physical units: shift-invariant, scales with the unit.
    torch.testing.assert_close(
        metrics.crps_ensemble(3.0 * ens + 7.0, 3.0 * truth + 7.0), 3.0 * ref, rtol=1e-12, atol=1e-13
    )


def test_crps_of_a_large_gaussian_ensemble_approaches_the_closed_form():
    mean, std = 0.4, 1.7
    y = torch.tensor([-4.0, -1.0, 0.0, 0.4, 1.3, 3.0, 6.5], dtype=torch.float64)
    ref = _crps_gaussian(torch.tensor(mean, dtype=torch.float64), std, y)
    # Quantile ensemble: the empirical law converges to the Gaussian deterministically, O(1/N).
    n = 20_000
    q = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    quant = mean + std * math.sqrt(2) * torch.erfinv(2 * q - 1)
    got = metrics.crps_ensemble(quant.reshape(n, 1).expand(n, y.numel()), y)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-3)
    # Random ensemble: within sampling error (std of the estimator <~ std / sqrt(N)).
    g = torch.Generator().manual_seed(2)
    ens = mean + std * torch.randn(n, y.numel(), generator=g, dtype=torch.float64)
    got = metrics.crps_ensemble(ens, y)
    torch.testing.assert_close(got, ref, rtol=0, atol=5 * std / math.sqrt(n))
    # The truth's own law scores best: a wrong mean or spread scores worse on average.
    truth = mean + std * torch.randn(4000, generator=g, dtype=torch.float64)
    good = metrics.crps_ensemble(mean + std * torch.randn(64, 4000, generator=g, dtype=torch.float64), truth)
    biased = metrics.crps_ensemble(mean + 1.0 + std * torch.randn(64, 4000, generator=g, dtype=torch.float64), truth)
    narrow = metrics.crps_ensemble(mean + 0.3 * std * torch.randn(64, 4000, generator=g, dtype=torch.float64), truth)
    assert float(good.mean()) < float(biased.mean()) and float(good.mean()) < float(narrow.mean())


# -- ensemble_sums -----------------------------------------------------------------------------
def _ens_truth(seed, n=3, b=4, c=2, h=12, w=10):
    g = torch.Generator().manual_seed(seed)
    truth = torch.randn(b, c, h, w, generator=g)
    ens = truth + 0.8 * torch.randn(n, b, c, h, w, generator=g)
    return ens, truth


def _add(a: dict, b: dict) -> dict:
    return {k: a[k] + b[k] for k in a}


def test_ensemble_sums_against_direct_formulas():
    ens, truth = _ens_truth(0)
    e, t = ens.double(), truth.double()
    s = metrics.ensemble_sums(ens, truth)
    assert set(s) == {"se_mean", "var", "crps", "se_member", "count"}
    assert all(v.dtype == torch.float64 for v in s.values())
    assert s["count"].item() == 4 * 12 * 10
    for c in range(2):
        ec, tc = e[:, :, c], t[:, c]
        mean = ec.mean(0)
        assert s["se_mean"][c].item() == pytest.approx(float(((mean - tc) ** 2).sum()), rel=1e-12)
        var = ((ec - mean) ** 2).sum(0) / (ec.shape[0] - 1)
        assert s["var"][c].item() == pytest.approx(float(var.sum()), rel=1e-12)
        assert s["crps"][c].item() == pytest.approx(float(_crps_brute(ec, tc).sum()), rel=1e-12)
        assert s["se_member"][c].item() == pytest.approx(float(((ec[0] - tc) ** 2).sum()), rel=1e-12)


@pytest.mark.parametrize("cuts", [[0, 1, 4], [0, 2, 3, 4]])
def test_ensemble_sums_add_up_over_batch_splits(cuts):
    ens, truth = _ens_truth(1)
    whole = metrics.ensemble_sums(ens, truth)
    parts = [metrics.ensemble_sums(ens[:, a:b], truth[a:b]) for a, b in zip(cuts[:-1], cuts[1:])]
    total = parts[0]
    for p in parts[1:]:
        total = _add(total, p)
    for k in whole:
        torch.testing.assert_close(total[k], whole[k], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("cuts", [[0, 6, 12], [0, 5, 7, 12], [0, 1, 11, 12]])
def test_ensemble_sums_add_up_over_row_bands(cuts):
    ens, truth = _ens_truth(2)
    whole = metrics.ensemble_sums(ens, truth)
    parts = [metrics.ensemble_sums(ens[..., a:b, :], truth[..., a:b, :]) for a, b in zip(cuts[:-1], cuts[1:])]
    total = parts[0]
    for p in parts[1:]:
        total = _add(total, p)
    for k in whole:
        torch.testing.assert_close(total[k], whole[k], rtol=1e-12, atol=1e-12)
    # And the summary of the added-up sums is the summary of the whole.
    for d in (whole, total):
        d["se_persistence"] = torch.ones(2, dtype=torch.float64) * 5
    a = metrics.ensemble_summary(whole, ["u", "v"], torch.tensor([1.0, 2.0]), members=3)
    b = metrics.ensemble_summary(total, ["u", "v"], torch.tensor([1.0, 2.0]), members=3)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k] == pytest.approx(b[k], rel=1e-12)


# -- ensemble_summary --------------------------------------------------------------------------
def _exchangeable(n, c, pixels, seed, member_scale=1.0):
    """Truth and members drawn from the same per-pixel law N(m_p, s_c^2) (members optionally
    with a different spread); returns ens (N, 1, C, 1, P), truth (1, C, 1, P)."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.tensor([0.5, 1.0, 3.0][:c], dtype=torch.float64).reshape(c, 1, 1)
    center = 2.0 * torch.randn(1, c, 1, pixels, generator=g, dtype=torch.float64)
    truth = center + scale * torch.randn(1, c, 1, pixels, generator=g, dtype=torch.float64)
    ens = center + member_scale * scale * torch.randn(n, 1, c, 1, pixels, generator=g, dtype=torch.float64)
    return ens, truth


def _summary(ens, truth, names, stds):
    s = metrics.ensemble_sums(ens, truth)
    s["se_persistence"] = torch.zeros_like(s["se_mean"])
    return metrics.ensemble_summary(s, names, stds, members=ens.shape[0])


def test_spread_skill_is_one_for_an_exchangeable_ensemble():
    names = ["a", "b", "c"]
    ens, truth = _exchangeable(4, 3, 60_000, seed=3)
    row = _summary(ens, truth, names, torch.ones(3))
    assert row["spread_skill"] == pytest.approx(1.0, rel=0.05)
    for name in names:
        assert row[f"spread_skill/{name}"] == pytest.approx(1.0, rel=0.05)
    # Without the (N + 1)/N finite-ensemble factor the ratio would be sqrt(4/5) = 0.89.
    assert row["spread_skill"] > 0.95


@pytest.mark.parametrize("scale", [0.5, 2.0])
def test_spread_skill_of_a_mis_dispersed_ensemble(scale):
    # Members N(m, (k s)^2), truth N(m, s^2), N members: E[var] = k^2 s^2,
    # E[(mean - truth)^2] = s^2 (1 + k^2/N), ratio = sqrt((N + 1)/N k^2 / (1 + k^2/N)).
    n = 4
    ens, truth = _exchangeable(n, 2, 60_000, seed=4, member_scale=scale)
    row = _summary(ens, truth, ["a", "b"], torch.ones(2))
    expected = math.sqrt((n + 1) / n * scale**2 / (1 + scale**2 / n))
    assert row["spread_skill"] == pytest.approx(expected, rel=0.05)
    assert (row["spread_skill"] < 0.8) if scale < 1 else (row["spread_skill"] > 1.2)


def test_summary_values_from_their_definitions():
    ens, truth = _ens_truth(5, n=5, b=2, c=2, h=6, w=7)
    s = metrics.ensemble_sums(ens, truth)
    s["se_persistence"] = torch.tensor([3.0, 12.0], dtype=torch.float64)
    s["se_regression"] = torch.tensor([1.0, 4.0], dtype=torch.float64)
    row = metrics.ensemble_summary(s, ["u", "v"], torch.tensor([1.0, 1.0]), members=5)
    count = 2 * 6 * 7
    e, t = ens.double(), truth.double()
    rmse = [math.sqrt(float(((e[:, :, c].mean(0) - t[:, c]) ** 2).mean())) for c in range(2)]
    spread = [math.sqrt(6 / 5 * float(e[:, :, c].var(0).mean())) for c in range(2)]
    crps = [float(_crps_brute(e[:, :, c], t[:, c]).mean()) for c in range(2)]
    rm = [math.sqrt(float(((e[0, :, c] - t[:, c]) ** 2).mean())) for c in range(2)]
    assert row["rmse"] == pytest.approx(sum(rmse) / 2, rel=1e-10)
    assert row["spread"] == pytest.approx(sum(spread) / 2, rel=1e-10)
    assert row["crps"] == pytest.approx(sum(crps) / 2, rel=1e-10)
    assert row["spread_skill"] == pytest.approx((spread[0] / rmse[0] + spread[1] / rmse[1]) / 2, rel=1e-10)
    assert row["rmse_member"] == pytest.approx(sum(rm) / 2, rel=1e-10)
    assert row["rmse_persistence"] == pytest.approx((math.sqrt(3 / count) + math.sqrt(12 / count)) / 2, rel=1e-12)
    assert row["rmse_regression"] == pytest.approx((math.sqrt(1 / count) + math.sqrt(4 / count)) / 2, rel=1e-12)
    del s["se_regression"]
    assert "rmse_regression" not in metrics.ensemble_summary(s, ["u", "v"], torch.ones(2), members=5)


def test_per_channel_rows_are_in_physical_units():
    # Scores computed on the physical fields (x * std + mean) equal the per-channel rows of
    # the summary made in normalized units with those stds; the ratio has no unit.
    names = ["t2m", "u10m", "msl"]
    stds = torch.tensor([4.0, 0.5, 120.0])
    means = torch.tensor([280.0, 1.0, 1.0e5], dtype=torch.float64)
    ens, truth = _exchangeable(4, 3, 5_000, seed=6)
    row = _summary(ens, truth, names, stds)
    row1 = _summary(ens, truth, names, torch.ones(3))
    sd, mu = stds.double().reshape(1, 3, 1, 1), means.reshape(1, 3, 1, 1)
    ens_p, truth_p = ens * sd + mu, truth * sd + mu
    for c, name in enumerate(names):
        rmse_p = math.sqrt(float(((ens_p[:, :, c].mean(0) - truth_p[:, c]) ** 2).mean()))
        crps_p = float(metrics.crps_ensemble(ens_p[:, :, c], truth_p[:, c]).mean())
        assert row[f"rmse/{name}"] == pytest.approx(rmse_p, rel=1e-9)
        assert row[f"crps/{name}"] == pytest.approx(crps_p, rel=1e-6)
        assert row[f"rmse/{name}"] == pytest.approx(float(stds[c]) * row1[f"rmse/{name}"], rel=1e-12)
        assert row[f"spread_skill/{name}"] == row1[f"spread_skill/{name}"]
    # The channel means (normalized units) do not depend on the stds.
    for k in ("rmse", "crps", "spread", "spread_skill", "rmse_member"):
        assert row[k] == row1[k]
