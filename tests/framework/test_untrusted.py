"""framework.untrusted: small files from others are read without blocking, unbounded memory or
unbounded recursion, and every way they can be wrong is one BadFile (a ValueError)."""

import os
import threading

import pytest

from framework.untrusted import BadFile, mapping, read_bytes, read_json


def _returns_within(fn, seconds=10):
    """fn's outcome (value or exception) if it returns within ``seconds``; fails the test if not."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001  (handed to the test)
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), "the read blocked"
    return out


def test_a_named_pipe_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "manifest.json"
    os.mkfifo(fifo)  # no writer: a plain open() would wait for one forever
    out = _returns_within(lambda: read_json(fifo))
    assert isinstance(out.get("error"), BadFile) and "not a regular file" in str(out["error"])


def test_a_link_to_a_device_is_refused(tmp_path):
    link = tmp_path / "stats.npy"
    link.symlink_to("/dev/zero")  # endless zeros: a plain read() fills the memory
    out = _returns_within(lambda: read_bytes(link))
    assert isinstance(out.get("error"), BadFile) and "not a regular file" in str(out["error"])


def test_a_file_over_the_cap_is_refused_and_one_under_it_read(tmp_path):
    f = tmp_path / "meta.json"
    f.write_bytes(b"x" * 101)
    with pytest.raises(BadFile, match="101 bytes, more than the 100"):
        read_bytes(f, limit=100)
    assert read_bytes(f, limit=101) == b"x" * 101
    link = tmp_path / "link.json"  # a link to a regular file is followed
    link.symlink_to(f)
    assert read_bytes(link, limit=101) == b"x" * 101


@pytest.mark.parametrize(
    "content,message",
    [
        (b"\xff\xfe{}", "not UTF-8"),
        (b'{"a": ', "not valid JSON"),
        (b"[" * 100_000 + b"]" * 100_000, "nests its JSON too deeply"),
    ],
    ids=["binary", "truncated", "deep"],
)
def test_malformed_json_is_one_bad_file(tmp_path, content, message):
    f = tmp_path / "f.json"
    f.write_bytes(content)
    with pytest.raises(BadFile, match=message):
        read_json(f)


def test_a_missing_file_is_still_an_os_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_json(tmp_path / "absent.json")


def test_mapping_names_what_is_not_an_object():
    assert mapping({"a": 1}, "x") == {"a": 1}
    with pytest.raises(BadFile, match=r"meta.json is a JSON list, not an object"):
        mapping([1, 2], "meta.json")
    assert issubclass(BadFile, ValueError)
