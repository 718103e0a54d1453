"""The domain splitter: turn a plain model into its domain-parallel form by substitution.

Recipes register, per layer class, how it splits (``register``) or that it is
pointwise and needs nothing (``register_local``). Every module with parameters or a
known spatial torch type must be covered; anything else is refused by name. A rule
registered with ``handles_children=True`` answers for the module's whole subtree: its
descendants are neither converted nor checked (e.g. a patch embedding whose strided
conv is local on bands of whole patches, though a strided conv in general is not).
"""

from __future__ import annotations

from typing import Callable

import torch.nn as nn

from framework.domain.comm import DomainGroup
from framework.domain.layers import GroupNormMixin, HaloMixin
from framework.errors import ConfigError

_RULES: dict[type, Callable[[nn.Module, DomainGroup], None]] = {}
_HANDLES_CHILDREN: set[type] = set()  # rules that answer for their module's whole subtree
_LOCAL: set[type] = {nn.Linear, nn.SiLU, nn.ReLU, nn.GELU, nn.Identity, nn.Dropout}
# Spatial torch layers without a rule: their result would silently differ when split.
_SPATIAL = (nn.ConvTranspose2d, nn.BatchNorm2d, nn.InstanceNorm2d, nn.LayerNorm, nn.Upsample, nn.MaxPool2d,
            nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.MultiheadAttention, nn.Dropout2d)


def register(cls: type, convert: Callable[[nn.Module, DomainGroup], None], *,
             handles_children: bool = False) -> None:
    """``convert(module, dg)`` splits modules of exactly ``cls`` (or raises ConfigError).

    ``handles_children``: the rule answers for the module's descendants too; the splitter
    then neither converts nor checks them.
    """
    _RULES[cls] = convert
    if handles_children:
        _HANDLES_CHILDREN.add(cls)
    else:
        _HANDLES_CHILDREN.discard(cls)


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


def _torch_layer_norm(m: nn.LayerNorm, dg: DomainGroup) -> None:
    # Over the last dim only it is per row: rows are never the last dim (dim 2 of (B, C, H, W),
    # dim 1 of a (B, H, W, D) token grid). Over more dims it may span rows.
    if len(m.normalized_shape) != 1:
        raise ConfigError(f"splitter: nn.LayerNorm over {tuple(m.normalized_shape)} cannot be split over rows "
                          "(supported: normalisation over the last dim only)")


register(nn.Conv2d, _torch_conv)
register(nn.GroupNorm, _torch_group_norm)
register(nn.LayerNorm, _torch_layer_norm)


def split(model: nn.Module, dg: DomainGroup) -> nn.Module:
    """Convert ``model`` in place; raises ConfigError naming the first module it cannot split."""
    plan = []
    handled: list[str] = []  # name prefixes of subtrees a rule answers for
    for name, m in model.named_modules():
        if any(name.startswith(p) for p in handled):
            continue
        cls = type(m)
        if cls in _RULES:
            plan.append((name, m, _RULES[cls]))
            if cls in _HANDLES_CHILDREN:
                handled.append(f"{name}." if name else "")
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
