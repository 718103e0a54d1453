"""Precision policies: how parameters, activations and gradients are typed.

A policy owns the autocast context, the GradScaler (fp16 only) and, once sharding
lands, FSDP2's MixedPrecisionPolicy. Model code never sees any of this.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from framework import registry
from framework.config.schema import PrecisionConfig


@dataclass
class Precision:
    name: str
    autocast_dtype: torch.dtype | None  # None: no autocast
    tf32: bool
    scaler: torch.amp.GradScaler | None
    sharded_cast: bool = False  # FSDP2's MixedPrecisionPolicy casts params: no autocast

    def autocast(self, device: torch.device):
        if self.autocast_dtype is None or self.sharded_cast:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=self.autocast_dtype)

    def apply_backend_flags(self) -> None:
        # tf32 is a global switch in torch; set it both ways so a second run in one
        # process (tests) never inherits the previous policy.
        torch.backends.cuda.matmul.allow_tf32 = self.tf32
        torch.backends.cudnn.allow_tf32 = self.tf32
        torch.set_float32_matmul_precision("high" if self.tf32 else "highest")

    def mixed_precision_policy(self):
        """FSDP2 MixedPrecisionPolicy: low-precision params, fp32 gradient reduction."""
        if self.autocast_dtype is None:
            return None
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=self.autocast_dtype, reduce_dtype=torch.float32)


def _policy(dtype, tf32=False, scaled=False):
    def build(cfg: PrecisionConfig, device: torch.device) -> Precision:
        scaler = None
        if scaled:
            scaler = torch.amp.GradScaler(device.type, init_scale=cfg.init_scale)
        return Precision(cfg.name, dtype, tf32, scaler)

    return build


registry.precision.add("fp32", PrecisionConfig, _policy(None))
registry.precision.add("tf32", PrecisionConfig, _policy(None, tf32=True))
registry.precision.add("bf16", PrecisionConfig, _policy(torch.bfloat16))
registry.precision.add("fp16", PrecisionConfig, _policy(torch.float16, scaled=True))


def build(cfg: PrecisionConfig, device: torch.device) -> Precision:
    return registry.precision.build(cfg.name, cfg, device)
