"""Parallel precompilation (framework/train/precompile.py): the jobs it finds, the cache it fills."""

from __future__ import annotations

import pickle
import random

import numpy as np
import pytest
import torch

from framework.distributed.env import DistEnv
from framework.distributed.sharding import find_units
from framework.train import precompile
from framework.train.compile import RegionForward, compile_model
from recipes.stormcast.songunet import SongUNet


def _probe(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


def _register_an_op_the_workers_lack() -> None:
    """A custom op only this process registers (its workers never import it): the compile cache's
    key carries a digest of the custom ops (``custom_ops_tag``), so the workers' graphs are only
    the ones the first step looks up if they take this process's digest, not their own."""
    from torch._library.custom_ops import OPDEFS

    if "precompiletest::probe" not in OPDEFS:
        torch.library.custom_op("precompiletest::probe", _probe, mutates_args=())


def _unet(dropout=0.0):
    torch.manual_seed(0)
    return SongUNet(
        (16, 16),
        3,
        2,
        model_channels=8,
        channel_mult=[1],
        num_blocks=1,
        attn_resolutions=[],
        dropout=dropout,
        embedding_type="zero",
    )


class _Task:
    """The two Task methods precompilation uses: an example batch (of samples shaped ``x`` and
    ``y``; the SongUNet's by default) and the loss."""

    def __init__(self, x=(3, 16, 16), y=(2, 16, 16)):
        self.x, self.y = x, y

    def example_batch(self, n, empty):
        return {"x": empty((n, *self.x)), "y": empty((n, *self.y))}

    @staticmethod
    def loss(model, batch):
        return torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])


def _loss_and_grads(model, batch) -> tuple[float, list[torch.Tensor]]:
    loss = _Task.loss(model, batch)
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()]


class _Precision:
    autocast_dtype = None

    @staticmethod
    def autocast(device):
        import contextlib

        return contextlib.nullcontext()


def test_discover_finds_each_distinct_block_call_once():
    """One job per distinct (block structure, inputs) pair, with the shapes the blocks really
    receive; its block is a picklable CPU copy without the compiled forward."""
    model = _unet()
    seen = []
    handles = [
        u.register_forward_pre_hook(lambda m, a: seen.append((type(m), tuple(a[0].shape), a[2] is not None)))
        for _, u in find_units(model, [])
    ]
    model(torch.randn(2, 3, 16, 16))
    for h in handles:
        h.remove()
    compiled = compile_model(model, device_type="cpu", backend="eager")
    every = precompile.plan_jobs(2, compiled, model, _Task(), 2, _Precision(), torch.device("cpu"))
    # the output GroupNorm the SongUNet names as a region: one job of its own, with its keyword
    (norm,) = [j for j in every if type(j.block).__name__ == "GroupNorm"]
    # its GroupNorm form resolved before the copy (on CPU, no CUDA graphs: inductor's)
    assert norm.kwargs == {"silu": True} and norm.block.compiled_form == "explicit"
    # the input and output convolutions it names: one job each, the input's on the data (no gradient)
    convs = [j for j in every if type(j.block).__name__ == "Conv2d"]
    assert sorted((tuple(j.args[0][1]), j.args[0][3]) for j in convs) == [
        ((2, 3, 16, 16), False),
        ((2, 8, 16, 16), True),
    ]
    jobs = [j for j in every if j is not norm and j not in convs]
    assert 0 < len(jobs) <= len(seen)
    shapes = {(tuple(j.args[0][1]), j.args[2] is not None) for j in jobs}
    assert shapes == {(s, skip) for _, s, skip in seen}
    for job in every:
        assert "forward" not in vars(job.block) and not job.block._forward_pre_hooks
        assert all(
            p.device.type == "cpu" and not isinstance(p, torch._subclasses.FakeTensor) for p in job.block.parameters()
        )
    for job in jobs + [norm]:
        assert job.args[0][3] is True  # the activations need gradients in a training step
    pickle.dumps(jobs)  # what the spawned workers receive
    torch._dynamo.reset()


