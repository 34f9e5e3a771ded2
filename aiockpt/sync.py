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
from collections.abc import AsyncGenerator, Awaitable, Callable, Generator, Mapping, MutableMapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar, cast, overload

import anyio
from anyio.from_thread import BlockingPortal

from . import _api, _verify
from ._checkpointer import Checkpointer as AsyncCheckpointer
from ._checkpointer import OnBusy
from ._cuda import caller, noting
from ._dist import DEFAULT_TIMEOUT
from ._errors import CheckpointError
from ._format import Key
from ._handle import Metadata, SaveHandle, SaveMetrics, SaveState
from ._insulate import caller_line, warnings_at
from ._interop import _convert
from ._interop._convert import DEFAULT_MAX_SHARD_SIZE, Target
from ._options import IOConfig, check_flags
from ._storage import Location, S3Options
from ._verify import VerifyReport

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
else:
    try:  # at run time too, so that typing.get_type_hints() resolves the annotations that name it
        from torch.distributed import ProcessGroup
    except ImportError:  # a torch built without distributed support: no group to pass
        ProcessGroup = object

__all__ = ["Checkpointer", "SyncSaveHandle", "convert", "load", "read", "read_metadata", "save", "verify"]

T = TypeVar("T")
StateT = TypeVar("StateT", bound=MutableMapping[str, Any])  # (as in aiockpt.load)


