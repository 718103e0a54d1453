"""trainer.compile: regional compilation (framework.train.compile) on CPU.

Most equality tests compile with backend="aot_eager" (dynamo + AOTAutograd, the same graphs
and guards, no inductor code generation): inductor's CPU backend builds C++ for each graph,
about 100 s for the tiny recipe on two cores, so one test (the tiny recipe through the CLI,
20 steps) runs inductor itself; on GPUs it is tests/recipes/stormcast/test_gpu.py and
tests/framework/distributed/test_gpu.py. The graph-break and recompile test uses
backend="eager" (dynamo only), which is what decides both counts.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from framework.train.compile import RegionForward, compile_model, compile_wanted
from recipes.stormcast.layers import UNetBlock
from recipes.stormcast.songunet import SongUNet
from tests.multiproc import spawn

pytestmark = pytest.mark.timeout(300)

TINY = {
    "img_resolution": (16, 16),
    "in_channels": 3,
    "out_channels": 2,
    "model_channels": 8,
    "channel_mult": [1, 2],
    "num_blocks": 1,
    "attn_resolutions": [8],
    "dropout": 0.0,
    "embedding_type": "zero",
}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _model(seed: int = 0, **overrides) -> SongUNet:
    torch.manual_seed(seed)
    m = SongUNet(**{**TINY, **overrides})
    for p in m.parameters():  # the near-zero output conv would hide differences
        torch.nn.init.normal_(p, std=0.05)
    return m


def _batches(n: int, batch: int = 2):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 3, 16, 16, generator=g), torch.randn(batch, 2, 16, 16, generator=g)) for _ in range(n)]


def _train(model, batches) -> list[float]:
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = []
    for x, y in batches:
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize(
    "recipe", ["stormcast", "stormcast_fast", "stormcast_diffusion", "stormcast_diffusion_fast", "stormscope"]
)
def test_gpu_presets_compile_on_cuda_and_stay_eager_on_cpu(compose, recipe):
    setting = compose([f"recipe={recipe}", "data.root=/data"]).trainer.compile
    assert setting is None  # auto
    assert compile_wanted(setting, "cuda") and not compile_wanted(setting, "cpu")
    assert not compile_wanted(False, "cuda") and compile_wanted(True, "cpu")  # said: as said
    assert compose([]).trainer.compile is False  # the default job: eager unless asked
    # the fp32 regression preset recomputes every GroupNorm + SiLU in backward (measured: 20.7 against
    # 36.3 GiB allocated without CUDA graphs); the bf16 one only levels 1 and 2's (the 40% MFU
    # setting of one GPU: 33.9 GiB reserved with CUDA graphs); the others keep every activation
    cfg = compose([f"recipe={recipe}", "data.root=/data"])
    trainer = cfg.trainer
    assert trainer.compile_memory_budget == (0.7 if recipe == "stormcast" else 1.0)
    assert list(cfg.model.get("recompute_norm_levels", [])) == ([1, 2] if recipe == "stormcast_fast" else [])
    # CUDA graphs where measured (auto, i.e. on under sharding=none): the bf16 StormCast presets
    cudagraphs = recipe in ("stormcast_fast", "stormcast_diffusion_fast")
    assert trainer.compile_cudagraphs == (None if cudagraphs else False)
    assert compose([]).trainer.compile_cudagraphs is False


@pytest.mark.parametrize("channels_last", [False, True])
def test_compiled_training_matches_eager_fp32(channels_last):
    """Compiled blocks (NCHW, and channels-last as CUDA conv nets compile by default) train like eager."""
    eager, compiled = _model(), _model()
    c = compile_model(compiled, device_type="cpu", backend="aot_eager", channels_last=channels_last)
    assert c.channels_last is channels_last
    blocks = sum(isinstance(m, UNetBlock) for m in compiled.modules())
    # every block, and the regions the SongUNet names besides them (its input convolution, output
    # GroupNorm + SiLU and output convolution)
    regions = [name for name, _ in c.units_list[blocks:]]
    assert c.enabled and c.units == blocks + 3 and regions == ["enc.16_conv", "out_norm", "out_conv"], c.units_list
    batches = _batches(3)
    a, b = _train(eager, batches), _train(compiled, batches)
    assert counters["stats"]["unique_graphs"] > 0, "nothing was compiled"
    for la, lb in zip(a, b):
        assert abs(la - lb) <= 1e-5 * abs(la), (a, b)
    for (n, p), q in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=f"parameter {n} after 3 steps")


def _saved_bytes(model, x) -> int:
    """Bytes the forward keeps for backward (what autograd's saved-tensor hooks see)."""
    total = []

    def pack(t):
        total.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x).square().mean()
    loss.backward()
    return sum(total)


