"""framework.plan: the exact bytes against real gloo ranks, the activation estimate against a real
step's memory, parallel=auto's choice, and ``mode=plan`` through the command line.

One config (``OV``) serves most tests, so the traces framework.plan caches per process are
made once: 3 output channels give the last layer a dim 0 that divides by neither 2 nor 4, so
FSDP2's padding and uneven shards are exercised.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from framework import plan
from framework.distributed.mesh import Degrees
from framework.errors import ConfigError
from tests.conftest import REPO
from tests.multiproc import spawn

pytestmark = pytest.mark.timeout(600)

OV = [
    "data.grid=[16,16]",
    "data.hrrr_channels=[u10m,v10m,t2m]",
    "data.batch_size=2",  # 2 samples, 4 ranks: only domain parallelism puts every rank to work
    "model.model_channels=8",
    "model.channel_mult=[1]",  # one level: half the ops to trace
]
# Layouts chosen so that all the tests trace three (band, micro-batch) shapes in all.
LAYOUTS = {
    2: ["parallel=fsdp2", "parallel=domain"],  # FSDP2 over 2; DDP over 2 bands
    4: ["parallel=fsdp2_domain", "parallel=hsdp parallel.dp_shard=1 parallel.domain=2 splitter=rows"],  # 1x2x2, 2x1x2
}


def _run(*extra):
    from framework import registry
    from framework.cli import compose
    from framework.config.validate import validate

    registry.load_providers()
    return validate(compose([*OV, *extra]))


# -- exact bytes: the plan against the tensors of real ranks ------------------------------------
def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (FSDP2's gradients share one per unit)."""
    storages = {_local(t).untyped_storage().data_ptr(): _local(t).untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _measure(rank, world, runs, expected):
    """On each rank: build the layout as the runtime does, take one step, weigh what the rank holds."""
    from framework import registry, runtime
    from framework.distributed import mesh
    from framework.distributed import precision as precision_mod
    from framework.distributed.env import DistEnv
    from framework.train import optim as optim_mod

    device = torch.device("cpu")
    for layout, want in expected.items():
        run = runs[layout]
        degrees = mesh.resolve(run.parallel, world)
        topology = mesh.build(degrees, "cpu")
        task_cls = registry.tasks.entry(run.task.name).builder
        domain = runtime._domain_group(run, topology, task_cls)
        task = task_cls(run, DistEnv(rank, world, rank, "torchrun"), device, domain=domain)
        model = registry.splitters.build(
            run.splitter.name,
            task.build_model(),
            run.splitter,
            topology=topology,
            domain=domain,
            plan=registry.models.entry(run.model.name).split_plan,
            model_name=run.model.name,
        )
        precision = precision_mod.build(run.precision, device)
        model = registry.sharding.build(
            run.sharding.name, model, run.sharding, topology=topology, precision=precision, device=device
        ).model
        optimizer = optim_mod.build(run.optim, model.parameters())
        batch = task.example_batch(run.data.batch_size // degrees.dp, lambda s, dtype=torch.float32: torch.randn(s))
        batch["step"] = 0
        task.loss(model, batch).backward()
        optimizer.step()
        params = list(model.parameters())
        state = [_local(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        got = [
            _storage_bytes(params),
            _storage_bytes([p.grad for p in params if p.grad is not None]),
            sum(t.nbytes for t in state),
        ]
        assert got == want[rank], f"{layout}, rank {rank}: real [params, grads, optimizer] {got}, planned {want[rank]}"


@pytest.mark.parametrize("world", [2, 4])
def test_planned_bytes_equal_the_tensors_of_real_gloo_ranks(world):
    expected, runs = {}, {}
    for layout in LAYOUTS[world]:
        run = runs[layout] = _run(*layout.split())
        p = plan.build(run, plan.configured(run, world), plan.Machine(world, world, None))
        expected[layout] = [[p.params[r], p.grads[r], p.optim[r]] for r in range(world)]
        if p.layout.shards > 1:  # 3-row parameters: uneven shards, padded storage
            assert len({tuple(e) for e in expected[layout]}) > 1
    spawn(_measure, world, runs, expected)


def test_fsdp2_padding_rule():
    """torch.chunk over dim 0: ceil(n / shards) rows of storage on every rank, the last ranks own fewer."""
    assert [plan._rows(torch.Size([6, 9]), 4, i) for i in range(4)] == [(2, 2), (2, 2), (2, 2), (2, 0)]
    assert [plan._rows(torch.Size([3]), 2, i) for i in range(2)] == [(2, 2), (2, 1)]


# -- activations: the trace against a real step's peak memory ---------------------------------
RSS_STEP = r"""
import contextlib, gc, json, sys
import torch
from framework import plan, registry
from framework.cli import compose
from framework.config.validate import validate
from framework.distributed.env import DistEnv

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

def measure(task, model, batch):
    for _ in range(2):  # warm: gradients exist (as in the plan), one-time kernel state is made
        task.loss(model, batch).backward()
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets the peak resident set (VmHWM) to the current one
    except OSError:
        return None
    before = status("VmRSS")
    task.loss(model, batch).backward()
    return status("VmHWM") - before

registry.load_providers()
run = validate(compose(sys.argv[1:]))
task = registry.tasks.entry(run.task.name).builder(run, DistEnv(), torch.device("cpu"))
model = task.build_model()
batch = task.example_batch(run.data.batch_size, lambda shape, dtype=torch.float32: torch.randn(shape))
batch["step"] = 0
# compiled: the units compiled as the plan compiles them (inductor's partition, no kernels), real tensors
with plan._compiled_units(run, model, "cpu") if run.trainer.compile else contextlib.nullcontext():
    growth = measure(task, model, batch)
print(json.dumps({"growth": growth}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc (Linux)")
@pytest.mark.parametrize("overrides", [[], ["trainer.compile=true", "trainer.compile_memory_budget=0.5"]],
                         ids=["eager", "compiled"])  # fmt: skip
def test_activation_estimate_is_within_25_percent_of_a_real_steps_peak_rss(overrides):
    # The tiny recipe as it is: 8 samples of 32x32, ~70 MB of activations (compiled at budget 0.5,
    # about half). glibc returns blocks >= 64 KiB to the OS when freed (mmap), so the resident set
    # follows the live tensors instead of keeping the allocator's cache; one thread: no per-thread
    # scratch.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    out = subprocess.run(
        [sys.executable, "-c", RSS_STEP, *overrides], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    growth = json.loads(out.stdout.strip().splitlines()[-1])["growth"]
    if growth is None:
        pytest.skip("/proc/self/clear_refs is not writable here: the peak RSS cannot be reset")
    from framework import registry
    from framework.cli import compose
    from framework.config.validate import validate

    registry.load_providers()
    run = validate(compose(overrides))
    p = plan.build(run, plan.configured(run, 1), plan.Machine(1, 1, None, device="cpu"))
    assert ("compiled" in p.activations_of) is bool(overrides), p.activations_of
    assert growth > 20 * 2**20, growth  # a real step, not noise
    assert abs(p.activations - growth) <= 0.25 * growth, (p.activations / 2**20, growth / 2**20)


@functools.cache  # (a plan is a result: the two tests below share the compiled one's trace)
def _planned_tiny(*extra, ranks: int = 1):
    """The tiny recipe's plan for ``ranks`` CUDA devices (OV's 16 x 16 grid as it is: a block's
    temporaries outweigh what it keeps)."""
    from framework.cli import compose
    from framework.config.validate import validate

    r = validate(compose(["model.dropout=0", *extra]))
    return plan.build(r, plan.configured(r, ranks), plan.Machine(ranks, ranks, None, device="cuda"))


def test_a_compiled_runs_plan_counts_what_its_compiled_step_keeps():
    """trainer.compile: the plan traces the step with the units compiled as the runtime compiles
    them, each graph split into forward and backward as inductor splits it (the regression
    preset's: 35.4 GiB against 84.5 for its eager step, 33.9 measured on an H200); FLOPs stay the
    eager step's. (CI's torch smokes run this one: AOTAutograd's partitioner under the plan's
    dispatch mode; the next test's variants are the suite's.)"""
    eager, compiled = _planned_tiny(), _planned_tiny("trainer.compile=true")
    assert eager.activations_of == "the eager step" and "compiled step" in compiled.activations_of
    assert compiled.activations < eager.activations, (compiled, eager)
    assert compiled.flops == eager.flops
    assert "(activations: the compiled step" in "\n".join(compiled.lines())
    assert torch._functorch.config.activation_memory_budget == 1.0  # the trace's budget is not left set


def test_a_compiled_plan_follows_the_memory_budget_the_recomputed_norms_and_the_domain_split():
    """The memory budget and the norms recomputed in backward lower the compiled estimate, as does
    a domain split (its halo exchanges traced)."""
    compiled = _planned_tiny("trainer.compile=true")
    budget = _planned_tiny("trainer.compile=true", "trainer.compile_memory_budget=0.5")
    norms = _planned_tiny("trainer.compile=true", "model.recompute_norm_levels=[0]")
    assert budget.activations < compiled.activations, (budget, compiled)
    assert norms.activations < compiled.activations, (norms.activations, compiled.activations)
    split = _planned_tiny("trainer.compile=true", "parallel=domain", ranks=2)
    assert "compiled step" in split.activations_of and split.activations < compiled.activations, split.activations_of
    assert torch._functorch.config.activation_memory_budget == 1.0


def test_a_compiled_step_that_cannot_be_traced_plans_with_the_eager_figure(monkeypatch):
    """Where dynamo cannot trace the step on fake tensors, the plan counts the eager step's
    activations, an estimate from above, and says why."""
    real = plan._step

    def step(*args):
        if args[-1]:  # compiled
            raise RuntimeError("no trace today")
        return real(*args)

    monkeypatch.setattr(plan, "_step", step)
    r = _run("trainer.compile=true", "trainer.compile_memory_budget=0.25")  # a key no other test traces
    cpu = plan.Machine(1, 1, None, device="cpu")
    p = plan.build(r, plan.configured(r, 1), cpu)
    eager = _run("trainer.compile=false")
    assert p.activations == plan.build(eager, plan.configured(eager, 1), cpu).activations
    assert p.activations_of.startswith("the eager step, above a compiled one's"), p.activations_of
    assert "no trace today" in p.activations_of


# -- the planned device's casts ---------------------------------------------------------------------
def test_bf16_plans_follow_the_casts_of_the_planned_device():
    """CUDA autocast keeps GroupNorm (and the SiLU after it) in fp32 where CPU autocast runs bf16;
    FSDP2's bf16 policy runs everything in bf16. The plan traces each as the device would."""
    run = _run("precision=bf16", "model.dropout=0")
    fp32 = _run("model.dropout=0")

    def acts(r, world, device, layout=None):
        lay = plan.configured(r, world) if layout is None else layout
        return plan.build(r, lay, plan.Machine(world, world, None, device=device)).activations

    cpu, cuda, full = acts(run, 1, "cpu"), acts(run, 1, "cuda"), acts(fp32, 1, "cuda")
    assert cpu < cuda < full, (cpu, cuda, full)
    fsdp2 = plan.configured(_run("precision=bf16", "model.dropout=0", "parallel=fsdp2"), 2)
    assert plan.compute_path(run, fsdp2, "cuda") == ("params", "cuda")
    assert plan.compute_path(run, plan.configured(run, 1), "cuda") == ("autocast", "cuda")
    assert plan.compute_path(fp32, fsdp2, "cpu") == ("fp32", "cpu")
    # half the samples per rank, all in bf16: about half the one-process CPU (bf16) trace
    assert 0.4 * cpu < acts(run, 2, "cuda", fsdp2) < 0.6 * cpu


def test_a_plan_is_for_a_gpu_unless_the_run_is_on_cpu():
    assert plan.target_device(_run("mode=plan")) == "cuda"  # a laptop plans the cluster job
    assert plan.target_device(_run("mode=plan", "device=cpu")) == "cpu"
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert plan.target_device(_run()) == expected  # parallel=auto at start-up: the step about to run


# -- the trainer's FLOPs: counted on fake tensors, equal to a real step's --------------------------
def test_step_flops_equal_a_real_steps_count_and_leave_the_random_state_alone():
    from torch.utils.flop_counter import FlopCounterMode

    from framework.distributed.env import DistEnv

    run = _run()
    state = torch.get_rng_state()
    flops, source = plan.step_flops(run, Degrees(1, 1, 1))
    assert torch.equal(torch.get_rng_state(), state)  # building the fake model drew nothing of ours
    assert source == "counted with torch.utils.flop_counter"

    from framework import registry

    task = registry.tasks.entry(run.task.name).builder(run, DistEnv(), torch.device("cpu"))
    model = task.build_model()
    batch = task.example_batch(run.data.batch_size, lambda shape, dtype=torch.float32: torch.randn(shape).to(dtype))
    batch["step"] = 0
    with FlopCounterMode(display=False) as counter:
        task.loss(model, batch).backward()
    assert flops == counter.get_total_flops() / run.data.batch_size > 0
    # two bands: the widest band's count (its halo rows included, as the ranks compute them), scaled
    # to the whole grid: 8-row bands of a 16-row grid redo a few rows each
    assert flops < plan.step_flops(run, Degrees(1, 1, 2))[0] < 1.25 * flops


# -- parallel=auto ------------------------------------------------------------------------------
def test_candidates_go_by_domain_degree_then_ddp_hsdp_fsdp2():
    got = [lay.describe() for lay in plan.candidates(plan.Machine(8, 4, None))]
    assert got[:6] == ["ddp 1x8x1", "hsdp 2x4x1", "fsdp2 1x8x1", "ddp 1x4x2", "hsdp 2x2x2", "fsdp2 1x4x2"]
    assert got[-2:] == ["ddp 1x1x8", "fsdp2 1x1x8"]  # 8 domain ranks cannot sit in a 4-GPU node
    assert [lay.describe() for lay in plan.candidates(plan.Machine(1, 1, None))] == ["none 1x1x1"]


def test_auto_takes_the_smallest_fitting_domain_degree_then_ddp_else_fsdp2():
    run = _run("parallel=auto")  # 2 samples per step on 4 ranks: domain parallelism needed
    machine = plan.Machine(4, 4, None)
    ddp = plan.build(run, plan.Layout(Degrees(1, 2, 2), "ddp"), machine)
    fsdp = plan.build(run, plan.Layout(Degrees(1, 2, 2), "fsdp2"), machine)
    assert fsdp.need < ddp.need  # sharded parameters, gradients, optimizer state; no DDP buckets

    roomy = plan.Machine(4, 4, 2 * ddp.need)
    chosen, reasons = plan.choose(run, roomy)
    assert chosen.layout == ddp.layout and chosen.fits
    assert reasons == [
        "not ddp 1x4x1: data.batch_size: 2 is not divisible by the 4 data-parallel ranks",
        "not fsdp2 1x4x1: data.batch_size: 2 is not divisible by the 4 data-parallel ranks",
    ]

    tight = plan.Machine(4, 4, int((ddp.need + fsdp.need) / 2 / 0.9))  # ddp does not fit, fsdp2 does
    chosen, reasons = plan.choose(run, tight)
    assert chosen.layout == fsdp.layout and chosen.need <= tight.usable < ddp.need
    assert reasons[-1].startswith("not ddp 1x2x2: needs ")

    with pytest.raises(ConfigError, match=r"^parallel=auto: no layout fits .* usable per GPU on 4 ranks; the leanest"):
        plan.choose(run, plan.Machine(4, 4, fsdp.need // 2))


def test_auto_at_start_up_sets_the_layout_and_logs_why(caplog):
    from framework.distributed import mesh
    from framework.runtime import _check_layout

    run = _run("parallel=auto", "plan.gpu_memory_gib=1")
    with caplog.at_level("INFO", logger="framework"):
        chosen = plan.apply_auto(run, 4, is_main=True)
    degrees = mesh.resolve(chosen.parallel, 4)
    _check_layout(chosen, degrees)  # what the runtime checks next
    assert (degrees.dp_shard, degrees.domain, chosen.sharding.name, chosen.splitter.name) == (2, 2, "ddp", "rows")
    assert chosen.raw.parallel.domain == 2 and chosen.raw.sharding.name == "ddp"  # saved with checkpoints
    log = caplog.text
    assert "parallel=auto: ddp 1x2x2" in log and "not ddp 1x4x1: data.batch_size: 2 is not divisible" in log


# -- the command line ---------------------------------------------------------------------------
def _precheck(args):
    from framework import cli

    with pytest.raises(SystemExit) as e:
        cli.precheck(args)
    return e.value.code


def test_mode_plan_prints_the_plan_and_stops_before_hydra(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = _precheck(["mode=plan", "plan.world_size=4", "plan.gpu_memory_gib=80", "parallel=fsdp2_domain", *OV])
    out = capsys.readouterr().out
    assert code == 0, out
    lines = out.splitlines()
    assert "mesh: dp_replicate=1 x dp_shard=2 x domain=2; sharding=fsdp2 over 4 ranks, splitter=rows" in lines
    assert "domain bands: rows per domain rank [8, 8] (of 16)" in lines
    assert any(line.startswith("halos: rows fetched above/below per exchange: 1/1 x") for line in lines)
    assert any(line.strip().startswith("enc.") and "(UNetBlock)" in line for line in lines)  # the FSDP units
    assert any(line.startswith("ranks 0-2 ") for line in lines) and any(line.startswith("rank 3 ") for line in lines)
    assert any(line.startswith("fits: yes: the fullest rank needs ") for line in lines)
    assert not list(tmp_path.iterdir())  # no run dir, no outputs


def test_mode_plan_in_a_sweep_job_returns_the_plan(tmp_path, monkeypatch):
    from framework import cli

    monkeypatch.chdir(tmp_path)
    out = cli.main(cli.compose(["mode=plan", "plan.world_size=4", "parallel=fsdp2_domain", *OV]))
    assert any(line.startswith("mesh: dp_replicate=1 x dp_shard=2 x domain=2") for line in out["plan"])
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["parallel=auto", "plan.gpu_memory_gib=0.0001"],
            r"error: parallel=auto: no layout fits 94\.\d+ KiB usable per GPU on 4 ranks; the leanest, ",
        ),
        (["parallel=fsdp2_domain", "plan.world_size=3"], r"error: parallel: dp_replicate x dp_shard x domain = "),
        (["plan.headroom=1"], r"error: plan\.headroom: must be in \[0, 1\) \(got 1\.0\)$"),
    ],
)
def test_mode_plan_errors_are_one_line_and_exit_2(capsys, args, message):
    world = [] if any(a.startswith("plan.world_size=") for a in args) else ["plan.world_size=4"]
    code = _precheck(["mode=plan", *world, *OV, *args])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert re.match(message, err.strip()), err
