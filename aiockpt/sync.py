"""Blocking facade for synchronous training loops.

:class:`Checkpointer` runs an asyncio event loop in a background thread (through an anyio blocking
portal) and forwards every call to an :class:`aiockpt.Checkpointer` living there, so background saves go
on while the training loop computes. The module-level functions run one operation to completion.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import queue
import threading
import weakref
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import TYPE_CHECKING, Literal, TypeVar, overload

import anyio
from anyio.from_thread import BlockingPortal

from . import _api
from ._checkpointer import Checkpointer as AsyncCheckpointer
from ._checkpointer import OnBusy
from ._cuda import caller, noting
from ._dist import DEFAULT_TIMEOUT
from ._errors import CheckpointError
from ._format import Key
from ._handle import Metadata, SaveHandle, SaveMetrics, SaveState
from ._options import IOConfig
from ._storage import Location, S3Options

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["Checkpointer", "SyncSaveHandle", "load", "read", "read_metadata", "save"]

T = TypeVar("T")


def _run(call: Callable[[], Awaitable[T]], name: str) -> T:
    """``call()`` run to completion in an event loop of its own, on this thread.

    Raises:
        CheckpointError: This thread runs an event loop already (the caller is a coroutine: it should
            await the function of the same name in :mod:`aiockpt`).
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return anyio.run(call)
    raise CheckpointError(
        f"aiockpt.sync.{name} was called from a running event loop, which it would block: "
        f"await aiockpt.{name}(...) there instead"
    )


def _start_portal() -> tuple[BlockingPortal, threading.Thread]:
    ready: queue.Queue[BlockingPortal | BaseException] = queue.Queue()

    async def serve() -> None:
        async with BlockingPortal() as portal:
            ready.put(portal)
            await portal.sleep_until_stopped()

    def run() -> None:
        try:
            anyio.run(serve, backend="asyncio")
        except BaseException as exc:  # pragma: no cover - start-up failure is reported to the caller
            ready.put(exc)

    # A daemon thread: an unclosed Checkpointer must not keep the interpreter alive at exit (its
    # finalizer closes it then, see Checkpointer.__init__).
    thread = threading.Thread(target=run, name="aiockpt-sync", daemon=True)
    thread.start()
    got = ready.get()
    if isinstance(got, BaseException):
        raise got
    return got, thread


class _PortalStopped(CheckpointError):
    """The facade's event-loop thread no longer takes calls: the Checkpointer is closed (or closing)."""


def _until_done(
    portal: BlockingPortal, thread: threading.Thread, call: Callable[[], Awaitable[T]], closed: str
) -> T:
    """``call()`` run on ``portal``'s event-loop thread; its result returned or its exception raised.

    If this thread is interrupted while it waits (``KeyboardInterrupt`` from Ctrl-C, or an exception
    raised by a signal handler), ``call`` is cancelled and waited for before the interruption is raised,
    as cancelling the task that awaits it would: a save (with ``async_op=False``, or still staging) or a
    load must not go on reading or writing the caller's tensors once the caller has its control back (the
    caller may go on training, and the save would commit torn weights). A save past its commit point
    completes. A second interruption meanwhile is raised at once.

    Raises:
        _PortalStopped: The portal has stopped (the Checkpointer was closed, by another thread say); the
            message is ``closed``.
    """
    ended = threading.Event()

    async def run() -> T:
        try:
            return await call()
        finally:
            ended.set()

    try:
        future = portal.start_task_soon(run)
    except RuntimeError:  # anyio: "This portal is not running" (closed since the caller checked)
        raise _PortalStopped(closed) from None
    try:
        return future.result()
    except BaseException:
        if not future.done():  # interrupted: ``call`` still runs
            future.cancel()  # cancels its scope on the loop (anyio)
            # Bounded by the thread: a task that never started sets nothing, but ends with the loop.
            while not ended.wait(0.05) and thread.is_alive():
                pass
        raise