def test_a_memory_budget_below_one_keeps_fewer_activations_and_trains_alike():
    """trainer.compile_memory_budget: AOTAutograd recomputes the blocks' pointwise work (GroupNorm +
    SiLU before each convolution) in backward instead of keeping it; the gradients do not change."""
    from framework.train.compile import set_memory_budget

    x = _batches(1)[0][0]
    saved, grads = {}, {}
    try:
        for budget in (1.0, 0.5):
            torch._dynamo.reset()
            model = _model()
            c = compile_model(model, device_type="cpu", backend="aot_eager_decomp_partition", memory_budget=budget)
            assert c.memory_budget == budget
            saved[budget] = _saved_bytes(model, x)
            grads[budget] = [p.grad for p in model.parameters()]
    finally:
        set_memory_budget(1.0)
    assert saved[0.5] < 0.75 * saved[1.0], saved
    for a, b in zip(grads[1.0], grads[0.5]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


def test_norms_of_chosen_levels_recompute_and_train_alike():
    """model.recompute_norm_levels: the compiled blocks of those levels keep less for backward
    (their GroupNorm + SiLU outputs are recomputed), without a graph break, and the gradients do
    not change; the finest level holds more of them than the coarse one."""
    x = _batches(1)[0][0]
    saved, grads = {}, {}
    for levels in ((), (1,), (0,)):
        torch._dynamo.reset()
        counters.clear()
        model = _model(recompute_norm_levels=levels)
        c = compile_model(model, device_type="cpu", backend="aot_eager_decomp_partition")
        saved[levels] = _saved_bytes(model, x)
        grads[levels] = [p.grad for p in model.parameters()]
        assert c.stats()["graph_breaks"] == 0, c.stats()["break_reasons"]
    assert saved[(0,)] < saved[(1,)] < saved[()], saved
    for levels in ((1,), (0,)):
        for a, b in zip(grads[()], grads[levels]):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


def test_the_recompute_pass_reaches_inductor_and_its_workers():
    """The model's ``recomputed_ops`` become inductor's joint-graph pass (inductor only), which
    travels pickled to precompilation's workers with the same cache identity, and marks exactly
    the nodes of those ops."""
    import pickle

    from torch.utils.checkpoint import CheckpointPolicy

    from framework.train.compile import RecomputeOps

    c = compile_model(_model(), device_type="cpu", backend="inductor")
    p = c.compile_kwargs["options"]["joint_custom_pre_pass"]
    assert isinstance(p, RecomputeOps) and p.names == ("stormcast::gn_apply_recomputed",)
    assert pickle.loads(pickle.dumps(p)).uuid() == p.uuid() != RecomputeOps(["x::y"]).uuid()
    assert "options" not in compile_model(_model(), device_type="cpu", backend="aot_eager").compile_kwargs

    from recipes.stormcast import fused_norm

    def two_norms(x, a):
        f32 = torch.float32
        return fused_norm.gn_apply_recomputed(x, a, a, True, f32) + fused_norm.gn_apply(x, a, a, True, f32)

    gm = torch.fx.symbolic_trace(two_norms)
    p(gm.graph)
    marked = {str(n.target): n.meta.get("recompute") for n in gm.graph.nodes if n.op == "call_function"}
    assert marked["stormcast.gn_apply_recomputed.default"] == CheckpointPolicy.MUST_RECOMPUTE, marked
    assert marked["stormcast.gn_apply.default"] is None and marked["<built-in function add>"] is None, marked

    # a custom op's random input (its dropout seed) is kept, an aten op's is not
    g = torch.fx.Graph()
    x, a = g.placeholder("x"), g.placeholder("a")
    seed = g.call_function(torch.ops.aten.randint.low, (0, 2**62, [1]), {"dtype": torch.int64})
    noise = g.call_function(torch.ops.aten.rand.default, ([1],))
    y = g.call_function(torch.ops.stormcast.gn_apply.default, (x, a, a, True, torch.float32, seed, 0.5))
    g.output((y, g.call_function(torch.ops.aten.mul.Tensor, (a, noise))))
    p(g)
    marked = {str(n.target): n.meta.get("recompute") for n in g.nodes if n.op == "call_function"}
    assert marked["aten.randint.low"] == CheckpointPolicy.MUST_SAVE, marked
    assert marked["aten.rand.default"] is None, marked
    # installed for any inductor compile (a model naming no op still needs its random inputs kept)
    bare = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    c = compile_model(bare, units=["Linear"], device_type="cpu", backend="inductor")
    assert c.compile_kwargs["options"]["joint_custom_pre_pass"].names == ()


def test_cuda_graphs_apply_where_parameters_stay_put():
    """trainer.compile_cudagraphs: null turns them on for CUDA under sharding=none (measured there),
    true also under ddp; true where they cannot apply (FSDP2, a domain split, activation
    checkpointing around the blocks) is a config error naming the obstacle, judged on the layout
    the run really applies (fsdp2 on one rank is none) and only when something is compiled."""
    from types import SimpleNamespace

    from framework import runtime
    from framework.distributed.mesh import Degrees
    from framework.errors import ConfigError
    from framework.train.compile import cudagraphs_wanted

    assert cudagraphs_wanted(None, "cuda", "none", 1) and not cudagraphs_wanted(None, "cuda", "ddp", 1)
    assert not cudagraphs_wanted(None, "cpu", "none", 1)
    assert not cudagraphs_wanted(None, "cuda", "fsdp2", 1) and not cudagraphs_wanted(None, "cuda", "ddp", 2)
    assert not cudagraphs_wanted(None, "cuda", "none", 1, checkpointed=True)
    assert cudagraphs_wanted(True, "cuda", "none", 1) and not cudagraphs_wanted(False, "cuda", "none", 1)

    def check(sharding, world=2, domain=1, setting=True, compile=None, checkpoint_level=0):
        run = SimpleNamespace(
            sharding=SimpleNamespace(name=sharding),
            splitter=SimpleNamespace(name="rows"),
            model=SimpleNamespace(name="songunet", checkpoint_level=checkpoint_level),
            trainer=SimpleNamespace(compile_cudagraphs=setting, compile=compile),
        )
        degrees = Degrees(dp_replicate=1, dp_shard=world // domain, domain=domain)
        runtime._check_layout(run, degrees)

    check("ddp")
    check("fsdp2", world=1)  # one rank: no sharding applied
    check("fsdp2", setting=None)  # auto: off there, no error
    check("fsdp2", compile=False)  # nothing compiled: nothing to refuse
    with pytest.raises(ConfigError, match=r"^trainer\.compile_cudagraphs=true cannot apply: sharding=fsdp2 gathers"):
        check("fsdp2")
    with pytest.raises(ConfigError, match=r"cannot apply: parallel\.domain=2: its collectives are not captured"):
        check("ddp", domain=2)
    with pytest.raises(ConfigError, match=r"cannot apply: activation checkpointing .*model\.checkpoint_level > 0"):
        check("none", world=1, checkpoint_level=1)
    # nothing to capture on CPU or without inductor: the option stays off, with a warning
    with pytest.warns(UserWarning, match=r"CUDA graphs need CUDA and inductor \(here cpu, inductor\); off"):
        assert not compile_model(_model(), device_type="cpu", cudagraphs=True).cudagraphs
    with pytest.warns(UserWarning, match=r"\(here cuda, eager\); off"):
        c = compile_model(_model(), device_type="cuda", backend="eager", cudnn_benchmark=False, cudagraphs=True)
    assert not c.cudagraphs
    torch._dynamo.reset()


@pytest.mark.parametrize("device,form", [("cuda", "fused"), ("cpu", "explicit")])
def test_auto_group_norms_pick_their_kernels_by_the_cuda_graph_setting(device, form):
    """compile_model tells each module with ``configure_compile`` whether the graphs replay as
    CUDA graphs: the SongUNet's "auto" GroupNorms take the Triton kernels only then (their
    launches cost host time that only CUDA graphs take away); a form set by the user stays."""
    from recipes.stormcast.layers import GroupNorm, set_compiled_form

    model = _model()
    norms = [m for m in model.modules() if isinstance(m, GroupNorm)]
    set_compiled_form(norms[0], "composite")
    c = compile_model(model, device_type=device, cudnn_benchmark=False, cudagraphs=True)  # inductor: compiles lazily
    assert c.cudagraphs is (device == "cuda")
    assert norms[0].compiled_form == "composite" and {m.compiled_form for m in norms[1:]} == {form}
    torch._dynamo.reset()


def test_configure_compile_gets_the_settings_it_takes_and_a_users_joint_pass_is_kept(caplog):
    """A ``configure_compile`` that takes only ``cudagraphs`` (written before ``channels_last``
    was added) still works, one with ``**kwargs`` gets both; an inductor joint pass the caller set is
    kept, with a warning that the model's recomputed ops go unmarked."""
    seen = []

    class Old(torch.nn.Module):
        def configure_compile(self, *, cudagraphs):
            seen.append(("old", cudagraphs))

    class Flexible(torch.nn.Module):
        def configure_compile(self, **settings):
            seen.append(("any", settings))

    model = _model()
    model.old, model.any = Old(), Flexible()
    mine = object()
    with caplog.at_level("WARNING", logger="framework"):
        c = compile_model(
            model, device_type="cpu", backend="inductor", channels_last=True, options={"joint_custom_pre_pass": mine}
        )
    assert seen == [("old", False), ("any", {"cudagraphs": False, "channels_last": True})], seen
    assert c.compile_kwargs["options"]["joint_custom_pre_pass"] is mine
    assert "joint_custom_pre_pass; ('stormcast::gn_apply_recomputed',) not marked for recompute" in caplog.text


class _Branchy(torch.nn.Module):
    """Two layers; the second only in some micro-batches (its first gradient comes later)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x, use_b: bool):
        y = self.a(x)
        return self.b(y) if use_b else y


def test_cuda_graph_steps_move_accumulated_gradients_out_of_the_pool(monkeypatch):
    """With CUDA graphs a block's parameter gradients are outputs of its backward graph, which the
    next generation's replay overwrites. Simulated here: a gradient that autograd took from a
    backward pass (not accumulated into an existing one) is "in the pool", and starting a new
    generation fills what is left in the pool with NaN. Three micro-batches per step, the second
    layer used from the second on: the accumulated gradients stay eager's."""
    from framework.train.compile import _replay_as_cuda_graphs

    pool: list[torch.Tensor] = []

    def new_generation():  # the next replay overwrites the pool's memory
        for t in pool:
            t.fill_(float("nan"))
        pool.clear()

    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", new_generation)
    model, ref = _Branchy(), _Branchy()
    _replay_as_cuda_graphs(model)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):  # steps
        for use_b in (False, True, True):  # micro-batches
            x = torch.randn(3, 4, generator=g)
            loss = model(x, use_b).square().sum()  # (the hook has run)
            before = {id(p.grad) for p in model.parameters() if p.grad is not None}
            loss.backward()
            pool.extend(p.grad for p in model.parameters() if p.grad is not None and id(p.grad) not in before)
            ref(x, use_b).square().sum().backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=f"{name}: a gradient left in the pool was overwritten")
        for m in (model, ref):
            m.zero_grad(set_to_none=True)


