"""The domain splitter: turn a plain model into its domain-parallel form by substitution.

A model's ``SplitPlan`` says, per layer class, how it splits (a rule) or that it is
pointwise and needs nothing (local). Plans are immutable values built by each model's
parallelize module (``PLAN = TORCH_PLAN.extend("mynet").rule(MyConv, convert)...``) from
``TORCH_PLAN``, the rules of torch's own layers, and named by the model's registry entry
(``registry.models.register("mynet", MyNetConfig, split_plan=PLAN)``); ``split(model,
dg, plan)`` applies one. There are no global rule tables: two models' plans never see each
other's rules, and naming a class twice in one plan is an error.

Every module with parameters or a known spatial torch type must be covered; anything else
is refused by name. A module without parameters that is not a known spatial type needs no
rule (e.g. a wrapper a task puts around the net that does per-pixel arithmetic with
per-channel buffers). A rule added with ``subtree=True`` answers for the module's whole
subtree: its descendants are neither converted nor checked (e.g. a patch embedding whose
strided conv is local on bands of whole patches, though a strided conv in general is not).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TypeVar, cast

import torch.nn as nn

from framework.domain.comm import DomainGroup
from framework.domain.layers import GroupNormMixin, HaloMixin
from framework.errors import ConfigError

Rule = Callable[[nn.Module, DomainGroup], None]
"""``convert(module, dg)``: split ``module`` in place for ``dg`` (or raise ConfigError)."""
M = TypeVar("M", bound=nn.Module)

# Spatial torch layers without a rule: their result would silently differ when split.
_SPATIAL = (
    nn.ConvTranspose2d,
    nn.BatchNorm2d,
    nn.InstanceNorm2d,
    nn.LayerNorm,
    nn.Upsample,
    nn.MaxPool2d,
    nn.AvgPool2d,
    nn.AdaptiveAvgPool2d,
    nn.MultiheadAttention,
    nn.Dropout2d,
)


@dataclass(frozen=True, eq=False)
class SplitPlan:
    """How one model's layers split over the domain axis. Immutable: ``rule`` and ``local``
    return a new plan (the one they extend is unchanged).

    ``name``: shown in errors. ``rules``: layer class -> rule (exact class match).
    ``subtree``: the classes whose rule answers for their descendants. ``local_classes``:
    pointwise classes that need nothing.
    """

    name: str
    rules: Mapping[type, Rule] = field(default_factory=lambda: MappingProxyType({}))
    subtree: frozenset[type] = frozenset()
    local_classes: frozenset[type] = frozenset()

    def __post_init__(self):
        object.__setattr__(self, "rules", MappingProxyType(dict(self.rules)))
        object.__setattr__(self, "subtree", frozenset(self.subtree))
        object.__setattr__(self, "local_classes", frozenset(self.local_classes))

    def _check_new(self, cls: type) -> None:
        if not isinstance(cls, type):
            raise TypeError(f"split plan '{self.name}': {cls!r} is not a class")
        if cls in self.rules or cls in self.local_classes:
            what = "a rule" if cls in self.rules else "local"
            raise ValueError(
                f"split plan '{self.name}': {cls.__module__}.{cls.__qualname__} is registered twice "
                f"(it already has {what}); a plan names each class once"
            )

    def rule(self, cls: type[M], convert: Callable[[M, DomainGroup], None], *, subtree: bool = False) -> SplitPlan:
        """This plan plus: modules of exactly ``cls`` are split by ``convert(module, dg)``.

        ``subtree``: the rule answers for the module's descendants too; the splitter then
        neither converts nor checks them. ValueError if ``cls`` is already in the plan.
        """
        self._check_new(cls)
        return SplitPlan(
            self.name,
            {**self.rules, cls: cast(Rule, convert)},  # only ever called on modules of exactly cls
            self.subtree | {cls} if subtree else self.subtree,
            self.local_classes,
        )

    def local(self, *classes: type) -> SplitPlan:
        """This plan plus: modules of exactly these classes are pointwise (per pixel, per token
        or per sample) and stay as they are. ValueError if a class is already in the plan."""
        plan = self
        for cls in classes:
            plan._check_new(cls)
            plan = SplitPlan(plan.name, plan.rules, plan.subtree, plan.local_classes | {cls})
        return plan

    def extend(self, name: str) -> SplitPlan:
        """This plan under a new name, to add a model's rules to (``TORCH_PLAN.extend("mynet")``)."""
        return SplitPlan(name, self.rules, self.subtree, self.local_classes)

    def __contains__(self, cls: type) -> bool:
        return cls in self.rules or cls in self.local_classes

    def __repr__(self):
        rules = ", ".join(sorted(c.__name__ for c in self.rules))
        local = ", ".join(sorted(c.__name__ for c in self.local_classes))
        return f"SplitPlan({self.name!r}, rules=[{rules}], local=[{local}])"


