"""framework.safe_unpickle: what a file may name is not what it may call, patch or fill."""

from __future__ import annotations

import collections
import io
import pickle

import pytest

from framework.safe_unpickle import Refused, RestrictedUnpickler


class Point:
    def __init__(self, x=0):
        self.x = x


POINT = b"\x80\x02c" + __name__.encode() + b"\nPoint\n"  # the class, by name


def load(data: bytes, callables=(Point,), buildable=(Point,)):
    allowed = {
        (__name__, "Point"): Point,
        ("collections", "deque"): collections.deque,
        ("builtins", "print"): print,
    }
    return RestrictedUnpickler(io.BytesIO(data), allowed, callables, buildable).load()


def test_what_ordinary_pickles_hold_loads():
    p = Point(3)
    out = load(pickle.dumps({"points": [p, p], "pair": (1, 2.5), "tags": {"a"}}, protocol=4))
    assert out["points"][0].x == 3 and out["points"][0] is out["points"][1]
    assert out["pair"] == (1, 2.5) and out["tags"] == {"a"}
    assert load(b"(" + POINT[2:] + b"K\x04o.").x == 4  # OBJ calls an allowed class


@pytest.mark.parametrize(
    "data,error",
    [
        (b"\x80\x02cbuiltins\nprint\nX\x02\x00\x00\x00hi\x85R.", "calling builtins.print is not allowed"),
        (b"\x80\x02ccollections\ndeque\n)\x81.", "calling collections.deque is not allowed"),  # NEWOBJ
        (b"(cbuiltins\nprint\nX\x02\x00\x00\x00hio.", "calling builtins.print is not allowed"),  # OBJ
        (b"\x80\x02cos\nsystem\n.", "'os.system' is not allowed"),
        (POINT + b"N}X\x01\x00\x00\x00xK\x01s\x86b.", f"setting the state of {__name__}.Point is not allowed"),
        (POINT + b")\x81(K\x01e.", "adding items to a Point is not allowed"),  # APPENDS
        (POINT + b")\x81K\x01K\x02s.", "adding entries to a Point is not allowed"),  # SETITEM
        (b"\x80\x02X\x01\x00\x00\x00aQ.", "a persistent id is not allowed"),
    ],
    ids=["reduce", "newobj", "obj", "unnamed", "build-on-class", "appends", "setitem", "persid"],
)
def test_a_file_cannot_call_patch_or_fill_beyond_what_is_allowed(data, error):
    with pytest.raises(Refused, match=error):
        load(data)
