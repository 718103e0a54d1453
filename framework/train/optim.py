"""Optimizer from its ``_target_`` (validated to lie under torch.optim. before this runs)."""

from __future__ import annotations

import dataclasses
import importlib

import torch

from framework.config.schema import OptimConfig

# Optimizers whose fused CUDA kernel ``optim.fused: null`` picks on a GPU: one kernel a step
# instead of the foreach path's dozen passes over the parameters and moments (torch itself
# never defaults to it). DTensor parameters (FSDP2, domain layouts) take it as well.
_FUSED_ON_CUDA = (torch.optim.Adam, torch.optim.AdamW)


def build(cfg: OptimConfig, params) -> torch.optim.Optimizer:
    module, _, name = cfg._target_.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    params = list(params)
    kwargs = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "_target_"}
    kwargs["betas"] = tuple(kwargs["betas"])
    if kwargs.get("fused") is None:
        kwargs.pop("fused", None)
        if cls in _FUSED_ON_CUDA and fused_fits(params):
            kwargs["fused"] = True
    return cls(params, **kwargs)


def fused_fits(params) -> bool:
    """Whether every parameter (of every param group) is a floating-point tensor on CUDA, where the
    fused kernel runs; CPU runs keep torch's default (their numerics are what the tests compare)."""
    tensors = [p for g in params for p in (g["params"] if isinstance(g, dict) else [g])]
    return bool(tensors) and all(p.device.type == "cuda" and torch.is_floating_point(p) for p in tensors)
