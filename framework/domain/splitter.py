"""The domain splitter: turn a plain model into its domain-parallel form by substitution.

Recipes register, per layer class, how it splits (``register``) or that it is
pointwise and needs nothing (``register_local``). Every module with parameters or a
known spatial torch type must be covered; anything else is refused by name.
"""

from __future__ import annotations

from typing import Callable

import torch.nn as nn

from framework.domain.comm import DomainGroup
from framework.domain.layers import GroupNormMixin, HaloMixin
from framework.errors import ConfigError

_RULES: dict[type, Callable[[nn.Module, DomainGroup], None]] = {}
_LOCAL: set[type] = {nn.Linear, nn.SiLU, nn.ReLU, nn.GELU, nn.Identity, nn.Dropout}
# Spatial torch layers without a rule: their result would silently differ when split.
_SPATIAL = (nn.ConvTranspose2d, nn.BatchNorm2d, nn.InstanceNorm2d, nn.LayerNorm, nn.Upsample, nn.MaxPool2d,
            nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.MultiheadAttention, nn.Dropout2d)


def register(cls: type, convert: Callable[[nn.Module, DomainGroup], None]) -> None:
    _RULES[cls] = convert


def register_local(*classes: type) -> None:
    _LOCAL.update(classes)


def swap_class(module: nn.Module, mixin: type, dg: DomainGroup, **attrs) -> None:
    """Give ``module`` the domain-parallel behaviour of ``mixin``, keeping its state."""
    base = type(module)
    module.__class__ = type(f"Domain{base.__name__}", (mixin, base), {})
    module._domain = dg
    for k, v in attrs.items():
        setattr(module, k, v)


def _torch_conv(m: nn.Conv2d, dg: DomainGroup) -> None:
    kh = m.kernel_size[0]
    if m.stride[0] != 1 or m.dilation[0] != 1 or m.padding[0] != kh // 2 or kh % 2 == 0 \
            or m.padding_mode != "zeros":
        raise ConfigError(f"splitter: nn.Conv2d with kernel {m.kernel_size}, stride {m.stride}, padding "
                          f"{m.padding}, dilation {m.dilation}, padding_mode {m.padding_mode!r} cannot be split "
                          "over rows (supported: odd kernels, stride 1, 'same' zero padding)")
    swap_class(m, HaloMixin, dg, _halo=(kh // 2, kh // 2))


def _torch_group_norm(m: nn.GroupNorm, dg: DomainGroup) -> None:
    swap_class(m, GroupNormMixin, dg)


register(nn.Conv2d, _torch_conv)
register(nn.GroupNorm, _torch_group_norm)


def split(model: nn.Module, dg: DomainGroup) -> nn.Module:
    """Convert ``model`` in place; raises ConfigError naming the first module it cannot split."""
    plan = []
    for name, m in model.named_modules():
        cls = type(m)
        if cls in _RULES:
            plan.append((name, m, _RULES[cls]))
        elif cls in _LOCAL:
            continue
        elif isinstance(m, _SPATIAL):
            raise ConfigError(f"splitter: cannot split module '{name}' ({cls.__name__}) over the domain axis")
        elif any(True for _ in m.parameters(recurse=False)):
            raise ConfigError(f"splitter: no domain rule for module '{name}' ({cls.__name__}) which holds "
                              f"parameters; register one in the recipe's parallelize module")
    done = []
    try:
        for name, m, convert in plan:
            original = type(m)
            try:
                convert(m, dg)
            except ConfigError as e:
                raise ConfigError(f"splitter: module '{name or '<root>'}' ({original.__name__}): "
                                  f"{str(e).removeprefix('splitter: ')}") from None
            done.append((m, original))
    except ConfigError:
        for m, original in done:  # all or nothing: never leave a half-split model
            m.__class__ = original
        raise
    return model
