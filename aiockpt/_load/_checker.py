"""Verifying a reader's runs on a second thread that shares the reader's CPU.

A buffered reader spends most of a cold load asleep, waiting for the device, and the rest copying (in
the kernel) and checksumming. Checked in the reader, each run's checksums delay the next read, and the
device idles meanwhile: on a 2-vCPU VM, 2 GiB read in 8 MiB runs took 0.68 s checked in the reader
against 0.61 s unchecked. A checker thread beside the reader overlaps the two, but free to run on any
CPU it takes the one the event loop wakes on (loop-lag p99 2.2-4.1 ms against 1.1-1.6 ms, measured three
times, at ``SCHED_IDLE`` and nice 10 alike). So a reader and its checker are pinned to one CPU that is
not the event loop's: the checker runs while its reader waits for the device, and the loop's CPU stays
free. Where every reader and every checker can have a CPU besides the loop's, checkers are not pinned;
where there are more readers than CPUs besides the loop's, or threads cannot be pinned (not Linux),
readers check their own runs (see :func:`checker_cpus`).

Runs of small blocks stay with their reader: checking them is a Python loop over the blocks, which would
take turns with the reader and the loop for the GIL.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from collections.abc import Callable, Iterator
from types import TracebackType

from .._fs import libc_function
from .._runs import Run
from .._threads import Aborted

# Runs whose blocks average less are checked by their reader (see the module docstring).
MIN_BLOCK = 64 << 10
# Runs read and not yet checked, at most: a reader that gets this far ahead waits for its checker, so
# the pages of unchecked runs (which drop-behind cannot evict yet) stay few.
_DEPTH = 4


# Where the calling thread runs now; ``None`` where threads cannot be pinned anyway.
_GETCPU: Callable[[], int] | None = None
if hasattr(os, "sched_setaffinity"):
    _GETCPU = libc_function("sched_getcpu", [])


# CPUs that readers and checkers of loads in flight in this process are pinned to.
_claimed: set[int] = set()
_claims = threading.Lock()


@contextlib.contextmanager
def checker_cpus(lanes: int) -> Iterator[list[int | None] | None]:
    """Where the checkers of ``lanes`` readers run, for the block; ``None``: readers check their own runs.

    Call it on the event loop's thread. With a CPU for each reader and each checker besides the loop's,
    checkers run wherever the kernel puts them (``None`` for each lane). With fewer, but one for each
    reader besides the loop's, each reader and its checker are pinned to one such CPU: the next ones
    after the CPU the loop's thread runs on now (processes that each pin their readers then tend to
    pick different CPUs), and none that another load in flight in this process has pinned its own to
    (those are claimed until the block ends). Otherwise, and where threads cannot be pinned, readers
    check their own runs.
    """
    cpus = _claim(lanes)
    try:
        yield cpus
    finally:
        if cpus:
            with _claims:
                _claimed.difference_update(c for c in cpus if c is not None)


def _allowed() -> list[int]:
    """The CPUs the calling thread may run on."""
    return sorted(os.sched_getaffinity(0))


def _claim(lanes: int) -> list[int | None] | None:
    if _GETCPU is None or lanes < 1:
        return None
    allowed = _allowed()
    if len(allowed) > 2 * lanes:
        return [None] * lanes
    here = _GETCPU()
    at = allowed.index(here) + 1 if here in allowed else 0
    after = [c for c in allowed[at:] + allowed[:at] if c != here]
    with _claims:
        free = [c for c in after if c not in _claimed][:lanes]
        if len(free) < lanes:
            return None
        _claimed.update(free)
    return list(free)


@contextlib.contextmanager
def pinned(cpu: int | None) -> Iterator[None]:
    """Run the block with the calling thread allowed on ``cpu`` only (``None``: left alone), then restore.

    Reader threads come from anyio's pool, and are reused for other work afterwards: the thread gets its
    own CPU set back, even if the block raises.
    """
    if cpu is None:
        yield
        return
    before: set[int] | None = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {cpu})
    except OSError:  # the CPU went offline, or a cgroup took it away: run where allowed
        before = None
    try:
        yield
    finally:
        if before is not None:
            _restore(before)


def _restore(cpus: set[int]) -> None:
    """Allow the calling thread on ``cpus`` again, or failing that on every CPU the process may use.

    Restoring fails if none of ``cpus`` is allowed any more (a cgroup's CPU set changed, CPUs went
    offline); the kernel narrows a request for every CPU to those allowed.
    """
    try:
        os.sched_setaffinity(0, cpus)
    except OSError:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, range(os.cpu_count() or 1))


def wants_checker(run: Run) -> bool:
    """Whether ``run``'s blocks are large enough to be checked by a checker (see :data:`MIN_BLOCK`)."""
    return run.end - run.offset >= MIN_BLOCK * len(run.pieces)


class Checker:
    """A thread, pinned to ``cpu`` (if not ``None``), that runs the checks a reader hands it, in order.

    Used as a context manager by the reader's thread: :meth:`put` hands over a check, and leaving the
    block waits for the thread to end. The first check that raises stops the others; its exception is
    raised to the reader by the next :meth:`put`, or on leaving the block. Once ``abort`` is set, or the
    block is left because of an exception (a damaged run found by the reader), the checks still queued
    are skipped; leaving the block normally after skipped checks raises :class:`Aborted`.
    """

    def __init__(self, cpu: int | None, abort: threading.Event) -> None:
        self._cpu = cpu
        self._abort = abort
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue(_DEPTH)
        self._error: BaseException | None = None
        self._skip = False
        self._thread = threading.Thread(target=self._loop, name="aiockpt-check", daemon=True)

    def __enter__(self) -> Checker:
        self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._skip = exc is not None
        self._queue.put(None)
        self._thread.join()
        if exc is None and self._error is not None:
            raise self._error
        if exc is None and self._abort.is_set():
            raise Aborted

    def put(self, check: Callable[[], None]) -> None:
        """Queue ``check``, waiting while :data:`_DEPTH` checks are; raise what an earlier check raised."""
        if self._error is not None:
            raise self._error
        self._queue.put(check)

    def _loop(self) -> None:
        with pinned(self._cpu):
            # Keeps taking checks after a failure, without running them, so that a reader blocked in
            # put() on a full queue is never left waiting.
            while (check := self._queue.get()) is not None:
                if self._error is None and not self._skip and not self._abort.is_set():
                    try:
                        check()
                    except BaseException as exc:  # handed to the reader's thread
                        self._error = exc