def test_channels_last_is_the_cuda_default_for_convolutional_blocks_only():
    from framework.domain.comm import DomainGroup
    from framework.domain.splitter import split
    from framework.train.compile import _wants_channels_last
    from recipes.stormcast.parallelize import PLAN
    from recipes.stormscope.dit import DiTBlock

    def units(model, cls):
        return [(n, m) for n, m in model.named_modules() if isinstance(m, cls)]

    unet = _model()
    assert _wants_channels_last(units(unet, UNetBlock), "cuda")
    assert not _wants_channels_last(units(unet, UNetBlock), "cpu")
    dit = DiTBlock(32, 2, 4.0, kernel=3, rope=True, impl="reference")  # linear layers: nothing for cuDNN
    assert not _wants_channels_last([("b", dit)], "cuda")
    split_unet = split(_model(), DomainGroup(None, [8, 8]), PLAN)  # domain-split blocks stay NCHW
    assert not _wants_channels_last(units(split_unet, UNetBlock), "cuda")


@pytest.mark.parametrize("channels_last", [False, True])
def test_compiled_blocks_hand_back_dense_gradients(channels_last, monkeypatch):
    """A compiled block's backward copies every incoming gradient that is not dense in the layout
    it was traced for (AOTAutograd's tangent coercion: on an H200, 10 full-size copies per step
    of the regression preset). The blocks hand back dense gradients instead (the decoder's
    concatenated skips and the resampling blocks included), so no such copy is left."""
    from torch._functorch import aot_autograd  # noqa: F401  (loads the runtime wrappers)
    from torch._functorch._aot_autograd import runtime_wrappers

    real = getattr(runtime_wrappers, "coerce_to_expected_memory_format", None)
    if real is None:
        pytest.skip("this torch names its tangent coercion differently")
    copies = []

    def counted(x, memory_format):
        y = real(x, memory_format)
        if y is not x:
            copies.append((tuple(x.shape), x.stride()))
        return y

    monkeypatch.setattr(runtime_wrappers, "coerce_to_expected_memory_format", counted)
    model = _model(attn_resolutions=[])  # decoder skips and one upsampling block
    compile_model(model, device_type="cpu", backend="aot_eager", channels_last=channels_last)
    x, _ = _batches(1)[0]
    model(x).square().mean().backward()
    assert counters["stats"]["unique_graphs"] > 0
    assert copies == [], copies


