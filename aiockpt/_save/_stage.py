"""Stage 1, every rank: flatten the state and make its bytes safe from later mutation.

With ``copy=True`` (``async_op=True``) every tensor is copied into one host staging buffer from the pool,
in worker threads that release the GIL (GPU tensors are copied into pinned memory, on the caller's
current stream of their device, so after the work the caller enqueued before the save; small ones are
gathered on their device first). When this stage returns, the caller may mutate its state freely. With
``copy=False`` (``async_op=False``) contiguous CPU tensors are written straight from their own memory
and only the rest is copied.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from functools import partial

import anyio
import torch

from .._cuda import cuda_devices, wait
from .._errors import StateError
from .._gc import collect_young, paused
from .._memory import PAGE, Claim, StagingPool, byte_view, nbytes_of, plain_cpu, plain_view
from .._runs import lanes
from .._threads import OFFER_ITEMS, acquire_sync, each_in_thread, release, run_sync, yield_gil
from .._tree import Flattened, flatten, render

# Large staged tensors start at multiples of this (the staging buffer itself does, see ``page_aligned``):
# every dtype view of the buffer is aligned, and their bytes can be written with O_DIRECT. At most 4 KiB
# more per tensor of 64 KiB or more.
_ALIGN = PAGE
# Tensors below this size are packed back to back, each copied by one ``memmove`` (see _copy_small).
_SMALL = 64 * 1024
_EMPTY = memoryview(b"")
# Large tensors are copied in pieces of this size, spread over at most _COPY_THREADS threads in lanes of
# about equal bytes: a few threads already reach the memory bandwidth of most machines.
_PIECE = 32 << 20
_COPY_THREADS = 4
# Small GPU tensors are concatenated on their device in groups of at most this many bytes, each group
# copied to the host in one (see _copy_gathered).
_GATHER = 512 << 10

# A tensor as staging found it: its dtype, shape and bytes. The plan is made from these, never from the
# tensor itself, which the caller may change (even in shape or dtype, in place) once an async save returned.
Spec = tuple[torch.dtype, tuple[int, ...], int]


@dataclass
class Staged:
    """The outcome of staging.

    Attributes:
        flat: The state's structure and unique tensors.
        specs: ``flat.tensors[i]`` as it was staged (what ``sources[i]`` holds).
        sources: The bytes of ``flat.tensors[i]`` in host memory that stays put until the write ends.
        buffer: The staging buffer to give back to the pool afterwards, if one was used.
        nbytes: Tensor bytes in the state.
        copied: Of those, bytes copied into the staging buffer.
    """

    flat: Flattened
    specs: list[Spec]
    sources: list[memoryview]
    buffer: torch.Tensor | None
    nbytes: int
    copied: int


def _bytewise(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``uint8`` where its elements are single bytes, for copies; else ``t``.

    ``copy_`` (and so ``contiguous``) has no kernel for some 1-byte dtypes (``float4_e2m1fn_x2``: a
    non-contiguous one of a few KiB fails), and a byte copies as a byte whatever its dtype. A lazy
    negative view keeps its dtype: its bytes are not its values, and ``view`` refuses it.
    """
    return t.view(torch.uint8) if t.element_size() == 1 and not t.is_neg() else t


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    return _bytewise(t).contiguous().reshape(-1).view(torch.uint8)


def _copy_small(
    tensors: list[torch.Tensor], small: list[int], offsets: dict[int, int], buffer: torch.Tensor
) -> None:
    """Copy each of ``tensors[small]`` (CPU tensors) to its offset in ``buffer``. Blocking.

    Per tensor this is a handful of cheap calls and one ``memmove`` (which releases the GIL): 20,000
    tensors of 4 KiB took 60-70 ms, where making a byte view of each and one ``torch.cat`` of them
    took 140-230 ms. Tensors whose memory does not hold their values as they read (not contiguous,
    lazy conjugate or negative views) are first made so.
    """
    base = buffer.data_ptr()
    for i in small:
        t = tensors[i]
        if not plain_cpu(t):
            t = _as_bytes(t)
        ctypes.memmove(base + offsets[i], t.data_ptr(), nbytes_of(t))


