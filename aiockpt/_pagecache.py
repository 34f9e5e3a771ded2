"""Which pages of a file the page cache holds, and evicting what a reader has consumed (drop-behind).

A load reads each byte of a checkpoint once. Left in the page cache, those pages crowd out what the
machine caches for other work, and every new page the read needs is one more the kernel must allocate:
on a VM whose idle memory goes back to the host (free page reporting, proactive reclaim), each such
page is first-touched again, which costs more CPU than copying it. Evicting a run once it is verified
lets the kernel reuse the same few pages for the rest of the read. Pages that were already cached when
the load began (a checkpoint just saved on this machine, or read by another process) are left there:
evicting them would only make the next reader go to the device.

Every function here blocks: call them only from worker threads.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import platform
import re
import sys
import time
from collections.abc import Iterable

from ._fs import libc_function

PAGE = mmap.PAGESIZE


def _libc_calls() -> tuple[ctypes._CFuncPtr, ...] | None:  # type: ignore[name-defined]
    if not hasattr(os, "posix_fadvise"):  # no way to evict a range (macOS, Windows)
        return None
    c_int, c_void_p, c_size_t = ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t
    mmap_ = libc_function("mmap", [c_void_p, c_size_t, c_int, c_int, c_int, ctypes.c_int64], c_void_p)
    mincore = libc_function("mincore", [c_void_p, c_size_t, c_void_p])
    munmap = libc_function("munmap", [c_void_p, c_size_t])
    if mmap_ is None or mincore is None or munmap is None:
        return None
    return mmap_, mincore, munmap


_CALLS = _libc_calls()
_MAP_FAILED = ctypes.c_void_p(-1).value
_UNCACHED = re.compile(rb"\0+")
# Pages of a residency map scanned per regex call (64 MiB of file with 4 KiB pages): each call holds the
# GIL, and a 100 GiB file's map is 26 MB. Also the stretch of file :func:`resident` counts per call.
_SCAN_PAGES = 1 << 14
# How long :func:`sweep` goes on evicting pages that in-flight readahead brings in after the reads end.
_SETTLE = 0.02

# cachestat(2) (Linux 6.5): how many pages of a file range are cached, found by walking only the pages
# the cache holds. Its number is the same on every architecture that numbers new calls uniformly.
_CACHESTAT_NR = 451 if sys.platform == "linux" and platform.machine() in {"x86_64", "aarch64"} else None


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_uint64)
        for name in ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")
    ]


def _syscall() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    return None if _CACHESTAT_NR is None else libc_function("syscall", None, ctypes.c_long)


_SYSCALL = _syscall()


def _cached_count(fd: int, start: int, length: int) -> int | None:
    """How many pages of ``fd`` in ``[start, start + length)`` the page cache holds, or ``None`` if unknown.

    ``None`` where ``cachestat`` is missing (kernels before 6.5, other platforms, a seccomp filter that
    refuses it: a failing call costs a microsecond) or refuses the file.
    """
    if _SYSCALL is None:
        return None
    stat = _Stat()
    if _SYSCALL(_CACHESTAT_NR, fd, ctypes.byref(_Range(start, length)), ctypes.byref(stat), 0) != 0:
        return None
    return int(stat.nr_cache)


def resident(fd: int, size: int) -> bytes | None:
    """One byte per page of the first ``size`` bytes of ``fd``: nonzero where the page cache holds it now.

    Maps the file without touching it and asks ``mincore``; no page is read or faulted in. ``mincore``
    looks up every page (23 ms for a cold 2 GiB file here, growing with the size), so stretches of
    :data:`_SCAN_PAGES` pages are first counted with ``cachestat``, which walks only the cached ones
    (0.01 ms for that file): only stretches that are partly cached are looked up page by page. Returns
    ``None`` where this cannot be told (no ``mincore`` or ``posix_fadvise``, or a file that refuses to be
    mapped, such as some FUSE and network file systems).
    """
    if _CALLS is None:
        return None
    if size <= 0:
        return b""
    pages = -(-size // PAGE)
    cached = _cached_count(fd, 0, size)
    if cached == 0:  # the common case of a cold checkpoint, and of one evicted before its load
        return bytes(pages)
    if cached == pages:
        return b"\1" * pages
    mmap_, mincore, munmap = _CALLS
    addr = mmap_(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr is None or addr == _MAP_FAILED:
        return None
    try:
        vec = bytearray(pages)
        buf = (ctypes.c_ubyte * pages).from_buffer(vec)
        step = _SCAN_PAGES * PAGE
        for lo in range(0, size, step):
            n = min(step, size - lo)
            count = None if cached is None else _cached_count(fd, lo, n)
            first, stop = lo // PAGE, -(-(lo + n) // PAGE)
            if count == stop - first:
                vec[first:stop] = b"\1" * (stop - first)
            elif count != 0 and mincore(addr + lo, n, ctypes.byref(buf, first)) != 0:
                return None
        del buf  # releases the export, so that ``vec`` can be converted
        return bytes(vec)
    finally:
        munmap(addr, size)


def kept(before: bytes, spans: Iterable[tuple[int, int]]) -> bytes:
    """``before`` (see :func:`resident`) with every page that overlaps a ``[start, end)`` span marked cached.

    For byte ranges a read must leave cached (mapped tensors' pages): :func:`drop_behind` and
    :func:`sweep` then treat them as pages that were cached before it began.
    """
    vec = bytearray(before)
    for start, end in spans:
        first, stop = start // PAGE, min(len(vec), -(-end // PAGE))
        if first < stop:
            vec[first:stop] = b"\1" * (stop - first)
    return bytes(vec)


def uncached(before: bytes, start: int, end: int) -> bool:
    """Whether no page overlapping ``[start, end)`` was cached, by ``before`` (see :func:`resident`)."""
    first, stop = start // PAGE, -(-end // PAGE)
    return before.count(0, first, stop) == stop - first


def drop_behind(fd: int, start: int, end: int, before: bytes | None) -> None:
    """Evict the pages of ``fd`` wholly inside ``[start, end)``, unless any of them was cached before.

    ``before`` is :func:`resident` of the file, taken before anything read it; with ``None`` (unknown),
    nothing is evicted. Only clean pages go (``POSIX_FADV_DONTNEED``); pages straddling ``start`` or
    ``end`` stay, so a neighbouring range being read is not disturbed. Eviction is a hint: a failure is
    ignored.
    """
    if before is None or end <= start or not uncached(before, start, end):
        return
    with contextlib.suppress(OSError):
        os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_DONTNEED)


def sweep(fd: int, before: bytes | None) -> None:
    """Evict every page of ``fd`` that was not cached ``before`` (see :func:`drop_behind`); for after a read.

    Readahead runs past what a reader asked for: into the range of the next reader's lane, which may have
    evicted it already, or past the last byte a load needed. One call per stretch of pages that were not
    cached before, within slices of :data:`_SCAN_PAGES` (one call per 64 MiB of a file that was cold).
    Pages whose read is still in flight are locked, and eviction passes over them: where ``cachestat``
    tells that more pages are cached than were before, the eviction is repeated a few times, a
    millisecond apart, for up to :data:`_SETTLE` seconds.
    """
    if before is None:
        return
    had = len(before) - before.count(0)
    deadline = time.monotonic() + _SETTLE
    with contextlib.suppress(OSError):
        while True:
            for lo in range(0, len(before), _SCAN_PAGES):
                for m in _UNCACHED.finditer(before, lo, lo + _SCAN_PAGES):
                    start, stop = m.span()
                    os.posix_fadvise(fd, start * PAGE, (stop - start) * PAGE, os.POSIX_FADV_DONTNEED)
            now = _cached_count(fd, 0, len(before) * PAGE)
            if now is None or now <= had or time.monotonic() >= deadline:
                return
            time.sleep(0.001)
