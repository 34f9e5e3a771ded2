"""Host memory: raw byte views of tensors and the reusable staging-buffer pool.

Byte views are built with ctypes from ``data_ptr()`` rather than through numpy, so they cost no copy and
no optional dependency. A view does not keep its tensor alive: whoever holds a view holds the tensor too.
"""

from __future__ import annotations

import ctypes
import threading

import torch

_EMPTY = memoryview(bytearray(0))


def nbytes_of(t: torch.Tensor) -> int:
    """Bytes of the tensor's elements (not of its storage)."""
    return t.numel() * t.element_size()


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable ``memoryview`` (format ``B``) of a contiguous CPU tensor's elements, without a copy.

    Raises:
        ValueError: ``t`` is not a contiguous CPU tensor.
    """
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("byte_view needs a contiguous CPU tensor")
    n = nbytes_of(t)
    if n == 0:
        return _EMPTY
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def cuda_available() -> bool:
    """Whether CUDA paths (pinned staging, device copies) can be used in this process."""
    return torch.cuda.is_available()


class StagingPool:
    """Host staging buffers reused across saves, so copies land in memory that is already touched.

    First-touch page faults make a copy into fresh memory several times slower than into reused memory,
    so a Checkpointer keeps the buffers of its last saves. Buffers are pinned when CUDA is available and
    the save copies from a GPU. Thread-safe.
    """

    def __init__(self) -> None:
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self._closed = False

    def acquire(self, nbytes: int, *, pinned: bool) -> torch.Tensor:
        """Return a uint8 buffer of at least ``nbytes``: the smallest free one that fits, or a new one."""
        with self._lock:
            fits = [b for b in self._free if b.numel() >= nbytes and b.is_pinned() == pinned]
            if fits:
                best = min(fits, key=lambda b: b.numel())
                self._free.remove(best)
                return best
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned and cuda_available())

    def release(self, buf: torch.Tensor) -> None:
        """Give ``buf`` back for reuse (dropped if the pool is closed)."""
        with self._lock:
            if not self._closed:
                self._free.append(buf)

    @property
    def held_bytes(self) -> int:
        """Bytes held by free buffers."""
        with self._lock:
            return sum(b.numel() for b in self._free)

    def close(self) -> None:
        """Drop every free buffer; buffers released later are dropped too.

        Blocking: freeing gigabytes takes a while, so call it from a worker thread.
        """
        with self._lock:
            self._closed = True
            free, self._free = self._free, []
        free.clear()