@pytest.mark.parametrize("channels_last", [False, True])
def test_weight_gradients_arrive_in_the_parameters_layout(channels_last):
    """A channels-last convolution's weight gradient is channels-last, and autograd copies any
    gradient laid out otherwise than its parameter (113 launches per step of the regression preset
    on an H200); the compiled convolutions hand them back in the parameter's layout (a tensor hook
    sees the gradient before that copy would be made)."""
    model = _model()
    compile_model(model, device_type="cpu", backend="aot_eager", channels_last=channels_last)
    laid_out = {}
    for name, p in model.named_parameters():
        if p.dim() == 4 and p.shape[-1] > 1:  # (a 1 x 1 kernel is both layouts at once)
            p.register_hook(lambda g, n=name, p=p: laid_out.__setitem__(n, g.stride() == p.stride()))
    x, _ = _batches(1)[0]
    model(x).square().mean().backward()
    assert len(laid_out) > 10 and all(laid_out.values()), [n for n, ok in laid_out.items() if not ok]


def _signatures(model: SongUNet, x: torch.Tensor) -> int:
    """Distinct (block config, input shapes) in one eager forward: the graphs regional compile needs."""
    seen = set()

    def hook(m, args):
        shapes = tuple(tuple(a.shape) if torch.is_tensor(a) else None for a in args)
        seen.add((m.in_channels, m.out_channels, m.conv0.up, m.conv0.down, m.attn is not None, shapes))

    handles = [b.register_forward_pre_hook(hook) for b in model.modules() if isinstance(b, UNetBlock)]
    with torch.no_grad():
        model(x)
    for h in handles:
        h.remove()
    return len(seen)


