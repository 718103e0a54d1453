"""EDM (Karras et al. 2022): the preconditioner, the training loss and the Heun sampler.

Plain PyTorch, as the model files: random numbers come in as arguments (the task draws
them keyed by sample and position, so every layout draws the same), and the denoiser
works on whatever rows it is given (a domain band or the whole field).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import nn


class EDMPrecond(nn.Module):
    """D(x; sigma) = c_skip x + c_out F(c_in x, c_noise), with F the wrapped network.

    ``sigma_data`` is a scalar or one value per output channel. The condition (if any) is
    concatenated to the scaled noisy input along channels, unscaled, as StormCast does.
    ``forward(x, sigma, condition=None)``: x (B, C, H, W), sigma (B,) or a scalar.
    """

    def __init__(self, net: nn.Module, sigma_data: float | Sequence[float] = 0.5):
        super().__init__()
        self.net = net
        values = [float(v) for v in (sigma_data if isinstance(sigma_data, Sequence) else [sigma_data])]
        if not values or min(values) <= 0:
            raise ValueError(f"sigma_data must be positive (got {values})")
        sd = torch.tensor(values, dtype=torch.float32)
        # A buffer, not a parameter: it is data statistics, saved with the model.
        self.register_buffer("sigma_data", sd.reshape(1, -1, 1, 1), persistent=True)

    def coefficients(self, sigma: torch.Tensor):
        sd = self.sigma_data
        s2, sd2 = sigma**2, sd**2
        c_skip = sd2 / (s2 + sd2)
        c_out = sigma * sd / (s2 + sd2).sqrt()
        c_in = 1 / (sd2 + s2).sqrt()
        return c_skip, c_out, c_in

    def forward(self, x: torch.Tensor, sigma, condition: torch.Tensor | None = None) -> torch.Tensor:
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=x.device).reshape(-1, 1, 1, 1)
        sigma = sigma.expand(x.shape[0], 1, 1, 1)
        c_skip, c_out, c_in = self.coefficients(sigma)
        c_noise = sigma.log().flatten() / 4
        inp = c_in * x.float()
        if condition is not None:
            inp = torch.cat([inp, condition.float()], dim=1)
        f = self.net(inp, c_noise)  # autocast / FSDP's policy pick the compute dtype
        return c_skip * x.float() + c_out * f.float()


# -- training ----------------------------------------------------------------------------------
def sigma_from_uniform(
    u: torch.Tensor,
    normal: torch.Tensor,
    *,
    distribution: str = "lognormal",
    p_mean: float = -1.2,
    p_std: float = 1.2,
    sigma_min: float = 0.002,
    sigma_max: float = 800.0,
) -> torch.Tensor:
    """Training noise levels from given draws: log-normal (EDM) or log-uniform."""
    if distribution == "lognormal":
        return (normal * p_std + p_mean).exp()
    if distribution == "loguniform":
        lo, hi = math.log(sigma_min), math.log(sigma_max)
        return (lo + u * (hi - lo)).exp()
    raise ValueError(f"unknown sigma distribution {distribution!r} (lognormal | loguniform)")


def edm_loss(
    precond,
    y: torch.Tensor,
    sigma: torch.Tensor,
    noise: torch.Tensor,
    condition: torch.Tensor | None = None,
    *,
    sigma_data=None,
) -> torch.Tensor:
    """Per-element weighted squared error of the denoiser at noise level ``sigma`` (B,).

    lambda(sigma) = (sigma^2 + sigma_data^2) / (sigma sigma_data)^2 makes the effective
    target of F unit-variance at every noise level (EDM, Table 1). ``sigma_data``
    defaults to the preconditioner's; pass it when ``precond`` is wrapped (DDP, FSDP).
    """
    sigma = sigma.float().reshape(-1, 1, 1, 1)
    sd = (
        precond.sigma_data
        if sigma_data is None
        else torch.as_tensor(sigma_data, dtype=torch.float32, device=y.device).reshape(1, -1, 1, 1)
    )
    weight = (sigma**2 + sd**2) / (sigma * sd) ** 2
    denoised = precond(y + noise * sigma, sigma.flatten(), condition)
    return weight * (denoised - y.float()) ** 2


# -- sampling ----------------------------------------------------------------------------------
def karras_sigmas(
    num_steps: int, sigma_min: float = 0.002, sigma_max: float = 800.0, rho: float = 7.0, dtype=torch.float64
) -> torch.Tensor:
    """The EDM time steps: sigma_max ... sigma_min in ``num_steps`` steps, then 0."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1 (got {num_steps})")
    if not 0 < sigma_min < sigma_max:
        raise ValueError(f"need 0 < sigma_min < sigma_max (got {sigma_min}, {sigma_max})")
    i = torch.arange(num_steps, dtype=dtype)
    ramp = i / max(num_steps - 1, 1)
    t = (sigma_max ** (1 / rho) + ramp * (sigma_min ** (1 / rho) - sigma_max ** (1 / rho))) ** rho
    return torch.cat([t, t.new_zeros(1)])


@torch.no_grad()
def heun_sample(
    denoise: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    latents: torch.Tensor,
    *,
    num_steps: int = 18,
    sigma_min: float = 0.002,
    sigma_max: float = 800.0,
    rho: float = 7.0,
    s_churn: float = 0.0,
    s_min: float = 0.0,
    s_max: float = math.inf,
    s_noise: float = 1.0,
    noise: Callable[[int], torch.Tensor] | None = None,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """EDM's second-order (Heun) sampler, deterministic (s_churn=0) or stochastic.

    ``denoise(x, sigma)`` returns D(x; sigma) for a scalar sigma. ``latents`` are unit
    normal draws (scaled here by sigma_max). ``noise(i)`` gives the unit-normal draws of
    step i's churn (shaped as latents); default: torch.randn_like. All sigmas are plain
    numbers, so every domain rank walks the same schedule on its own rows.
    ``dtype``: the sampler's state (float64 by default; float32 halves its memory and traffic).
    Returns samples in ``dtype`` (cast by the caller).
    """
    sigmas = karras_sigmas(num_steps, sigma_min, sigma_max, rho).tolist()
    noise = noise or (lambda i: torch.randn_like(latents))
    gamma_max = min(s_churn / num_steps, math.sqrt(2) - 1)
    x = latents.to(dtype) * sigmas[0]
    for i, (t_cur, t_next) in enumerate(zip(sigmas[:-1], sigmas[1:])):
        gamma = gamma_max if s_min <= t_cur <= s_max else 0.0
        t_hat = t_cur + gamma * t_cur
        if gamma > 0:  # churn: raise the noise level, then step down from there
            x = x + math.sqrt(t_hat**2 - t_cur**2) * s_noise * noise(i).to(dtype)
        d = (x - denoise(x, t_hat).to(dtype)) / t_hat
        x_next = x + (t_next - t_hat) * d
        if t_next > 0:  # the 2nd-order correction (skipped on the last step to sigma=0)
            d_next = (x_next - denoise(x_next, t_next).to(dtype)) / t_next
            x_next = x + (t_next - t_hat) * (0.5 * d + 0.5 * d_next)
        x = x_next
    return x