def _run(call: Callable[[], Awaitable[T]], name: str) -> T:
    """``call()`` run to completion in an event loop of its own, on this thread.

    Raises:
        CheckpointError: This thread runs an event loop already (the caller is a coroutine: it should
            await the function of the same name in :mod:`aiockpt`).
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        where = caller_line(2)  # the line that called the facade's function: its warnings point there

        async def run() -> T:
            with warnings_at(where):
                return await call()

        return anyio.run(run)
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


class _Watches:
    """The steps that a facade's watches wait for, each awaited in a cancel scope. Event-loop thread only.

    Closing the facade cancels them: a ``next()`` blocked in another thread then raises at once, rather
    than at its watch's next poll, and the event-loop thread stops without waiting a poll interval.
    """

    def __init__(self) -> None:
        self.pending: set[anyio.CancelScope] = set()
        self.closed = False

    def close(self) -> None:
        self.closed = True
        for scope in list(self.pending):
            scope.cancel()


async def _aclose(ckpt: AsyncCheckpointer, watches: _Watches, cancel: bool = False) -> None:
    """Close ``ckpt`` (see :meth:`aiockpt.Checkpointer.aclose`), then end the steps its watches wait for."""
    try:
        await ckpt.aclose(cancel=cancel)
    finally:
        watches.close()


class _Handover:
    """Whether a call handed to the event-loop thread began there, and its cancellation.

    :meth:`cancel` runs on the loop thread, called through the portal after the hand-over, so after
    the loop spawned the call's task if the hand-over got that far: portal calls are spawned in the
    order they are made, and a task's first step (which sets :attr:`scope`) runs before a task spawned
    after it.
    """

    def __init__(self) -> None:
        self.scope: anyio.CancelScope | None = None
        self.cancelled = False

    def cancel(self) -> bool:
        """Cancel the call (at once if it began, or as it begins); return whether it began. Loop thread."""
        self.cancelled = True
        if self.scope is not None:
            self.scope.cancel()
        return self.scope is not None


def _until_done(
    portal: BlockingPortal, thread: threading.Thread, call: Callable[[], Awaitable[T]], closed: str
) -> T:
    """``call()`` run on ``portal``'s event-loop thread; its result returned or its exception raised.

    If this thread is interrupted while it hands the call over or waits (``KeyboardInterrupt`` from
    Ctrl-C, or an exception raised by a signal handler), ``call`` is cancelled and waited for before the
    interruption is raised, as cancelling the task that awaits it would: a save (with ``async_op=False``,
    or still staging) or a load must not go on reading or writing the caller's tensors once the caller
    has its control back (the caller may go on training, and the save would commit torn weights). A save
    past its commit point completes. A second interruption meanwhile is raised at once.

    Raises:
        _PortalStopped: The portal has stopped (the Checkpointer was closed, by another thread say); the
            message is ``closed``.
    """
    ended = threading.Event()
    returned: list[T] = []
    handover = _Handover()

    async def run() -> T | None:
        try:
            with anyio.CancelScope() as scope:
                handover.scope = scope
                if handover.cancelled:
                    scope.cancel()
                returned.append(await call())
            return returned[0] if returned else None  # (None: cancelled by the caller, who is gone)
        finally:
            ended.set()

    future: concurrent.futures.Future[T | None] | None = None
    try:
        # The portal's hand-over blocks until the loop has spawned `run`, which may then run as far as a
        # save's "staged" before this thread goes on: an interruption raised in it must cancel `run` too,
        # though no future reached this thread (see _Handover).
        future = portal.start_task_soon(run)
        return cast("T", future.result())
    except BaseException as exc:
        # One clause for all: a RuntimeError raised by a signal handler (during the hand-over or the wait)
        # is an interruption like any other, whose call must be cancelled. anyio's own, for a portal not
        # running, is told apart by the portal refusing the cancellation too.
        if not ended.is_set():  # interrupted: ``call`` may run, or be about to begin
            began = True
            try:
                began = portal.call(handover.cancel)
            except RuntimeError:  # anyio: the portal has stopped (and `run` with it, if it began)
                if future is None and isinstance(exc, RuntimeError):  # (closed since the caller checked)
                    raise _PortalStopped(closed) from None
            # Bounded by the thread: a task that never started sets nothing, but ends with the loop.
            while began and not ended.wait(0.05) and thread.is_alive():
                pass
        # Interrupted as ``call`` returned: its result never reaches the caller. A background save's
        # handle is so ended, as in an insulated call (see ``_insulate``).
        for result in returned:
            abandoned = getattr(result, "_abandoned", None)
            if abandoned is not None:
                with contextlib.suppress(RuntimeError):  # anyio: the portal has stopped meanwhile
                    portal.call(abandoned)
        raise


def _shut_down(
    portal: BlockingPortal, thread: threading.Thread, ckpt: AsyncCheckpointer, watches: _Watches, pid: int
) -> None:
    """Close ``ckpt`` (waiting for its saves in flight) and stop its event-loop thread. Blocking.

    What a facade's finalizer runs when it was never closed: it was garbage-collected, or the interpreter
    is exiting. Nothing in a forked child, which has no such thread (``pid`` is the parent's).
    """
    if os.getpid() != pid or not thread.is_alive():
        return
    if threading.current_thread() is thread:  # dropped by code on the loop, which must not block
        args = (portal, thread, ckpt, watches, pid)
        threading.Thread(target=_shut_down, args=args, name="aiockpt-sync-close").start()
        return
    try:
        portal.call(_aclose, ckpt, watches)  # a failure is printed by the finalizer (the thread still stops)
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
    where = caller_line(2)  # the line that called the facade's method: its warnings point there

    async def run() -> T:
        with noting(noted), warnings_at(where):
            return await call()

    return run


class SyncSaveHandle:
    """A save in flight, seen from synchronous code."""

    def __init__(self, handle: SaveHandle, portal: BlockingPortal) -> None:
        self._handle = handle
        self._portal = portal
        self._pid = os.getpid()  # (a forked child has no event-loop thread)

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
        """Ask the save to stop (see :meth:`aiockpt.SaveHandle.cancel`); nothing once it has ended.

        Raises:
            CheckpointError: This process is a fork of the one saving.
        """
        # An ended save needs no portal: it may be stopped already (its Checkpointer closed).
        if not self._handle.done():
            self._check_reachable()
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
            CheckpointError: The save failed, was cancelled or skipped; or this process is a fork of the one
                saving, which alone can wait for it.
        """
        if self._handle.done():
            return self._handle._outcome()
        self._check_reachable()
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

    def _check_reachable(self) -> None:
        """Refuse a save of another process: in a forked child, which has no event-loop thread.

        There the copy of the handle would wait for ever: handing a call to a portal whose thread is not
        there blocks.

        Raises:
            CheckpointError: This process is a fork of the one saving.
        """
        if os.getpid() != self._pid:
            raise CheckpointError(
                f"the save of step {self._handle.step} runs in process {self._pid}, of which this process "
                "is a fork: its handle serves that process only"
            )


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
        self._pid = os.getpid()  # (a forked child has no event-loop thread)
        self._closing = threading.Lock()  # one close at a time (several threads may close)
        self._watches = _Watches()
        try:
            self._portal.call(self._ckpt.open)
        except BaseException:
            self._stop()
            raise
        # Never closed (dropped, or still open at exit): close it then, as leaving a ``with`` block
        # would, so that its event-loop thread (and the loop's descriptors) does not outlive it. The
        # callback holds no reference to ``self``.
        self._finalizer = weakref.finalize(
            self, _shut_down, self._portal, self._thread, self._ckpt, self._watches, os.getpid()
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
        metadata: Mapping[str, str | int | float | bool | None] | None = ...,
    ) -> Metadata: ...

    @overload
    def save(
        self,
        state: Mapping[str, object],
        *,
        step: int,
        async_op: Literal[True],
        metadata: Mapping[str, str | int | float | bool | None] | None = ...,
    ) -> SyncSaveHandle: ...

    @overload
    def save(
        self,
        state: Mapping[str, object],
        *,
        step: int,
        async_op: bool,
        metadata: Mapping[str, str | int | float | bool | None] | None = ...,
    ) -> Metadata | SyncSaveHandle: ...

    def save(
        self,
        state: Mapping[str, object],
        *,
        step: int,
        async_op: bool = False,
        metadata: Mapping[str, str | int | float | bool | None] | None = None,
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
        self, state: MutableMapping[str, Any], *, step: int | None = None, strict: bool = True
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
        """Committed steps, oldest first, listed afresh.

        As :meth:`refresh` does; the async :meth:`aiockpt.Checkpointer.steps` gives those of its last
        listing, without I/O.

        Raises:
            StorageError: ``root`` cannot be listed (it was removed, say).
            CheckpointError: The Checkpointer is closed.
        """
        return self._call(self._ckpt.refresh)

    def latest_step(self) -> int | None:
        """The newest committed step, listed afresh (see :meth:`steps`), or ``None``.

        Raises:
            StorageError: ``root`` cannot be listed (it was removed, say).
            CheckpointError: The Checkpointer is closed.
        """
        steps = self.steps()
        return steps[-1] if steps else None

    def refresh(self) -> list[int]:
        """Re-read the committed steps, oldest first; see :meth:`aiockpt.Checkpointer.refresh`.

        Raises:
            StorageError: ``root`` cannot be listed (it was removed, say).
            CheckpointError: The Checkpointer is closed.
        """
        return self._call(self._ckpt.refresh)

    def path_of(self, step: int) -> Location:
        """The directory (or object prefix) of ``step``'s checkpoint. Blocks nothing, also once closed."""
        return self._ckpt.path_of(step)

    def watch(self, *, poll_interval: float = 1.0, coalesce: bool = True) -> Generator[int, None, None]:
        """Yield steps as they are committed, by any process; see :meth:`aiockpt.Checkpointer.watch`.

        A generator over the async watch, which runs on the event-loop thread: it starts (lists the root,
        whose steps it will not yield) at the first ``next()``, not at the call, and each ``next()``
        blocks until a poll lists a new step. Leaving the ``for`` loop (or ``close()`` on the generator)
        closes the async watch too. A ``next()`` that another thread is blocked in raises
        :class:`CheckpointError` at once when the Checkpointer is closed (as the async watch of a closed
        Checkpointer does, at its next poll); so does a ``next()`` after it is closed. An interruption
        (``KeyboardInterrupt``) while ``next()`` blocks cancels the poll in progress and ends the watch,
        as cancelling a pending ``anext`` ends the async watch: start a new one. A watch that raised is
        over: its next ``next()`` raises ``StopIteration``.

        Args:
            poll_interval: Seconds between listings.
            coalesce: When several steps appeared between two listings, yield only the newest, and only
                when it is the newest committed step; with ``False``, yield each, oldest first.

        Yields:
            Each step newly committed.

        Raises:
            StorageError: ``root`` cannot be listed (but for its being missing, which is waited out).
            CheckpointError: ``poll_interval`` is not a positive number of seconds or ``coalesce`` not a
                bool (at the first ``next()``), or the Checkpointer is closed (also while ``next()``
                waits).
        """
        steps = self._ckpt.watch(poll_interval=poll_interval, coalesce=coalesce)
        try:
            while (step := self._call(lambda: self._next_step(steps))) is not None:
                yield step
        finally:
            self._end_watch(steps)

    async def _next_step(self, steps: AsyncGenerator[int, None]) -> int | None:
        """The next step of the async watch ``steps``; ``None`` once it has ended. Event-loop thread.

        Raises:
            CheckpointError: The facade is closing or closed (its close cancelled the wait).
        """
        closed = f"the Checkpointer of {self._ckpt.root} is closed"
        if self._watches.closed:
            raise CheckpointError(closed)
        with anyio.CancelScope() as scope:
            self._watches.pending.add(scope)
            try:
                return await anext(steps)
            except StopAsyncIteration:
                return None
            finally:
                self._watches.pending.discard(scope)
        raise CheckpointError(closed)  # only ``_Watches.close`` cancels the scope

    def _end_watch(self, steps: AsyncGenerator[int, None]) -> None:
        """Close the async watch ``steps`` on the event-loop thread, where it is still open. Blocking."""
        # A generator collected on the event-loop thread must not block it: asyncio's finalizer of async
        # generators closes ``steps`` once it is collected. Once the loop has stopped, its shutdown has.
        if threading.current_thread() is self._thread or not self._thread.is_alive():
            return
        # Stopped meanwhile (the loop's shutdown closes it), or still running: an interrupted ``next()``
        # whose wait a second interruption cut short, and whose cancellation ends ``steps``.
        with contextlib.suppress(_PortalStopped, RuntimeError):
            _until_done(self._portal, self._thread, steps.aclose, "")

    def wait(self) -> None:
        """Block until every save in flight has ended (none has once closed)."""
        if self._thread.is_alive():
            with contextlib.suppress(_PortalStopped):  # closed meanwhile: nothing is in flight
                _until_done(self._portal, self._thread, self._ckpt.wait, "")

    def close(self, *, cancel: bool = False) -> None:
        """Finish (or cancel) the saves in flight and stop the event-loop thread.

        Safe to call again, and from several threads: the later calls return once it is closed.

        Raises:
            CheckpointError: ``cancel`` is not a bool (nothing is closed then).
        """
        check_flags(cancel=cancel)
        with self._closing:
            if not self._thread.is_alive():
                return
            self._finalizer.detach()
            try:
                _until_done(
                    self._portal, self._thread, lambda: _aclose(self._ckpt, self._watches, cancel), ""
                )
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
        if os.getpid() != self._pid:
            raise CheckpointError(
                f"the Checkpointer of {self._ckpt.root} belongs to process {self._pid}, of which this "
                "process is a fork: make a new one here"
            )
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
    metadata: Mapping[str, str | int | float | bool | None] | None = None,
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
    state: StateT,
    path: str | os.PathLike[str],
    *,
    strict: bool = True,
    allow_pickle: bool = False,
    io: IOConfig | None = None,
    s3: S3Options | None = None,
    rank: int | None = None,
) -> StateT:
    """Load ``path`` into ``state`` in place (``rank``'s per-rank state); see :func:`aiockpt.load`."""

    async def run() -> StateT:
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


def verify(
    path: str | os.PathLike[str],
    *,
    io: IOConfig | None = None,
    progress: Callable[[int, int], object] | None = None,
) -> VerifyReport:
    """Check the checkpoint at ``path`` without loading it; see :func:`aiockpt.verify`.

    Takes the same arguments; ``progress`` is called on this thread (that of the call's event loop).

    Returns:
        A :class:`aiockpt.VerifyReport`: ``report.ok``, or one :class:`aiockpt.CorruptionError` per
        damaged chunk in ``report.problems``.

    Raises:
        CheckpointNotFoundError: ``path`` is not a committed checkpoint, or it was deleted while it was
            verified.
        FormatError: The manifest is not an aiockpt manifest, or has a newer format version.
        StorageError: A data file exists but cannot be opened.
        CheckpointError: ``path`` is empty or an ``s3://`` URL, ``progress`` is not callable, or this
            thread runs an event loop (await :func:`aiockpt.verify` there).
    """

    async def run() -> VerifyReport:
        return await _verify.verify(path, io=io, progress=progress)

    return _run(run, "verify")


def convert(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    to: Target,
    allow_pickle: bool = False,
    drop_non_tensors: bool = False,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    progress: Callable[[int, int], object] | None = None,
    io: IOConfig | None = None,
    rank: int | None = None,
) -> Path:
    """Convert the checkpoint ``src`` into a new one, ``dst``, of format ``to``; see :func:`aiockpt.convert`.

    Takes the same arguments; ``progress`` is called on this thread (that of the call's event loop).

    Returns:
        The absolute path of the new checkpoint.

    Raises:
        CheckpointExistsError: ``dst`` exists.
        CheckpointNotFoundError: ``src`` is not a checkpoint.
        StateError: The source holds what the target cannot (see :func:`aiockpt.convert`).
        FormatError: The source is unreadable.
        StorageError: Writing failed; nothing is left at ``dst``.
        CheckpointError: An argument is invalid (``to``, ``max_shard_size``, ``progress``, a flag that is
            not a bool, a ``rank`` not of the world that saved ``src``), or this thread runs an event loop
            (await :func:`aiockpt.convert` there).
    """

    async def run() -> Path:
        return await _convert.convert(
            src,
            dst,
            to=to,
            allow_pickle=allow_pickle,
            drop_non_tensors=drop_non_tensors,
            max_shard_size=max_shard_size,
            progress=progress,
            io=io,
            rank=rank,
        )

    return _run(run, "convert")
