"""The test harness's own rules: which failures run once more."""

from __future__ import annotations

import re

import pytest

from tests.conftest import NATIVE_CRASH


@pytest.mark.parametrize(
    "message",
    [
        "ChildFailedError: process 4711 terminated with signal SIGABRT",
        "AssertionError: ['parallel=fsdp2_domain'] x2 failed:\n  malloc_consolidate(): invalid chunk size\n"
        "  error: saving checkpoint step_00000003 failed: a peer rank died\nassert -6 == 0",
        "AssertionError: rank 1 failed:\nfree(): invalid size\nassert -6 == 0",
        "AssertionError: x\ndouble free or corruption (out)\n",
        "AssertionError: x\nmalloc(): unaligned tcache chunk detected\n",
    ],
)
def test_a_ranks_native_crash_is_rerun(message):
    assert re.search(NATIVE_CRASH, message)


@pytest.mark.parametrize(
    "message",
    [
        "AssertionError: losses differ: 0.5 != 0.6",
        "AssertionError: run failed:\nTraceback (most recent call last):\nRuntimeError: free memory is low",
        "AssertionError: ['parallel=ddp'] x2 failed:\nerror: data.grid: rows=33 is not divisible by 2\nassert 2 == 0",
        "ValueError: tiles (128, 3, 8): 3 tokens a step do not divide 128 tokens a program",
    ],
)
def test_a_python_failure_is_never_rerun(message):
    assert not re.search(NATIVE_CRASH, message)