def test_tiny_songunet_compiles_without_graph_breaks_within_its_recompile_budget():
    """CI guard: a graph break or a recompile beyond one graph per distinct block signature
    (e.g. a guard on a module instance, a shape made dynamic) fails here."""
    model = _model(num_blocks=2)  # two blocks per level: some signatures repeat
    x, y = _batches(1)[0]
    budget = _signatures(model, x)
    c = compile_model(model, device_type="cpu", backend="eager")
    for _ in range(2):  # the second step must reuse every graph
        torch.nn.functional.mse_loss(model(x), y).backward()
    s = c.stats()
    assert s["graph_breaks"] == 0, s["break_reasons"]
    # one graph per block signature, shared by its blocks, and one for each region the UNet names
    # (input and output convolutions: one code, two graphs; the output GroupNorm)
    assert s["cached_graphs"] == budget + 3, (s, budget)
    assert s["recompiles"] == budget  # (budget - 1) + 1: recompiles of the blocks' code and the convolutions'
    assert budget + 3 < c.units  # blocks with one signature do share a graph
    assert s["first_step_s"] is not None  # the start-up report ran after the first step


def test_a_flop_counting_first_step_leaves_the_blocks_compiled():
    """Dynamo skips for good a frame it first meets under a dispatch mode (FlopCounterMode)."""
    from torch.utils.flop_counter import FlopCounterMode

    model = _model()
    c = compile_model(model, device_type="cpu", backend="eager")
    x, y = _batches(1)[0]
    counter = FlopCounterMode(display=False)
    with counter:
        torch.nn.functional.mse_loss(model(x), y).backward()
    assert counter.get_total_flops() > 0
    assert c.stats()["graphs"] == 0  # the counted step ran eager
    torch.nn.functional.mse_loss(model(x), y).backward()
    assert c.stats()["graphs"] > 0


def test_validation_runs_eager_and_names_are_unchanged():
    model = _model()
    keys = list(model.state_dict())
    compile_model(model, device_type="cpu", backend="eager")
    assert list(model.state_dict()) == keys  # checkpoints and the domain splitter see the same names
    assert all(isinstance(b.forward, RegionForward) for b in model.modules() if isinstance(b, UNetBlock))
    x, _ = _batches(1)[0]
    model.eval()
    with torch.no_grad():
        model(x)
    assert counters["frames"]["ok"] == 0


