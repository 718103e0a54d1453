"""benchmarks/scaling.py's model FLOPs: counted on the meta device, equal to a real step's."""

import argparse

import pytest
import torch

from benchmarks import scaling
from framework import registry
from framework.train import metrics


@pytest.mark.parametrize("kind", ["songunet", "diffusion"])
def test_model_flops_on_the_meta_device_equal_a_real_steps_per_sample(kind):
    """MFU's numerator: the count on a meta-device copy (which needs no memory, so an 80 GB card
    can measure the preset's batch) equals FlopCounterMode on a real two-sample step, per sample."""
    registry.load_providers()
    args = argparse.Namespace(model=kind, height=32, width=48, dropout=None, attn_tiles=None)
    model, io, _ = scaling.build_model(args)
    x_ch = io[0] - io[1] if kind == "diffusion" else io[0]
    torch.manual_seed(0)
    batch = {"x": torch.randn(2, x_ch, 32, 48), "y": torch.randn(2, io[1], 32, 48)}
    if kind == "diffusion":
        batch.update(sigma=torch.rand(2) + 0.5, noise=torch.randn(2, io[1], 32, 48))
    real = metrics.count_flops(lambda: scaling._loss(model, batch, kind).backward())[1]
    meta = scaling.model_flops(args, model, x_ch, io)
    assert real > 0 and meta == real / 2
    assert all(p.device.type == "cpu" for p in model.parameters())  # the measured model is left alone


def test_the_profile_sorts_kernels_by_kind():
    """The DiT's fused attention kernels count as attention (run 22's table had them as "other"),
    inductor's fused pointwise kernels as inductor's, cuBLAS's as matrix products, the MLP's bias and
    GELU kernels apart from inductor's."""
    kinds = {
        "_fna_backward_dkdv": "attention",
        "_fna_delta": "attention",
        "triton_poi_fused_gelu_gelu_backward_view_6": "triton (inductor)",
        "nvjet_sm90_tst_192x192_64x4_1x2_h_bz_coopB_bias_TNN": "matmul",
        "gn_fused_apply": "group norm (fused Triton)",
        "_bias_gelu_bwd": "MLP bias + GELU (fused Triton)",
        "something_new": "other",
    }
    assert {name: scaling.kernel_kind(name) for name in kinds} == kinds
