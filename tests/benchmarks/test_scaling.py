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
    args = argparse.Namespace(model=kind, height=32, width=48, dropout=None, attn_tiles=None, residual_tiles=None)
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
    GELU kernels and its residual ops' apart from inductor's (run 41's table had the latter as "other")."""
    kinds = {
        "_fna_backward_dkdv": "attention",
        "_fna_delta": "attention",
        "triton_poi_fused_gelu_gelu_backward_view_6": "triton (inductor)",
        "nvjet_sm90_tst_192x192_64x4_1x2_h_bz_coopB_bias_TNN": "matmul",
        "gn_fused_apply": "group norm (fused Triton)",
        "_bias_gelu_bwd": "MLP bias + GELU (fused Triton)",
        "_residual_bwd": "residuals + norm (fused Triton)",
        "_fna_forward": "attention",
        "something_new": "other",
    }
    assert {name: scaling.kernel_kind(name) for name in kinds} == kinds


def test_compare_runs_each_variant_in_turn_and_prints_it_against_the_first(tmp_path):
    """--compare on the CPU harness: the driver's real torchrun workers, one per variant, in order;
    each ran what its variant names (the workers report the DiT's implementations)."""
    import json
    import subprocess
    import sys

    out = tmp_path / "runs.json"
    cmd = [sys.executable, "benchmarks/scaling.py", "--gpus", "1", "--layouts", "none", "--model", "dit"]
    cmd += ["--modes", "eager", "--steps", "1", "--warmup", "0", "--device", "cpu", "--height", "16"]
    cmd += ["--width", "24", "--batch-per-gpu", "1", "--attn-impl", "reference", "--out", str(out)]
    # (a tile set's own comma stays in its value)
    tiled = "residual-impl=fused,residual-tiles=fwd=32x4/4,bwd=8x2/2,mlp-impl=torch"
    cmd += ["--compare", "residual-impl=torch", tiled]
    proc = subprocess.run(cmd, cwd=scaling.REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(out.read_text())
    ran = [(r["compared"], r["impls"]["residual"], r["impls"]["residual_tiles"], r["impls"]["mlp"]) for r in runs]
    first, second = ("residual-impl=torch", "torch", None, "fused"), (tiled, "fused", "fwd=32x4/4,bwd=8x2/2", "torch")
    assert ran == [first, second]
    table = proc.stdout.splitlines()
    assert "none x1 eager" in table[0] and "1 round(s) alternating" in table[0], proc.stdout
    assert table[2].split()[0] == first[0] and table[2].split()[3] == "1.000", proc.stdout
    assert table[3].split()[0] == second[0] and float(table[3].split()[3]) > 0, proc.stdout


@pytest.mark.parametrize(
    ("tiles", "message"),
    [
        ("16x3/2", "residual tiles '16x3/2': expected ROWSxSTEP/WARPS, the step and warps powers of 2"),
        ("fwd=16x2/2,dq=16x2/2", "expected SPEC or fwd=SPEC,bwd=SPEC, got 'dq'"),
        ("8x16/2", "16 tokens a step do not divide 8 tokens a program"),
    ],
)
def test_residual_tiles_are_checked_by_the_driver_in_one_line(capsys, tiles, message):
    with pytest.raises(SystemExit) as e:
        scaling.main(["--model", "dit", "--residual-tiles", tiles])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_residual_tiles_reach_the_ops_of_the_built_model(monkeypatch):
    """A worker's --residual-tiles set the tiles the ops launch with (read at each call)."""
    from recipes.stormscope import residual

    monkeypatch.setattr(residual, "TILES", dict(residual.TILES))
    registry.load_providers()
    args = argparse.Namespace(
        model="dit", height=32, width=48, dropout=None, attn_tiles=None, attn_impl="reference", attn_block=None,
        mlp_impl="fused", residual_impl="fused", residual_tiles="bwd=32x4/4",
    )  # fmt: skip
    scaling.build_model(args)
    assert residual.TILES == {"fwd": residual.Tiles(16, 4, 4), "bwd": residual.Tiles(32, 4, 4)}


def test_a_compare_variant_that_is_not_an_option_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        scaling.main(["--compare", "residual-impl=torch", "rounds=3"])
    assert e.value.code == 2
    assert "--compare 'rounds=3': rounds is the comparison's own, not a variant's" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        scaling.main(["--compare", "--residual-impl"])
    assert e.value.code == 2
