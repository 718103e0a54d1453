"""The domain splitter (framework/domain/splitter.py), its registry entry and the runtime's
domain checks: what it converts, what it refuses (by name), what it leaves alone."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from framework import registry, runtime
from framework.config.schema import SplitterConfig
from framework.domain import splitter
from framework.domain.comm import DomainGroup
from framework.domain.layers import GroupNormMixin, HaloMixin
from framework.domain.splitter import split, swap_class
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
    assert split(model, fake_domain()) is model
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
        swap = split(nn.Sequential(m), fake_domain())[0]
        assert swap._halo == (halo, halo), k


@pytest.mark.parametrize("conv,what", [
    (nn.Conv2d(3, 3, 3, stride=2, padding=1), "stride (2, 2)"),
    (nn.Conv2d(3, 3, 3, padding=0), "padding (0, 0)"),
    (nn.Conv2d(3, 3, 3, padding=2, dilation=2), "dilation (2, 2)"),
    (nn.Conv2d(3, 3, 2, padding=1), "kernel (2, 2)"),
    (nn.Conv2d(3, 3, 3, padding=1, padding_mode="reflect"), "padding_mode 'reflect'"),
])
def test_torch_convs_that_cannot_split_over_rows_are_refused(conv, what):
    with pytest.raises(ConfigError, match=r"nn\.Conv2d with .*cannot be split over rows") as info:
        split(Net(conv), fake_domain())
    assert what in str(info.value)


@pytest.mark.parametrize("extra,name", [
    (nn.BatchNorm2d(3), "BatchNorm2d"),
    (nn.ConvTranspose2d(3, 3, 2, stride=2), "ConvTranspose2d"),
    (nn.InstanceNorm2d(3), "InstanceNorm2d"),
    (nn.Upsample(scale_factor=2), "Upsample"),
    (nn.MaxPool2d(2), "MaxPool2d"),
    (nn.AvgPool2d(3, 1, 1), "AvgPool2d"),
    (nn.Dropout2d(0.1), "Dropout2d"),
    (nn.Sequential(nn.SiLU(), nn.BatchNorm2d(3)), "BatchNorm2d"),
])
def test_spatial_torch_modules_without_a_rule_are_refused_by_name(extra, name):
    model = Net(extra)
    before = classes(model)
    where = "extra.1" if isinstance(extra, nn.Sequential) else "extra"
    with pytest.raises(ConfigError, match=rf"splitter: cannot split module '{where}' \({name}\) over the domain "
                                          "axis"):
        split(model, fake_domain())
    assert classes(model) == before  # refused before anything was converted


def test_a_custom_module_with_parameters_and_no_rule_is_refused_by_name():
    model = Net(Mystery())
    with pytest.raises(ConfigError, match=r"no domain rule for module 'extra' \(Mystery\) which holds parameters; "
                                          r"register one"):
        split(model, fake_domain())
    assert type(model.stem) is nn.Conv2d


def test_registered_rules_and_local_modules_are_accepted(monkeypatch):
    monkeypatch.setattr(splitter, "_RULES", dict(splitter._RULES))
    monkeypatch.setattr(splitter, "_LOCAL", set(splitter._LOCAL))
    splitter.register_local(Mystery)
    model = split(Net(Mystery()), fake_domain())
    assert type(model.extra) is Mystery
    seen = []
    splitter.register(Mystery, lambda m, dg: seen.append((m, dg)))
    dg = fake_domain()
    model = split(Net(Mystery()), dg)
    assert seen == [(model.extra, dg)]


def test_swap_class_sets_attributes():
    m = nn.Conv2d(2, 2, 3, padding=1)
    dg = fake_domain()
    swap_class(m, HaloMixin, dg, _halo=(4, 2))
    assert m._domain is dg and m._halo == (4, 2) and isinstance(m, nn.Conv2d)


def test_a_refused_split_leaves_the_model_unchanged():
    model = Net(nn.Conv2d(3, 3, 3, stride=2, padding=1))
    before = classes(model)
    with pytest.raises(ConfigError):
        split(model, fake_domain())
    assert classes(model) == before


def test_a_module_refused_by_its_rule_is_named():
    with pytest.raises(ConfigError, match="'extra'"):
        split(Net(nn.Conv2d(3, 3, 3, stride=2, padding=1)), fake_domain())


# ------------------------------------------------------------------ registry entry

def test_registry_entries():
    cfg = SplitterConfig(name="shard_tensor")
    model = Net()
    plain = classes(model)
    assert registry.splitters.build("shard_tensor", model, cfg, topology=None, domain=None) is model
    assert registry.splitters.build("shard_tensor", model, cfg, topology=None, domain=fake_domain([16])) is model
    assert classes(model) == plain  # no domain, or a domain of one rank: nothing to split
    assert registry.splitters.build("off", model, SplitterConfig(name="off"), topology=None,
                                    domain=fake_domain()) is model
    assert classes(model) == plain
    out = registry.splitters.build("shard_tensor", model, cfg, topology=None, domain=fake_domain())
    assert out is model and isinstance(model.stem, HaloMixin)


# ------------------------------------------------------------------ runtime checks

def _layout(sharding, splitter_name, world, domain):
    run = SimpleNamespace(sharding=SimpleNamespace(name=sharding), splitter=SimpleNamespace(name=splitter_name))
    return run, SimpleNamespace(world=world, domain=domain)


def test_runtime_layout_checks():
    runtime._check_layout(*_layout("fsdp2", "shard_tensor", 4, 2))
    runtime._check_layout(*_layout("ddp", "shard_tensor", 2, 2))
    runtime._check_layout(*_layout("none", "off", 1, 1))
    with pytest.raises(ConfigError, match=r"parallel\.domain=2 needs splitter=shard_tensor"):
        runtime._check_layout(*_layout("fsdp2", "off", 4, 2))
    with pytest.raises(ConfigError, match=r"sharding=none on 2 ranks would train 2 unsynchronised replicas"):
        runtime._check_layout(*_layout("none", "shard_tensor", 2, 2))


def test_runtime_domain_group_extents_are_multiples_of_the_downsampling():
    from recipes.stormcast.config import SongUNetConfig

    def group(rows, domain, channel_mult):
        run = SimpleNamespace(model=SongUNetConfig(channel_mult=channel_mult), data=SimpleNamespace(grid=[rows, 16]))
        topology = SimpleNamespace(degrees=SimpleNamespace(domain=domain), group=lambda name: None)
        return runtime._domain_group(run, topology)

    assert group(48, 1, [1, 2, 2, 2, 2]) is None
    assert group(48, 2, [1, 2, 2, 2, 2]).extents == [32, 16]
    assert group(20, 4, [1, 2, 2]).extents == [8, 4, 4, 4]
    assert group(20, 2, [1, 2, 2]).extents == [12, 8]  # the uneven runs of test_training.py
    assert group(24, 2, [1, 2, 2]).extents == [12, 12]
    assert group(512, 2, [1, 2, 2, 2, 2]).extents == [256, 256]
    with pytest.raises(ConfigError, match=r"parallel\.domain: 16 rows cannot be split over 2 domain ranks in "
                                          r"multiples of 16"):
        group(16, 2, [1, 2, 2, 2, 2])
