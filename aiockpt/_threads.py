"""Running blocking work off the event loop, with cooperative abort on cancellation.

A wait for a worker thread never ends before the thread has returned, whatever cancels the waiting task
(a thread cannot be interrupted, and what it makes or writes must be cleaned up after it, not before).
anyio's own wait holds against anyio cancellation only; :func:`_in_thread` holds against asyncio's
``task.cancel()`` too. So that cancelling a multi-GB write does not mean waiting for it to finish,
workers poll a :class:`threading.Event` between units of work, and :func:`run_workers` sets it the
moment its task is cancelled or any worker fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import gc
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Generic, TypeVar

import anyio

# anyio imports the backend of the running event loop on its first use, on that loop's thread: 10 ms
# here when the machine is idle, 90 ms under the I/O of a large load, as a stall of the first save or
# load. Importing it with aiockpt moves that to import time. (Harmless under trio: a module, unused.)
import anyio._backends._asyncio
import anyio.to_thread
import msgspec
import msgspec.structs

from ._cuda import as_caller
from ._gc import paused
from ._options import IOConfig

T = TypeVar("T")


class Aborted(Exception):
    """Raised inside a worker that stopped because the abort event was set."""


_switch_lock = threading.Lock()
_switch_depth = 0
# The interval of before the first use, while the current one is lowered (set before it is lowered,
# cleared after it is restored: a fork in between finds it).
_switch_saved: float | None = None
# Bumped in a forked child: blocks entered before the fork are not counted there (see _forget_switches).
_switch_generation = 0


@contextlib.contextmanager
def short_switches(interval: float | None) -> Iterator[None]:
    """While the block runs, make CPython hand the GIL to a waiting thread after ``interval`` seconds.

    Worker threads of a save or load run Python code (planning, matching, per-tensor loops) for tens of
    milliseconds when a state has 10^4 tensors. Each time the event loop's thread wakes up meanwhile, it
    waits for the GIL for up to the interpreter's switch interval, 5 ms by default: that is its lag. The
    setting is process-wide, so uses are counted across threads: the first lowers it (never raises it),
    the last restores the previous value. ``None`` makes the block a no-op. A process forked meanwhile
    starts with the previous value and no uses (see :func:`_forget_switches`).
    """
    global _switch_depth, _switch_saved
    if interval is None:
        yield
        return
    with _switch_lock:
        if _switch_depth == 0:
            _switch_saved = saved = sys.getswitchinterval()
            sys.setswitchinterval(min(interval, saved))
        _switch_depth += 1
        generation = _switch_generation
    try:
        yield
    finally:
        with _switch_lock:
            # A block entered before a fork, left in the child, was never counted there.
            if generation == _switch_generation:
                _switch_depth -= 1
                if _switch_depth == 0 and _switch_saved is not None:
                    sys.setswitchinterval(_switch_saved)
                    _switch_saved = None


def _forget_switches() -> None:
    """In a forked child: restore the switch interval of before the parent's uses, and count none.

    The child has none of the parent's saves or loads, and no thread of the parent: without this it kept
    the short interval for good, and a lock held by a parent's thread at the fork, for good too.
    """
    global _switch_lock, _switch_depth, _switch_saved, _switch_generation
    _switch_lock = threading.Lock()
    if _switch_saved is not None:
        sys.setswitchinterval(_switch_saved)
        _switch_saved = None
    _switch_depth = 0
    _switch_generation += 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_switches)


# The nice increment of the threads that run_each starts for the save or load running in this context.
_worker_nice: contextvars.ContextVar[int] = contextvars.ContextVar("aiockpt_worker_nice", default=0)


@contextlib.contextmanager
def responsive(io: IOConfig, *, lowered: bool = False) -> Iterator[None]:
    """The settings a save or load runs under, so that the event loop stays responsive.

    Process-wide: the older GC generations held off (``io.pause_gc``, see :func:`~aiockpt._gc.paused`)
    and the short GIL switch interval (``io.switch_interval``, see :func:`short_switches`). For this
    task, if ``lowered`` (saves): the lower priority of the threads that write and checksum its bytes
    (``io.worker_nice``, see :func:`run_each`). Loads keep their readers at the caller's priority: a
    lowered reader made fresh reads of 2 GiB 15-30% slower (its page faults into new memory), for no
    measured gain in loop lag.
    """
    token = _worker_nice.set(io.worker_nice if lowered else 0)
    try:
        with paused(io.pause_gc), short_switches(io.switch_interval):
            yield
    finally:
        _worker_nice.reset(token)


# A worker offers the GIL at most this often (seconds of its own work between offers).
_OFFER_EVERY = 0.0005
# A save's per-tensor loops of Python work in a worker thread (flattening, planning, cutting pieces) call
# yield_gil once every this many items. Without the offers, the switch interval alone hands the GIL over,
# and on a 2-vCPU VM the event loop's thread, woken on the worker's CPU, often waited there for 2-5 ms
# (until the next 4 ms tick) while the other CPU idled (sched_switch traces). Durable saves of 20,000
# tensors of 4 KiB, 12 a process, 3 processes each way alternating: the loop's wakes over 2 ms late
# 16-20 of about 2,600 without, 1-3 with; p99 1.37-1.42 against 1.11-1.18 ms; the staging stage 74-77
# against 82-89 ms (each offer sleeps about 80 us). A load's loops make none: the same offers made a
# load of that state 6-12% slower, and its loop lag was within the target without them.
OFFER_ITEMS = 64
_last_offer = threading.local()


def yield_gil() -> None:
    """Let a thread that is waiting for the GIL (the event loop's) take it, at most every 0.5 ms.

    CPython hands the GIL to a waiting thread only after its switch interval (5 ms by default) or when
    the holder blocks. Worker threads call this between slices of long GIL-bound work (decoding a large
    manifest, freeing bookkeeping), which bounds the event loop's wait by the slice, not by the switch
    interval. The offer is a zero-length sleep: one that returns sooner (``sched_yield``) gives the GIL
    back before the waiting thread has woken up to take it. It costs about 80 us on a 2-vCPU VM, so it
    is made only when 0.5 ms of work have passed since this thread's last one: offered after every
    slice of 256 objects, it made freeing 10^5 objects ten times slower.
    """
    now = time.perf_counter()
    if now - getattr(_last_offer, "at", 0.0) >= _OFFER_EVERY:
        time.sleep(0)
        _last_offer.at = time.perf_counter()


class _Dropped(Exception):
    """What a call whose waiting task gave up before its thread began "raises" (to nobody)."""


class _Call(Generic[T]):
    """One call handed to a worker thread, and whether it has begun (see :func:`_in_thread`)."""

    def __init__(self, fn: Callable[[], T], loop: asyncio.AbstractEventLoop) -> None:
        self.fn = fn
        self.lock = threading.Lock()
        # "pending", then "running" and "done" (in the thread), or "dropped" (by the waiting task).
        self.state = "pending"
        self.waiting = False  # a cancelled task waits for ``ended`` (only then is the loop woken for it)
        self.ended: asyncio.Future[None] = loop.create_future()
        self.loop = loop
        # The outcome, also for a waiting task whose wait asyncio cancelled (anyio drops it then).
        self.result: T | None = None
        self.failure: BaseException | None = None

    def __call__(self) -> T:
        with self.lock:
            if self.state == "dropped":
                raise _Dropped  # the waiting task gave up before the thread began: nothing runs
            self.state = "running"
        try:
            self.result = self.fn()
            return self.result
        except BaseException as exc:
            self.failure = exc
            raise
        finally:
            with self.lock:
                self.state = "done"
                waiting = self.waiting
            if waiting:
                with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
                    self.loop.call_soon_threadsafe(_settle, self.ended)

    def began(self) -> bool:
        """Whether the thread runs (or ran) the call; if not, it never will. Event-loop thread.

        From here on ``ended`` is set once the call has returned.
        """
        with self.lock:
            if self.state == "pending":
                self.state = "dropped"
                return False
            if self.state == "done":
                _settle(self.ended)
            else:
                self.waiting = True
            return True


def _settle(ended: asyncio.Future[None]) -> None:
    if not ended.done():
        ended.set_result(None)


async def _in_thread(fn: Callable[[], T], limiter: anyio.CapacityLimiter | None) -> T:
    """``fn()`` in one of anyio's worker threads; a cancellation waits for the thread to return.

    anyio's wait is shielded from anyio cancellation, not from asyncio's ``task.cancel()`` (from
    ``asyncio.timeout``, ``asyncio.wait_for``, or ``asyncio.run`` cancelling every task left as a loop
    ends): that raises at the wait and drops the call's outcome while the thread goes on. Here the
    cancellation is re-raised once the thread has returned (or at once, where it had not begun, and then
    never does); further ones meanwhile are absorbed.
    """
    loop = asyncio.get_running_loop()
    call = _Call(fn, loop)
    try:
        return await anyio.to_thread.run_sync(call, limiter=limiter)
    except asyncio.CancelledError:
        if call.began():
            await _until(call.ended)
        raise


async def _until(ended: asyncio.Future[None]) -> None:
    """Wait for ``ended``, through any cancellation (each absorbed one is taken back). Event-loop thread."""
    task = asyncio.current_task()
    with anyio.CancelScope(shield=True):  # anyio delivers nothing here; asyncio may, once per cancel()
        while not ended.done():
            try:
                await asyncio.shield(ended)
            except asyncio.CancelledError:
                if task is not None and sys.version_info >= (3, 11):
                    task.uncancel()


async def run_sync(fn: Callable[[], T], limiter: anyio.CapacityLimiter | None = None) -> T:
    """Run one short blocking call in a worker thread (the event loop keeps ticking).

    The call runs on the caller's CUDA device and streams, where a save or load noted them (see ``_cuda``).
    A cancellation, of any kind, propagates once the call has returned.
    """
    return await _in_thread(as_caller(fn), limiter)


async def acquire_sync(fn: Callable[[], T], limiter: anyio.CapacityLimiter | None = None) -> T:
    """Like :func:`run_sync`, for a call that returns a resource (a buffer, a file, a temp dir).

    A cancelled ``run_sync`` still waits for its thread but then drops the result, which would leak the
    resource. Here the call is shielded, so the caller always receives the result and owns its clean-up;
    a pending cancellation is delivered at the caller's next checkpoint instead.
    """
    call = _Call(as_caller(fn), asyncio.get_running_loop())
    try:
        with anyio.CancelScope(shield=True):
            result = await anyio.to_thread.run_sync(call, limiter=limiter)
    except asyncio.CancelledError:
        # asyncio's task.cancel(), which the shield does not hold off: the result is the caller's all the
        # same, and the cancellation is delivered again, at its next await.
        if not call.began():
            raise
        await _until(call.ended)
        if call.failure is not None:
            raise
        task = asyncio.current_task()
        assert task is not None
        if sys.version_info >= (3, 11):
            task.uncancel()  # what cancel() below counts again
        task.cancel()
        return call.result  # type: ignore[return-value]
    return result


# Objects freed at a time between offers of the GIL when a large container is dismantled: each slice of
# 20,000 small tensors' bookkeeping takes about 0.1 ms to free.
_FREE_SLICE = 256


def dismantle(box: list[object]) -> None:
    """Drop the objects in ``box``, whose last references it should hold, a slice at a time. Blocking.

    Freeing a container of 10^4 tensors, memoryviews or plan items frees all of them in one C call that
    holds the GIL for milliseconds, wherever it runs: a stall of the event loop's thread. Here containers
    of more than ``_FREE_SLICE`` items are emptied into a private list that is freed a slice at a time,
    offering the GIL in between, and the smaller objects found on the way (a dataclass, a struct) are
    opened the same way, so no single free is large. Nothing is mutated: an object still referenced
    elsewhere is only let go of, and what only it holds is freed with it as before.
    """
    stack = box[:]
    box.clear()
    while stack:
        obj = stack.pop()
        # Two references: ``obj`` and getrefcount's argument. More: someone else keeps it alive.
        if sys.getrefcount(obj) > 2:
            continue
        if isinstance(obj, (list, tuple, dict, set, frozenset)) and len(obj) > _FREE_SLICE:
            items = [*obj, *obj.values()] if isinstance(obj, dict) else list(obj)
            del obj  # only references are dropped: ``items`` keeps every element alive
            while items:
                del items[-_FREE_SLICE:]
                yield_gil()
        elif isinstance(obj, msgspec.Struct):
            stack.extend(msgspec.structs.astuple(obj))  # gc=False structs show no referents to gc
        else:
            stack.extend(gc.get_referents(obj))


async def release(box: list[object], limiter: anyio.CapacityLimiter | None = None) -> None:
    """Drop the objects in ``box`` in a worker thread, which must then hold their last references.

    Freeing the per-tensor bookkeeping of a checkpoint of 10^4 tensors holds the GIL for several
    milliseconds: done on the event loop's thread it is a stall, and as one C call in a worker it is one
    too (see :func:`dismantle`). Callers move their references into ``box`` and ``del`` their own names
    first.
    """
    with anyio.CancelScope(shield=True):
        await _in_thread(partial(dismantle, box), limiter)


def _can_lower(nice: int) -> bool:
    # Only Linux gives each thread its own nice value; elsewhere os.nice would lower the whole process.
    return nice > 0 and sys.platform == "linux"


def _lower(nice: int) -> None:
    """Lower the calling thread's priority by ``nice`` (Linux: this thread's alone). Blocking.

    Refused (``OSError``: a sandbox that forbids it, say), the thread keeps the caller's priority.

    Raises:
        Exception: What ``os.nice`` raises other than ``OSError`` (``TypeError`` for a ``nice`` not an int).
    """
    with contextlib.suppress(OSError):
        os.nice(nice)


def _in_own_threads(works: Sequence[Callable[[], None]], nice: int) -> list[BaseException]:
    """Run each of ``works`` in a new thread of its own, all at once, and wait for all of them. Blocking.

    Each thread first lowers its own priority by ``nice`` (if :func:`_can_lower`), as part of its work:
    a thread of its own, lowered and then gone, as an unprivileged process could not raise a pooled
    thread's priority back. Nothing a thread does is lost: whatever it raises (``BaseException`` too,
    the lowering included) is in the list returned, in the order raised. A thread that cannot be
    started is a failure too (the works after it are not run), and every thread started is waited for.

    Returns:
        The exceptions raised, in the order they were; empty if every work returned.
    """
    errors: list[BaseException] = []
    lower = _can_lower(nice)

    def guarded(work: Callable[[], None]) -> None:
        try:
            if lower:
                _lower(nice)
            work()
        except BaseException as exc:
            errors.append(exc)

    threads: list[threading.Thread] = []
    try:
        for work in works:
            thread = threading.Thread(target=guarded, args=(work,), name="aiockpt-io", daemon=True)
            thread.start()
            threads.append(thread)
    except BaseException as exc:  # (RuntimeError: can't start new thread)
        errors.append(exc)
    finally:
        for thread in threads:
            thread.join()
    return errors


def each_in_thread(works: Sequence[Callable[[], None]]) -> None:
    """Run each of ``works`` in a thread of its own, all at once, and wait for all of them. Blocking.

    For work split over threads from inside a worker thread (a save's staging copy). The threads run at
    the lowered priority of the save running in this context, like those of :func:`run_each`; a single
    work at the caller's priority runs in the calling thread.

    Raises:
        BaseException: The first failure of a work, of lowering its thread's priority, or of starting its
            thread, once every thread started has returned.
    """
    nice = _worker_nice.get()
    if len(works) == 1 and not _can_lower(nice):
        works[0]()
        return
    errors = _in_own_threads(works, nice)
    if errors:
        raise errors[0]


async def run_workers(
    work: Callable[[threading.Event], None], count: int, limiter: anyio.CapacityLimiter | None = None
) -> None:
    """Run ``work(abort)`` in ``count`` threads at once and wait for all of them (see :func:`run_each`).

    Raises:
        Exception: The first worker failure.
    """
    await run_each([work] * count, limiter)


async def run_each(
    works: Sequence[Callable[[threading.Event], None]],
    limiter: anyio.CapacityLimiter | None = None,
    *,
    lower: bool = True,
) -> None:
    """Run each of ``works`` as ``work(abort)`` in a thread of its own, all at once, and wait for all.

    Every work must return soon after ``abort`` is set. The first exception raised by a worker sets
    ``abort`` and is re-raised here once every worker has returned (an :class:`Aborted` of a sibling is
    dropped). Inside ``responsive(io, lowered=True)`` with an ``io.worker_nice`` above 0, on Linux, each
    work runs in a new thread of that lower priority, which the pooled thread waits for; ``lower=False``
    keeps them at the caller's even there. Nothing a worker raises is lost, ``BaseException`` included,
    nor a failure to lower its thread's priority or to start that thread (see :func:`_in_own_threads`).

    Raises:
        BaseException: The first worker failure.
    """
    abort = threading.Event()
    errors: list[BaseException] = []
    nice = _worker_nice.get() if lower else 0

    def guarded(work: Callable[[threading.Event], None]) -> None:
        # In the pooled thread: every failure is recorded, the lowering's and the thread start's too. An
        # Aborted once ``abort`` is set is dropped (a failure recorded here, or a cancellation that
        # propagates anyway, set it); one before would hide a work left unfinished, and is recorded.
        try:
            if _can_lower(nice):
                failures = _in_own_threads([partial(work, abort)], nice)
                if failures:
                    raise failures[0]
            else:
                work(abort)
        except BaseException as exc:
            if not (isinstance(exc, Aborted) and abort.is_set()):
                errors.append(exc)
                abort.set()

    done = anyio.Event()

    async def abort_on_cancel() -> None:
        try:
            await done.wait()
        finally:
            abort.set()

    async with anyio.create_task_group() as outer:
        # The watcher wakes when cancelled from outside (then the workers are told to stop), or when every
        # worker has returned. Not by cancelling its scope: anyio's CancelScope.cancel() formats the
        # repr of the current task into its reason, which took 2-4 ms of the event loop's thread here.
        outer.start_soon(abort_on_cancel)
        try:
            async with anyio.create_task_group() as workers:
                for work in works:
                    workers.start_soon(_in_thread, partial(guarded, work), limiter)
        finally:
            done.set()
    if errors:
        raise errors[0]
