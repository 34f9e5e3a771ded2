"""Save handles, their states and metrics, and the metadata of a committed checkpoint."""

from __future__ import annotations

import contextlib
import enum
import time
import warnings
from collections.abc import Awaitable, Callable, Generator, Iterator
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import anyio
import anyio.abc
import msgspec

from ._errors import CheckpointCancelledError, SaveSkippedError
from ._format import FileInfo, Manifest


class Metadata(msgspec.Struct, frozen=True, kw_only=True):
    """What a committed checkpoint holds and how long saving it took.

    Attributes:
        path: The checkpoint directory.
        step: The training step, if saved with one.
        world_size: Ranks that took part in the save.
        nbytes: Tensor bytes in the checkpoint (replicated tensors counted once).
        num_tensors: Logical tensors in the checkpoint.
        files: Data files and their sizes.
        created_at: Unix time of the commit.
        manifest_crc32c: Checksum of the manifest body.
        timings: Seconds spent in each phase: ``stage``, ``local_plan``, ``global_plan``, ``write``,
            ``finish``; and ``wait``, in none of them, waiting for other saves (see
            :attr:`SaveMetrics.seconds`).
        written_bytes: Bytes this rank wrote to data files.
        direct_bytes: Of ``written_bytes``, those written with ``O_DIRECT`` (see
            :attr:`SaveMetrics.direct_bytes`).
        user_metadata: The ``metadata=`` given to the save.

    Read back from a committed checkpoint (:func:`aiockpt.read_metadata`), ``timings`` is empty and
    ``written_bytes`` and ``direct_bytes`` are 0: they describe a save as it ran, and are not stored.
    """

    path: str
    step: int | None
    world_size: int
    nbytes: int
    num_tensors: int
    files: tuple[FileInfo, ...]
    created_at: float
    manifest_crc32c: int
    timings: dict[str, float]
    written_bytes: int = 0
    direct_bytes: int = 0
    user_metadata: dict[str, str | int | float | bool | None] = {}

    @classmethod
    def of(
        cls, path: str, manifest: Manifest, crc: int, nbytes: int, metrics: SaveMetrics | None = None
    ) -> Metadata:
        """The metadata of the checkpoint at ``path`` that ``manifest`` describes.

        ``crc`` is the checksum of the manifest's body, ``nbytes`` its tensor bytes; how the save ran
        comes from ``metrics`` (``None``: read back from a committed checkpoint, where it is not stored).
        """
        return cls(
            path=path,
            step=manifest.step,
            world_size=manifest.world_size,
            nbytes=nbytes,
            num_tensors=len(manifest.tensors),
            files=manifest.files,
            created_at=manifest.created_at,
            manifest_crc32c=crc,
            timings={} if metrics is None else dict(metrics.seconds),
            written_bytes=0 if metrics is None else metrics.written_bytes,
            direct_bytes=0 if metrics is None else metrics.direct_bytes,
            user_metadata=dict(manifest.user_metadata),
        )


class SaveState(enum.Enum):
    """Where a save is. ``COMMITTED``, ``FAILED``, ``CANCELLED`` and ``SKIPPED`` are final."""

    STAGING = "staging"
    STAGED = "staged"
    WRITING = "writing"
    COMMITTED = "committed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    SKIPPED = "skipped"


_FINAL = frozenset({SaveState.COMMITTED, SaveState.FAILED, SaveState.CANCELLED, SaveState.SKIPPED})


