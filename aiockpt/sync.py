"""Blocking facade for synchronous training loops.

:class:`Checkpointer` runs an asyncio event loop in a background thread (through an anyio blocking
portal) and forwards every call to an :class:`aiockpt.Checkpointer` living there, so background saves go
on while the training loop computes. The module-level functions run one operation to completion.
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
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
from ._storage import Location

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["Checkpointer", "SyncSaveHandle", "load", "read", "save"]

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

    # A daemon thread: an unclosed Checkpointer must not keep the interpreter alive at exit.
    thread = threading.Thread(target=run, name="aiockpt-sync", daemon=True)
    thread.start()
    got = ready.get()
    if isinstance(got, BaseException):
        raise got
    return got, thread


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
            self._portal.call(self._cancel)

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
        future = self._portal.start_task_soon(self._handle.wait)
        return future.result(timeout)


class Checkpointer:
    """The blocking twin of :class:`aiockpt.Checkpointer`; use it as a context manager.

    Takes the same arguments. Background saves run on a private event-loop thread.
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
    ) -> None:
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
        )
        self._portal, self._thread = _start_portal()
        try:
            self._portal.call(self._ckpt.open)
        except BaseException:
            self._stop()
            raise

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
            self._portal.call(self._ckpt.wait)

    def close(self, *, cancel: bool = False) -> None:
        """Finish (or cancel) the saves in flight and stop the event-loop thread."""
        if not self._thread.is_alive():
            return
        try:
            self._portal.call(lambda: self._ckpt.aclose(cancel=cancel))
        finally:
            self._stop()

    def _call(self, call: Callable[[], Awaitable[T]]) -> T:
        """``call()`` run on the event-loop thread, its result returned.

        Raises:
            CheckpointError: The Checkpointer is closed (its event-loop thread has stopped).
        """
        if not self._thread.is_alive():
            raise CheckpointError(f"the Checkpointer of {self._ckpt.root} is closed")
        return self._portal.call(call)

    def _stop(self) -> None:
        self._portal.call(self._portal.stop)
        self._thread.join()


def save(
    state: Mapping[str, object],
    path: str | os.PathLike[str],
    *,
    allow_pickle: bool = False,
    metadata: dict[str, str | int | float | bool | None] | None = None,
    io: IOConfig | None = None,
) -> Metadata:
    """Save ``state`` to ``path`` and return once durable; see :func:`aiockpt.save`."""

    async def run() -> Metadata:
        return await _api.save(state, path, allow_pickle=allow_pickle, metadata=metadata, io=io)

    return _run(run, "save")


def load(
    state: MutableMapping[str, object],
    path: str | os.PathLike[str],
    *,
    strict: bool = True,
    allow_pickle: bool = False,
    io: IOConfig | None = None,
) -> MutableMapping[str, object]:
    """Load ``path`` into ``state`` in place; see :func:`aiockpt.load`."""

    async def run() -> MutableMapping[str, object]:
        return await _api.load(state, path, strict=strict, allow_pickle=allow_pickle, io=io)

    return _run(run, "load")


def read(
    path: str | os.PathLike[str], *, allow_pickle: bool = False, io: IOConfig | None = None
) -> dict[Key, object]:
    """Read ``path`` as a fresh tree of CPU tensors; see :func:`aiockpt.read`."""

    async def run() -> dict[Key, object]:
        return await _api.read(path, allow_pickle=allow_pickle, io=io)

    return _run(run, "read")
