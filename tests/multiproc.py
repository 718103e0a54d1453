"""Start real ranks from inside pytest: gloo on localhost, a store held by pytest, one process each.

The ranks are forked by multiprocessing's fork server, which imports torch & co once
(tests.zygote.PRELOAD), instead of each rank paying 5-15 s of imports as a spawned interpreter."""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import os
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp

from tests.zygote import PRELOAD, held_store


def _entry(rank, world, store, fn, args, errors, timeout_s):
    os.environ.update(store, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    faulthandler.enable(all_threads=True)  # a rank that dies of a signal prints where each thread was
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
        fn(rank, world, *args)
        # Every rank done before any tears gloo down: a rank that destroys its group while a
        # peer still talks to it can abort in gloo's C++ teardown ("terminate called ...").
        # Best effort: a test may have broken the group on purpose (a hung rank).
        with contextlib.suppress(Exception):
            dist.barrier()
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn, world: int, *args, timeout_s: float = 120):
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; re-raise the first failure."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))  # takes effect when the server starts (first use)
    errors = ctx.SimpleQueue()
    try:
        with held_store(world) as store:
            mp.start_processes(
                _entry, args=(world, store, fn, args, errors, timeout_s), nprocs=world, start_method="forkserver"
            )
    except mp.ProcessRaisedException as e:
        details = [] if errors.empty() else [errors.get()]
        raise AssertionError(f"rank failed: {details or e}") from None