def _layout(rank, world, sharding, backend):
    from framework.config.schema import ParallelConfig, PrecisionConfig, ShardingConfig
    from framework.distributed import mesh, precision
    from framework.distributed import sharding as policies

    torch._dynamo.reset()
    batches = _batches(2, batch=4)
    ref = _model()
    ref_losses = _train(ref, batches)
    topo = mesh.build(mesh.resolve(ParallelConfig(), world), "cpu")
    model = _model()
    c = compile_model(model, device_type="cpu", backend=backend)
    prec = precision.build(PrecisionConfig(name="fp32"), torch.device("cpu"))
    sharded = policies.__dict__[sharding](
        model, ShardingConfig(name=sharding), topology=topo, precision=prec, device=torch.device("cpu")
    )
    per = 4 // world
    sl = slice(rank * per, (rank + 1) * per)
    local = _train(sharded.model, [(x[sl], y[sl]) for x, y in batches])
    assert c.stats()["graphs"] > 0 and c.stats()["graph_breaks"] == 0
    for step, (lr, ll) in enumerate(zip(ref_losses, local)):
        t = torch.tensor([ll / world])
        torch.distributed.all_reduce(t)
        assert abs(t.item() - lr) <= 1e-5 * lr, (step, t.item(), lr)


def _domain_layout(rank, world, sharding, extents, recompute_levels=()):
    """The SongUNet split over the rows of each sample (2 domain ranks, uneven bands), its blocks
    compiled with the halo exchanges, GroupNorm sums and attention gathers inside their graphs,
    then DDP or FSDP2 over the domain ranks, as parallel=domain / fsdp2_domain build it. With
    ``recompute_levels``, the split norms of those levels recompute in backward (their statistics'
    all-gather too), under the checkpoint ``GroupNormMixin`` puts around them."""
    import framework.domain.layers as domain_layers
    from framework.config.schema import ParallelConfig, PrecisionConfig, ShardingConfig
    from framework.distributed import mesh, precision
    from framework.distributed import sharding as policies
    from framework.domain.comm import DomainGroup
    from framework.domain.splitter import split
    from recipes.stormcast.parallelize import PLAN

    torch._dynamo.reset()
    batches = _batches(2, batch=2)
    ref_losses = _train(_model(), batches)
    topo = mesh.build(mesh.resolve(ParallelConfig(dp_shard=1, domain=world), world), "cpu")
    dg = DomainGroup(topo.group("domain"), extents)
    model = _model()
    model.set_norm_recompute(recompute_levels)
    model = split(model, dg, PLAN)
    checkpoints = []
    real = domain_layers.checkpoint
    domain_layers.checkpoint = lambda *a, **k: checkpoints.append(1) or real(*a, **k)
    c = compile_model(model, device_type="cpu", backend="aot_eager")
    prec = precision.build(PrecisionConfig(name="fp32"), torch.device("cpu"))
    sharded = policies.__dict__[sharding](
        model, ShardingConfig(name=sharding), topology=topo, precision=prec, device=torch.device("cpu")
    )
    rows = slice(sum(extents[:rank]), sum(extents[: rank + 1]))
    share = world * extents[rank] / sum(extents)  # the task's weight: the gradient average becomes the sum
    opt = torch.optim.Adam(sharded.model.parameters(), lr=1e-3)
    for step, (x, y) in enumerate(batches):
        loss = torch.nn.functional.mse_loss(sharded.model(x[:, :, rows]), y[:, :, rows]) * share
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = loss.detach() / world
        torch.distributed.all_reduce(total)
        assert abs(total.item() - ref_losses[step]) <= 1e-5 * ref_losses[step], (step, total.item(), ref_losses)
    s = c.stats()
    assert c.enabled and s["graphs"] > 0 and s["graph_breaks"] == 0, s
    assert bool(checkpoints) == bool(recompute_levels), checkpoints


@pytest.mark.parametrize("sharding,levels", [("ddp", [0]), ("fsdp2", [])], ids=["ddp-recompute", "fsdp2"])
def test_compiled_domain_layouts_train_like_one_eager_process(sharding, levels):
    """trainer.compile on parallel=domain (DDP) and fsdp2_domain: one graph per block signature,
    no graph break, the losses of one eager process; under DDP with the finest level's norms
    recomputed (``model.recompute_norm_levels``)."""
    spawn(_domain_layout, 2, sharding, [10, 6], levels, timeout_s=240)