def _copy_gathered(
    tensors: list[torch.Tensor], gathered: list[int], offsets: dict[int, int], buffer: torch.Tensor
) -> None:
    """Copy ``tensors[gathered]`` (small GPU tensors, packed back to back) to their offsets in ``buffer``.

    A ``copy_`` per tensor costs a copy's launch and a few Python calls each; instead the tensors of a
    device are concatenated there, in groups of up to ``_GATHER`` bytes, and each group is copied to the
    host in one, on the caller's current stream (``plan_stage`` packs a group's tensors in order). On an
    H100 machine, 20,000 tensors of 4 KiB took 0.22-0.35 s one by one and 0.01 s in one group. The
    concatenation needs ``_GATHER`` bytes of device memory: where the device has none to spare, the
    group's tensors are copied one by one instead. Enqueues only: wait for the devices before reading.

    Groups are small (512 KiB), and the GIL is offered after each, because forming one is Python that
    holds the GIL: on the H100, with 8 MiB groups, state B's saves had a loop-lag p99 of 1.33-2.65 ms
    against 1.15-1.31 ms one ``copy_`` each; ``python -m benchmarks.batches`` (a proxy on CPU tensors
    under a save's settings, two runs on the 2-vCPU host) gave a p99 of 2.13 and 2.34 ms in groups of
    8 MiB, 0.53 and 0.86 ms in groups of 512 KiB, as fast.
    """
    start = 0
    while start < len(gathered):
        device = tensors[gathered[start]].device
        end, size = start, 0
        while end < len(gathered):
            t = tensors[gathered[end]]
            if t.device != device or (size and size + nbytes_of(t) > _GATHER):
                break
            size += nbytes_of(t)
            end += 1
        group = [_as_bytes(tensors[i]) for i in gathered[start:end]]
        at = offsets[gathered[start]]
        try:
            buffer[at : at + size].copy_(torch.cat(group), non_blocking=True)
        except torch.cuda.OutOfMemoryError:
            for i, t in zip(gathered[start:end], group, strict=True):
                buffer[offsets[i] : offsets[i] + t.numel()].copy_(t, non_blocking=True)
        start = end
        yield_gil()


def _copy_large(jobs: list[tuple[int, int, int]], threads: int) -> None:
    """``memmove`` each ``(destination, source, nbytes)`` of ``jobs``, over ``threads`` threads. Blocking.

    The threads are the save's own, at its lowered priority (``IOConfig.worker_nice``): when they keep
    every CPU busy, the event loop's thread still runs as soon as it wakes. (``Tensor.copy_`` would run
    on torch's intra-op threads, at the caller's priority: in 2 GiB copies into reused memory on 2
    vCPUs the loop-lag p99 was 0.4-3.3 ms with it, 0.2-0.9 ms with two lowered threads, at the same
    speed.)
    """
    pieces = [(d + at, s + at, min(_PIECE, n - at)) for d, s, n in jobs for at in range(0, n, _PIECE)]
    _over_threads([(partial(ctypes.memmove, d, s, n), n) for d, s, n in pieces], threads)


def _touch(buffer: torch.Tensor, threads: int) -> None:
    """Write every page of a new ``buffer`` once (zeros), in pieces over ``threads`` threads. Blocking.

    The first write to each page of new memory faults (on a VM twice, in the guest and in the host); done
    here, ahead, a save's copy into the buffer later runs at the speed of reused memory.
    """
    base, n = buffer.data_ptr(), buffer.numel()
    pieces = [(base + at, min(_PIECE, n - at)) for at in range(0, n, _PIECE)]
    _over_threads([(partial(ctypes.memset, at, 0, m), m) for at, m in pieces], threads)


def _nbytes(piece: tuple[Callable[[], object], int]) -> int:
    return piece[1]


def _over_threads(pieces: Sequence[tuple[Callable[[], object], int]], threads: int) -> None:
    """Run each ``(call, nbytes)`` of ``pieces``, in order, in ``threads`` lanes of equal bytes. Blocking.

    Split by bytes, not by count: a state's tensors end in pieces shorter than ``_PIECE``, and lanes of
    equal counts were uneven enough that 2 GiB took 0.108-0.158 s over two threads against 0.071-0.076 s
    split by bytes (and 0.064-0.090 s for ``Tensor.copy_`` of the same tensors, interleaved, 6 rounds).
    """
    parts = lanes(list(pieces), max(1, threads), _nbytes)

    def lane(part: Iterable[tuple[Callable[[], object], int]]) -> None:
        for call, _ in part:
            call()

    each_in_thread([partial(lane, part) for part in parts])


