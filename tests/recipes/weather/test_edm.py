"""EDM: preconditioning against the paper's formulas, the loss against hand computation and
the optimal denoiser, the sampler against the closed-form probability flow of Gaussian data."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from recipes.weather import edm


class Recorder(nn.Module):
    """F(inp, c_noise) = fn(inp, c_noise); remembers what it was given."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn
        self.calls = []

    def forward(self, inp, c_noise, *rest):
        self.calls.append((inp.detach().clone(), c_noise.detach().clone(), rest))
        return self.fn(inp, c_noise)


def _edm_coefficients(sigma: torch.Tensor, sd: torch.Tensor):
    """EDM Table 1, in float64: c_skip, c_out, c_in, c_noise."""
    sigma, sd = sigma.double(), sd.double()
    c_skip = sd**2 / (sigma**2 + sd**2)
    c_out = sigma * sd / torch.sqrt(sigma**2 + sd**2)
    c_in = 1 / torch.sqrt(sigma**2 + sd**2)
    return c_skip, c_out, c_in, torch.log(sigma) / 4


# -- EDMPrecond --------------------------------------------------------------------------------
def test_precond_scalar_sigma_data_against_the_edm_formulas():
    g = torch.Generator().manual_seed(0)
    B, C, H, W = 4, 3, 5, 6
    x = torch.randn(B, C, H, W, generator=g) * 3
    f_out = torch.randn(B, C, H, W, generator=g)
    sigma = torch.tensor([0.002, 0.3, 1.7, 80.0])
    net = Recorder(lambda inp, c: f_out)
    out = edm.EDMPrecond(net, sigma_data=0.7)(x, sigma)
    c_skip, c_out, c_in, c_noise = _edm_coefficients(sigma.reshape(-1, 1, 1, 1), torch.tensor(0.7))
    ((inp, got_noise, rest),) = net.calls
    assert rest == ()
    assert got_noise.shape == (B,)
    torch.testing.assert_close(got_noise.double(), c_noise.flatten(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(inp.double(), c_in * x.double(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(out.double(), c_skip * x.double() + c_out * f_out.double(), rtol=1e-6, atol=1e-6)
    assert out.dtype == torch.float32 and out.shape == x.shape


def test_precond_limits_identity_at_low_noise_and_network_at_high_noise():
    x = torch.full((1, 1, 2, 2), 2.0)
    f = torch.full((1, 1, 2, 2), -1.0)
    p = edm.EDMPrecond(Recorder(lambda inp, c: f), sigma_data=0.5)
    # sigma -> 0: D = x (c_skip -> 1, c_out -> 0); sigma >> sigma_data: D -> sigma_data * F.
    torch.testing.assert_close(p(x, 1e-6), x, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(p(x, 1e5), 0.5 * f, rtol=1e-4, atol=1e-4)


def test_precond_scalar_sigma_is_broadcast_over_the_batch():
    x = torch.randn(3, 2, 4, 4)
    net = Recorder(lambda inp, c: inp)
    p = edm.EDMPrecond(net, sigma_data=1.0)
    a = p(x, 2.5)
    b = p(x, torch.full((3,), 2.5))
    assert torch.equal(a, b)
    assert net.calls[0][1].shape == (3,)
    torch.testing.assert_close(net.calls[0][1], torch.full((3,), math.log(2.5) / 4))


def test_precond_per_channel_sigma_data_broadcasts_over_channels():
    g = torch.Generator().manual_seed(1)
    sd = [0.5, 1.0, 2.0]
    x = torch.randn(2, 3, 4, 5, generator=g)
    f_out = torch.randn(2, 3, 4, 5, generator=g)
    sigma = torch.tensor([0.4, 3.0])
    net = Recorder(lambda inp, c: f_out)
    p = edm.EDMPrecond(net, sigma_data=sd)
    assert p.sigma_data.shape == (1, 3, 1, 1)
    out = p(x, sigma)
    c_skip, c_out, c_in, _ = _edm_coefficients(sigma.reshape(-1, 1, 1, 1), torch.tensor(sd).reshape(1, 3, 1, 1))
    torch.testing.assert_close(net.calls[0][0].double(), c_in * x.double(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(out.double(), c_skip * x.double() + c_out * f_out.double(), rtol=1e-6, atol=1e-6)
    # Channel c behaves exactly as a scalar-sigma_data precond with sd[c].
    for c, s in enumerate(sd):
        net_c = Recorder(lambda inp, cn, c=c: f_out[:, c : c + 1])
        one = edm.EDMPrecond(net_c, sigma_data=s)(x[:, c : c + 1], sigma)
        torch.testing.assert_close(out[:, c : c + 1], one, rtol=1e-6, atol=1e-6)


def test_precond_condition_is_concatenated_after_the_scaled_input_unscaled():
    x = torch.randn(2, 3, 4, 4)
    cond = torch.randn(2, 5, 4, 4).double()  # any dtype: passed on as float32
    net = Recorder(lambda inp, c: inp[:, :3])
    p = edm.EDMPrecond(net, sigma_data=0.5)
    p(x, torch.tensor([1.0, 10.0]), cond)
    inp = net.calls[0][0]
    assert inp.shape == (2, 8, 4, 4) and inp.dtype == torch.float32
    c_in = 1 / torch.sqrt(torch.tensor([1.0, 10.0]) ** 2 + 0.25).reshape(-1, 1, 1, 1)
    torch.testing.assert_close(inp[:, :3], c_in * x)
    assert torch.equal(inp[:, 3:], cond.float())


def test_precond_sigma_data_is_a_saved_buffer_not_a_parameter():
    p = edm.EDMPrecond(nn.Identity(), sigma_data=[0.5, 2.0])
    assert "sigma_data" in p.state_dict()
    assert not any(n.endswith("sigma_data") for n, _ in p.named_parameters())


@pytest.mark.parametrize("bad", [0.0, -0.5, [0.5, 0.0], [1.0, -1.0], []])
def test_precond_rejects_non_positive_sigma_data(bad):
    with pytest.raises(ValueError, match="sigma_data"):
        edm.EDMPrecond(nn.Identity(), sigma_data=bad)


# -- loss --------------------------------------------------------------------------------------
def test_edm_loss_equals_the_hand_computed_weighted_error():
    g = torch.Generator().manual_seed(2)
    B, C = 3, 2
    y = torch.randn(B, C, 4, 5, generator=g)
    noise = torch.randn(B, C, 4, 5, generator=g)
    cond = torch.randn(B, 1, 4, 5, generator=g)
    sigma = torch.tensor([0.05, 1.3, 25.0])
    sd = torch.tensor([0.6, 1.4]).reshape(1, C, 1, 1)

    def f(inp, c_noise):  # a net that uses both the scaled input, the condition and c_noise
        return 0.3 * inp[:, :C] - 0.2 * inp[:, C:] + c_noise.reshape(-1, 1, 1, 1)

    loss = edm.edm_loss(edm.EDMPrecond(Recorder(f), sigma_data=[0.6, 1.4]), y, sigma, noise, cond)

    s = sigma.double().reshape(-1, 1, 1, 1)
    c_skip, c_out, c_in, c_noise = _edm_coefficients(s, sd)
    x = y.double() + s * noise.double()
    d = c_skip * x + c_out * (0.3 * c_in * x - 0.2 * cond.double() + c_noise)
    lam = (s**2 + sd.double() ** 2) / (s * sd.double()) ** 2
    ref = lam * (d - y.double()) ** 2
    assert loss.shape == y.shape
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-6)


def _posterior_mean_net(mu: float, v: torch.Tensor, sd: torch.Tensor):
    """F for which D(x; sigma) is the exact posterior mean E[y | x] of y ~ N(mu, v) per channel."""

    def f(inp, c_noise):
        sigma = torch.exp(4 * c_noise.double()).reshape(-1, 1, 1, 1)
        c_skip, c_out, c_in, _ = _edm_coefficients(sigma, sd)
        x = inp.double() / c_in
        d = mu + v / (v + sigma**2) * (x - mu)
        return ((d - c_skip * x) / c_out).float()

    return f


@pytest.mark.parametrize("v,sd", [([1.0], [1.0]), ([4.0, 0.25], [0.5, 0.5]), ([0.3], [1.7])])
def test_edm_loss_of_the_optimal_denoiser_is_the_analytic_expectation(v, sd):
    # y ~ N(mu, v), x = y + sigma n: D - y = -(y - mu) s^2/(v + s^2) + v s n/(v + s^2), so
    # E[(D - y)^2] = v s^2 / (v + s^2) and E[loss] = lambda(s) v s^2/(v + s^2)
    #             = v (s^2 + sd^2) / (sd^2 (v + s^2))  (= 1 at every sigma when sd^2 = v).
    g = torch.Generator().manual_seed(3)
    mu, C, n = 0.7, len(v), 50_000
    vt = torch.tensor(v, dtype=torch.float64).reshape(1, C, 1, 1)
    sdt = torch.tensor(sd, dtype=torch.float64).reshape(1, C, 1, 1)
    sigma = torch.tensor([0.02, 0.3, 1.0, 4.0, 60.0])
    B = sigma.numel()
    y = (mu + vt.sqrt() * torch.randn(B, C, 1, n, generator=g, dtype=torch.float64)).float()
    noise = torch.randn(B, C, 1, n, generator=g)
    p = edm.EDMPrecond(Recorder(_posterior_mean_net(mu, vt, sdt)), sigma_data=sd)
    loss = edm.edm_loss(p, y, sigma, noise).double().mean((2, 3))  # (B, C)
    s2 = sigma.double().reshape(-1, 1) ** 2
    expected = vt.reshape(1, C) * (s2 + sdt.reshape(1, C) ** 2) / (sdt.reshape(1, C) ** 2 * (vt.reshape(1, C) + s2))
    # lambda (D - y)^2 is lambda e chi^2_1: relative std of a mean of n is sqrt(2/n).
    torch.testing.assert_close(loss, expected, rtol=5 * math.sqrt(2 / n), atol=0)


# -- noise levels ------------------------------------------------------------------------------
def test_sigma_lognormal_is_exp_of_the_shifted_scaled_normal():
    n = torch.tensor([-2.0, -0.5, 0.0, 0.3, 1.9], dtype=torch.float64)
    u = torch.rand(5, dtype=torch.float64)
    got = edm.sigma_from_uniform(u, n, p_mean=-1.2, p_std=1.2)
    torch.testing.assert_close(got, torch.exp(-1.2 + 1.2 * n), rtol=1e-15, atol=0)
    got = edm.sigma_from_uniform(u, n, distribution="lognormal", p_mean=0.4, p_std=2.0)
    torch.testing.assert_close(got, torch.exp(0.4 + 2.0 * n), rtol=1e-15, atol=0)


def test_sigma_loguniform_spans_the_range_with_log_uniform_quantiles():
    lo, hi = 0.002, 800.0
    u = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0], dtype=torch.float64)
    got = edm.sigma_from_uniform(u, torch.zeros(5), distribution="loguniform", sigma_min=lo, sigma_max=hi)
    ref = torch.tensor([lo * (hi / lo) ** q for q in u.tolist()], dtype=torch.float64)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=0)
    assert got[2].item() == pytest.approx(math.sqrt(lo * hi), rel=1e-12)  # median: geometric mean
    # From draws: log sigma is uniform on [log lo, log hi].
    from framework.domain import draws

    m = 4000
    s = edm.sigma_from_uniform(
        draws.uniform(range(m)), draws.normal(range(m)), distribution="loguniform", sigma_min=lo, sigma_max=hi
    )
    assert float(s.min()) >= lo and float(s.max()) <= hi
    q = ((s.log() - math.log(lo)) / math.log(hi / lo)).sort().values
    i = torch.arange(1, m + 1, dtype=torch.float64)
    assert float(torch.maximum(i / m - q, q - (i - 1) / m).max()) < 1.95 / math.sqrt(m)


def test_sigma_unknown_distribution_raises():
    with pytest.raises(ValueError, match="unknown sigma distribution"):
        edm.sigma_from_uniform(torch.rand(3), torch.randn(3), distribution="uniform")


# -- time steps --------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 3, 18, 64])
def test_karras_sigmas_shape_ends_and_monotone(n):
    t = edm.karras_sigmas(n, sigma_min=0.002, sigma_max=80.0)
    assert t.dtype == torch.float64 and t.shape == (n + 1,)
    assert t[0].item() == pytest.approx(80.0, rel=1e-12)
    assert t[-2].item() == pytest.approx(0.002, rel=1e-10)
    assert t[-1].item() == 0.0
    assert bool((t[1:] < t[:-1]).all())


def test_karras_sigmas_follow_the_rho_formula():
    lo, hi, rho = 0.01, 50.0, 7.0
    t = edm.karras_sigmas(3, sigma_min=lo, sigma_max=hi, rho=rho)
    mid = ((hi ** (1 / rho) + lo ** (1 / rho)) / 2) ** rho
    assert t[1].item() == pytest.approx(mid, rel=1e-12)
    t = edm.karras_sigmas(11, sigma_min=lo, sigma_max=hi, rho=3.0)
    i = 4
    ref = (hi ** (1 / 3) + i / 10 * (lo ** (1 / 3) - hi ** (1 / 3))) ** 3
    assert t[i].item() == pytest.approx(ref, rel=1e-12)
    # rho = 1 is a linear ramp.
    torch.testing.assert_close(
        edm.karras_sigmas(5, 1.0, 9.0, rho=1.0), torch.tensor([9.0, 7.0, 5.0, 3.0, 1.0, 0.0], dtype=torch.float64)
    )


def test_karras_sigmas_single_step_is_sigma_max_then_zero():
    assert edm.karras_sigmas(1, 0.002, 80.0).tolist() == pytest.approx([80.0, 0.0])


@pytest.mark.parametrize(
    "args", [(0, 0.002, 80.0), (-3, 0.002, 80.0), (8, 0.0, 80.0), (8, -1.0, 80.0), (8, 80.0, 80.0), (8, 100.0, 80.0)]
)
def test_karras_sigmas_rejects_bad_arguments(args):
    with pytest.raises(ValueError, match=r"num_steps must be >= 1|need 0 < sigma_min < sigma_max"):
        edm.karras_sigmas(*args)


# -- sampler -----------------------------------------------------------------------------------
def _gaussian_denoiser(mu: float, s: float):
    """The exact D(x; sigma) = E[y | y + sigma n = x] for y ~ N(mu, s^2)."""
    return lambda x, sigma: mu + s * s / (s * s + sigma * sigma) * (x - mu)


def _standardized(n: int, seed: int) -> torch.Tensor:
    z = torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (z - z.mean()) / z.std()


# Probability flow of y ~ N(mu, s^2): dx/dsigma = (x - D)/sigma = (x - mu) sigma/(s^2 + sigma^2), so
# (x - mu)/sqrt(s^2 + sigma^2) is constant along a path. From x = sigma_max z (the sampler's prior:
# mean 0, not mu) to sigma = 0: x = mu + s (sigma_max z - mu)/sqrt(s^2 + sigma_max^2), hence
#   mean = mu (1 - s/sqrt(s^2 + sigma_max^2)),  std = s sigma_max/sqrt(s^2 + sigma_max^2).
def _flow_moments(mu, s, sigma_max):
    r = math.sqrt(s * s + sigma_max * sigma_max)
    return mu * (1 - s / r), s * sigma_max / r


@pytest.mark.parametrize("mu,s", [(3.0, 1.0), (0.0, 1.0), (-2.0, 0.5), (1.0, 5.0)])
def test_deterministic_heun_sampler_follows_the_probability_flow(mu, s):
    z = _standardized(4096, seed=4)
    out = edm.heun_sample(_gaussian_denoiser(mu, s), z.float(), num_steps=128, sigma_max=80.0)
    assert out.dtype == torch.float64 and out.shape == z.shape
    mean, std = _flow_moments(mu, s, 80.0)
    assert float(out.std()) == pytest.approx(std, rel=1e-3)
    assert float(out.mean()) == pytest.approx(mean, rel=1e-3, abs=1e-9)
    if mu != 0:  # the prior's mean (0) is not forgotten: the sample mean stays short of mu
        assert abs(float(out.mean()) - mu) > 0.5 * abs(mu) * s / math.sqrt(s * s + 6400)
    # Deterministic: the map latents -> samples is the affine flow map, element by element.
    ref = mean + std * z
    torch.testing.assert_close(out, ref, rtol=0, atol=2e-3 * s * float(z.abs().max()))


def test_heun_sampler_converges_at_second_order():
    s, sigma_max = 1.0, 80.0
    exact = _flow_moments(0.0, s, sigma_max)[1]
    z = torch.ones(1, dtype=torch.float64)
    err = {
        n: abs(float(edm.heun_sample(_gaussian_denoiser(0.0, s), z, num_steps=n, sigma_max=sigma_max)) - exact)
        for n in (16, 32, 64, 128)
    }
    assert 3.2 < err[32] / err[64] < 5.0
    assert 3.2 < err[64] / err[128] < 5.0
    assert err[128] < 1e-3 * exact


def _algorithm2_moments(n_steps, mu, s, sigma_max, s_churn, s_min=0.0, s_max=math.inf, s_noise=1.0, sigma_min=0.002):
    """EDM Algorithm 2 on Gaussian data, carried as (mean, variance) of x: every step is affine
    in x (x -> mu + a (x - mu)) plus independent churn noise, so the output law is exact."""
    ramp = [i / max(n_steps - 1, 1) for i in range(n_steps)]
    t = [(sigma_max ** (1 / 7) + r * (sigma_min ** (1 / 7) - sigma_max ** (1 / 7))) ** 7 for r in ramp] + [0.0]
    gamma_max = min(s_churn / n_steps, math.sqrt(2) - 1)
    f = lambda sig: sig / (s * s + sig * sig)  # noqa: E731  (x - D(x; sig))/sig = f(sig) (x - mu)
    m, v = 0.0, sigma_max**2
    for tc, tn in zip(t[:-1], t[1:]):
        gamma = gamma_max if s_min <= tc <= s_max else 0.0
        th = tc * (1 + gamma)
        v += (th * th - tc * tc) * s_noise**2
        h = tn - th
        a = 1 + h * f(th) if tn == 0 else 1 + h / 2 * (f(th) + f(tn) * (1 + h * f(th)))
        m, v = mu + a * (m - mu), a * a * v
    return m, v


def test_stochastic_sampler_matches_algorithm_2_and_forgets_the_prior_mean():
    mu, s, n, steps = 3.0, 1.0, 200_000, 32
    g = torch.Generator().manual_seed(5)
    z = torch.randn(n, generator=g)
    calls = []

    def noise(i):
        calls.append(i)
        return torch.randn(n, generator=g)

    out = edm.heun_sample(_gaussian_denoiser(mu, s), z, num_steps=steps, sigma_max=80.0, s_churn=40, noise=noise)
    assert calls == list(range(steps))  # churn on every step (s_min=0, s_max=inf), once each
    m, v = _algorithm2_moments(steps, mu, s, 80.0, 40)
    # Churn forgets the prior: the mean is mu, where the deterministic flow stays 0.0375 short.
    assert m == pytest.approx(mu, abs=1e-3)
    assert float(out.mean()) == pytest.approx(m, abs=5 * math.sqrt(v / n))
    assert float(out.var()) == pytest.approx(v, abs=5 * v * math.sqrt(2 / n))
    det_mean = _flow_moments(mu, s, 80.0)[0]
    assert abs(float(out.mean()) - det_mean) > 10 * math.sqrt(v / n)


def test_stochastic_sampler_law_approaches_the_data_with_many_steps():
    # The sampler is affine in its Gaussian inputs, so one run on basis vectors gives its exact
    # output law: element 0 sees zeros (the mean), element 1 the latent only, element 2 + j the
    # noise of step j only. With gamma capped at sqrt(2) - 1, churned Heun steps keep an O(1)
    # error until num_steps >> s_churn, so the variance only converges as steps grow.
    mu, s, churn = 3.0, 1.0, 40.0
    var_err = {}
    for steps in (32, 128, 512):
        basis = torch.zeros(steps + 2, dtype=torch.float64)
        basis[1] = 1.0

        def noise(i, steps=steps):
            e = torch.zeros(steps + 2, dtype=torch.float64)
            e[2 + i] = 1.0
            return e

        out = edm.heun_sample(
            _gaussian_denoiser(mu, s), basis, num_steps=steps, sigma_max=80.0, s_churn=churn, noise=noise
        )
        mean = out[0].item()
        var = float(((out[1:] - mean) ** 2).sum())
        m, v = _algorithm2_moments(steps, mu, s, 80.0, churn)
        assert mean == pytest.approx(m, rel=1e-9)
        assert var == pytest.approx(v, rel=1e-9)
        assert mean == pytest.approx(mu, abs=1e-4)
        var_err[steps] = abs(var - s * s)
    assert var_err[32] > var_err[128] > var_err[512]
    assert var_err[512] < 2e-3


def test_churn_noise_is_drawn_once_per_churned_step_with_its_index():
    steps, s_min, s_max = 24, 0.05, 10.0
    sig = edm.karras_sigmas(steps, sigma_max=80.0).tolist()
    expected = [i for i in range(steps) if s_min <= sig[i] <= s_max]
    assert 0 < len(expected) < steps
    calls = []

    def noise(i):
        calls.append(i)
        return torch.zeros(8)

    edm.heun_sample(
        _gaussian_denoiser(0.0, 1.0),
        torch.randn(8),
        num_steps=steps,
        sigma_max=80.0,
        s_churn=10,
        s_min=s_min,
        s_max=s_max,
        noise=noise,
    )
    assert calls == expected
    calls.clear()
    edm.heun_sample(_gaussian_denoiser(0.0, 1.0), torch.randn(8), num_steps=steps, sigma_max=80.0, noise=noise)
    assert calls == []  # s_churn = 0: deterministic, no draws


def test_churn_with_restricted_range_matches_algorithm_2():
    steps, mu, s = 24, 1.5, 0.8
    basis = torch.zeros(steps + 2, dtype=torch.float64)
    basis[1] = 1.0

    def noise(i):
        e = torch.zeros(steps + 2, dtype=torch.float64)
        e[2 + i] = 1.0
        return e

    kw = dict(num_steps=steps, sigma_max=80.0, s_churn=10, s_min=0.05, s_max=10.0, s_noise=1.007)
    out = edm.heun_sample(_gaussian_denoiser(mu, s), basis, noise=noise, **kw)
    m, v = _algorithm2_moments(steps, mu, s, 80.0, 10, s_min=0.05, s_max=10.0, s_noise=1.007)
    assert out[0].item() == pytest.approx(m, rel=1e-9)
    assert float(((out[1:] - out[0]) ** 2).sum()) == pytest.approx(v, rel=1e-9)


def test_denoiser_nan_propagates_to_the_samples():
    def bad(x, sigma):
        d = x * 0.5
        d[0] = float("nan")
        return d

    out = edm.heun_sample(bad, torch.randn(4), num_steps=4, sigma_max=10.0)
    assert torch.isnan(out[0])
    assert torch.isfinite(out[1:]).all()
