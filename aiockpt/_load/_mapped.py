"""Fresh tensors backed by private mappings of the data files, for ``aiockpt.read`` (``IOConfig.map_reads``).

A fresh read into new memory makes the machine provide every byte twice: a page of the page cache, which the
kernel fills from the device, and a page of the new tensor, which the copy then first-touches. On a VM whose
idle memory goes back to its host, that first touch costs more than the copy itself (cold fresh reads of 2 GiB
into new memory took 1.02-1.07 s at best, 1.08-1.20 s median, against 0.58-0.61 s and 0.65-1.36 s mapped; see
docs/benchmarks.md). A large tensor held whole by one chunk is therefore made a view of a copy-on-write
(``MAP_PRIVATE``) mapping of its data file: its pages are the page cache's, populated and verified by the read
stage like any other run, and writing to the tensor copies the page written, never the file.

What the mapping costs its user: the tensor's pages are page-cache pages, which the kernel may evict
under memory pressure and read again from the file when next touched (the file is never changed once a
checkpoint is committed, and deleting it keeps a mapped file's bytes readable until the last tensor goes);
a tensor whose storage is a mapping must not be resized in place (grown within the mapping, it overlaps
the next tensor). ``IOConfig(map_reads=False)`` gives every
fresh tensor memory of its own instead.

Every function here blocks: call them only from worker threads.
"""

from __future__ import annotations

import ctypes
import errno
import math
import mmap
import os
import stat
import sys
from pathlib import Path
from typing import cast

import torch

from .._format import TensorEntry
from .._memory import contiguous_strides
from .._pages import MADVISE
from .._runs import address_of

# Tensors smaller than this are read into shared slabs (see ``_match._Slabs``): mapping each of them
# would cost a page, or more, per tensor.
MIN_BYTES = 64 << 10
# madvise(2) advice (Linux 5.14): fault every page of a range in, reading what the page cache lacks.
_MADV_POPULATE_READ = 22
_MADVISE = MADVISE if sys.platform == "linux" else None

# Set once the kernel has refused MADV_POPULATE_READ (before 5.14): the checksum pass then faults pages in.
_populate_refused = False


def populate(start: memoryview, nbytes: int) -> bool:
    """Fault in the ``nbytes`` of mapped memory that begin where ``start`` does, reading what the cache lacks.

    One call reads the range with the kernel's readahead, where touching it page by page (as the
    checksum pass otherwise does) takes a fault per page. Without ``MADV_POPULATE_READ`` it does nothing.

    Returns:
        ``False`` where the kernel found pages that touching would kill the process for (``SIGBUS``: the
        file was cut short after it was mapped, or cannot be read); ``True`` otherwise, also where
        nothing could be populated.
    """
    global _populate_refused  # a process-wide fact about the kernel, found once
    if _MADVISE is None or _populate_refused or nbytes <= 0 or not len(start):
        return True
    address = address_of(start)
    page = mmap.PAGESIZE
    first = address - address % page
    if _MADVISE(first, address + nbytes - first, _MADV_POPULATE_READ) == 0:
        return True
    err = ctypes.get_errno()
    if err == errno.EINVAL:  # a kernel that lacks the advice
        _populate_refused = True
    return err != errno.EFAULT


class Mapper:
    """Makes fresh tensors that are views of ``MAP_PRIVATE`` mappings of ``directory``'s data files.

    One mapping per data file, made when a tensor of it is first asked for and shared by all of them.
    The file's size is taken when it is mapped, and only tensors that lie wholly inside it are mapped: a
    truncated file leaves its missing tensors to the read stage, which reports them, and never maps bytes
    past the end of a file (touching them would kill the process with ``SIGBUS``).
    """

    def __init__(self, directory: Path) -> None:
        self._directory = directory
        # Per data file, its mapping, or ``None`` if it cannot be mapped (missing, empty, no regular file,
        # refused).
        self._storages: dict[str, torch.UntypedStorage | None] = {}

    def tensor(self, entry: TensorEntry, dtype: torch.dtype) -> torch.Tensor | None:
        """``entry``'s tensor as a view of its data file's mapping, or ``None`` where it cannot be one.

        Only a tensor of at least :data:`MIN_BYTES` held whole by a single chunk at an offset its element
        size divides is mapped; others are read into memory of their own.
        """
        if len(entry.chunks) != 1:
            return None
        chunk = entry.chunks[0]
        size = dtype.itemsize
        if chunk.sizes != entry.shape or any(chunk.offsets) or chunk.offset % size:
            return None
        if chunk.nbytes < MIN_BYTES or chunk.nbytes != math.prod(entry.shape) * size:
            return None
        storage = self._storage(chunk.file)
        if storage is None or chunk.offset + chunk.nbytes > storage.nbytes():
            return None
        strides = contiguous_strides(entry.shape)
        return torch.empty(0, dtype=dtype).set_(storage, chunk.offset // size, entry.shape, strides)

    def _storage(self, name: str) -> torch.UntypedStorage | None:
        if name in self._storages:
            return self._storages[name]
        storage: torch.UntypedStorage | None = None
        path = self._directory / name
        try:
            found = os.stat(path)
            nbytes = found.st_size if stat.S_ISREG(found.st_mode) else 0
            if nbytes:
                # shared=False: a private (copy-on-write) mapping; the file's descriptor is closed.
                made = torch.UntypedStorage.from_file(str(path), shared=False, nbytes=nbytes)
                storage = cast("torch.UntypedStorage", made)
        except (OSError, RuntimeError):
            storage = None  # the read stage opens the file itself, and reports what is wrong with it
        self._storages[name] = storage
        return storage
