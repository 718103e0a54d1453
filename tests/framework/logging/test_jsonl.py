"""metrics.jsonl on resume: the rows past the resumed step go, every other line stays as it was."""

import json

from framework.logging.jsonl import _truncate


def test_resuming_drops_later_rows_and_keeps_every_line_it_cannot_read(tmp_path):
    """Torn, damaged (bytes that are not UTF-8) and absurdly nested lines are not rows past the
    step: they stay byte for byte, and the rows past the step go."""
    path = tmp_path / "metrics.jsonl"
    deep = b"[" * 100_000 + b"]" * 100_000
    lines = [
        json.dumps({"step": 1, "split": "train", "loss": 1.0}).encode(),
        b"\xff\xfe not utf-8",
        deep,
        json.dumps({"step": 2, "split": "train", "loss": 0.5}).encode(),
        json.dumps({"step": 3, "split": "train", "loss": 0.25}).encode(),
        b'{"step": 4, "spl',  # torn by a kill
    ]
    path.write_bytes(b"\n".join(lines))
    assert _truncate(path, 2) == 1
    assert path.read_bytes() == b"\n".join([*lines[:4], lines[5]]) + b"\n"
