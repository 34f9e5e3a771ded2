"""Host memory: raw byte views of tensors and the reusable staging-buffer pool.

Byte views are built with ctypes from ``data_ptr()`` rather than through numpy, so they cost no copy and
no optional dependency. A view does not keep its tensor alive: whoever holds a view holds the tensor too.
"""

from __future__ import annotations

import ctypes
import threading

import anyio
import torch

from ._errors import BusyError

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
    the save copies from a GPU.

    With a ``budget``, the bytes of buffers in use plus those kept for reuse never exceed it: a save
    reserves its staging bytes first (:meth:`reserve`, on the event loop; it waits for, or refuses, what
    does not fit), and :meth:`acquire` drops kept buffers before allocating past the budget.
    ``acquire``/``release``/``close`` are thread-safe and blocking; ``reserve``/``unreserve`` belong to the
    event loop.

    Args:
        budget: Most bytes of staging memory held at once (``None``: no limit).
        wait: Whether a reservation that does not fit now waits for memory to be given back
            (otherwise it raises :class:`BusyError`).
    """

    def __init__(self, budget: int | None = None, *, wait: bool = True) -> None:
        self.budget = budget
        self.wait = wait
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self._closed = False
        self._reserved = 0
        self._changed: anyio.Event | None = None

    async def reserve(self, nbytes: int) -> None:
        """Reserve ``nbytes`` of the budget for a save (no-op without a budget).

        Raises:
            BusyError: ``nbytes`` exceeds the whole budget, or does not fit now and ``wait`` is false.
        """
        if self.budget is None or nbytes == 0:
            return
        if nbytes > self.budget:
            raise BusyError(
                f"this save stages {nbytes:,} bytes, more than the whole staging budget of {self.budget:,}"
            )
        while self._reserved + nbytes > self.budget:
            if not self.wait:
                raise BusyError(
                    f"the staging budget of {self.budget:,} bytes is in use by other saves "
                    f"({self._reserved:,} reserved; this save needs {nbytes:,})"
                )
            if self._changed is None:
                self._changed = anyio.Event()
            await self._changed.wait()
        self._reserved += nbytes

    def unreserve(self, nbytes: int) -> None:
        """Give back a reservation (on the event loop); wakes saves waiting for budget."""
        if self.budget is None or nbytes == 0:
            return
        self._reserved -= nbytes
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def acquire(self, nbytes: int, *, pinned: bool) -> torch.Tensor:
        """Return a uint8 buffer of at least ``nbytes``: the smallest kept one that fits, or a new one."""
        drop: list[torch.Tensor] = []
        with self._lock:
            fits = [b for b in self._free if b.numel() >= nbytes and b.is_pinned() == pinned]
            if fits:
                best = min(fits, key=lambda b: b.numel())
                self._free.remove(best)
                return best
            if self.budget is not None:
                # The reservation guarantees the buffers in use fit with this one; kept ones may not.
                kept = sum(b.numel() for b in self._free)
                while self._free and self._reserved + kept > self.budget:
                    victim = max(self._free, key=lambda b: b.numel())
                    self._free.remove(victim)
                    kept -= victim.numel()
                    drop.append(victim)
        drop.clear()  # freed here, in the calling (worker) thread
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned and cuda_available())

    def release(self, buf: torch.Tensor) -> None:
        """Give ``buf`` back for reuse (dropped if the pool is closed)."""
        with self._lock:
            if not self._closed:
                self._free.append(buf)

    @property
    def held_bytes(self) -> int:
        """Bytes held by buffers kept for reuse."""
        with self._lock:
            return sum(b.numel() for b in self._free)

    def close(self) -> None:
        """Drop every kept buffer; buffers released later are dropped too.

        Blocking: freeing gigabytes takes a while, so call it from a worker thread.
        """
        with self._lock:
            self._closed = True
            free, self._free = self._free, []
        free.clear()