@dataclass
class SaveMetrics:
    """Per-phase seconds and bytes of one save, filled in as it runs.

    Attributes:
        seconds: Phase name -> seconds (``stage``, ``local_plan``, ``global_plan``, ``write``, ``finish``),
            and ``wait``: the seconds the save waited for others meanwhile (an in-flight slot, staging
            memory within ``staging_budget``, the deletions of retention), counted in no phase.
        staging_seconds: Seconds from the call until the state could be mutated again.
        total_seconds: Seconds from the call until the checkpoint was committed (or the save ended).
        nbytes: Tensor bytes in the state.
        staged_bytes: Bytes copied into staging buffers.
        written_bytes: Bytes this rank wrote to data files.
        direct_bytes: Of ``written_bytes``, those written with ``O_DIRECT`` (``IOConfig.direct_writes``),
            around the page cache; the rest went through it (small blocks, unaligned ends, and every
            byte where the file system or the memory refused direct I/O).
    """

    seconds: dict[str, float] = field(default_factory=dict)
    staging_seconds: float = 0.0
    total_seconds: float = 0.0
    nbytes: int = 0
    staged_bytes: int = 0
    written_bytes: int = 0
    direct_bytes: int = 0
    _t0: float = field(default_factory=time.perf_counter, init=False, repr=False)
    _mark: float = field(default=0.0, init=False, repr=False)
    _waited: float = field(default=0.0, init=False, repr=False)  # in the running phase, not counted in it

    def phase(self, name: str) -> None:
        """Close the running phase as ``name`` (less what it waited, see :meth:`waiting`)."""
        now = time.perf_counter()
        self.seconds[name] = now - (self._mark or self._t0) - self._waited
        self._mark, self._waited = now, 0.0

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Count the block as ``wait``, not as the phase it runs in (waits for other saves' resources)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            spent = time.perf_counter() - start
            self._waited += spent
            self.seconds["wait"] = self.seconds.get("wait", 0.0) + spent

    def staged(self) -> None:
        """Record that the state may be mutated from now on."""
        self.staging_seconds = time.perf_counter() - self._t0

    def ended(self) -> None:
        """Record the end of the save."""
        self.total_seconds = time.perf_counter() - self._t0


class Interrupted(Exception):
    """Carries a ``KeyboardInterrupt`` or ``SystemExit`` raised by a background save before it was staged.

    The save runs in a task of its own; raised there, asyncio would stop the event loop with it. It is
    raised instead in the task that started the save, as any failure before staging is.
    """

    def __init__(self, interrupt: BaseException) -> None:
        super().__init__(repr(interrupt))
        self.interrupt = interrupt


class SaveHandle:
    """A save in flight. ``await handle`` returns its :class:`Metadata` once the checkpoint is durable.

    Raises (on await):
        CheckpointCancelledError: The save was cancelled before it committed.
        SaveSkippedError: The save was skipped by ``on_busy="skip"``.
        CheckpointError: Any failure of the save, as raised by it.
    """

    def __init__(self, *, path: str, step: int | None) -> None:
        self.path = path
        self.step = step
        self.metrics = SaveMetrics()
        self._state = SaveState.STAGING
        self._done = anyio.Event()
        self._metadata: Metadata | None = None
        self._error: BaseException | None = None
        # The error's traceback as the save left it: raised again from there by every await, which would
        # otherwise add its own frames to the one exception's traceback, each time more.
        self._error_tb: TracebackType | None = None
        self._scope: anyio.CancelScope | None = None
        self._cancelled = False  # cancel() was called: a scope entered later starts cancelled
        self._background = False  # run in the loop's task group of background saves (see _runner)
        self._starting = False  # its starter waits in tg.start(): no handle has reached the caller yet

    def __repr__(self) -> str:
        return f"<SaveHandle step={self.step} path={self.path!r} state={self._state.value}>"

    @property
    def state(self) -> SaveState:
        """Where the save is now."""
        return self._state

    @property
    def skipped(self) -> bool:
        """Whether ``on_busy="skip"`` dropped this save."""
        return self._state is SaveState.SKIPPED

    def done(self) -> bool:
        """Whether the save has ended (committed, failed, cancelled or skipped)."""
        return self._state in _FINAL

    def cancel(self) -> None:
        """Ask the save to stop. Before the commit point it aborts cleanly; once committing, it completes."""
        if self.done():
            return
        self._cancelled = True
        if self._scope is not None:
            self._scope.cancel()

    async def _abandoned(self) -> None:
        """The call that started this save was cancelled as it returned: this handle never reached it.

        The save is cancelled as by :meth:`cancel` (so it completes only where it is committing already)
        and waited for: no save goes on that nobody can see or wait for, holding its in-flight slot (see
        ``_insulate``).
        """
        self.cancel()
        await self._done.wait()

    async def wait(self) -> Metadata:
        """Wait until the save ends; return its metadata or raise its failure (see the class docstring)."""
        await self._done.wait()
        return self._outcome()

    def _outcome(self) -> Metadata:
        """The metadata of an ended save, or its failure raised (see :meth:`wait`)."""
        assert self.done()
        if self._state is SaveState.SKIPPED:
            raise SaveSkippedError(f"the save of step {self.step} was skipped: max_inflight saves were busy")
        if self._state is SaveState.CANCELLED:
            raise CheckpointCancelledError(f"the save to {self.path} was cancelled before it committed")
        if self._error is not None:
            raise self._error.with_traceback(self._error_tb)
        assert self._metadata is not None
        return self._metadata

    def __await__(self) -> Generator[Any, None, Metadata]:
        return self.wait().__await__()

    def _set_state(self, state: SaveState) -> None:
        if not self.done():
            self._state = state

    def _finish(
        self, state: SaveState, *, metadata: Metadata | None = None, error: BaseException | None = None
    ) -> None:
        if self.done():
            return
        self._state, self._metadata, self._error = state, metadata, error
        self._error_tb = error.__traceback__ if error is not None else None
        self.metrics.ended()
        self._done.set()

    @contextlib.contextmanager
    def _cancellable(self) -> Iterator[anyio.CancelScope]:
        """A cancel scope that :meth:`cancel` cancels, also when it was called before the scope began.

        The save runs in one; so does its wait for a free in-flight slot, before it runs.
        """
        with anyio.CancelScope() as scope:
            self._scope = scope
            if self._cancelled:
                scope.cancel()
            yield scope

    @classmethod
    def _skipped(cls, *, path: str, step: int | None) -> SaveHandle:
        handle = cls(path=path, step=step)
        handle._finish(SaveState.SKIPPED)
        return handle

    async def _drive(
        self,
        body: Callable[[Callable[[SaveState], None]], Awaitable[Metadata]],
        *,
        task_status: anyio.abc.TaskStatus[SaveHandle] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Run ``body(report)`` as this handle's save; report "started" once it is staged.

        A failure before staging is raised to whoever started the save; after staging it is kept for
        ``await handle``. Cancellation by :meth:`cancel` ends here; any other cancellation propagates.
        """
        started = False

        def report(state: SaveState) -> None:
            nonlocal started
            self._set_state(state)
            if state is SaveState.STAGED:
                self.metrics.staged()
                started = True
                task_status.started(self)

        with self._cancellable() as scope:
            try:
                metadata = await body(report)
            except anyio.get_cancelled_exc_class():
                self._finish(SaveState.CANCELLED)
                if self._background and started and not self._cancelled and not self._starting:
                    # Not by cancel() (nor aclose(cancel=True), which calls it), nor with its starter
                    # (cancelled after the save reported "staged" but before tg.start() returned, which
                    # then cancels the save and raises: the handle never reached the caller): the task
                    # of the loop's background saves was cancelled, which asyncio.run does to a loop
                    # ending, and an application's "cancel every other task" too.
                    warnings.warn(
                        f"the save to {self.path} was cancelled before it committed: aiockpt's task for "
                        "background saves was cancelled with it in flight, as asyncio.run does when its "
                        "loop ends (await the handle, or close its Checkpointer, before that)",
                        RuntimeWarning,
                        stacklevel=1,
                    )
                raise
            except Exception as exc:
                self._finish(SaveState.FAILED, error=exc)
                if not started:
                    raise
                return
            except BaseException as exc:  # KeyboardInterrupt, SystemExit (from a Stateful, say)
                self._finish(SaveState.FAILED, error=exc)
                if self._starting and not started:
                    # Raised in this task, asyncio would stop the event loop with it: carried to the
                    # task that started the save instead, and raised there (see _runner).
                    raise Interrupted(exc) from None
                raise
            self._finish(SaveState.COMMITTED, metadata=metadata)
        if scope.cancelled_caught and not started:
            raise CheckpointCancelledError(f"the save to {self.path} was cancelled while staging")
