"""The machine's own limits for moving a state's bytes: memcpy, fsync'd write and cold read.

The write and read use plain ``os.pwrite``/``os.preadv`` at disjoint offsets of one file, in large chunks,
from and into the tensors' own memory: no serialization and no extra copies, which is as fast as Python
can move these bytes through the page cache on this machine. A checkpoint library is judged against them.
The write is also measured with the device's writeback started after every chunk (``sync_file_range``),
which keeps the device busy while later chunks are copied into the page cache, and with ``O_DIRECT`` from
a copy of the state on transparent huge pages (made beforehand, untimed), which copies nothing into the
page cache: the limit for a writer that owns aligned memory, as aiockpt's staged saves and bounce buffers
are. The read is also measured with ``O_DIRECT`` into that copy: the device's own read speed, with no
page cache in the way (aiockpt's loads read cold files so, through bounce buffers). Huge pages because
the device moves physically contiguous memory faster (each request carries at most its queue's
``max_segments`` ranges of memory): 2 GiB took 0.45-0.47 s from one, 0.53-0.58 s from the same copy on
shared 4 KiB pages, Python's default for anonymous memory.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import torch

from benchmarks._fs import drop_cache, fsync_path, start_writeback

CHUNK = 16 * 1024 * 1024
PAGE = 4096
HUGE_PAGE = 2 << 20  # a transparent huge page (x86-64, arm64 with 4 KiB pages)
_O_DIRECT = getattr(os, "O_DIRECT", 0)

Chunk = tuple[int, memoryview]


def memcpy(src: dict[str, torch.Tensor], dst: dict[str, torch.Tensor]) -> float:
    """Copy every tensor of ``src`` into the matching, already allocated tensor of ``dst``.

    Returns:
        Elapsed seconds.
    """
    start = time.perf_counter()
    for key, t in src.items():
        dst[key].copy_(t)
    return time.perf_counter() - start


def _chunks(views: list[memoryview]) -> list[Chunk]:
    """Lay ``views`` end to end in one file; cut them into ``(file offset, buffer)`` pieces of <= CHUNK."""
    out: list[Chunk] = []
    offset = 0
    for view in views:
        for i in range(0, len(view), CHUNK):
            piece = view[i : i + CHUNK]
            out.append((offset + i, piece))
        offset += len(view)
    return out


def _split(chunks: list[Chunk], parts: int) -> list[list[Chunk]]:
    """Split ``chunks`` into ``parts`` contiguous runs of about equal bytes (one per thread)."""
    total = sum(len(c) for _, c in chunks)
    out: list[list[Chunk]] = [[] for _ in range(parts)]
    done = 0
    for chunk in chunks:
        out[min(done * parts // max(total, 1), parts - 1)].append(chunk)
        done += len(chunk[1])
    return out


def _pwrite_all(fd: int, chunks: list[Chunk], early: bool = False) -> None:
    for offset, buf in chunks:
        pos, rest = offset, buf
        while rest:
            n = os.pwrite(fd, rest, pos)
            pos, rest = pos + n, rest[n:]
        if early:
            start_writeback(fd, offset, len(buf))


def _preadv_all(fd: int, chunks: list[Chunk]) -> None:
    for offset, buf in chunks:
        pos, rest = offset, buf
        while rest:
            n = os.preadv(fd, [rest], pos)
            if n == 0:
                raise EOFError(f"short read at offset {pos}")
            pos, rest = pos + n, rest[n:]


def _run_parts(fn_parts: list[list[Chunk]], fd: int, fn: Callable[[int, list[Chunk]], None]) -> None:
    if len(fn_parts) == 1:
        fn(fd, fn_parts[0])
        return
    with ThreadPoolExecutor(len(fn_parts)) as pool:
        for fut in [pool.submit(fn, fd, part) for part in fn_parts]:
            fut.result()


def fsync_write(path: Path, views: list[memoryview], threads: int, *, early: bool = False) -> float:
    """Write ``views`` back to back into a new file with ``threads`` writers, then fsync it and its directory.

    Args:
        path: File to create (replaced if it exists).
        views: The bytes to write, e.g. from :func:`benchmarks._state.byte_views`.
        threads: Number of writer threads, each taking one contiguous byte range.
        early: Start the device's writeback of each chunk as soon as it is written.

    Returns:
        Elapsed seconds, from open to the directory fsync.
    """
    parts = _split(_chunks(views), threads)
    path.unlink(missing_ok=True)
    fsync_path(path.parent)
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _run_parts(parts, fd, partial(_pwrite_all, early=early))
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_path(path.parent)
    return time.perf_counter() - start


class Aligned:
    """A copy of some buffers, back to back, on transparent huge pages where the kernel gives them.

    A private anonymous mapping whose copy starts at a 2 MiB boundary, advised ``MADV_HUGEPAGE`` (where
    huge pages are not given, ordinary pages serve; where private mappings are missing, a shared one).
    """

    def __init__(self, views: list[memoryview]) -> None:
        self.nbytes = sum(len(v) for v in views)
        size = -(-max(self.nbytes, 1) // PAGE) * PAGE
        if hasattr(mmap, "MAP_PRIVATE"):
            self._map = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE)
            whole = memoryview(self._map)
            skip = -ctypes.addressof(ctypes.c_char.from_buffer(whole)) % HUGE_PAGE
            if hasattr(mmap, "MADV_HUGEPAGE"):
                self._map.madvise(mmap.MADV_HUGEPAGE, skip, size)
            self.view = whole[skip : skip + size]
            whole.release()
        else:
            self._map = mmap.mmap(-1, size)
            self.view = memoryview(self._map)
        pos = 0
        for v in views:
            self.view[pos : pos + len(v)] = v
            pos += len(v)

    def close(self) -> None:
        """Unmap the copy."""
        self.view.release()
        self._map.close()


def direct_supported(directory: Path) -> bool:
    """Whether files in ``directory`` can be opened for writing with ``O_DIRECT``."""
    if not _O_DIRECT:
        return False
    probe = directory / ".o_direct_probe"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | _O_DIRECT, 0o644))
    except OSError:
        return False
    finally:
        probe.unlink(missing_ok=True)
    return True


def direct_write(path: Path, source: Aligned, threads: int) -> float:
    """Write ``source`` into a new file with ``O_DIRECT`` and ``threads`` writers; fsync it and its directory.

    The last page is written whole (zero-padded) and the file cut to size after.

    Returns:
        Elapsed seconds, from open to the directory fsync.
    """
    padded = -(-source.nbytes // PAGE) * PAGE
    parts = _split(_chunks([source.view[:padded]]), threads)
    path.unlink(missing_ok=True)
    fsync_path(path.parent)
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _O_DIRECT, 0o644)
    try:
        _run_parts(parts, fd, _pwrite_all)
        if padded != source.nbytes:
            os.ftruncate(fd, source.nbytes)
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_path(path.parent)
    return time.perf_counter() - start


def _pread_direct_all(fd: int, chunks: list[Chunk]) -> None:
    for offset, buf in chunks:
        pos, rest = offset, buf
        while rest:
            n = os.preadv(fd, [rest], pos)
            if n == 0 or n % PAGE:  # the end of the file (its last page is short)
                break
            pos, rest = pos + n, rest[n:]


def direct_read(path: Path, dest: Aligned, threads: int) -> float:
    """Read ``path`` (as :func:`fsync_write` wrote it) into ``dest`` with ``O_DIRECT``, ``threads`` readers.

    ``dest`` holds the same bytes already (a copy of the same state): its contents do not change. The file
    is evicted first, like :func:`cold_read`'s (a direct read does not use cached pages anyway).

    Returns:
        Elapsed seconds of the read.
    """
    padded = -(-dest.nbytes // PAGE) * PAGE
    parts = _split(_chunks([dest.view[:padded]]), threads)
    drop_cache(path)
    start = time.perf_counter()
    fd = os.open(path, os.O_RDONLY | _O_DIRECT)
    try:
        _run_parts(parts, fd, _pread_direct_all)
    finally:
        os.close(fd)
    return time.perf_counter() - start


def cold_read(path: Path, views: list[memoryview], threads: int) -> float:
    """Evict ``path`` from the page cache, then read it into ``views`` with ``threads`` readers.

    Args:
        path: A file written by :func:`fsync_write` from buffers of the same sizes.
        views: Preallocated, already touched destination buffers.
        threads: Number of reader threads, each taking one contiguous byte range.

    Returns:
        Elapsed seconds of the read (the eviction is not timed).
    """
    parts = _split(_chunks(views), threads)
    drop_cache(path)
    start = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        _run_parts(parts, fd, _preadv_all)
    finally:
        os.close(fd)
    return time.perf_counter() - start
