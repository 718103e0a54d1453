"""benchmarks/residual_norm.py on CPU: the comparison runs both implementations on the same inputs."""

from __future__ import annotations

import pytest
import torch

from benchmarks import residual_norm


def test_both_implementations_compute_the_residual_sums_and_the_norm():
    r = residual_norm.compare(2, 40, 24, torch.float32, torch.device("cpu"), iters=1, warmup=0)
    assert set(r) == {"residual_norm", "gated_residual"}
    for case in r.values():
        for impl in ("inductor", "op"):
            assert case[impl]["fwd_ms"] > 0 and case[impl]["fwd_bwd_ms"] > 0
            assert case[impl]["max_err"] < 1e-5, (impl, case[impl])  # against float64 of the same inputs


def test_the_sweep_refuses_a_cpu_in_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        residual_norm.main(["--device", "cpu", "--tokens", "8", "--width", "8", "--iters", "1", "--sweep", "128x2/8"])
    assert e.value.code == 2
    assert "--sweep times the compiled kernel: it needs --device cuda" in capsys.readouterr().err
