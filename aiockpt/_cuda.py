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
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import torch

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
