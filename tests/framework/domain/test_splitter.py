"""The domain splitter (framework/domain/splitter.py): split plans, what a plan converts,
what it refuses (by name), what it leaves alone; the splitter registry entries (``rows``
and its deprecated alias ``shard_tensor``) and the runtime's domain checks."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import framework.domain
from framework import registry, runtime
from framework.config.schema import SplitterConfig
from framework.domain.comm import DomainGroup
from framework.domain.layers import GroupNormMixin, HaloMixin
from framework.domain.splitter import TORCH_PLAN, SplitPlan, model_plan, require_plan, split, swap_class
from framework.errors import ConfigError


def fake_domain(extents=(8, 8)) -> DomainGroup:
    """A domain group without communication: enough to convert (not to run) a model."""
    return DomainGroup(None, list(extents))


class Mystery(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return x * self.scale[:, None, None]


class Net(nn.Module):
    def __init__(self, extra: nn.Module | None = None):
        super().__init__()
        self.stem = nn.Conv2d(3, 3, 3, padding=1)
        self.body = nn.Sequential(nn.GroupNorm(1, 3), nn.SiLU())
        if extra is not None:
            self.extra = extra
        self.head = nn.Conv2d(3, 3, 1)

    def forward(self, x):
        x = self.body(self.stem(x))
        return self.head(self.extra(x) if hasattr(self, "extra") else x)


def classes(model):
    return {n: type(m) for n, m in model.named_modules()}


# ------------------------------------------------------------------ conversion


def test_split_swaps_classes_in_place_keeping_state_and_names():
    model = Net()
    before = copy.deepcopy(model.state_dict())
    names = [n for n, _ in model.named_parameters()]
    stem_weight = model.stem.weight
    assert split(model, fake_domain(), TORCH_PLAN) is model
    assert isinstance(model.stem, HaloMixin) and isinstance(model.stem, nn.Conv2d)
    assert type(model.stem).__name__ == "DomainConv2d" and model.stem._halo == (1, 1)
    assert isinstance(model.body[0], GroupNormMixin) and isinstance(model.body[0], nn.GroupNorm)
    assert type(model.body[1]) is nn.SiLU  # pointwise: left alone
    assert model.head._halo == (0, 0)
    assert model.stem.weight is stem_weight  # the same Parameter objects (optimizers, FSDP2 see them)
    assert [n for n, _ in model.named_parameters()] == names
    assert all(torch.equal(a, b) for a, b in zip(before.values(), model.state_dict().values()))
    copy.deepcopy(model)  # converted models still copy
    Net().load_state_dict(model.state_dict())  # and checkpoints load across layouts


def test_torch_conv_halo_follows_the_kernel():
    for k, halo in ((1, 0), (3, 1), (5, 2), (7, 3)):
        m = nn.Conv2d(2, 2, (k, 3), padding=(k // 2, 1))
        swap = split(nn.Sequential(m), fake_domain(), TORCH_PLAN)[0]
        assert swap._halo == (halo, halo), k


@pytest.mark.parametrize(
    "conv,what",
    [
        (nn.Conv2d(3, 3, 3, stride=2, padding=1), "stride (2, 2)"),
        (nn.Conv2d(3, 3, 3, padding=0), "padding (0, 0)"),
        (nn.Conv2d(3, 3, 3, padding=2, dilation=2), "dilation (2, 2)"),
        (nn.Conv2d(3, 3, 2, padding=1), "kernel (2, 2)"),
        (nn.Conv2d(3, 3, 3, padding=1, padding_mode="reflect"), "padding_mode 'reflect'"),
    ],
)
def test_torch_convs_that_cannot_split_over_rows_are_refused(conv, what):
    with pytest.raises(ConfigError, match=r"nn\.Conv2d with .*cannot be split over rows") as info:
        split(Net(conv), fake_domain(), TORCH_PLAN)
    assert what in str(info.value)


@pytest.mark.parametrize(
    "extra,name",
    [
        (nn.BatchNorm2d(3), "BatchNorm2d"),
        (nn.ConvTranspose2d(3, 3, 2, stride=2), "ConvTranspose2d"),
        (nn.InstanceNorm2d(3), "InstanceNorm2d"),
        (nn.Upsample(scale_factor=2), "Upsample"),
        (nn.MaxPool2d(2), "MaxPool2d"),
        (nn.AvgPool2d(3, 1, 1), "AvgPool2d"),
        (nn.Dropout2d(0.1), "Dropout2d"),
        (nn.Sequential(nn.SiLU(), nn.BatchNorm2d(3)), "BatchNorm2d"),
    ],
)
def test_spatial_torch_modules_without_a_rule_are_refused_by_name(extra, name):
    model = Net(extra)
    before = classes(model)
    where = "extra.1" if isinstance(extra, nn.Sequential) else "extra"
    with pytest.raises(
        ConfigError,
        match=rf"splitter: cannot split module '{where}' \({name}\) over the domain "
        "axis",
    ):
        split(model, fake_domain(), TORCH_PLAN)
    assert classes(model) == before  # refused before anything was converted


def test_a_custom_module_with_parameters_and_no_rule_is_refused_by_name():
    model = Net(Mystery())
    with pytest.raises(
        ConfigError,
        match=r"no domain rule for module 'extra' \(Mystery\) which holds parameters; "
        r"add one to split plan 'torch'",
    ):
        split(model, fake_domain(), TORCH_PLAN)
    assert type(model.stem) is nn.Conv2d


def test_rules_and_local_classes_added_to_a_plan_are_accepted():
    model = split(Net(Mystery()), fake_domain(), TORCH_PLAN.extend("mystery").local(Mystery))
    assert type(model.extra) is Mystery
    seen = []
    plan = TORCH_PLAN.extend("mystery").rule(Mystery, lambda m, dg: seen.append((m, dg)))
    dg = fake_domain()
    model = split(Net(Mystery()), dg, plan)
    assert seen == [(model.extra, dg)]
    assert isinstance(model.stem, HaloMixin)  # the base plan's torch rules still apply


def test_a_subtree_rule_answers_for_its_descendants():
    class Patchify(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Conv2d(3, 3, 2, stride=2)  # a strided conv: refused on its own

    with pytest.raises(ConfigError, match=r"module 'extra\.proj' \(Conv2d\)"):
        split(Net(Patchify()), fake_domain(), TORCH_PLAN.extend("p").rule(Patchify, lambda m, dg: None))
    model = split(
        Net(Patchify()), fake_domain(), TORCH_PLAN.extend("p").rule(Patchify, lambda m, dg: None, subtree=True)
    )
    assert type(model.extra.proj) is nn.Conv2d and isinstance(model.stem, HaloMixin)


# ------------------------------------------------------------------ plans


def test_the_torch_plan_covers_torch_layers():
    assert set(TORCH_PLAN.rules) == {nn.Conv2d, nn.GroupNorm, nn.LayerNorm}
    assert {nn.Linear, nn.SiLU, nn.ReLU, nn.GELU, nn.Identity, nn.Dropout} == TORCH_PLAN.local_classes
    assert nn.Conv2d in TORCH_PLAN and Mystery not in TORCH_PLAN and TORCH_PLAN.name == "torch"


@pytest.mark.parametrize(
    "add_again",
    [
        lambda p: p.rule(Mystery, lambda m, dg: None),
        lambda p: p.local(Mystery),
    ],
    ids=["as a rule", "as local"],
)
@pytest.mark.parametrize(
    "first",
    [
        lambda p: p.rule(Mystery, lambda m, dg: None),
        lambda p: p.rule(Mystery, lambda m, dg: None, subtree=True),
        lambda p: p.local(Mystery),
    ],
    ids=["rule", "subtree rule", "local"],
)
def test_a_class_registered_twice_in_a_plan_is_an_error(first, add_again):
    plan = first(TORCH_PLAN.extend("twice"))
    with pytest.raises(ValueError, match=r"split plan 'twice': .*Mystery is registered twice"):
        add_again(plan)


def test_a_base_class_registered_again_is_an_error_not_a_replacement():
    with pytest.raises(
        ValueError,
        match=r"split plan 'mine': torch\.nn\.modules\.conv\.Conv2d is registered twice "
        r"\(it already has a rule\)",
    ):
        TORCH_PLAN.extend("mine").rule(nn.Conv2d, lambda m, dg: None)
    with pytest.raises(ValueError, match=r"SiLU is registered twice \(it already has local\)"):
        TORCH_PLAN.extend("mine").local(nn.SiLU)
    with pytest.raises(ValueError, match="Mystery is registered twice"):
        TORCH_PLAN.extend("mine").local(Mystery, Mystery)  # within one call too


def test_plans_are_immutable_values():
    before = (dict(TORCH_PLAN.rules), TORCH_PLAN.local_classes, TORCH_PLAN.subtree)
    TORCH_PLAN.extend("a").rule(Mystery, lambda m, dg: None, subtree=True).local(nn.Tanh)
    assert (dict(TORCH_PLAN.rules), TORCH_PLAN.local_classes, TORCH_PLAN.subtree) == before
    with pytest.raises(TypeError):
        TORCH_PLAN.rules[Mystery] = lambda m, dg: None
    with pytest.raises(AttributeError):
        TORCH_PLAN.name = "other"
    with pytest.raises(TypeError, match="plan must be a SplitPlan"):
        split(Net(), fake_domain(), None)


def test_two_plans_are_independent():
    seen = []
    one = TORCH_PLAN.extend("one").rule(Mystery, lambda m, dg: seen.append("one"))
    two = TORCH_PLAN.extend("two")
    split(Net(Mystery()), fake_domain(), one)
    assert seen == ["one"]
    with pytest.raises(ConfigError, match=r"no domain rule for module 'extra' \(Mystery\) .*split plan 'two'"):
        split(Net(Mystery()), fake_domain(), two)  # the other plan's rule does not leak in
    three = TORCH_PLAN.extend("three").rule(Mystery, lambda m, dg: seen.append("three"))  # no clash with one
    split(Net(Mystery()), fake_domain(), three)
    assert seen == ["one", "three"]
    with pytest.raises(ConfigError, match="no domain rule for module 'extra'"):
        split(Net(Mystery()), fake_domain(), TORCH_PLAN)


def test_the_recipes_plans_are_separate():
    from recipes.stormcast import layers
    from recipes.stormcast.parallelize import PLAN as UNET
    from recipes.stormscope import dit
    from recipes.stormscope.parallelize import PLAN as DIT

    assert isinstance(UNET, SplitPlan) and (UNET.name, DIT.name) == ("songunet", "dit")
    assert layers.Conv2d in UNET and layers.Conv2d not in DIT
    assert dit.NeighbourhoodAttention in DIT and dit.NeighbourhoodAttention not in UNET
    assert nn.Conv2d in UNET and nn.Conv2d in DIT  # both extend the torch plan
    assert dit.PatchEmbed in DIT.subtree and not UNET.subtree
    registry.load_providers()
    assert registry.models.entry("songunet").split_plan is UNET
    assert registry.models.entry("dit").split_plan is DIT
    assert model_plan("songunet") is UNET


def test_swap_class_sets_attributes():
    m = nn.Conv2d(2, 2, 3, padding=1)
    dg = fake_domain()
    swap_class(m, HaloMixin, dg, _halo=(4, 2))
    assert m._domain is dg and m._halo == (4, 2) and isinstance(m, nn.Conv2d)


def test_a_refused_split_leaves_the_model_unchanged():
    model = Net(nn.Conv2d(3, 3, 3, stride=2, padding=1))
    before = classes(model)
    with pytest.raises(ConfigError):
        split(model, fake_domain(), TORCH_PLAN)
    assert classes(model) == before


def test_a_module_refused_by_its_rule_is_named():
    with pytest.raises(ConfigError, match="'extra'"):
        split(Net(nn.Conv2d(3, 3, 3, stride=2, padding=1)), fake_domain(), TORCH_PLAN)


# ------------------------------------------------------------------ registry entries


def test_registry_entries():
    cfg = SplitterConfig(name="rows")
    model = Net()
    plain = classes(model)
    kw = dict(topology=None, plan=TORCH_PLAN, model_name="net")
    assert registry.splitters.build("rows", model, cfg, domain=None, **kw) is model
    assert registry.splitters.build("rows", model, cfg, domain=fake_domain([16]), **kw) is model
    assert classes(model) == plain  # no domain, or a domain of one rank: nothing to split
    assert registry.splitters.build("off", model, SplitterConfig(name="off"), domain=fake_domain(), **kw) is model
    assert classes(model) == plain
    out = registry.splitters.build("rows", model, cfg, domain=fake_domain(), **kw)
    assert out is model and isinstance(model.stem, HaloMixin)


def test_a_model_without_a_plan_under_domain_gives_one_config_error_line(monkeypatch):
    cfg = SplitterConfig(name="rows")
    # no domain, or one rank: a plan is not needed
    assert registry.splitters.build("rows", Net(), cfg, topology=None, domain=None, plan=None) is not None
    assert registry.splitters.build("rows", Net(), cfg, topology=None, domain=fake_domain([16]), plan=None)
    model = Net()
    plain = classes(model)
    with pytest.raises(ConfigError) as info:
        registry.splitters.build(
            "rows", model, cfg, topology=None, domain=fake_domain([8, 8, 8]), plan=None, model_name="planless"
        )
    msg = str(info.value)
    assert msg == (
        "model 'planless' has no split plan, so it cannot run with parallel.domain=3; use "
        "parallel.domain=1 (or register the model with split_plan=...)"
    )
    assert "\n" not in msg and classes(model) == plain
    with pytest.raises(ConfigError, match=r"^model 'planless': its split_plan is a dict, not a SplitPlan$"):
        require_plan({}, "planless", 2)
    # the registry's entry names the plan; a model registered without one
    monkeypatch.setitem(registry.models._entries, "planless", registry.Entry("planless", None, None))
    with pytest.raises(
        ConfigError,
        match=r"^model 'planless' has no split plan, so it cannot run with "
        r"parallel\.domain=2; use parallel\.domain=1",
    ):
        model_plan("planless", 2)


def test_shard_tensor_is_a_deprecated_alias_of_rows(monkeypatch):
    import warnings

    monkeypatch.setattr(framework.domain, "_warned", set())
    kw = dict(topology=None, plan=TORCH_PLAN, model_name="net")
    kinds = lambda model: {
        n: (type(m).__name__, type(m).__mro__[1:], getattr(m, "_halo", None))  # noqa: E731
        for n, m in model.named_modules()
    }
    want = kinds(registry.splitters.build("rows", Net(), SplitterConfig(name="rows"), domain=fake_domain(), **kw))
    cfg = SplitterConfig(name="shard_tensor")
    with pytest.warns(
        FutureWarning,
        match=r"^splitter=shard_tensor is deprecated and will be removed in the next "
        r"release; use splitter=rows \(same behaviour\)$",
    ):
        model = registry.splitters.build("shard_tensor", Net(), cfg, domain=fake_domain(), **kw)
    assert kinds(model) == want and isinstance(model.stem, HaloMixin)  # the same conversion
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: a second use is silent
        again = registry.splitters.build("shard_tensor", Net(), cfg, domain=fake_domain(), **kw)
        assert registry.splitters.build("shard_tensor", Net(), cfg, domain=None, **kw) is not None
    assert kinds(again) == want
    with pytest.raises(ConfigError, match="has no split plan"):  # and refuses alike
        registry.splitters.build("shard_tensor", Net(), cfg, topology=None, domain=fake_domain(), plan=None)


def test_presets_select_rows_and_the_alias_still_composes(compose):
    from framework.config.validate import validate

    for preset in ("domain", "fsdp2_domain"):
        assert compose([f"parallel={preset}"]).splitter.name == "rows", preset
    run = validate(compose(["parallel=fsdp2_domain", "splitter=shard_tensor"]))  # conf/splitter/shard_tensor.yaml
    assert run.splitter.name == "shard_tensor" and run.sharding.name == "fsdp2"


# ------------------------------------------------------------------ runtime checks


def _layout(sharding, splitter_name, world, domain):
    run = SimpleNamespace(
        sharding=SimpleNamespace(name=sharding),
        splitter=SimpleNamespace(name=splitter_name),
        model=SimpleNamespace(name="songunet"),
        trainer=SimpleNamespace(compile_cudagraphs=None, compile=None),
    )
    return run, SimpleNamespace(world=world, domain=domain)


def test_runtime_layout_checks():
    runtime._check_layout(*_layout("fsdp2", "rows", 4, 2))
    runtime._check_layout(*_layout("ddp", "rows", 2, 2))
    runtime._check_layout(*_layout("ddp", "shard_tensor", 2, 2))
    runtime._check_layout(*_layout("none", "off", 1, 1))
    with pytest.raises(ConfigError, match=r"parallel\.domain=2 needs splitter="):
        runtime._check_layout(*_layout("fsdp2", "off", 4, 2))
    with pytest.raises(ConfigError, match=r"sharding=none on 2 ranks would train 2 unsynchronised replicas"):
        runtime._check_layout(*_layout("none", "rows", 2, 2))


def test_runtime_domain_group_extents_are_multiples_of_the_downsampling():
    from recipes.stormcast.config import SongUNetConfig
    from recipes.weather.task import RegressionTask

    def group(rows, domain, channel_mult):
        run = SimpleNamespace(model=SongUNetConfig(channel_mult=channel_mult), data=SimpleNamespace(grid=[rows, 16]))
        topology = SimpleNamespace(degrees=SimpleNamespace(domain=domain), group=lambda name: None)
        return runtime._domain_group(run, topology, RegressionTask)

    assert group(48, 1, [1, 2, 2, 2, 2]) is None
    assert group(48, 2, [1, 2, 2, 2, 2]).extents == [32, 16]
    assert group(20, 4, [1, 2, 2]).extents == [8, 4, 4, 4]
    assert group(20, 2, [1, 2, 2]).extents == [12, 8]  # the uneven runs of test_training.py
    assert group(24, 2, [1, 2, 2]).extents == [12, 12]
    assert group(512, 2, [1, 2, 2, 2, 2]).extents == [256, 256]
    with pytest.raises(
        ConfigError,
        match=r"parallel\.domain: 16 rows cannot be split over 2 domain ranks in "
        r"multiples of 16",
    ):
        group(16, 2, [1, 2, 2, 2, 2])