def _copy_threads() -> int:
    """Threads for copying large tensors into a staging buffer: up to four, as many as torch uses.

    The same into a Checkpointer's first, new buffer as into the reused one of its later saves. The first
    write to each page of new memory faults (on a VM twice, in the guest and in the host), so a first
    save's copy runs at a fraction of the memory's speed, and more threads take the faults sooner. On 2
    vCPUs, 2 GiB into a new buffer took 0.40-1.38 s (median 0.53 s) with two threads against 0.78-1.70 s
    (0.95 s) with one, each stalling the event loop over 25 ms in 3 of 15 trials (half or more of those
    wakes were stalls of the whole machine, which another process saw too); the benchmark suite's first
    save returned after 3.2-3.5 s against 6.6 s. (One thread had been chosen after earlier trials in
    which two stalled the loop 22-38 ms in 12 of 35, one in none of 20; see docs/benchmarks.md.)
    """
    return max(1, min(_COPY_THREADS, torch.get_num_threads()))


@dataclass
class Layout:
    """Where each tensor that must be copied goes in the staging buffer (``total`` bytes)."""

    flat: Flattened
    specs: list[Spec]
    sources: list[memoryview]
    nbytes: int
    small: list[int]
    gathered: list[int]
    large: list[int]
    offsets: dict[int, int]
    total: int
    devices: set[torch.device]


