"""Where the tests run the recipe's Triton kernels: on CPU under Triton's interpreter when
``TRITON_INTERPRET=1`` was set before Triton was imported (`.ci/run`'s interpreter set), and on
CUDA in the ``gpu`` tests (skipped without a GPU)."""

from __future__ import annotations

import os

import pytest
import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
KERNEL_DEVICES = (["cpu"] if INTERPRETED else []) + [
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")])
]
