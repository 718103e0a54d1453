import math

import pytest
import torch

from framework.config.schema import ScheduleConfig
from framework.train import schedule


def lrs(cfg, steps, lr=1.0):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    s = schedule.build(cfg, opt, steps)
    out = []
    for _ in range(steps):
        out.append(s.get_last_lr()[0])
        opt.step()
        s.step()
    return out


def test_constant_with_warmup():
    v = lrs(ScheduleConfig(name="constant", warmup_steps=4), 10)
    assert v[:4] == pytest.approx([0.2, 0.4, 0.6, 0.8])
    assert v[4:] == [1.0] * 6


def test_cosine_with_warmup_ends_at_floor():
    v = lrs(ScheduleConfig(name="cosine", warmup_steps=2, min_lr_ratio=0.1), 12)
    assert v[0] == pytest.approx(1 / 3) and v[2] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(v[2:], v[3:]))  # monotone decay
    # step t after warmup: floor + (1-floor) * (1+cos(pi*t/10))/2
    assert v[7] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 5 / 10)))


def test_cosine_without_warmup_starts_at_peak():
    assert lrs(ScheduleConfig(name="cosine"), 5)[0] == 1.0
