"""benchmarks/mlp_gelu.py on CPU: the comparison runs both implementations on the same inputs."""

from __future__ import annotations

import pytest
import torch

from benchmarks import mlp_gelu


def test_both_implementations_compute_the_gelu_of_the_sum():
    r = mlp_gelu.compare(64, 40, torch.float32, torch.device("cpu"), iters=1, warmup=0)
    for impl in ("inductor", "op"):
        assert r[impl]["fwd_ms"] > 0 and r[impl]["fwd_bwd_ms"] > 0
        assert r[impl]["max_err"] < 1e-5, (impl, r[impl])  # against float64 F.gelu of the same inputs


def test_the_sweep_refuses_a_cpu_in_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        mlp_gelu.main(["--device", "cpu", "--rows", "8", "--cols", "8", "--iters", "1", "--sweep", "64x32x128/4"])
    assert e.value.code == 2
    assert "--sweep times the compiled kernel: it needs --device cuda" in capsys.readouterr().err
