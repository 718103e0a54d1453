"""framework.train.optim: the optimizer from its config, fused on CUDA unless told otherwise."""

from __future__ import annotations

import pytest
import torch

from framework.checkpoint.state import _place_steps
from framework.config.schema import OptimConfig
from framework.train import optim


def _params(device="cpu", n=3):
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(5, 4, device=device)) for _ in range(n)]


@pytest.mark.parametrize("target", ["torch.optim.Adam", "torch.optim.AdamW"])
def test_cpu_runs_keep_torchs_default_and_an_explicit_choice_is_kept(target):
    assert optim.build(OptimConfig(_target_=target), _params()).param_groups[0]["fused"] is None
    chosen = optim.build(OptimConfig(_target_=target, fused=True), _params())  # torch's CPU kernel
    assert chosen.param_groups[0]["fused"] is True


def test_fused_fits_floating_point_cuda_tensors_only():
    meta = torch.empty(3, device="meta")
    assert not optim.fused_fits([meta]) and not optim.fused_fits([]) and not optim.fused_fits([{"params": [meta]}])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_null_means_the_fused_kernel_and_it_trains_as_the_foreach_one():
    runs = {}
    for fused in (None, False):
        params = _params("cuda")
        opt = optim.build(OptimConfig(_target_="torch.optim.AdamW", lr=1e-2, weight_decay=0.1, fused=fused), params)
        assert opt.param_groups[0]["fused"] is (True if fused is None else False)
        torch.manual_seed(1)
        for _ in range(20):
            for p in params:
                p.grad = torch.randn_like(p)
            opt.step()
        runs[fused] = [p.detach().clone() for p in params]
    for a, b in zip(runs[None], runs[False]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_foreach_state_resumed_under_the_fused_kernel_moves_its_step_counts_to_the_gpu():
    params = _params("cuda")
    old = torch.optim.Adam(params, lr=1e-2)  # foreach: step counts on the CPU
    for p in params:
        p.grad = torch.randn_like(p)
    old.step()
    new = optim.build(OptimConfig(lr=1e-2), params)
    new.load_state_dict(old.state_dict())
    new.param_groups[0]["fused"] = True  # as the resume applies the live optimizer's flags
    _place_steps(new)
    assert all(s["step"].device.type == "cuda" and s["step"].dtype == torch.float32 for s in new.state.values())
    new.step()
    assert all(s["step"].item() == 2 for s in new.state.values())