def test_the_blocks_take_their_group_norm_form_to_the_workers():
    """model.compiled_norm is set on the GroupNorm instances, so a worker's unpickled block builds
    the graph of the form the training process runs (a class attribute set in the training
    process would stay behind: the workers compiled the default form, the first step all else)."""
    from recipes.stormcast.layers import GroupNorm, set_compiled_form

    model = _unet()
    set_compiled_form(model, "composite")
    compiled = compile_model(model, device_type="cpu", backend="eager")
    jobs = pickle.loads(
        pickle.dumps(precompile.plan_jobs(2, compiled, model, _Task(), 2, _Precision(), torch.device("cpu")))
    )
    norms = [m for j in jobs for m in j.block.modules() if isinstance(m, GroupNorm)]
    assert norms and {m.compiled_form for m in norms} == {"composite"} != {GroupNorm.compiled_form}
    torch._dynamo.reset()


def test_planning_leaves_the_random_states_as_they_were():
    """The fake forward draws (dropout): a run with precompilation must draw what one without does."""
    model = _unet(dropout=0.5)
    compiled = compile_model(model, device_type="cpu", backend="eager")
    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    before = torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()
    assert precompile.plan_jobs(2, compiled, model, _Task(), 2, _Precision(), torch.device("cpu"))
    assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]
    assert np.array_equal(np.random.get_state()[1], before[2])
    torch._dynamo.reset()


