"""Optimizer from its ``_target_`` (validated to lie under torch.optim. before this runs)."""

from __future__ import annotations

import dataclasses
import importlib

import torch

from framework.config.schema import OptimConfig


def build(cfg: OptimConfig, params) -> torch.optim.Optimizer:
    module, _, name = cfg._target_.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    kwargs = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "_target_"}
    kwargs["betas"] = tuple(kwargs["betas"])
    if kwargs.get("fused") is None:
        kwargs.pop("fused", None)
    return cls(params, **kwargs)