@pytest.mark.parametrize("sharding,backend", [("fsdp2", "aot_eager"), ("ddp", "eager")])
def test_compiled_layouts_train_like_one_eager_process(sharding, backend):
    """FSDP2's and DDP's hooks around compiled blocks, on 2 gloo ranks. FSDP2 through AOTAutograd
    (its unsharded parameters are graph inputs whose storage it frees and refills); DDP with
    dynamo alone, as its gradient hooks sit on the parameters either way (and CI time is short)."""
    spawn(_layout, 2, sharding, backend, timeout_s=240)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_tiny_recipe_compiled_with_inductor_trains_like_eager(tmp_path):
    """trainer.compile=true through the CLI with inductor's CPU backend (scalar C++ kernels, see
    conftest.py; about 70 s on 2 cores): fp32, 20 steps, the eager losses within 1e-5, no graph break. Two
    precompile workers build every block's graphs before the first step, which loads them all."""
    from framework.logging.jsonl import read
    from scripts.loss_compare import compare
    from tests.conftest import run_cli

    common = [
        "deterministic=true",
        "trainer.max_steps=20",
        "trainer.log_every=1",
        "trainer.val_every=0",
        "trainer.figures=false",
        "trainer.progress=false",
        "checkpoint=none",
        f"data.root={tmp_path / 'data'}",
    ]
    runs = {}
    for mode in ("false", "true"):
        run = tmp_path / f"compile_{mode}"
        workers = ["trainer.compile_workers=2"] if mode == "true" else []
        proc = run_cli([*common, f"trainer.compile={mode}", *workers, f"hydra.run.dir={run}"], tmp_path, timeout=500)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[mode] = [r["loss"] for r in read(run / "metrics.jsonl", "train")]
    assert len(runs["true"]) == 20 and compare(runs["false"], runs["true"]) <= 1e-5, runs
    log = (tmp_path / "compile_true" / "framework.log").read_text()
    assert "backend=inductor" in log and " 0 graph breaks" in log, log[-2000:]
    assert "precompiled by 2 workers" in log and "inductor built 0 forward/backward graphs" in log, log[-2000:]


def test_a_model_names_regions_to_compile_besides_its_blocks():
    """``compile_regions``: paths below the module that names them, compiled like the blocks (here
    from a wrapper, as the diffusion preconditioner wraps the UNet); a region inside a block is
    left to the block, and eval-mode calls stay eager."""
    from framework.train.compile import named_regions

    class Wrapper(torch.nn.Module):
        compile_regions = ("net.enc.16_block0.norm0",)  # inside a block: left to it

        def __init__(self):
            super().__init__()
            self.net = _model()

        def forward(self, x):
            return self.net(x)

    model = Wrapper()
    c = compile_model(model, device_type="cpu", backend="eager")
    names = [n for n, _ in c.units_list]
    regions = ["net.enc.16_conv", "net.out_norm", "net.out_conv"]  # the UNet's own, once each
    assert names[-3:] == regions and names.count("net.out_norm") == 1
    assert "net.enc.16_block0.norm0" not in names
    assert named_regions(model, c.units_list[:-3]) == [(n, model.get_submodule(n)) for n in regions]
    assert isinstance(model.net.out_norm.forward, RegionForward)
    x, y = _batches(1)[0]
    torch.nn.functional.mse_loss(model(x), y).backward()
    assert c.stats()["graph_breaks"] == 0 and model.net.out_norm.weight.grad is not None
    graphs = counters["stats"]["unique_graphs"]
    with torch.no_grad():  # validation: the eager forward, nothing traced
        model.eval()(x)
    assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.parametrize(
    "regions,error",
    [
        (("no_such",), "no submodule 'no_such'"),
        (("enc",), "'enc' holds compiled blocks"),
        ("out_norm", "a tuple of submodule paths"),
    ],
    ids=["missing", "holds-blocks", "not-a-tuple"],
)
def test_a_bad_compile_region_is_a_config_error_naming_it(monkeypatch, regions, error):
    from framework.errors import ConfigError

    monkeypatch.setattr(SongUNet, "compile_regions", regions)
    with pytest.raises(ConfigError, match=error):
        compile_model(_model(), device_type="cpu", backend="eager")