def test_off_where_it_cannot_apply(caplog):
    model = _unet()
    compiled = compile_model(model, device_type="cpu", backend="eager")
    assert precompile.plan_jobs(0, compiled, model, _Task(), 2, _Precision(), torch.device("cpu")) == []

    class NoExample(_Task):
        @staticmethod
        def example_batch(n, empty):
            return None

    with caplog.at_level("INFO", logger="framework"):
        assert precompile.plan_jobs(2, compiled, model, NoExample(), 2, _Precision(), torch.device("cpu")) == []
        assert precompile.plan_jobs(0, compiled, model, _Task(), 2, _Precision(), torch.device("cpu")) == []
    assert "not precompiled (LookupError: the task gives no example_batch)" in caplog.text
    assert "not precompiled (trainer.compile_workers=0" in caplog.text
    cores = __import__("os").cpu_count() or 1
    assert precompile.auto_workers(None, 10, 1) == (min(10, 8, cores // 2) if cores >= 4 else 0)
    assert precompile.auto_workers(3, 2, 1) == 2 and precompile.auto_workers(0, 5, 1) == 0
    torch._dynamo.reset()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_precompiled_graphs_are_what_the_first_step_loads(tmp_path, caplog):
    """Two workers build the blocks' graphs with inductor (CPU backend); the first training step
    then builds none and loads every one from the cache, and trains like the eager model. A job
    a worker cannot build (here: inputs of the wrong width) is reported, not raised, and the
    step compiles what is missing. Channels-last (the GPU's layout), the workers give the input
    convolution the contiguous input it takes (``compile_contiguous_inputs``) and the blocks
    channels-last ones. The workers key their graphs as this process does, though they lack one
    of its custom ops. (Contiguous, the CPU's layout: the tiny recipe's compiled run through the
    CLI in test_compile.py, with two workers, and the spawned worker below.)"""
    _register_an_op_the_workers_lack()
    eager, model = _unet(dropout=0.0), _unet(dropout=0.0)
    compiled = compile_model(model, device_type="cpu", cache_dir=tmp_path / "cache", channels_last=True)
    layouts = {name: unit.forward.channels_last for name, unit in compiled.units_list}
    assert layouts.pop("enc.16_conv") is False and set(layouts.values()) == {True}, layouts
    jobs = precompile.plan_jobs(2, compiled, model, _Task(), 2, _Precision(), torch.device("cpu"))
    bad = precompile.Job(jobs[0].block, (("tensor", (2, 5, 16, 16), torch.float32, True), *jobs[0].args[1:]))
    with caplog.at_level("INFO", logger="framework"):
        out = precompile.run_jobs(
            [*jobs, bad], 2, compiled, _Precision(), False, torch.device("cpu"), DistEnv(), timeout_s=500
        )
    assert out["built"] == len(jobs) and len(out["failed"]) == 1, out
    assert "precompiled by 2 workers" in caplog.text and "not built" in caplog.text

    g = torch.Generator().manual_seed(1)
    batch = {"x": torch.randn(2, 3, 16, 16, generator=g), "y": torch.randn(2, 2, 16, 16, generator=g)}
    losses = [_loss_and_grads(m, batch) for m in (eager, model)]
    s = compiled.stats()
    assert s["built"] == 0 and s["loaded"] == 2 * len(jobs), s  # a forward and a backward graph each
    assert s["aot_loaded"] == len(jobs), s  # joint graphs neither traced nor partitioned again
    assert abs(losses[0][0] - losses[1][0]) <= 1e-6 * abs(losses[0][0])
    for ge, gc in zip(losses[0][1], losses[1][1]):
        torch.testing.assert_close(gc, ge, rtol=1e-4, atol=1e-6)
    torch._dynamo.reset()


class _HandsOnHalf(torch.nn.Module):
    """A unit whose compiled form hands the next unit 16-bit values, as the SongUNet's fused
    GroupNorm does under CUDA graphs (its eager form: float32)."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(16))

    def forward(self, x):
        y = x * self.scale
        return y.to(torch.bfloat16) if torch.compiler.is_compiling() else y


class _Head(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.linear(x.float())


@pytest.mark.timeout(300)
def test_discovery_sees_what_the_compiled_units_hand_on(tmp_path):
    """The units run eagerly on fake tensors in discovery, but as compiled code sees itself
    (``torch.compiler.is_compiling()``), so the unit after one whose compiled form casts is
    emulated with the inputs the step gives it: the first step then builds no graph (before:
    the head's two graphs, built for float32 inputs by the worker, were built again by the
    step for bfloat16 ones). Outside discovery the flag is as it was."""
    _register_an_op_the_workers_lack()
    torch.manual_seed(0)
    model = torch.nn.Sequential(_HandsOnHalf(), _Head())
    compiled = compile_model(model, units=["_HandsOnHalf", "_Head"], device_type="cpu", cache_dir=tmp_path / "cache")
    jobs = precompile.plan_jobs(1, compiled, model, _Task((16,), (16,)), 4, _Precision(), torch.device("cpu"))
    assert not torch.compiler.is_compiling()
    assert sorted((type(j.block).__name__, j.args[0][2]) for j in jobs) == [
        ("_HandsOnHalf", torch.float32),
        ("_Head", torch.bfloat16),
    ], jobs
    # the discovery's wrapper is gone: the units' forwards are compile_model's again
    assert all(isinstance(vars(unit)["forward"], RegionForward) for _, unit in compiled.units_list)
    out = precompile.run_jobs(jobs, 1, compiled, _Precision(), False, torch.device("cpu"), DistEnv(), timeout_s=250)
    assert out is not None and out["built"] == 2 and not out["failed"], out
    x, y = torch.randn(4, 16), torch.randn(4, 16)
    _Task.loss(model, {"x": x, "y": y}).backward()
    s = compiled.stats()
    assert s["built"] == 0 and s["loaded"] == 4, s
    torch._dynamo.reset()


class _Layer(torch.nn.Module):
    """One linear layer after a GELU: one compiled unit, a forward and a backward graph."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.linear(torch.nn.functional.gelu(x))


@pytest.mark.timeout(300)
def test_a_spawned_worker_builds_what_the_first_step_loads(tmp_path):
    """The torch-version-sensitive core of precompilation at a size CI's runs on the oldest and
    newest torch can afford (the SongUNet test above takes a minute there): a spawned worker
    builds a unit's graphs with inductor under this process's cache key, custom-op digest and
    global flags included; the first step builds none, loads the forward, backward and joint
    graphs, and computes what the eager model does."""
    _register_an_op_the_workers_lack()
    torch.manual_seed(0)
    eager = _Layer()
    model = _Layer()
    model.load_state_dict(eager.state_dict())
    compiled = compile_model(model, units=["Linear"], device_type="cpu", cache_dir=tmp_path / "cache")
    jobs = precompile.plan_jobs(1, compiled, model, _Task((16,), (16,)), 4, _Precision(), torch.device("cpu"))
    assert len(jobs) == 1 and jobs[0].args[0][1] == (4, 16), jobs
    out = precompile.run_jobs(jobs, 1, compiled, _Precision(), False, torch.device("cpu"), DistEnv(), timeout_s=250)
    assert out is not None and out["built"] == 1 and not out["failed"], out

    g = torch.Generator().manual_seed(1)
    batch = {"x": torch.randn(4, 16, generator=g), "y": torch.randn(4, 16, generator=g)}
    losses = [_loss_and_grads(m, batch) for m in (eager, model)]
    s = compiled.stats()
    assert s["built"] == 0 and s["loaded"] == 2 and s["aot_loaded"] == 1, s
    assert abs(losses[0][0] - losses[1][0]) <= 1e-6 * abs(losses[0][0])
    for ge, gc in zip(losses[0][1], losses[1][1]):
        torch.testing.assert_close(gc, ge, rtol=1e-5, atol=1e-7)
    torch._dynamo.reset()
