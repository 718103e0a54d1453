"""The loop's measurements (framework/train/metrics.py) and what the trainer says of them."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import torch

from framework.train import metrics
from framework.train.trainer import DATA_WAIT_WARN, Trainer


def test_the_stopwatch_counts_the_wait_for_input_per_lap():
    """``waiting`` adds up the time spent inside it; each lap reports the last lap's wait and starts
    the next from zero (a validation's lap leaves no wait to the next training window)."""
    watch = metrics.Stopwatch(torch.device("cpu"))
    for _ in range(2):
        with watch.waiting():
            time.sleep(0.05)
        time.sleep(0.05)
    dt = watch.lap()
    assert 0.18 <= dt and 0.09 <= watch.waited <= dt - 0.09, (dt, watch.waited)
    time.sleep(0.02)
    watch.lap()
    assert watch.waited == 0.0


def _trainer_state(step: int, start: int = 0, device: str = "cuda", main: bool = True):
    return SimpleNamespace(
        step=step,
        _start=start,
        _warned_data_wait=False,
        device=torch.device(device),
        env=SimpleNamespace(is_main=main),
        run=SimpleNamespace(data=SimpleNamespace(num_workers=4)),
    )


def test_a_loader_that_does_not_keep_up_is_named_once(caplog):
    """Over a tenth of a window's time waiting for batches on a GPU: one warning that names the
    steps, the share and data.num_workers; not for the first window (compile, workers starting),
    not twice, not on CPU (the default job's rows say 0.2 there: no workers, two cores), and
    from rank 0 only."""
    warn = Trainer._warn_data_wait
    state = _trainer_state(step=10)
    with caplog.at_level(logging.WARNING, logger="framework"):
        warn(state, 0.9, since=0)  # the first window since the start (or a resume): not judged
        warn(state, DATA_WAIT_WARN, since=5)  # at the threshold: fine
        assert not caplog.records
        warn(state, 0.25, since=5)
        state.step = 20
        warn(state, 0.5, since=10)
    (record,) = caplog.records
    assert record.getMessage() == (
        "steps 6-10 waited for their data 25% of the time: the data loader does not keep up "
        "(data.num_workers=4: raise it; docs/data.md, Read speed)"
    )
    resumed = _trainer_state(step=130, start=120)
    with caplog.at_level(logging.WARNING, logger="framework"):
        warn(resumed, 0.5, since=120)
        warn(_trainer_state(step=20, device="cpu"), 0.5, since=10)
        warn(_trainer_state(step=20, main=False), 0.5, since=10)  # one voice: rank 0's, as its row
    assert len(caplog.records) == 1
