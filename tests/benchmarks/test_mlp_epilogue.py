"""benchmarks/mlp_epilogue.py: the DiT MLP's bias and GELU in the products' epilogues (docs/benchmarks.md, run 45).

The kernels run under Triton's interpreter on CPU when ``TRITON_INTERPRET=1`` is set before Triton
is imported (`.ci/run`'s interpreter set; float32 there: the interpreter's 16-bit products through
tensor descriptors are wrong), compiled on CUDA in the ``gpu`` tests (bf16).
"""

from __future__ import annotations

import pytest
import torch

from benchmarks import mlp_epilogue as epi
from recipes.stormscope import gelu
from tests.recipes.stormscope.kernel_devices import INTERPRETED, KERNEL_DEVICES


def _inputs(device):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    # 150 rows: three row tiles of 64, the last ragged; 160 columns: three of 64, the last ragged
    return epi._inputs(150, 96, 160, dtype, torch.device(device))


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("spec", ["64x64/32/4/2", "64x64/32/4/2/persistent", "64x64/32/4/2/persistent/flat"])
def test_the_epilogues_are_the_gelu_ops_applied_to_the_products(device, spec):
    """Forward: h0 is x W1^T and g is ``bias_gelu(h0)`` bit for bit; backward: dh and b1's gradient
    are ``bias_gelu_backward`` of dY W2 (whose sums may differ from torch's in the last bits); with
    one program a tile, programs that loop over tiles, and that loop flattened."""
    t = _inputs(device)
    x, w1, b1, w2, dy = t["x"], t["w1"], t["b1"], t["w2"], t["dy"]
    tiles = epi.GemmTiles.parse(spec)
    g, h0 = epi.launch_forward(x, w1, b1, tiles)
    tol = dict(atol=1e-5, rtol=1e-5) if x.dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(h0, x @ w1.t(), **tol)
    assert torch.equal(g, gelu.bias_gelu(h0, b1))
    dh, db1 = epi.launch_backward(dy, w2, h0, b1, tiles)
    want_dh, want_db = gelu.bias_gelu_backward(dy @ w2, h0, b1)
    assert db1.dtype == torch.float32
    torch.testing.assert_close(dh, want_dh, **tol)
    torch.testing.assert_close(db1, want_db, **tol)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_the_bias_gradient_is_the_same_bits_every_time(device):
    t = _inputs(device)
    tiles = epi.GemmTiles(64, 64, 32, 4, 2, True)
    h0 = epi.launch_forward(t["x"], t["w1"], t["b1"], tiles)[1]
    first, again = (epi.launch_backward(t["dy"], t["w2"], h0, t["b1"], tiles) for _ in range(2))
    assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_tiles_parse_from_the_benchmarks_notation():
    t = epi.GemmTiles.parse("128x64/32/4/3/persistent")
    assert t == epi.GemmTiles(128, 64, 32, 4, 3, True) and str(t) == "128x64/32/4/3/persistent"
    sets = epi.parse_tile_set("bwd=64x64/32/4/2")
    assert sets == {"fwd": epi.GemmTiles(), "bwd": epi.GemmTiles(64, 64, 32, 4, 2, persistent=False)}
    assert epi.GemmTiles.parse("128x64/32/4/3/persistent/flat").flat
    for bad in ("128x64/32/4", "128x64/32/4/3/fast", "128/32/4/3", "128x64/32/4/3/flat"):
        with pytest.raises(ValueError, match=r"BMxBN/BK/warps/stages\[/persistent\[/flat\]\], got"):
            epi.GemmTiles.parse(bad)


@pytest.mark.skipif(INTERPRETED, reason="the interpreter's kernels are Python functions, not Triton's")
def test_the_products_build_for_hopper_on_the_tensor_cores_through_the_copy_engine(monkeypatch):
    """Both products at the preset's size (81920 tokens, 768 -> 3072) with the benchmark's default
    tiles, built for sm90 on any machine: warp-group products, tiles loaded by TMA, within an
    SM's shared memory (what the GPU's figures in run 45 ran)."""
    pytest.importorskip("triton")
    from benchmarks import kernel_build

    calls: list = []
    for name in ("_gelu_forward", "_gelu_backward"):
        monkeypatch.setattr(epi, name, kernel_build._Recorder(getattr(epi, name), calls))
    shapes = {"x": (81920, 768), "w1": (3072, 768), "w2": (768, 3072), "h0": (81920, 3072)}
    t = {k: torch.empty(s, dtype=torch.bfloat16) for k, s in shapes.items()}
    b1 = torch.empty(3072)
    epi.launch_forward(t["x"], t["w1"], b1)
    epi.launch_backward(t["x"], t["w2"], t["h0"], b1)
    assert [c[0].__name__ for c in calls] == ["_gelu_forward", "_gelu_backward"]
    for kernel, _, args, kw in calls:
        r = kernel_build.report(kernel, args, kw, 90)
        assert r["tensor_core"] == "wgmma" and not r["wgmma_serialized"] and r["tma_loads"] >= 2, r
        assert r["shared_bytes"] <= kernel_build.SHARED_KIB[90] * 1024, r


def test_a_bad_tile_set_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        epi.main(["--device", "cpu", "--tiles", "64x64/32/4/2/flat"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "GEMM tiles must read BMxBN/BK/warps/stages[/persistent[/flat]], got '64x64/32/4/2/flat'" in err
