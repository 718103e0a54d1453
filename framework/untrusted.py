"""Reading small files that others may have made (a checkpoint's manifest, a store's metadata,
statistics, sidecars): never block, never take unbounded memory, never recurse without end.

``read_bytes`` opens without blocking and reads only a regular file (a named pipe or a link to
a device such as ``/dev/zero`` among the files would otherwise hang the reader or fill its
memory), up to a size cap. ``read_json`` adds UTF-8 and JSON decoding, with deep nesting
refused like any other malformed text, and ``mapping`` checks the top level's type. Every
failure is a :class:`BadFile`, a ``ValueError``: callers that already turn ``ValueError`` (a
JSON decoding error) into their one-line error keep doing so.
"""

from __future__ import annotations

import json
import math
import os
import stat
from typing import Any, BinaryIO

# Metadata and sidecar files are kilobytes; the largest read through here (a statistics .npy of
# a few thousand channels, a forecast store's metadata) stays far below this.
DEFAULT_LIMIT = 64 << 20


class BadFile(ValueError):
    """A file that cannot be what it claims to be (not a regular file, too large, malformed)."""


def open_regular(path: str | os.PathLike) -> BinaryIO:
    """``open(path, "rb")`` for a regular file only (else BadFile): opening a named pipe would wait
    for a writer, and a device such as ``/dev/zero`` is read without end."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise BadFile(f"{path} is not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bytes(path: str | os.PathLike, limit: int = DEFAULT_LIMIT) -> bytes:
    """The contents of the regular file ``path``, at most ``limit`` bytes. OSError when it is
    missing or unreadable; BadFile when it is not a regular file or is larger than ``limit``."""
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise BadFile(f"{path} holds {size} bytes, more than the {limit} such a file may")
        data = f.read(limit + 1)
    if len(data) > limit:  # grew while read
        raise BadFile(f"{path} holds more than the {limit} bytes such a file may")
    return data


def read_json(path: str | os.PathLike, limit: int = DEFAULT_LIMIT) -> Any:
    """``read_bytes`` parsed as UTF-8 JSON; BadFile (a ValueError) for text that is not."""
    data = read_bytes(path, limit)
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise BadFile(f"{path} is not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise BadFile(f"{path} is not valid JSON ({e.msg}, line {e.lineno})") from None
    except RecursionError:
        raise BadFile(f"{path} nests its JSON too deeply") from None


def mapping(value: Any, what: str) -> dict:
    """``value`` if it is a JSON object (a dict), else BadFile naming ``what``."""
    if not isinstance(value, dict):
        raise BadFile(f"{what} is a JSON {type(value).__name__}, not an object")
    return value


def shown(value: Any, width: int = 80) -> str:
    """``repr(value)`` for a one-line message, cut to ``width`` characters (a value from another's
    file may be as long as the file)."""
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def is_int(value: Any) -> bool:
    """A JSON integer (``True`` is an int to Python, not to a reader of JSON)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A finite JSON number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # a JSON int past float's range
        return False