def swap_class(module: nn.Module, mixin: type, dg: DomainGroup, **attrs) -> None:
    """Give ``module`` the domain-parallel behaviour of ``mixin``, keeping its state."""
    base = type(module)
    module.__class__ = type(f"Domain{base.__name__}", (mixin, base), {})
    module._domain = dg  # type: ignore[assignment]  # torch types Module.__setattr__ for tensors/modules only
    for k, v in attrs.items():
        setattr(module, k, v)


def is_split(module: nn.Module) -> bool:
    """Whether ``swap_class`` gave ``module`` a domain-parallel behaviour."""
    return hasattr(module, "_domain")


def _torch_conv(m: nn.Conv2d, dg: DomainGroup) -> None:
    kh = m.kernel_size[0]
    if m.stride[0] != 1 or m.dilation[0] != 1 or m.padding[0] != kh // 2 or kh % 2 == 0 or m.padding_mode != "zeros":
        raise ConfigError(
            f"splitter: nn.Conv2d with kernel {m.kernel_size}, stride {m.stride}, padding "
            f"{m.padding}, dilation {m.dilation}, padding_mode {m.padding_mode!r} cannot be split "
            "over rows (supported: odd kernels, stride 1, 'same' zero padding)"
        )
    swap_class(m, HaloMixin, dg, _halo=(kh // 2, kh // 2))


def _torch_group_norm(m: nn.GroupNorm, dg: DomainGroup) -> None:
    swap_class(m, GroupNormMixin, dg)


def _torch_layer_norm(m: nn.LayerNorm, dg: DomainGroup) -> None:
    # Over the last dim only it is per row: rows are never the last dim (dim 2 of (B, C, H, W),
    # dim 1 of a (B, H, W, D) token grid). Over more dims it may span rows.
    if len(m.normalized_shape) != 1:
        raise ConfigError(
            f"splitter: nn.LayerNorm over {tuple(m.normalized_shape)} cannot be split over rows "
            "(supported: normalisation over the last dim only)"
        )


# The base every model's plan extends: torch's own layers.
TORCH_PLAN = (
    SplitPlan("torch")
    .rule(nn.Conv2d, _torch_conv)
    .rule(nn.GroupNorm, _torch_group_norm)
    .rule(nn.LayerNorm, _torch_layer_norm)
    .local(nn.Linear, nn.SiLU, nn.ReLU, nn.GELU, nn.Identity, nn.Dropout)
)


def require_plan(plan, model_name: str | None = None, domain_size: int | None = None) -> SplitPlan:
    """``plan`` if it is one; else the one-line ConfigError of a model that cannot be split."""
    if isinstance(plan, SplitPlan):
        return plan
    what = f"model '{model_name}'" if model_name else "the model"
    where = f"parallel.domain={domain_size}" if domain_size else "parallel.domain > 1"
    if plan is None:
        raise ConfigError(
            f"{what} has no split plan, so it cannot run with {where}; use parallel.domain=1 "
            "(or register the model with split_plan=...)"
        )
    raise ConfigError(f"{what}: its split_plan is a {type(plan).__name__}, not a SplitPlan")


def model_plan(name: str, domain_size: int | None = None) -> SplitPlan:
    """The split plan of the registered model ``name``; one-line ConfigError if it has none."""
    from framework import registry

    return require_plan(registry.models.entry(name).split_plan, name, domain_size)


def split(model: nn.Module, dg: DomainGroup, plan: SplitPlan) -> nn.Module:
    """Convert ``model`` in place by ``plan``; raises ConfigError naming the first module it
    cannot split (and then leaves the model unchanged)."""
    if not isinstance(plan, SplitPlan):
        raise TypeError(f"split: plan must be a SplitPlan, not {type(plan).__name__}")
    todo = []
    handled: list[str] = []  # name prefixes of subtrees a rule answers for
    for name, m in model.named_modules():
        if any(name.startswith(p) for p in handled):
            continue
        cls = type(m)
        if cls in plan.rules:
            todo.append((name, m, plan.rules[cls]))
            if cls in plan.subtree:
                handled.append(f"{name}." if name else "")
        elif cls in plan.local_classes:
            continue
        elif isinstance(m, _SPATIAL):
            raise ConfigError(f"splitter: cannot split module '{name}' ({cls.__name__}) over the domain axis")
        elif any(True for _ in m.parameters(recurse=False)):
            raise ConfigError(
                f"splitter: no domain rule for module '{name}' ({cls.__name__}) which holds "
                f"parameters; add one to split plan '{plan.name}' (the model's parallelize module)"
            )
    done = []
    try:
        for name, m, convert in todo:
            original = type(m)
            try:
                convert(m, dg)
            except ConfigError as e:
                raise ConfigError(
                    f"splitter: module '{name or '<root>'}' ({original.__name__}): {str(e).removeprefix('splitter: ')}"
                ) from None
            done.append((m, original))
    except ConfigError:
        for m, original in done:  # all or nothing: never leave a half-split model
            m.__class__ = original
        raise
    return model
