"""Anonymous memory that devices move bytes into and out of: direct-I/O bounce buffers, pinned staging.

Both kinds are made the same way (:func:`touched_mapping`): a private mapping, advised through ``ctypes``
and touched by the thread that makes it, so that the kernel never has to fault its pages in on behalf
of a device transfer. A transfer into pages never touched (an ``O_DIRECT`` read, ``cudaHostRegister``
locking them) faults them in inside ``get_user_pages``, which holds the process's ``mmap_lock`` all the
while: on a VM that hands idle memory back to its host, with huge pages to assemble, for tens of ms, and
any ``mmap`` or ``mprotect`` by another thread (the event loop's thread starting a worker thread) waits
for it. A plain page fault locks only the faulting mapping.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from typing import TypeVar

from ._fs import libc_function
from ._runs import address_of

# madvise(2) through ctypes, which lets go of the GIL during the call: ``mmap.madvise`` holds it, also
# while the call waits for ``mmap_lock``.
MADVISE = None
if os.name == "posix":
    MADVISE = libc_function("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int])

# A transparent huge page on x86-64 (and arm64 with 4 KiB pages): the unit :func:`touched_mapping` aligns to.
HUGE_PAGE = 2 << 20

M = TypeVar("M", bound=mmap.mmap)


def private_mappings() -> bool:
    """Whether private anonymous mappings can be made here (not on Windows)."""
    return hasattr(mmap, "MAP_PRIVATE")


def touched_mapping(nbytes: int, kind: type[M]) -> tuple[M, int]:
    """A private anonymous mapping of type ``kind`` holding ``nbytes`` (> 0) from a 2 MiB boundary.

    Returns the mapping and the offset in it where those bytes begin. Advised ``MADV_HUGEPAGE``: where
    the kernel backs them with transparent huge pages they are physically contiguous per 2 MiB, and a
    device request carries them in few, large segments (from scattered 4 KiB pages at most the queue's
    ``max_segments`` pages, 1 MiB here; see ``_memory.direct_buffer`` for what that cost). Not inherited
    by a forked child (``MADV_DONTFORK``), which would otherwise share pages a device writes into, or
    copy them. Every page is touched here, by the calling thread, with the GIL let go of (see the
    module's docstring for why). Where an advice is missing, or huge pages are never given, ordinary
    pages serve.

    Needs :func:`private_mappings`; blocking (touching gigabytes takes a while): call it in a worker
    thread.
    """
    raw = kind(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE)
    view = memoryview(raw)
    base = address_of(view)
    view.release()  # the mapping stays where it is; a live export would keep it from being closed
    skip = -base % HUGE_PAGE  # a multiple of the page size: mappings start at a page
    if hasattr(mmap, "MADV_DONTFORK"):
        _advise(raw, base, 0, nbytes + HUGE_PAGE, mmap.MADV_DONTFORK)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        _advise(raw, base, skip, nbytes, mmap.MADV_HUGEPAGE)
    ctypes.memset(base + skip, 0, nbytes)  # (a foreign call: the GIL is let go of)
    return raw, skip


def _advise(raw: mmap.mmap, base: int, start: int, length: int, advice: int) -> None:
    """``madvise`` of ``length`` bytes from ``start`` in ``raw`` (mapped at ``base``), without the GIL."""
    if MADVISE is None:
        raw.madvise(advice, start, length)
    elif MADVISE(base + start, length, advice) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
