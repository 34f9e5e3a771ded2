"""Batching many byte ranges into few large vectored I/O calls, shared by the write and read stages.

A *piece* is at most one checksum block of one chunk, placed at a file offset. Consecutive pieces of one
file, with only small alignment gaps between them, form a *run* that one ``pwritev``/``preadv`` call
moves. Per-item Python work is therefore one list append; per-run work is one system call.
"""

from __future__ import annotations

import ctypes
import errno
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
# O_DIRECT writes need file offsets, lengths and memory addresses aligned to the device's logical block
# (512 bytes or 4 KiB) and DMA alignment; a file-system page satisfies every common device, and keeps a
# directly written range and a buffered one out of each other's file-system blocks.
DIRECT_ALIGN = 4096

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
    # Written with O_DIRECT (see ``group``'s ``direct``): its pieces are back to back, from a page-aligned
    # file offset.
    direct: bool = False


def split(offset: int, view: memoryview, item: int, block: int) -> list[Piece]:
    """Cut one chunk's bytes into pieces of at most ``block`` bytes, one per checksum block."""
    n = len(view)
    if n <= block:
        return [Piece(offset, view, item, 0)]
    return [Piece(offset + s, view[s : s + block], item, i) for i, s in enumerate(range(0, n, block))]


def group(pieces: list[Piece], direct: Callable[[Piece], bool] | None = None) -> list[Run]:
    """Group pieces, sorted by offset, into runs of nearby pieces.

    With ``direct``, the pieces it accepts go into runs of their own (``Run.direct``) that hold no gap
    and in which every piece but the last ends at a multiple of :data:`DIRECT_ALIGN`: such a run's
    bytes up to its last aligned offset can be written with ``O_DIRECT`` (see :func:`direct_parts`).
    ``direct`` accepts only pieces that start at an aligned file offset and hold a page or more.
    """
    runs: list[Run] = []
    run: Run | None = None
    for i, p in enumerate(pieces):
        n = len(p.view)
        aligned = direct is not None and direct(p)
        if (
            run is None
            or p.offset < run.end
            or p.offset - run.end > MAX_GAP
            or run.end - run.offset + n > RUN_BYTES
            or len(run.pieces) >= MAX_IOV
            or aligned != run.direct
            or (aligned and (p.offset != run.end or run.end % DIRECT_ALIGN))
        ):
            run = Run(offset=p.offset, end=p.offset, first=i, direct=aligned)
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


def address_of(view: memoryview) -> int:
    """The address of the first byte of ``view`` (a writable, non-empty view)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def direct_parts(run: Run) -> tuple[list[memoryview], memoryview]:
    """A direct run's bytes (see :func:`group`): views of its page-aligned length, and the rest.

    The rest is the unaligned end of its last piece (empty if none): it lies in a file-system block of
    its own, so writing it through the page cache neither reads nor rewrites the aligned part's blocks.
    """
    body = (run.end - run.offset) // DIRECT_ALIGN * DIRECT_ALIGN
    iov = [p.view for p in run.pieces]
    tail = iov[-1][len(iov[-1]) - (run.end - run.offset - body) :]
    iov[-1] = iov[-1][: len(iov[-1]) - len(tail)]
    if not len(iov[-1]):
        iov.pop()
    return iov, tail


def write_direct(direct_fd: int, fd: int, offset: int, iov: list[memoryview], tail: memoryview) -> None:
    """Write ``iov`` at ``offset`` through ``direct_fd`` (``O_DIRECT``), then ``tail`` through ``fd``.

    ``iov``'s memory and lengths are page-aligned; short writes are retried.

    Raises:
        OSError: As ``pwritev`` raises it; ``EINVAL`` where the file system refuses this alignment,
            before or after some of the aligned bytes were written.
    """
    iov = list(iov)
    while iov:
        done = os.pwritev(direct_fd, iov, offset)
        if not done or done % DIRECT_ALIGN:  # a short write that a direct call cannot continue
            raise OSError(errno.EINVAL, f"O_DIRECT write of {sum(map(len, iov))} bytes wrote {done}")
        offset += done
        _consume(iov, done)
    pos = 0
    while pos < len(tail):
        pos += os.pwrite(fd, tail[pos:], offset + pos)


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
