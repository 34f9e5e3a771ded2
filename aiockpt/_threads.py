"""Running blocking work off the event loop, with cooperative abort on cancellation.

anyio waits for a worker thread to return even when the awaiting task is cancelled (a thread cannot be
interrupted). So that cancelling a multi-GB write does not mean waiting for it to finish, workers poll a
:class:`threading.Event` between units of work, and :func:`run_workers` sets it the moment its task is
cancelled or any worker fails.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import TypeVar

import anyio
import anyio.to_thread

from ._gc import paused
from ._options import IOConfig

T = TypeVar("T")


class Aborted(Exception):
    """Raised inside a worker that stopped because the abort event was set."""


_switch_lock = threading.Lock()
_switch_depth = 0
_switch_saved = 0.0


@contextlib.contextmanager
def short_switches(interval: float | None) -> Iterator[None]:
    """While the block runs, make CPython hand the GIL to a waiting thread after ``interval`` seconds.

    Worker threads of a save or load run Python code (planning, matching, per-tensor loops) for tens of
    milliseconds when a state has 10^4 tensors. Each time the event loop's thread wakes up meanwhile, it
    waits for the GIL for up to the interpreter's switch interval, 5 ms by default: that is its lag. The
    setting is process-wide, so uses are counted across threads: the first lowers it (never raises it),
    the last restores the previous value. ``None`` makes the block a no-op.
    """
    global _switch_depth, _switch_saved
    if interval is None:
        yield
        return
    with _switch_lock:
        if _switch_depth == 0:
            _switch_saved = sys.getswitchinterval()
            sys.setswitchinterval(min(interval, _switch_saved))
        _switch_depth += 1
    try:
        yield
    finally:
        with _switch_lock:
            _switch_depth -= 1
            if _switch_depth == 0:
                sys.setswitchinterval(_switch_saved)


@contextlib.contextmanager
def responsive(io: IOConfig) -> Iterator[None]:
    """The process-wide settings a save or load runs under, so that the event loop stays responsive.

    The older GC generations held off (``io.pause_gc``, see :func:`~aiockpt._gc.paused`) and the short
    GIL switch interval (``io.switch_interval``, see :func:`short_switches`).
    """
    with paused(io.pause_gc), short_switches(io.switch_interval):
        yield


def yield_gil() -> None:
    """Let a thread that is waiting for the GIL (the event loop's) take it now.

    CPython hands the GIL to a waiting thread only after its switch interval (5 ms) or when the holder
    blocks. Worker threads call this between slices of long GIL-bound work (decoding a large manifest),
    which bounds the event loop's wait by the slice, not by the switch interval.
    """
    time.sleep(0)  # releases the GIL around a zero-length sleep


async def run_sync(fn: Callable[[], T], limiter: anyio.CapacityLimiter | None = None) -> T:
    """Run one short blocking call in a worker thread (the event loop keeps ticking)."""
    return await anyio.to_thread.run_sync(fn, limiter=limiter)


async def acquire_sync(fn: Callable[[], T], limiter: anyio.CapacityLimiter | None = None) -> T:
    """Like :func:`run_sync`, for a call that returns a resource (a buffer, a file, a temp dir).

    A cancelled ``run_sync`` still waits for its thread but then drops the result, which would leak the
    resource. Here the call is shielded, so the caller always receives the result and owns its clean-up;
    a pending cancellation is delivered at the caller's next checkpoint instead.
    """
    with anyio.CancelScope(shield=True):
        result = await anyio.to_thread.run_sync(fn, limiter=limiter)
    return result  # noqa: RET504 (mypy sees the shielded scope as able to swallow a return)


async def release(box: list[object], limiter: anyio.CapacityLimiter | None = None) -> None:
    """Drop the objects in ``box`` in a worker thread, which must then hold their last references.

    Freeing the per-tensor bookkeeping of a checkpoint of 10^4 tensors is one cascade of deallocations
    that holds the GIL for several milliseconds; done on the event loop's thread, it is a stall. Callers
    move their references into ``box`` and ``del`` their own names first.
    """
    with anyio.CancelScope(shield=True):
        await anyio.to_thread.run_sync(box.clear, limiter=limiter)


async def run_workers(
    work: Callable[[threading.Event], None], count: int, limiter: anyio.CapacityLimiter | None = None
) -> None:
    """Run ``work(abort)`` in ``count`` threads at once and wait for all of them (see :func:`run_each`).

    Raises:
        Exception: The first worker failure.
    """
    await run_each([work] * count, limiter)


async def run_each(
    works: Sequence[Callable[[threading.Event], None]], limiter: anyio.CapacityLimiter | None = None
) -> None:
    """Run each of ``works`` as ``work(abort)`` in a thread of its own, all at once, and wait for all.

    Every work must return soon after ``abort`` is set. The first exception raised by a worker sets
    ``abort`` and is re-raised here once every worker has returned (an :class:`Aborted` of a sibling is
    dropped).

    Raises:
        Exception: The first worker failure.
    """
    abort = threading.Event()
    errors: list[BaseException] = []

    def guarded(work: Callable[[threading.Event], None]) -> None:
        try:
            work(abort)
        except Aborted:
            pass
        except BaseException as exc:
            errors.append(exc)
            abort.set()

    async def abort_on_cancel() -> None:
        try:
            await anyio.sleep_forever()
        finally:
            abort.set()

    async with anyio.create_task_group() as outer:
        # The watcher wakes only when cancelled: by a cancellation from outside (then the workers are told
        # to stop), or by the line below once every worker has returned.
        outer.start_soon(abort_on_cancel)
        async with anyio.create_task_group() as workers:
            for work in works:
                workers.start_soon(partial(anyio.to_thread.run_sync, partial(guarded, work), limiter=limiter))
        outer.cancel_scope.cancel()
    if errors:
        raise errors[0]
