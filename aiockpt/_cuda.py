"""CUDA: running a save's or load's device work as the caller's own, on the caller's device and streams.

PyTorch orders work on a tensor by stream: a kernel the caller enqueued before calling ``save`` may not
have run yet, and a copy of the tensor is only safe after it on the same stream. It also resolves
``device="cuda"`` (``torch.cuda.get_rng_state()``, ``torch.empty(..., device="cuda")``) to the calling
thread's current device. aiockpt copies tensors and calls ``state_dict()`` / ``load_state_dict()`` in
worker threads, whose current device is 0 and whose current stream on every device is its default
stream, whatever the caller set. So a save or load notes the caller's current device and its current
streams that are not a default stream (:func:`noting`, on the calling thread), and every call it runs in
a worker thread runs with them current (:func:`as_caller`, :func:`current`).

Waiting for device work is per device and up to an event recorded on its current stream (:func:`wait`),
never ``torch.cuda.synchronize()``: in a worker thread that waits on device 0 (making a CUDA context
there in a process that uses another GPU), and for every stream's work, not only the copies'.

Without CUDA in use in the process (:func:`in_use`), nothing is noted and every function here is a no-op.
"""

from __future__ import annotations

import contextlib
import contextvars
import mmap
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import torch

from ._pages import private_mappings, touched_mapping

T = TypeVar("T")


@dataclass(frozen=True)
class Caller:
    """The calling thread's current CUDA device and its current streams that are not a default stream."""

    device: int
    streams: tuple[torch.cuda.Stream, ...] = ()


def in_use() -> bool:
    """Whether this process uses CUDA (without it, no tensor can be on a GPU)."""
    return bool(torch.cuda.is_initialized())  # type: ignore[no-untyped-call]


def caller() -> Caller | None:
    """What this thread has current, or ``None`` where CUDA is not in use in this process.

    Reading a device's current stream makes no CUDA context on it, so every device can be asked.
    """
    if not in_use():
        return None
    streams = []
    for d in range(torch.cuda.device_count()):
        s = torch.cuda.current_stream(d)
        if s != torch.cuda.default_stream(d):
            streams.append(s)
    return Caller(torch.cuda.current_device(), tuple(streams))


# What the save or load running in this context noted of its caller (anyio hands it to worker threads).
_noted: contextvars.ContextVar[Caller | None] = contextvars.ContextVar("aiockpt_cuda_caller", default=None)


@contextlib.contextmanager
def noting(given: Caller | None = None) -> Iterator[None]:
    """Note the caller for the save or load that runs in this block.

    ``given`` is what the blocking facade noted on its caller's thread (this block then runs on the
    facade's event-loop thread). Without it, an outer block's note stands, else this thread's is taken.
    """
    if given is None and _noted.get() is not None:
        yield
        return
    token = _noted.set(given if given is not None else caller())
    try:
        yield
    finally:
        _noted.reset(token)


def noted() -> Caller | None:
    """What the save or load running in this context noted of its caller (on the event loop)."""
    return _noted.get()


@contextlib.contextmanager
def current(noted: Caller | None) -> Iterator[None]:
    """In a worker thread: make ``noted``'s device and streams current for the block (``None``: nothing)."""
    if noted is None:
        yield
        return
    # The device first: a stream's context on another device returns to it, and switching back to the
    # worker's own device 0 (not in use by the caller) would make a CUDA context there.
    with torch.cuda.device(noted.device), contextlib.ExitStack() as stack:
        for s in noted.streams:
            stack.enter_context(torch.cuda.stream(s))
        yield


def as_caller(fn: Callable[[], T]) -> Callable[[], T]:
    """``fn``, to run in a worker thread with the noted caller's device and streams current.

    Read on the event loop (where the note lives); ``fn`` itself is returned where there is none.
    """
    caller = _noted.get()
    if caller is None:
        return fn

    def run() -> T:
        with current(caller):
            return fn()

    return run


def record(device: torch.device) -> torch.cuda.Event:
    """An event after the work enqueued so far on ``device``'s current stream."""
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record(torch.cuda.current_stream(device))
    return event


def wait(devices: Iterable[torch.device]) -> None:
    """Block until the work enqueued so far on the current stream of each of ``devices`` is done."""
    for device in devices:
        record(device).synchronize()


