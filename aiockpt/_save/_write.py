"""Stage 4, every rank: write this rank's chunks into its data file, checksum them, fsync.

Chunks are cut into checksum blocks and batched into runs (see ``_runs``); writer threads take runs from a
shared queue and ``pwritev`` each at its offset, so one file may be written by several threads at once,
while one more thread computes every block's CRC32C from the same (unchanging) source memory. Checksums
do not depend on the write, so neither waits for the other: a single writer thread keeps the disk busy
without pausing for checksums. The file is fsynced once, at the end.
"""

from __future__ import annotations

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
from .._threads import Aborted, acquire_sync, run_each, run_sync
from ._global_plan import RankPlan


class WriteResult(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """What a rank reports after writing: per write of its plan, the CRC32C of each block."""

    rank: int
    checksums: tuple[tuple[int, ...], ...]
    nbytes: int


def blocks(nbytes: int, block: int) -> int:
    """Number of checksum blocks of a chunk of ``nbytes`` (an empty chunk has one, of no bytes)."""
    return max(1, -(-nbytes // block))


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


def checksum_runs(runs: deque[Run], sums: list[list[int]], abort: threading.Event) -> None:
    """Checksum runs until none is left: each piece's CRC32C goes to ``sums[item][block]``.

    Raises:
        Aborted: ``abort`` was set (checked between runs).
    """

    def checksum(run: Run) -> None:
        for p in run.pieces:
            sums[p.item][p.block] = crc32c.crc32c(p.view)

    _each_run(runs, abort, checksum)


def write_runs(runs: deque[Run], fd: int, abort: threading.Event) -> None:
    """Write runs until none is left, each at its offset in ``fd``.

    Raises:
        Aborted: ``abort`` was set (checked between runs).
    """
    _each_run(runs, abort, partial(write_run, fd))


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

    def cut() -> tuple[list[Run], list[list[int]]]:
        # Per-chunk Python work, proportional to the number of tensors: kept off the event loop's thread.
        return group(_pieces(plan, sources, block)), [
            [0] * blocks(len(sources[w.item]), block) for w in plan.writes
        ]

    def sync_and_report() -> WriteResult:
        os.fsync(fd)
        return WriteResult(rank=plan.rank, checksums=tuple(tuple(s) for s in sums), nbytes=plan.nbytes)

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

    runs, sums = await run_sync(cut, limiter)
    try:
        fd = await acquire_sync(open_file, limiter)
        writer = partial(write_runs, deque(runs), fd)
        summer = partial(checksum_runs, deque(runs), sums)
        await run_each([summer, *[writer] * min(threads, max(1, len(runs)))], limiter)
        result = await run_sync(sync_and_report, limiter)
    except OSError as exc:
        raise StorageError(f"cannot write {path}: {exc.strerror or exc}", path=str(path)) from exc
    finally:
        if fd >= 0:
            with anyio.CancelScope(shield=True):
                await run_sync(lambda: os.close(fd), limiter)
    return result
