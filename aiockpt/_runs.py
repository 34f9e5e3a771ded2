"""Batching many byte ranges into few large vectored I/O calls, shared by the write and read stages.

A *piece* is at most one checksum block of one chunk, placed at a file offset. Consecutive pieces of one
file, with only small alignment gaps between them, form a *run* that one ``pwritev``/``preadv`` call
moves. Per-item Python work is therefore one list append; per-run work is one system call.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

T = TypeVar("T")

# Largest run: big enough to amortise a system call, small enough to spread over threads and to keep a
# just-read block in cache while its checksum is computed.
RUN_BYTES = 8 << 20
# Below IOV_MAX (1024 on Linux), leaving room for padding entries.
MAX_IOV = 512
MAX_GAP = 4096

_ZEROS = memoryview(bytes(MAX_GAP))


@dataclass(slots=True)
class Piece:
    """``view`` holds the bytes at ``offset``; it is block ``block`` of chunk ``item``."""

    offset: int
    view: memoryview
    item: int
    block: int


@dataclass(slots=True)
class Run:
    """Pieces that one vectored call moves, starting at file ``offset``.

    They are ``pieces[first : first + len(self.pieces)]`` of the list :func:`group` was given.
    """

    offset: int
    pieces: list[Piece] = field(default_factory=list)
    end: int = 0
    first: int = 0


def split(offset: int, view: memoryview, item: int, block: int) -> list[Piece]:
    """Cut one chunk's bytes into pieces of at most ``block`` bytes, one per checksum block."""
    n = len(view)
    if n <= block:
        return [Piece(offset, view, item, 0)]
    return [Piece(offset + s, view[s : s + block], item, i) for i, s in enumerate(range(0, n, block))]


def group(pieces: list[Piece]) -> list[Run]:
    """Group pieces, sorted by offset, into runs of nearby pieces."""
    runs: list[Run] = []
    run: Run | None = None
    for i, p in enumerate(pieces):
        n = len(p.view)
        if (
            run is None
            or p.offset < run.end
            or p.offset - run.end > MAX_GAP
            or run.end - run.offset + n > RUN_BYTES
            or len(run.pieces) >= MAX_IOV
        ):
            run = Run(offset=p.offset, end=p.offset, first=i)
            runs.append(run)
        run.pieces.append(p)
        run.end = p.offset + n
    return runs


def lanes(runs: list[T], parts: int, size: Callable[[T], int]) -> list[deque[T]]:
    """Split ``runs`` (in file order) into at most ``parts`` contiguous lanes of about equal bytes.

    Each reader thread takes one lane and walks it in order, so every thread reads one sequential range
    of the file and the kernel's readahead keeps up, as it does for a plain sequential read.
    """
    total = sum(size(r) for r in runs) or 1
    out: list[deque[T]] = [deque() for _ in range(max(1, min(parts, len(runs))))]
    done = 0
    for r in runs:
        out[min(done * len(out) // total, len(out) - 1)].append(r)
        done += size(r)
    return [lane for lane in out if lane]


def _iov(run: Run, gap: memoryview) -> list[memoryview]:
    iov: list[memoryview] = []
    pos = run.offset
    for p in run.pieces:
        if p.offset > pos:
            iov.append(gap[: p.offset - pos])
        if len(p.view):
            iov.append(p.view)
        pos = p.offset + len(p.view)
    return iov


def _consume(iov: list[memoryview], done: int) -> None:
    """Drop the first ``done`` bytes from ``iov`` after a short vectored call."""
    while iov and done >= len(iov[0]):
        done -= len(iov[0])
        iov.pop(0)
    if iov and done:
        iov[0] = iov[0][done:]


def write_run(fd: int, run: Run) -> None:
    """Write a run at its offset, zero-filling gaps; retries short writes."""
    iov = _iov(run, _ZEROS)
    offset = run.offset
    while iov:
        done = os.pwritev(fd, iov, offset)
        offset += done
        _consume(iov, done)


def read_run(fd: int, run: Run, scratch: memoryview) -> int:
    """Read a run into its pieces' views (gaps into ``scratch``); returns bytes read, short at end of file."""
    iov = _iov(run, scratch)
    offset = run.offset
    total = 0
    while iov:
        done = os.preadv(fd, iov, offset)
        if done == 0:
            break
        offset += done
        total += done
        _consume(iov, done)
    return total
