"""Host memory: raw byte views of tensors and the reusable staging-buffer pool.

Byte views are built with ctypes from ``data_ptr()`` rather than through numpy, so they cost no copy and
no optional dependency. A view does not keep its tensor alive: whoever holds a view holds the tensor too.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import threading
from dataclasses import dataclass, field
from typing import cast

import anyio
import torch

from ._cuda import pinned_empty
from ._errors import BusyError
from ._pages import private_mappings, touched_mapping
from ._runs import DIRECT_ALIGN, RUN_BYTES

_EMPTY = memoryview(bytearray(0))


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides, in elements, of a contiguous tensor of ``shape``."""
    strides = [1] * len(shape)
    for i in range(len(shape) - 1, 0, -1):
        strides[i - 1] = strides[i] * shape[i]
    return tuple(strides)


def nbytes_of(t: torch.Tensor) -> int:
    """Bytes of the tensor's elements (not of its storage)."""
    return t.nbytes


def filling() -> contextlib.AbstractContextManager[None]:
    """The mode a load's copies into its targets run in: inference mode, in the thread that copies.

    Outside autograd, as ``load_state_dict`` copies: a target may be a leaf that requires grad (an
    ``nn.Parameter``), which refuses an in-place copy that autograd would record. Inference mode rather
    than ``no_grad``: a tensor made under ``torch.inference_mode()`` (an actor's serving weights, say)
    refuses every in-place write outside it, while a normal tensor takes one in it as under ``no_grad``
    (its version counter still counts the write). Tensors made in the block are inference tensors: only
    the copies go in it, never code whose tensors reach the caller. The mode is per thread.
    """
    return cast("contextlib.AbstractContextManager[None]", torch.inference_mode())


def plain_cpu(t: torch.Tensor) -> bool:
    """Whether ``t``'s memory holds its values as they read, so that its bytes can be used directly.

    That is a contiguous CPU tensor that is not a lazy conjugate or negative view (whose bytes would be
    written, or overwritten, un-applied).
    """
    return t.is_cpu and t.is_contiguous() and not t.is_conj() and not t.is_neg()


# ctypes array types by length, for the views below: ``c_char * n`` looks its type up in a cache of its
# own, keyed by a tuple built per call.
_ARRAYS: dict[int, type[ctypes.Array[ctypes.c_char]]] = {}


def _view(t: torch.Tensor) -> memoryview:
    return view_at(t.data_ptr(), t.nbytes)


