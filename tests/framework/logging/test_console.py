"""The console sink on a terminal: rows above the progress bar, and in framework.log as well."""

from __future__ import annotations

import io
import logging
import sys

from framework.logging.console import ConsoleSink


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_rows_on_a_terminal_also_reach_the_log_file(tmp_path, monkeypatch):
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)  # the bar
    monkeypatch.setattr(sys, "stdout", terminal)  # tqdm.write, and Hydra's console handler
    log = logging.getLogger("framework")
    file = logging.FileHandler(tmp_path / "framework.log")
    screen = logging.StreamHandler(terminal)  # as Hydra's console handler: must not print it twice
    for h in (file, screen):
        log.addHandler(h)
    old_level = log.level
    log.setLevel(logging.INFO)
    try:
        sink = ConsoleSink(total_steps=10, start_step=0)
        assert sink.bar is not None
        sink.log({"step": 3, "split": "train", "loss": 0.123456, "rmse/t2m": 1.0})
        sink.advance(3, 0.123456, None)
        sink.close()
    finally:
        for h in (file, screen):
            log.removeHandler(h)
        file.close()
        log.setLevel(old_level)
    line = "step=3  split=train  loss=0.1235"
    assert (tmp_path / "framework.log").read_text() == line + "\n"  # per-channel keys stay in metrics.jsonl
    assert terminal.getvalue().count(line) == 1  # once on the screen, written above the bar