def plan_stage(state: Mapping[str, object], *, copy: bool, allow_pickle: bool) -> Layout:
    """Flatten ``state`` and lay out its staging buffer. Blocking (calls ``state_dict()``)."""
    with paused():
        flat = flatten(state, allow_pickle=allow_pickle)
        collect_young()  # its tuples of keys and nodes, whole, while they are in the cache
    tensors = flat.tensors
    # Grown, not made whole as ``[_EMPTY] * n``: a collection that meets it early meets it small.
    specs: list[Spec] = []
    sources: list[memoryview] = []
    small: list[int] = []
    gathered: list[int] = []
    large: list[int] = []
    nbytes = 0
    for i, t in enumerate(tensors):
        if not i % OFFER_ITEMS:
            yield_gil()
        n = nbytes_of(t)
        nbytes += n
        specs.append((t.dtype, tuple(t.shape), n))
        # Others (GPU tensors, lazy conj/neg views) go through a copy.
        view = None if copy or n == 0 else plain_view(t)
        sources.append(_EMPTY if view is None else view)
        if n == 0 or view is not None:
            continue
        if n < _SMALL and t.is_cpu:
            small.append(i)
        elif n < _SMALL and t.is_cuda:
            gathered.append(i)
        else:
            large.append(i)
    # Small CPU tensors packed back to back (one memmove each), then small GPU tensors the same way, each
    # device's together (gathered there, see _copy_gathered), then large ones at aligned offsets (copied
    # in pieces over a few threads, or one copy_ each from a GPU).
    gathered.sort(key=lambda i: tensors[i].device.index or 0)  # stable: same-device tensors keep order
    offsets: dict[int, int] = {}
    pos = 0
    for i in small + gathered:
        offsets[i] = pos
        pos += specs[i][2]
    for i in large:
        pos = -(-pos // _ALIGN) * _ALIGN
        offsets[i] = pos
        pos += specs[i][2]
    devices = cuda_devices(tensors[i] for i in gathered + large)
    collect_young()  # ``sources`` and the index lists, which grew without setting off a collection
    return Layout(flat, specs, sources, nbytes, small, gathered, large, offsets, pos, devices)


def _check_sizes(layout: Layout) -> None:
    """Refuse to copy a tensor whose size changed since ``plan_stage`` laid out its place in the buffer.

    Between the two, the save may wait for staging memory while other tasks run.

    Raises:
        StateError: A tensor was resized while the save staged it, naming its key.
    """
    tensors, specs = layout.flat.tensors, layout.specs
    for n, i in enumerate(layout.offsets):
        if not n % OFFER_ITEMS:
            yield_gil()
        if nbytes_of(tensors[i]) != specs[i][2]:
            key = render(layout.flat.paths[i])
            raise StateError(
                f"the tensor at key {key!r} changed from {specs[i][2]} to {nbytes_of(tensors[i])} bytes "
                "while the save was staging it; change a state only once save() has returned",
                key=key,
            )


def copy_stage(layout: Layout, pool: StagingPool, claim: Claim) -> Staged:
    """Copy the tensors of ``layout`` into the staging buffer ``claim`` grants. Blocking.

    Raises:
        StateError: A tensor was resized while the save staged it, naming its key.
    """
    flat, specs, sources, tensors = layout.flat, layout.specs, layout.sources, layout.flat.tensors
    if not layout.offsets:
        return Staged(flat=flat, specs=specs, sources=sources, buffer=None, nbytes=layout.nbytes, copied=0)
    _check_sizes(layout)
    buffer = pool.take(claim)
    try:
        _copy_small(tensors, layout.small, layout.offsets, buffer)
        _copy_gathered(tensors, layout.gathered, layout.offsets, buffer)
        base = buffer.data_ptr()
        jobs: list[tuple[int, int, int]] = []
        for i in layout.large:
            t = tensors[i]
            off = layout.offsets[i]
            if plain_cpu(t):
                jobs.append((base + off, t.data_ptr(), nbytes_of(t)))
                continue
            src = _bytewise(t)
            dst = buffer[off : off + nbytes_of(t)].view(src.dtype).view(src.shape)
            dst.copy_(src, non_blocking=t.is_cuda)
        if jobs:
            _copy_large(jobs, _copy_threads())
        wait(layout.devices)  # the device-to-host copies, enqueued on the caller's streams
    except BaseException:
        pool.release(buffer)
        raise
    whole = byte_view(buffer)
    copied = 0
    for i, off in layout.offsets.items():
        n = specs[i][2]
        sources[i] = whole[off : off + n]
        copied += n
    return Staged(flat=flat, specs=specs, sources=sources, buffer=buffer, nbytes=layout.nbytes, copied=copied)


async def stage(
    state: Mapping[str, object],
    *,
    copy: bool,
    pool: StagingPool,
    allow_pickle: bool,
    waiting: Callable[[], AbstractContextManager[None]] = nullcontext,
    limiter: anyio.CapacityLimiter | None = None,
) -> Staged:
    """Flatten ``state`` and stage its tensors (see the module docstring).

    Staging memory is claimed from the pool (within its budget) before copying, inside ``waiting()``
    (the save's :meth:`~aiockpt.SaveMetrics.waiting`); the buffer goes back to the pool with
    ``StagingPool.release`` once written.

    Raises:
        StateError: The state holds something that cannot be saved; the message names the key.
        BusyError: The staging budget cannot hold this save (ever, or now in a pool that does not wait).
    """
    layout = await run_sync(lambda: plan_stage(state, copy=copy, allow_pickle=allow_pickle), limiter)
    if not layout.offsets:
        return copy_stage(layout, pool, Claim(0, False))
    with waiting():
        claim = await pool.claim(layout.total, pinned=bool(layout.devices))
    try:
        return await acquire_sync(lambda: copy_stage(layout, pool, claim), limiter)
    except BaseException:
        pool.notify()  # a failed copy gave its buffer back
        raise
    finally:
        await _forget(pool, claim)  # no-op once taken: the buffer then travels with the Staged result


async def _forget(pool: StagingPool, claim: Claim) -> None:
    """Undo ``claim`` if it was never taken; what it held that must be freed is freed in a worker thread.

    Freeing a staging buffer can take long (a pinned one is unlocked and unmapped), and this runs on the
    event loop: see ``StagingPool.forget``.
    """
    dropped = pool.forget(claim)
    if dropped:
        with anyio.CancelScope(shield=True):
            await run_sync(dropped.clear)


async def reserve(
    state: Mapping[str, object],
    *,
    pool: StagingPool,
    allow_pickle: bool,
    limiter: anyio.CapacityLimiter | None = None,
) -> int:
    """Allocate now, and keep in ``pool``, the staging buffer an ``async_op=True`` save of ``state`` needs.

    A new host buffer's pages are written once here (see :func:`_touch`); a pinned one's were faulted in
    by page-locking it. A kept buffer that fits is not allocated again. Returns the bytes the save will
    stage (0: none).

    Raises:
        StateError: The state holds something that cannot be saved; the message names the key.
        BusyError: The staging budget cannot hold the buffer (ever, or now in a pool that does not wait).
    """
    layout = await run_sync(lambda: plan_stage(state, copy=True, allow_pickle=allow_pickle), limiter)
    total, pinned = layout.total if layout.offsets else 0, bool(layout.devices)
    box: list[object] = [layout]  # per-tensor bookkeeping: freed in a worker thread, not on the loop
    del layout
    await release(box, limiter)
    if not total:
        return 0
    claim = await pool.claim(total, pinned=pinned)
    fresh = claim.buffer is None

    def allocate() -> None:
        buffer = pool.take(claim)
        try:
            if fresh and not buffer.is_pinned():
                _touch(buffer, _copy_threads())
        finally:
            pool.release(buffer)

    try:
        await acquire_sync(allocate, limiter)
    finally:
        await _forget(pool, claim)
        pool.notify()
    return total
