"""Stage 4, every rank: write this rank's chunks into its data file, checksum them, fsync.

Chunks are cut into checksum blocks and batched into runs (see ``_runs``); writer threads take runs from a
shared queue and ``pwritev`` each at its offset, so one file may be written by several threads at once,
while one more thread computes the CRC32C of large blocks from the same (unchanging) source memory.
Checksums do not depend on the write, so neither waits for the other: a single writer thread keeps the
disk busy without pausing for checksums. Runs of small blocks are checksummed by their writer instead
(see :data:`_INLINE_BELOW`). The file is fsynced once, at the end.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections import deque
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import anyio
import crc32c
import msgspec

from .._errors import StorageError
from .._runs import Piece, Run, group, split, write_run
from .._threads import Aborted, acquire_sync, release, run_each, run_sync, yield_gil
from ._global_plan import RankPlan


class WriteResult(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """What a rank reports after writing: per write of its plan, the CRC32C of each block."""

    rank: int
    checksums: tuple[tuple[int, ...], ...]
    nbytes: int


def _pieces(plan: RankPlan, sources: Sequence[memoryview], block: int) -> list[Piece]:
    pieces: list[Piece] = []
    for j, w in enumerate(plan.writes):
        pieces += split(w.offset, sources[w.item], j, block)
    return pieces


def _each_run(runs: deque[Run], abort: threading.Event, handle: Callable[[Run], None]) -> None:
    """A worker's loop: take runs from ``runs`` (shared with other workers) until none is left.

    Raises:
        Aborted: ``abort`` was set (checked between runs).
    """
    while True:
        if abort.is_set():
            raise Aborted
        try:
            run = runs.popleft()
        except IndexError:
            return
        handle(run)


# Checksum tuples built per C call in ``Checksums.by_write`` (about 0.1 ms of work).
_TUPLES_PER_SLICE = 2048
# Runs whose blocks are smaller than this on average are checksummed by the writer that writes them.
# crc32c keeps the GIL for buffers under 32 KiB, so a thread of its own computes their checksums no
# sooner, and three threads that take turns with the GIL (the event loop's, a writer's, the checksum
# thread's) made the loop wake late: 20,000 blocks of 4 KiB, 8 saves, 28-31 wakes over 2 ms late
# during the write against 5-9 with the checksums in the writer, in the same minutes.
_INLINE_BELOW = 64 << 10


def inline(run: Run) -> bool:
    """Whether ``run``'s checksums are computed by its writer (see :data:`_INLINE_BELOW`)."""
    return run.end - run.offset < len(run.pieces) * _INLINE_BELOW


class Checksums:
    """The CRC32C of every piece of one rank's writes (in ``_pieces`` order), computed a run at a time.

    A run's checksums are one ``map`` over its pieces' memory, a single C loop: with 10^4 small tensors a
    Python loop per piece kept the checksum thread competing with the event loop's thread for the GIL
    during the whole write.
    """

    def __init__(self, pieces: list[Piece], writes: int) -> None:
        self._pieces = pieces
        self._views = [p.view for p in pieces]
        self._crcs = [0] * len(pieces)
        self._writes = writes

    def add(self, run: Run) -> None:
        """Checksum the pieces of ``run`` (made by ``group`` from the same pieces)."""
        end = run.first + len(run.pieces)
        self._crcs[run.first : end] = map(crc32c.crc32c, self._views[run.first : end])

    def fill(self, runs: deque[Run], abort: threading.Event) -> None:
        """Checksum runs until none is left.

        Raises:
            Aborted: ``abort`` was set (checked between runs).
        """
        _each_run(runs, abort, self.add)

    def by_write(self) -> tuple[tuple[int, ...], ...]:
        """Each write's block checksums, in order, once every run was checksummed."""
        crcs = self._crcs
        if len(crcs) == self._writes:  # one block each
            # In slices: one zip over 20,000 checksums is a 1-2 ms C call that holds the GIL throughout.
            out: list[tuple[int, ...]] = []
            for start in range(0, len(crcs), _TUPLES_PER_SLICE):
                yield_gil()
                out.extend(zip(crcs[start : start + _TUPLES_PER_SLICE]))
            return tuple(out)
        starts = [i for i, p in enumerate(self._pieces) if p.block == 0]
        starts.append(len(crcs))
        return tuple(tuple(crcs[a:b]) for a, b in itertools.pairwise(starts))


def write_runs(runs: deque[Run], fd: int, sums: Checksums, abort: threading.Event) -> None:
    """Write runs until none is left, each at its offset in ``fd``; checksum those that are :func:`inline`.

    Raises:
        Aborted: ``abort`` was set (checked between runs).
    """

    def one(run: Run) -> None:
        if inline(run):
            sums.add(run)
        write_run(fd, run)

    _each_run(runs, abort, one)


async def write(
    plan: RankPlan,
    sources: Sequence[memoryview],
    directory: Path,
    *,
    block: int,
    threads: int,
    limiter: anyio.CapacityLimiter | None = None,
) -> WriteResult:
    """Write ``plan``'s chunks, whose bytes are ``sources[item]``, into ``directory / plan.file``.

    Returns:
        The checksums of every block written.

    Raises:
        StorageError: The file could not be created, written or synced (e.g. the disk is full); the
            message names the file.
    """
    if not plan.writes:
        return WriteResult(rank=plan.rank, checksums=(), nbytes=0)
    path = directory / plan.file
    fd = -1

    def cut() -> tuple[list[Run], deque[Run], Checksums]:
        # Per-chunk Python work, proportional to the number of tensors: kept off the event loop's thread.
        pieces = _pieces(plan, sources, block)
        runs = group(pieces)
        return runs, deque(r for r in runs if not inline(r)), Checksums(pieces, len(plan.writes))

    def open_file() -> int:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            if plan.nbytes:
                # Reserve the space up front: a full disk fails here, before any byte is written.
                os.posix_fallocate(fd, 0, plan.nbytes)
        except BaseException:
            os.close(fd)
            raise
        return fd

    runs, threaded, sums = await run_sync(cut, limiter)
    try:
        fd = await acquire_sync(open_file, limiter)
        writers = min(threads, max(1, len(runs)))
        # The writers share one queue of every run; the checksum thread takes the runs of large blocks.
        works = [partial(write_runs, deque(runs), fd, sums)] * writers
        if threaded:
            works.insert(0, partial(sums.fill, threaded))
        await run_each(works, limiter)
        result = await run_sync(partial(_sync_and_report, fd, plan, sums), limiter)
    except OSError as exc:
        raise StorageError(f"cannot write {path}: {exc.strerror or exc}", path=str(path)) from exc
    finally:
        if fd >= 0:
            with anyio.CancelScope(shield=True):
                await run_sync(lambda: os.close(fd), limiter)
        # A piece and a memoryview per block: freed in a worker, a slice at a time, not on the loop's thread.
        box: list[object] = [runs, threaded, sums]
        del runs, threaded, sums
        await release(box, limiter)
    return result


def _sync_and_report(fd: int, plan: RankPlan, sums: Checksums) -> WriteResult:
    os.fsync(fd)
    return WriteResult(rank=plan.rank, checksums=sums.by_write(), nbytes=plan.nbytes)