def _shut_down(portal: BlockingPortal, thread: threading.Thread, ckpt: AsyncCheckpointer, pid: int) -> None:
    """Close ``ckpt`` (waiting for its saves in flight) and stop its event-loop thread. Blocking.

    What a facade's finalizer runs when it was never closed: it was garbage-collected, or the interpreter
    is exiting. Nothing in a forked child, which has no such thread (``pid`` is the parent's).
    """
    if os.getpid() != pid or not thread.is_alive():
        return
    if threading.current_thread() is thread:  # dropped by code on the loop, which must not block
        args = (portal, thread, ckpt, pid)
        threading.Thread(target=_shut_down, args=args, name="aiockpt-sync-close").start()
        return
    try:
        portal.call(ckpt.aclose)  # a failure is printed by the finalizer (and the thread still stopped)
    finally:
        _stop(portal, thread)


def _stop(portal: BlockingPortal, thread: threading.Thread) -> None:
    """Stop ``portal`` and join its thread (nothing if another caller stopped it already). Blocking."""
    with contextlib.suppress(RuntimeError):  # not running: stopped already
        portal.call(portal.stop)
    if thread is not threading.current_thread():
        thread.join()


def _as_this_thread(call: Callable[[], Awaitable[T]]) -> Callable[[], Awaitable[T]]:
    """``call``, to run on the portal's event-loop thread as if on this one (its CUDA device and streams).

    The save or load then copies GPU tensors after the work this thread enqueued on its current streams,
    as it would when awaited on this thread (see ``_cuda``).
    """
    noted = caller()

    async def run() -> T:
        with noting(noted):
            return await call()

    return run


class SyncSaveHandle:
    """A save in flight, seen from synchronous code."""

    def __init__(self, handle: SaveHandle, portal: BlockingPortal) -> None:
        self._handle = handle
        self._portal = portal

    def __repr__(self) -> str:
        return repr(self._handle).replace("<SaveHandle", "<SyncSaveHandle", 1)

    @property
    def state(self) -> SaveState:
        """Where the save is now."""
        return self._handle.state

    @property
    def metrics(self) -> SaveMetrics:
        """Per-phase seconds and bytes."""
        return self._handle.metrics

    @property
    def skipped(self) -> bool:
        """Whether ``on_busy="skip"`` dropped this save."""
        return self._handle.skipped

    def done(self) -> bool:
        """Whether the save has ended."""
        return self._handle.done()

    def cancel(self) -> None:
        """Ask the save to stop (see :meth:`aiockpt.SaveHandle.cancel`); nothing once it has ended."""
        # An ended save needs no portal: it may be stopped already (its Checkpointer closed).
        if not self._handle.done():
            try:
                self._portal.call(self._cancel)
            except RuntimeError:  # the portal stopped meanwhile: closing ended the save first
                if not self._handle.done():
                    raise

    async def _cancel(self) -> None:
        self._handle.cancel()

    def result(self, timeout: float | None = None) -> Metadata:
        """Block until the checkpoint is durable and return its metadata.

        Also after the Checkpointer was closed: closing ends every save first.

        Raises:
            TimeoutError: ``timeout`` seconds passed first (the save goes on).
            CheckpointError: The save failed, was cancelled or skipped.
        """
        if self._handle.done():
            return self._handle._outcome()
        try:
            future = self._portal.start_task_soon(self._handle.wait)
        except RuntimeError:  # the portal stopped meanwhile: closing ended the save first
            return self._handle._outcome()
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            # Only waiting stops (the save goes on). Before Python 3.11 this is not the built-in
            # TimeoutError that the docstring promises.
            future.cancel()
            raise TimeoutError(f"the save of step {self._handle.step} is not durable yet") from None