def view_at(address: int, n: int) -> memoryview:
    """A writable ``memoryview`` (format ``B``) of the ``n`` bytes at ``address``, which must stay alive."""
    if n == 0:
        return _EMPTY
    array = _ARRAYS.get(n)
    if array is None:
        array = _ARRAYS[n] = ctypes.c_char * n
    return memoryview(array.from_address(address)).cast("B")


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable ``memoryview`` (format ``B``) of a contiguous CPU tensor's elements, without a copy.

    Raises:
        ValueError: ``t`` is not a contiguous CPU tensor.
    """
    if not t.is_cpu or not t.is_contiguous():
        raise ValueError("byte_view needs a contiguous CPU tensor")
    return _view(t)


def plain_view(t: torch.Tensor) -> memoryview | None:
    """``byte_view(t)`` where :func:`plain_cpu` holds, else ``None`` (one check, made per tensor of 10^4)."""
    return _view(t) if plain_cpu(t) else None


# Staging buffers start at a multiple of this (and lay out large tensors at multiples of it), so that their
# bytes can be written with O_DIRECT.
PAGE = DIRECT_ALIGN


def page_aligned(raw: torch.Tensor, nbytes: int) -> torch.Tensor:
    """The ``nbytes`` of the byte tensor ``raw`` (``nbytes + PAGE`` long) that start at a page boundary."""
    skip = -raw.data_ptr() % PAGE
    return raw[skip : skip + nbytes]


def direct_buffer(nbytes: int) -> tuple[mmap.mmap, memoryview]:
    """``nbytes`` (> 0) of page-aligned anonymous memory for ``O_DIRECT`` transfers, and its mapping.

    A :func:`~aiockpt._pages.touched_mapping`: private, touched, not inherited by a forked child, and
    2 MiB-aligned and advised ``MADV_HUGEPAGE``, so that a direct write moves it in few, large segments.
    From memory of scattered 4 KiB pages each device request carries at most its queue's ``max_segments``
    pages (254 here, 1 MiB): 2 GiB written with ``O_DIRECT`` from 3 bounce buffers of 8 MiB took
    0.95-1.04 s from private 4 KiB pages, 0.62-0.75 s from shared ones (Python's default for anonymous
    memory), 0.51-0.63 s from huge pages, against 0.49-0.53 s from a single 2 GiB copy (same rounds).
    Touched because a direct read into untouched pages faulted them in under ``mmap_lock``: the first
    2 GiB load of a new process so had loop wakes 13-40 ms late in 4 of 5 runs (seen in ``/proc``: the
    loop's thread blocked in ``mmap`` and ``mprotect`` while a reader was in a direct read); with the
    pages touched, none over 4 ms in 5. The view must be released before the mapping is closed.
    """
    if not private_mappings():  # Windows
        raw = mmap.mmap(-1, nbytes)
        return raw, memoryview(raw)
    raw, skip = touched_mapping(nbytes, mmap.mmap)
    return raw, memoryview(raw)[skip : skip + nbytes]


class BouncePool:
    """Bounce buffers for direct I/O (:func:`direct_buffer`, ``size`` bytes each), kept between uses.

    A save's first copies into new huge pages ran at 0.1-0.4 GB/s in the benchmark suite once other
    libraries had churned memory (the kernel compacting it for them), against 5-9 GB/s into pages
    already touched: up to 0.24 s of a 0.55 s write. Up to ``keep`` buffers given back are kept for the
    next save (``keep * size`` bytes held by the process from its first direct write on); larger ones,
    and those beyond ``keep``, are unmapped. Thread-safe.
    """

    def __init__(self, size: int, keep: int) -> None:
        self.size = size
        self.keep = keep
        self._free: list[tuple[mmap.mmap, memoryview]] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> tuple[mmap.mmap, memoryview]:
        """A buffer of at least ``nbytes``: a kept one where it fits, else a new one. Blocking."""
        if nbytes <= self.size:
            with self._lock:
                if self._free:
                    return self._free.pop()
            return direct_buffer(self.size)
        return direct_buffer(nbytes)

    def give(self, buffer: tuple[mmap.mmap, memoryview]) -> None:
        """Take ``buffer`` back (from :meth:`take`); it must no longer be in use. Blocking."""
        with self._lock:
            if len(buffer[1]) == self.size and len(self._free) < self.keep:
                self._free.append(buffer)
                return
        _unmap(buffer)

    def clear(self) -> None:
        """Unmap the kept buffers. Blocking."""
        with self._lock:
            kept, self._free = self._free, []
        for buffer in kept:
            _unmap(buffer)

    def forget(self) -> None:
        """In a forked child: drop the kept buffers, which ``MADV_DONTFORK`` left out of its memory.

        Handing one out there would be handing out addresses that nothing is mapped at. The lock is
        made anew too: another thread of the parent may have held it at the fork.
        """
        self._lock = threading.Lock()
        self._free = []  # unmapping ranges that are not mapped is harmless


# The bounce buffers of direct writes and direct reads: one run each (``RUN_BYTES``, widened to page
# alignment at both ends, as a direct read of a run at an unaligned offset is; a run of one larger block
# gets one of its own, not kept). Kept: as many as a save's two writers and its preparer, or a load's two
# readers and its finisher, use at once, and one more.
BOUNCE = BouncePool(RUN_BYTES + 2 * DIRECT_ALIGN, keep=4)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=BOUNCE.forget)


class BounceSlots:
    """At most ``slots`` buffers of :data:`BOUNCE`, each ``nbytes`` long or more, for one file's direct I/O.

    The buffers taken are reused by their user until :meth:`close` gives them all back to the pool. Not
    thread-safe: users call it under a lock of their own, on whose condition they wait for a buffer.
    """

    def __init__(self, nbytes: int, slots: int) -> None:
        self._nbytes = nbytes
        self._slots = max(1, slots)
        self._taken: list[tuple[mmap.mmap, memoryview]] = []
        self._free: list[memoryview] = []

    def take(self) -> memoryview | None:
        """A buffer given back, else a new one while fewer than ``slots`` are taken, else ``None``."""
        if self._free:
            return self._free.pop()
        if len(self._taken) >= self._slots:
            return None
        self._taken.append(BOUNCE.take(self._nbytes))
        return self._taken[-1][1]

    def give(self, view: memoryview) -> None:
        """Take back a buffer from :meth:`take`, for the next :meth:`take`."""
        self._free.append(view)

    def close(self) -> None:
        """Give every buffer back to :data:`BOUNCE`; none may be in use any more. Blocking."""
        self._free.clear()
        taken, self._taken = self._taken, []
        for buffer in taken:
            BOUNCE.give(buffer)


def _unmap(buffer: tuple[mmap.mmap, memoryview]) -> None:
    raw, view = buffer
    view.release()
    with contextlib.suppress(BufferError):  # a slice still held (by a traceback): unmapped when freed
        raw.close()


class PinnedKeeper:
    """Pinned staging buffers of one-shot saves, kept for the process's next one-shot save. Thread-safe.

    A one-shot :func:`aiockpt.save` of GPU tensors stages them in page-locked memory. torch's caching
    pinned allocator, which served them before, rounds each block up to a power of two and keeps it for
    the process; on an H100 machine its first block for 2.1 GiB took 1.99 s to make, and an ``mmap`` on
    the event loop's thread (what starting a worker thread does) waited 1.88 s of it (the driver holds
    the process's ``mmap_lock`` meanwhile). :func:`pinned_empty` made the same in 0.43-0.74 s with such
    waits of about 1 ms, and holds exactly the bytes asked. The last ``keep`` buffers given back are
    kept, each for a later save of exactly its size (as a state saved again is); older ones are unlocked
    and freed.
    """

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self._kept: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self._orphans: list[torch.Tensor] = []

    def take(self, nbytes: int) -> torch.Tensor:
        """A kept buffer of exactly ``nbytes``, else a new one. Blocking: call it in a worker thread."""
        with self._lock:
            for i, buf in enumerate(self._kept):
                if buf.numel() == nbytes:
                    return self._kept.pop(i)
        return pinned_empty(nbytes)

    def give(self, buf: torch.Tensor) -> None:
        """Keep ``buf`` (from :meth:`take`, no longer in use); free the oldest beyond ``keep``. Blocking."""
        with self._lock:
            self._kept.append(buf)
            dropped = self._kept[: max(0, len(self._kept) - self.keep)]
            del self._kept[: len(dropped)]
        dropped.clear()  # unlocked and unmapped here, outside the lock

    @property
    def held_bytes(self) -> int:
        """Bytes of the buffers kept."""
        with self._lock:
            return sum(b.numel() for b in self._kept)

    def forget(self) -> None:
        """In a forked child: hand none of the kept buffers out (``MADV_DONTFORK`` left them unmapped).

        They are not freed either: that would unregister them with CUDA, which a forked child cannot
        use. The lock is made anew: another thread of the parent may have held it at the fork.
        """
        self._lock = threading.Lock()
        self._orphans.extend(self._kept)
        self._kept = []


# One-shot saves' pinned staging buffers (see PinnedKeeper): two kept, for a state saved again and, say,
# a second state saved beside it.
ONE_SHOT_PINNED = PinnedKeeper(keep=2)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=ONE_SHOT_PINNED.forget)


def cuda_available() -> bool:
    """Whether CUDA paths (pinned staging, device copies) can be used in this process."""
    return torch.cuda.is_available()


@dataclass
class Claim:
    """Staging memory granted to one save: a kept buffer to reuse, or room to allocate ``nbytes``."""

    nbytes: int
    pinned: bool
    buffer: torch.Tensor | None = None
    evicted: list[torch.Tensor] = field(default_factory=list)
    taken: bool = False


class StagingPool:
    """Host staging buffers reused across saves, so copies land in memory that is already touched.

    First-touch page faults make a copy into fresh memory several times slower than into reused memory,
    so a Checkpointer keeps the buffers of its last saves. Buffers are pinned when CUDA is available and
    the save copies from a GPU.

    With a ``budget``, the real sizes of buffers handed out plus those kept for reuse never exceed it. A
    save first :meth:`claim`s memory on the event loop (reusing the smallest kept buffer that fits, or
    making room by dropping kept ones); a claim that cannot be granted waits for buffers to come back, or
    raises :class:`BusyError` when ``wait`` is false. :meth:`take` (in a worker thread) turns the claim into
    a buffer; :meth:`release` (in a worker thread) gives it back, then :meth:`notify` (on the loop) wakes
    the saves waiting for memory. Accounting is guarded by a lock; buffers are always freed in threads.

    Args:
        budget: Most bytes of staging memory held at once (``None``: no limit).
        wait: Whether a claim that does not fit now waits (otherwise it raises :class:`BusyError`).
        own_pinned: Pinned buffers are page-locked memory of the pool's own, exactly as large as claimed
            and unlocked once dropped (``_cuda.pinned_empty``): for a long-lived pool, which reuses its
            buffers and whose budget must be the memory really held.
        pinned_from: Otherwise, pinned buffers are taken from this keeper and given back to it when the
            pool is closed: for a pool per one-shot save, which would otherwise make its buffer anew
            every time (0.43-0.74 s for 2.1 GiB on an H100 machine). Without either, torch's caching
            pinned allocator serves them.
    """

    def __init__(
        self,
        budget: int | None = None,
        *,
        wait: bool = True,
        own_pinned: bool = False,
        pinned_from: PinnedKeeper | None = None,
    ) -> None:
        self.budget = budget
        self.wait = wait
        self.own_pinned = own_pinned
        self.pinned_from = pinned_from
        self._lent: list[torch.Tensor] = []  # the buffers ``pinned_from`` lent, given back on close
        self._free: list[torch.Tensor] = []
        self._in_use = 0
        self._lock = threading.Lock()
        self._closed = False
        self._changed: anyio.Event | None = None

    async def claim(self, nbytes: int, *, pinned: bool) -> Claim:
        """Claim ``nbytes`` of staging memory for one save (on the event loop).

        Raises:
            BusyError: ``nbytes`` exceeds the whole budget, or does not fit now and ``wait`` is false.
        """
        if self.budget is not None and nbytes > self.budget:
            raise BusyError(
                f"this save stages {nbytes:,} bytes, more than the whole staging budget of {self.budget:,}"
            )
        while True:
            claim = self._try_claim(nbytes, pinned)
            if claim is not None:
                return claim
            if not self.wait:
                raise BusyError(
                    f"the staging budget of {self.budget:,} bytes is in use by other saves "
                    f"({self._in_use:,} bytes); this save needs {nbytes:,}"
                )
            if self._changed is None:
                self._changed = anyio.Event()
            await self._changed.wait()

    def _try_claim(self, nbytes: int, pinned: bool) -> Claim | None:
        with self._lock:
            if nbytes == 0:
                return Claim(0, pinned, taken=False)
            fits = [b for b in self._free if b.numel() >= nbytes and b.is_pinned() == pinned]
            if fits:  # reuse: the buffer moves from kept to in use, the total is unchanged
                best = min(fits, key=lambda b: b.numel())
                self._free = [b for b in self._free if b is not best]
                self._in_use += best.numel()
                return Claim(nbytes, pinned, buffer=best)
            if self.budget is not None and self._in_use + nbytes > self.budget:
                return None
            # A kept buffer too small for this claim is dropped: the state it served has grown past it (or
            # a larger one is saved now, which can reuse the new buffer later). Kept otherwise, a state that
            # grows a little every save kept one more buffer each time, without a budget without end.
            evicted = [b for b in self._free if b.numel() < nbytes and b.is_pinned() == pinned]
            if evicted:
                self._free = [b for b in self._free if not any(b is e for e in evicted)]
            if self.budget is not None:
                kept = sum(b.numel() for b in self._free)
                while self._free and self._in_use + kept + nbytes > self.budget:
                    victim = max(self._free, key=lambda b: b.numel())
                    self._free = [b for b in self._free if b is not victim]
                    kept -= victim.numel()
                    evicted.append(victim)
            self._in_use += nbytes
            return Claim(nbytes, pinned, evicted=evicted)

    def take(self, claim: Claim) -> torch.Tensor:
        """The buffer of ``claim``: the reused one, or a new one (blocking: call it in a worker thread)."""
        claim.taken = True
        claim.evicted.clear()  # dropped buffers are freed here, off the event loop
        if claim.buffer is not None:
            buf, claim.buffer = claim.buffer, None
            return buf
        pinned = claim.pinned and cuda_available()
        if pinned and self.own_pinned:
            return pinned_empty(claim.nbytes)  # page-aligned: a mapping of its own
        if pinned and self.pinned_from is not None:
            buf = self.pinned_from.take(claim.nbytes)  # page-aligned too
            with self._lock:
                self._lent.append(buf)
            return buf
        raw = torch.empty(claim.nbytes + PAGE, dtype=torch.uint8, pin_memory=pinned)
        return page_aligned(raw, claim.nbytes)

    def forget(self, claim: Claim) -> list[torch.Tensor]:
        """Undo a claim that was never taken (its save ended first); return the buffers to free.

        The buffer it would have reused goes back to the kept ones (unless the pool is closed). The
        buffers it evicted to make room are returned to be dropped, with that one once the pool is
        closed (the budget counts neither any more): the caller drops them in a worker thread, since
        freeing a buffer can take long (unlocking and unmapping 2 GiB of pinned memory: 0.4 s) and this
        runs on the event loop.
        """
        if claim.taken:
            return []
        claim.taken = True
        reused, dropped = claim.buffer, claim.evicted
        claim.buffer, claim.evicted = None, []
        with self._lock:
            if reused is not None:
                self._in_use -= reused.numel()
                if self._closed:
                    dropped.append(reused)
                else:
                    self._free.append(reused)
            else:
                self._in_use -= claim.nbytes
        self.notify()
        return dropped

    def release(self, buf: torch.Tensor) -> None:
        """Give back a buffer from :meth:`take` for reuse (dropped if the pool is closed)."""
        with self._lock:
            self._in_use -= buf.numel()
            if not self._closed:
                self._free.append(buf)

    def notify(self) -> None:
        """Wake the saves waiting for memory (on the event loop, after a release)."""
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    @property
    def held_bytes(self) -> int:
        """Bytes of buffers kept for reuse."""
        with self._lock:
            return sum(b.numel() for b in self._free)

    @property
    def in_use_bytes(self) -> int:
        """Bytes of buffers handed out to saves."""
        return self._in_use

    def close(self) -> None:
        """Drop every kept buffer; buffers released later are dropped too.

        Blocking: freeing gigabytes takes a while, so call it from a worker thread.
        """
        with self._lock:
            self._closed = True
            free, self._free = self._free, []
            lent, self._lent = self._lent, []
        if self.pinned_from is not None:
            for buf in free:
                if any(buf is b for b in lent):
                    self.pinned_from.give(buf)
        lent.clear()
        free.clear()