def cuda_devices(tensors: Iterable[torch.Tensor]) -> set[torch.device]:
    """The CUDA devices ``tensors`` are on."""
    return {t.device for t in tensors if t.is_cuda}


# cudaHostRegisterPortable: the pages count as pinned for every device's context, not only the current one's.
_REGISTER_PORTABLE = 1


def _in_own_thread(device: int, call: Callable[[], object]) -> bool:
    """Run a ``torch.cuda.cudart()`` call on ``device`` in a thread of its own; whether it succeeded.

    The CUDA runtime keeps a failed call's error as the calling thread's last error, which torch's next
    kernel launch check in that thread raises, whatever it launched (seen on an H100 machine). No binding
    clears it, but it ends with its thread. The device is made current there: otherwise the runtime
    would make a context on device 0 for the call.
    """
    result: list[object] = []

    def run() -> None:
        with torch.cuda.device(device):
            result.append(call())

    thread = threading.Thread(target=run, name="aiockpt-cuda-pin")
    thread.start()
    thread.join()
    return bool(result) and result[0] == torch.cuda.cudart().cudaError.success  # type: ignore[no-untyped-call]


class _Locked(mmap.mmap):
    """Anonymous memory page-locked for CUDA with ``cudaHostRegister``; unlocked before it is unmapped.

    A tensor made of it by ``torch.frombuffer`` holds a reference to it, so it lives as long as the
    tensor's storage (any view of it included). Its ``__del__`` runs before ``mmap``'s own deallocation
    unmaps the pages: the driver never holds a registration of memory that is gone.
    """

    address = 0  # set once registered
    device = 0

    def __del__(self) -> None:
        if not self.address:
            return
        address, self.address = self.address, 0
        # At interpreter shutdown the runtime (or thread creation) may be gone, and the pages with it.
        with contextlib.suppress(Exception):
            unregister = torch.cuda.cudart().cudaHostUnregister  # type: ignore[no-untyped-call]
            _in_own_thread(self.device, lambda: unregister(address))


def pinned_empty(nbytes: int) -> torch.Tensor:
    """``nbytes`` (> 0) of page-locked host memory as a ``uint8`` tensor, freed with its storage.

    ``torch.empty(..., pin_memory=True)`` rounds every block up to a power of two and keeps freed
    blocks cached for reuse, never unlocking them: a 2.1 GiB staging buffer holds 4 GiB of locked
    memory for the rest of the process. This registers exactly ``nbytes`` of a
    :func:`~aiockpt._pages.touched_mapping` instead (2 MiB-aligned, huge pages where the kernel gives
    them, touched before it is registered), unregistered and unmapped once the last view of the tensor
    is gone. Where registering fails (a platform without it, or no memory left to lock), or on Windows,
    it falls back to torch's allocator, which took 2.06 s for 2.1 GiB on an H100 machine (a 4 GiB block).

    Registering untouched pages faults them in inside the driver's pinning, under the process's
    ``mmap_lock``: on three H100 machines (``python -m benchmarks.pinned`` and a forerunner), while
    2.1 GiB of untouched 4 KiB pages were registered, a 64 KiB ``mmap`` on the event loop's thread (what
    starting a worker thread does) waited 588-939 ms; with huge pages touched first, 0.4-1.9 ms (the
    two were not measured apart). Made and registered in 0.43-0.74 s against 0.63-1.01 s, freed in
    0.06-0.15 s against 0.07-0.28 s; copies from the device ran at 51-55 GB/s into both, and direct
    writes from them alike.

    Blocking (registering locks every page): call it in a worker thread, with the device current that
    the copies will use (see :func:`current`).
    """
    if not private_mappings():  # Windows
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    locked, skip = touched_mapping(nbytes, _Locked)
    buffer = torch.frombuffer(locked, dtype=torch.uint8, count=nbytes, offset=skip)
    address, device = buffer.data_ptr(), torch.cuda.current_device()
    register = torch.cuda.cudart().cudaHostRegister  # type: ignore[no-untyped-call]
    if not _in_own_thread(device, lambda: register(address, nbytes, _REGISTER_PORTABLE)):
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)  # ``locked`` goes with ``buffer``
    locked.address, locked.device = address, device
    return buffer