class Checkpointer:
    """The blocking twin of :class:`aiockpt.Checkpointer`; use it as a context manager.

    Takes the same arguments (``s3=`` included), checked alike. Background saves run on a private
    event-loop thread.

    Raises:
        CheckpointError: An argument has a wrong type or is out of range (see
            :class:`aiockpt.Checkpointer`).
        StorageError: ``root`` cannot be made or listed.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        keep_last: int | None = None,
        keep_every: int | None = None,
        max_inflight: int = 1,
        on_busy: OnBusy = "wait",
        allow_pickle: bool = False,
        io: IOConfig | None = None,
        staging_budget: int | None = None,
        process_group: ProcessGroup | None = None,
        collective_timeout: float = DEFAULT_TIMEOUT,
        use_collectives: bool = True,
        s3: S3Options | None = None,
    ) -> None:
        # Built (and its arguments checked) before the event-loop thread starts: a bad argument costs
        # no thread.
        self._ckpt = AsyncCheckpointer(
            root,
            keep_last=keep_last,
            keep_every=keep_every,
            max_inflight=max_inflight,
            on_busy=on_busy,
            allow_pickle=allow_pickle,
            io=io,
            staging_budget=staging_budget,
            process_group=process_group,
            collective_timeout=collective_timeout,
            use_collectives=use_collectives,
            s3=s3,
        )
        self._portal, self._thread = _start_portal()
        self._closing = threading.Lock()  # one close at a time (several threads may close)
        try:
            self._portal.call(self._ckpt.open)
        except BaseException:
            self._stop()
            raise
        # Never closed (dropped, or still open at exit): close it then, as leaving a ``with`` block
        # would, so that its event-loop thread (and the loop's descriptors) does not outlive it. The
        # callback holds no reference to ``self``.
        self._finalizer = weakref.finalize(
            self, _shut_down, self._portal, self._thread, self._ckpt, os.getpid()
        )

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def root(self) -> Location:
        """The checkpoint root directory (or ``s3://`` location)."""
        return self._ckpt.root

    @overload
    def save(
        self,
        state: Mapping[str, object],
        *,
        step: int,
        async_op: Literal[False] = ...,
        metadata: dict[str, str | int | float | bool | None] | None = ...,
    ) -> Metadata: ...

    @overload
    def save(
        self,
        state: Mapping[str, object],
        *,
        step: int,
        async_op: Literal[True],
        metadata: dict[str, str | int | float | bool | None] | None = ...,
    ) -> SyncSaveHandle: ...

    def save(
        self,
        state: Mapping[str, object],
        *,
        step: int,
        async_op: bool = False,
        metadata: dict[str, str | int | float | bool | None] | None = None,
    ) -> Metadata | SyncSaveHandle:
        """Save ``state`` as ``step``; see :meth:`aiockpt.Checkpointer.save`."""
        if async_op:
            handle = self._call(
                _as_this_thread(lambda: self._ckpt.save(state, step=step, async_op=True, metadata=metadata))
            )
            return SyncSaveHandle(handle, self._portal)
        return self._call(_as_this_thread(lambda: self._ckpt.save(state, step=step, metadata=metadata)))

    def reserve(self, state: Mapping[str, object]) -> int:
        """Allocate the staging memory of ``state``'s saves now; see :meth:`aiockpt.Checkpointer.reserve`."""
        return self._call(_as_this_thread(lambda: self._ckpt.reserve(state)))

    def load(
        self, state: MutableMapping[str, object], *, step: int | None = None, strict: bool = True
    ) -> int | None:
        """Load ``step`` (default: latest) into ``state``; see :meth:`aiockpt.Checkpointer.load`."""
        return self._call(_as_this_thread(lambda: self._ckpt.load(state, step=step, strict=strict)))

    def read(self, step: int | None = None) -> dict[Key, object]:
        """Read ``step`` (default: latest) as a fresh tree; see :meth:`aiockpt.Checkpointer.read`."""
        return self._call(lambda: self._ckpt.read(step))

    def metadata(self, step: int | None = None) -> Metadata:
        """The metadata of ``step`` (default: latest); see :meth:`aiockpt.Checkpointer.metadata`."""
        return self._call(lambda: self._ckpt.metadata(step))

    def steps(self) -> list[int]:
        """Committed steps, oldest first."""
        return self._call(self._ckpt.refresh)

    def latest_step(self) -> int | None:
        """The newest committed step, or ``None``."""
        steps = self.steps()
        return steps[-1] if steps else None

    def wait(self) -> None:
        """Block until every save in flight has ended (none has once closed)."""
        if self._thread.is_alive():
            with contextlib.suppress(_PortalStopped):  # closed meanwhile: nothing is in flight
                _until_done(self._portal, self._thread, self._ckpt.wait, "")

    def close(self, *, cancel: bool = False) -> None:
        """Finish (or cancel) the saves in flight and stop the event-loop thread.

        Safe to call again, and from several threads: the later calls return once it is closed.
        """
        with self._closing:
            if not self._thread.is_alive():
                return
            self._finalizer.detach()
            try:
                _until_done(self._portal, self._thread, lambda: self._ckpt.aclose(cancel=cancel), "")
            except _PortalStopped:
                pass  # stopped already, the Checkpointer with it (its finalizer ran, at exit say)
            finally:
                self._stop()

    def _call(self, call: Callable[[], Awaitable[T]]) -> T:
        """``call()`` run on the event-loop thread, its result returned.

        Raises:
            CheckpointError: The Checkpointer is closed (its event-loop thread has stopped).
        """
        closed = f"the Checkpointer of {self._ckpt.root} is closed"
        if not self._thread.is_alive():
            raise CheckpointError(closed)
        return _until_done(self._portal, self._thread, call, closed)

    def _stop(self) -> None:
        _stop(self._portal, self._thread)


def save(
    state: Mapping[str, object],
    path: str | os.PathLike[str],
    *,
    allow_pickle: bool = False,
    metadata: dict[str, str | int | float | bool | None] | None = None,
    io: IOConfig | None = None,
    process_group: ProcessGroup | None = None,
    collective_timeout: float = DEFAULT_TIMEOUT,
    use_collectives: bool = True,
    s3: S3Options | None = None,
) -> Metadata:
    """Save ``state`` to ``path`` and return once durable; see :func:`aiockpt.save`.

    Takes the same arguments but ``async_op``: the event loop of the call ends with it, so a save that
    goes on in the background has no loop to go on in (:class:`Checkpointer` has one).
    """

    async def run() -> Metadata:
        return await _api.save(
            state,
            path,
            allow_pickle=allow_pickle,
            metadata=metadata,
            io=io,
            process_group=process_group,
            collective_timeout=collective_timeout,
            use_collectives=use_collectives,
            s3=s3,
        )

    return _run(run, "save")


def load(
    state: MutableMapping[str, object],
    path: str | os.PathLike[str],
    *,
    strict: bool = True,
    allow_pickle: bool = False,
    io: IOConfig | None = None,
    s3: S3Options | None = None,
    rank: int | None = None,
) -> MutableMapping[str, object]:
    """Load ``path`` into ``state`` in place (``rank``'s per-rank state); see :func:`aiockpt.load`."""

    async def run() -> MutableMapping[str, object]:
        return await _api.load(state, path, strict=strict, allow_pickle=allow_pickle, io=io, s3=s3, rank=rank)

    return _run(run, "load")


def read(
    path: str | os.PathLike[str],
    *,
    allow_pickle: bool = False,
    io: IOConfig | None = None,
    s3: S3Options | None = None,
    rank: int | None = None,
) -> dict[Key, object]:
    """Read ``path`` as a fresh tree of CPU tensors (``rank``'s per-rank state); see :func:`aiockpt.read`."""

    async def run() -> dict[Key, object]:
        return await _api.read(path, allow_pickle=allow_pickle, io=io, s3=s3, rank=rank)

    return _run(run, "read")


def read_metadata(path: str | os.PathLike[str], *, s3: S3Options | None = None) -> Metadata:
    """What the checkpoint at ``path`` holds, from its manifest; see :func:`aiockpt.read_metadata`."""

    async def run() -> Metadata:
        return await _api.read_metadata(path, s3=s3)

    return _run(run, "read_metadata")
