"""The regression task's loss."""

from __future__ import annotations

import torch

from recipes.weather.task import mse_loss


def test_mse_loss_is_torchs_in_float32_whatever_the_layouts():
    """A channels-last 16-bit prediction (a compiled model's on CUDA) against an NCHW float32
    target: torch's float32 MSE, value and gradient, computed in the target's layout."""
    torch.manual_seed(0)
    target = torch.randn(2, 3, 5, 7)
    for pred in (torch.randn(2, 3, 5, 7), torch.randn(2, 3, 5, 7).bfloat16().to(memory_format=torch.channels_last)):
        pred.requires_grad_()
        ref = torch.nn.functional.mse_loss(pred.float(), target)
        out = mse_loss(pred, target)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
        (g,) = torch.autograd.grad(out, pred)
        (g_ref,) = torch.autograd.grad(ref, pred)
        torch.testing.assert_close(g, g_ref, rtol=0, atol=0)
    band = torch.randn(2, 3, 10, 7)[:, :, :5]  # a domain rank's band of rows: not contiguous, kept as it is
    torch.testing.assert_close(mse_loss(band, target), torch.nn.functional.mse_loss(band, target))
