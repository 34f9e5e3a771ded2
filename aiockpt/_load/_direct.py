"""Reading runs with ``O_DIRECT``: readers fill bounce buffers, one finisher verifies and copies into place.

A direct read costs the kernel almost nothing per byte (no page-cache page to allocate, fill and evict),
but its bytes land in an aligned bounce buffer, not in the destination: each run must be verified there
and copied into place. Done by the reader itself, that work sits between two reads and the device idles
meanwhile (2 GiB on a 2-vCPU VM: 0.66-0.75 s at best, against 0.55-0.62 s for a plain buffered read
with two threads). Here reader threads only read, each into a bounce buffer of the shared pool
(:data:`aiockpt._memory.BOUNCE`), and a finisher thread verifies every block of each run read, copies
the blocks that verify into their destinations and gives the buffer back. Two readers keep two requests
in flight; they sleep in the device's reads, so the finisher is the only thread that keeps a CPU busy.
Where the machine has few CPUs, readers and finisher are all pinned to one that is not the event loop's
(see ``_checker``; readers left free took the loop's CPU: loop-lag p99 2.15 ms against 0.65-0.69 ms).
Cold loads of 2 GiB so took 0.593-0.596 s at best, the plain ``O_DIRECT`` read 0.521-0.525 s.
``aiockpt.verify`` reads the same runs through the same pipeline, its finisher only verifying.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from functools import partial
from pathlib import Path

import anyio
import crc32c

from .._fs import open_direct
from .._memory import BounceSlots
from .._pagecache import uncached
from .._runs import DIRECT_ALIGN, Piece, Run, address_of
from .._threads import Aborted, run_each
from ._checker import checker_cpus, pinned, wants_checker

# How long a thread waiting for the other side sleeps between looks at ``abort``.
_POLL = 0.05

# What a refused O_DIRECT read raises: EINVAL where the file system wants other alignment; such a run is
# read through the page cache instead, into the same buffer.
_REFUSED = (errno.EINVAL,)


def span(run: Run) -> tuple[int, int]:
    """The file range ``[start, stop)`` that covers ``run``, widened to ``O_DIRECT`` alignment."""
    return run.offset - run.offset % DIRECT_ALIGN, -(-run.end // DIRECT_ALIGN) * DIRECT_ALIGN


def reads_direct(direct: bool | None, snapshot: bytes | None, run: Run) -> bool:
    """Whether ``run``, bound for CPU memory that is not a mapping of its file, is read with ``O_DIRECT``.

    ``direct`` is ``IOConfig.direct_reads``; ``snapshot``, the file's pages cached before the reads began
    (``None`` where drop-behind is off: pages may be shared, and nothing is evicted). ``None`` picks the
    runs a buffered read would evict again: blocks of 64 KiB or more on average (``wants_checker``), none
    of whose pages, widened to ``O_DIRECT`` alignment, is cached.
    """
    if direct is not None:
        return direct
    if snapshot is None or not wants_checker(run):
        return False
    start, stop = span(run)
    return uncached(snapshot, start, stop)


def _open_for_direct(path: Path) -> int | None:
    """``path`` opened read-only with ``O_DIRECT``, or ``None`` where that is refused or fails.

    A missing or unreadable file fails the buffered open that comes first, with its own error: any
    failure here only means the runs are read buffered.
    """
    try:
        return open_direct(path, os.O_RDONLY)
    except OSError:
        return None


def split_direct(
    directory: Path,
    jobs: Sequence[tuple[str, Run]],
    wanted: Sequence[bool],
    fds: Mapping[str, int],
    direct_fds: dict[str, int],
) -> tuple[list[tuple[int, int, Run]], list[tuple[str, Run]]]:
    """Split ``jobs`` (file name, run) into the direct jobs of :class:`DirectReads` and the rest.

    Each file with a run ``wanted`` direct is opened with ``O_DIRECT`` (into ``direct_fds``, by name; the
    caller closes them); the wanted runs of a file that refuses it stay with the rest, read buffered
    through ``fds``. Both lists keep the order of ``jobs``.
    """
    for name in sorted({name for (name, _), want in zip(jobs, wanted, strict=True) if want}):
        dfd = _open_for_direct(directory / name)
        if dfd is not None:
            direct_fds[name] = dfd
    direct: list[tuple[int, int, Run]] = []
    rest: list[tuple[str, Run]] = []
    for (name, run), want in zip(jobs, wanted, strict=True):
        if want and name in direct_fds:
            direct.append((direct_fds[name], fds[name], run))
        else:
            rest.append((name, run))
    return direct, rest


def _read_span(direct_fd: int, fd: int, buffer: memoryview, start: int) -> int:
    """Read into ``buffer`` from file offset ``start`` (aligned) until it is full or the file ends.

    Through ``direct_fd``; where ``O_DIRECT`` is refused for this read, through ``fd`` (buffered).
    Returns the bytes read.
    """
    got = 0
    via = direct_fd
    while got < len(buffer):
        try:
            done = os.preadv(via, [buffer[got:]], start + got)
        except OSError as exc:
            if via == fd or exc.errno not in _REFUSED:
                raise
            via = fd
            continue
        got += done
        # Only the end of the file makes a direct read return less than asked, or an unaligned count.
        if done == 0 or (via == direct_fd and got % DIRECT_ALIGN):
            break
    return got


def copy_checked(
    run: Run,
    buffer: memoryview,
    start: int,
    end: int,
    checksums: Sequence[tuple[int, ...]] | None,
    *,
    copy: bool = True,
) -> tuple[list[Piece], list[Piece]]:
    """Verify the pieces of ``run``, read into ``buffer`` from file offset ``start`` up to ``end``; copy them.

    Each piece is checksummed in the buffer, then copied into its view only if it matches: a damaged
    block never reaches its destination. A block (4 MiB by default) is still in the CPU's cache when it is
    copied. Both calls release the GIL (``crc32c`` for blocks over 32 KiB, ``memmove``). ``copy=False``
    only verifies (``aiockpt.verify``).

    Returns:
        The pieces the file ended before (truncated), and the pieces whose checksum does not match.
    """
    base = address_of(buffer)
    short: list[Piece] = []
    bad: list[Piece] = []
    for p in run.pieces:
        n = len(p.view)
        if p.offset + n > end:
            short.append(p)
            continue
        at = p.offset - start
        if checksums is not None and crc32c.crc32c(buffer[at : at + n]) != checksums[p.item][p.block]:
            bad.append(p)
        elif copy and n:
            ctypes.memmove(address_of(p.view), base + at, n)
    return short, bad


# A run read and not yet finished: the run, its buffer, the file offset of the buffer's first byte, the
# file offset where the bytes read end, and the error that failed its read (with ``failed`` only).
_Done = tuple[Run, memoryview, int, int, OSError | None]


class DirectReads:
    """The ``O_DIRECT`` runs of one load or verification, and the threads that read and finish them.

    ``jobs`` are ``(direct fd, buffered fd, run)``, in file order; ``finish(run, buffer, start, end)``
    verifies a run read into ``buffer`` and copies it into place (raising on a damaged or missing block).
    A failed read raises in its reader, unless ``failed`` is given: the finisher then calls
    ``failed(run, error)`` instead of ``finish`` for that run and the reads go on (a verification reports
    every unreadable run). Run :meth:`read` in ``readers`` threads and :meth:`finish` in one, all at once;
    each returns soon after ``abort`` is set. At most ``readers + 2`` bounce buffers are in use: one per
    reader, one being finished and one read and waiting. :meth:`close` gives them back once every thread
    has returned.
    """

    def __init__(
        self,
        jobs: Sequence[tuple[int, int, Run]],
        readers: int,
        finish: Callable[[Run, memoryview, int, int], None],
        failed: Callable[[Run, OSError], None] | None = None,
    ) -> None:
        self.readers = max(1, min(readers, len(jobs)))
        self._jobs = deque(jobs)
        self._count = len(jobs)
        self._finish = finish
        self._failed = failed
        size = max((stop - start for start, stop in (span(run) for _, _, run in jobs)), default=0)
        self._buffers = BounceSlots(size, self.readers + 2)
        self._done: deque[_Done] = deque()
        self._cond = threading.Condition()

    async def run(self, checkers: bool, limiter: anyio.CapacityLimiter | None = None) -> None:
        """Read and finish every run, each reader and the finisher in a thread of its own; on the loop.

        With ``checkers``, all of them are pinned to the CPU a load's checker would get (see
        ``_checker.checker_cpus``), which leaves the event loop's CPU free.

        Raises:
            OSError: A read failed (without ``failed``).
            CorruptionError: As ``finish`` raises it.
        """
        with checker_cpus(1) if checkers else nullcontext() as cpus:
            cpu = cpus[0] if cpus else None
            readers = [partial(self.read, cpu=cpu)] * self.readers
            await run_each([*readers, partial(self.finish, cpu=cpu)], limiter)

    def read(self, abort: threading.Event, cpu: int | None = None) -> None:
        """A reader's work, on ``cpu`` if not ``None``: read runs into free buffers until none is left.

        Raises:
            Aborted: ``abort`` was set.
            OSError: A read failed (without ``failed``).
        """
        with pinned(cpu):
            self._read(abort)

    def _read(self, abort: threading.Event) -> None:
        while True:
            if abort.is_set():
                raise Aborted
            with self._cond:
                if not self._jobs:
                    return
                direct_fd, fd, run = self._jobs.popleft()
            buffer = self._take(abort)  # (on failure, still taken: given back by close)
            start, stop = span(run)
            error: OSError | None = None
            try:
                got = _read_span(direct_fd, fd, buffer[: stop - start], start)
            except OSError as exc:
                if self._failed is None:
                    raise
                got, error = 0, exc
            with self._cond:
                self._done.append((run, buffer, start, start + got, error))
                self._cond.notify_all()

    def finish(self, abort: threading.Event, cpu: int | None = None) -> None:
        """The finisher's work, on ``cpu`` if not ``None``: finish every run as it is read.

        Raises:
            Aborted: ``abort`` was set (a reader failed, or the load was cancelled).
            CorruptionError: As ``finish`` raises it.
        """
        with pinned(cpu):
            for _ in range(self._count):
                with self._cond:
                    while not self._done or abort.is_set():
                        if abort.is_set():
                            raise Aborted
                        self._cond.wait(_POLL)
                    run, buffer, start, end, error = self._done.popleft()
                try:
                    if error is not None and self._failed is not None:
                        self._failed(run, error)
                    else:
                        self._finish(run, buffer, start, end)
                finally:
                    self._give(buffer)

    def _take(self, abort: threading.Event) -> memoryview:
        with self._cond:
            while (buffer := self._buffers.take()) is None:
                if abort.is_set():
                    raise Aborted
                self._cond.wait(_POLL)
            return buffer

    def _give(self, buffer: memoryview) -> None:
        with self._cond:
            self._buffers.give(buffer)
            self._cond.notify_all()

    def close(self) -> None:
        """Give the bounce buffers back to the pool (blocking); call once every thread has returned.

        Runs not read (the load failed or was cancelled) are let go of here too, in the calling thread.
        """
        self._jobs.clear()
        self._done.clear()
        self._buffers.close()