def test_a_region_named_twice_or_frozen_is_compiled_once_or_not_at_all(monkeypatch):
    model = _model()
    monkeypatch.setattr(SongUNet, "compile_regions", ("out_norm", "out_norm"))
    names = [n for n, _ in compile_model(model, device_type="cpu", backend="eager").units_list]
    assert names.count("out_norm") == 1
    frozen = _model()
    frozen.out_norm.requires_grad_(False)
    names = [n for n, _ in compile_model(frozen, device_type="cpu", backend="eager").units_list]
    assert "out_norm" not in names


def test_the_compile_cache_is_the_users_own_never_the_run_dirs(monkeypatch, tmp_path, caplog):
    """Inductor unpickles and imports what its cache holds, so a run dir from someone else must
    not be it: the cache is per user, and one that others could write to or swap is refused."""
    import os
    import stat

    from framework.errors import ConfigError
    from framework.train.compile import user_cache_dir

    def cache_dir_after_compile(cache):
        monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
        compile_model(_model(), device_type="cpu", backend="eager", cache_dir=cache)
        return os.environ.get("TORCHINDUCTOR_CACHE_DIR")

    base = tmp_path / "xdg"
    monkeypatch.setenv("XDG_CACHE_HOME", str(base))
    cache = base / "framework" / "compile"
    assert user_cache_dir() == cache
    assert cache_dir_after_compile(user_cache_dir()) == str(cache) and stat.S_IMODE(cache.stat().st_mode) == 0o700
    cache.chmod(0o777)  # a shared directory: anyone could plant code in it
    with pytest.raises(ConfigError, match=rf"compile cache {cache}: {cache} may be written by others \(mode 777\)"):
        cache_dir_after_compile(cache)
    cache.chmod(0o700)
    base.chmod(0o775)  # a group scratch area above it: another member could swap framework/ for theirs
    with pytest.raises(ConfigError, match=rf"compile cache {cache}: {base} may be written by others \(mode 775\)"):
        cache_dir_after_compile(cache)
    base.chmod(0o1777)  # sticky, as /tmp: others may not rename what is not theirs
    assert cache_dir_after_compile(cache) == str(cache)
    if os.getuid() == 0:  # only root can hand a directory to another user
        os.chown(cache, 65534, 65534)
        with pytest.raises(ConfigError, match=rf"compile cache {cache}: {cache} belongs to another user \(uid 65534\)"):
            cache_dir_after_compile(cache)
    # no home to write to (a container without one): torch's own default, said once
    assert not (cache_dir_after_compile(Path("/dev/null/framework/compile")) or "").startswith("/dev/null")
    assert "compile cache /dev/null/framework/compile cannot be created" in caplog.text
    mine = tmp_path / "mine"  # the user's own TORCHINDUCTOR_CACHE_DIR is their choice, unchecked
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(mine))
    compile_model(_model(), device_type="cpu", backend="eager", cache_dir=cache)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(mine)


_OP_VERSIONS = {"1": "seed", "2": "mask"}  # an argument's name before and after an upgrade of the op
_UPGRADED_OP = """
import sys, torch
from typing import Optional
from framework.train.compile import use_caches
name = {names!r}[sys.argv[1]]
exec(f"def scale(x: torch.Tensor, {{name}}: Optional[torch.Tensor] = None, p: float = 0.0) -> torch.Tensor:"
     "    return x * (1 + p)")
op = torch.library.custom_op("cachetagtest::scale", scale, mutates_args=())
op.register_fake(lambda x, *rest: torch.empty_like(x))
use_caches()
f = torch.compile(lambda x: torch.ops.cachetagtest.scale(x.sin(), None, 0.0) + 1, backend="inductor")
print(f(torch.ones(3)).tolist())
"""


def test_a_custom_ops_new_schema_compiles_afresh_instead_of_loading_the_old_graph(tmp_path):
    """Inductor's cache keys a graph by its code, which names a custom op but not its schema: a
    graph cached against an op's old signature, loaded after an upgrade, called it with an
    argument it no longer takes. ``use_caches`` puts a digest of the custom ops into the key."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(root)}
    script = _UPGRADED_OP.format(names=_OP_VERSIONS)
    for version in ("1", "2"):
        out = subprocess.run(
            [sys.executable, "-c", script, version], env=env, capture_output=True, text=True, timeout=300
        )
        assert out.returncode == 0, out.stderr[-2000:]
        assert json.loads(out.stdout) == pytest.approx([math.sin(1) + 1] * 3), out.stdout
