"""Graceful preemption: on SIGTERM, let the saves in flight finish (and save once more) before exiting."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import FrameType, TracebackType
from typing import Any, cast

import anyio

from ._checkpointer import Checkpointer
from ._errors import CheckpointError
from ._options import check_flags

# What ``signal.getsignal`` returns.
_Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


class Preemption:
    """An async context manager that turns a termination signal into a clean, checkpointed exit.

    Schedulers (Kubernetes, Slurm, spot instances) send SIGTERM some seconds before killing a job.
    Inside ``async with Preemption(ckpt) as preemption:`` the signal sets :attr:`requested` (the training
    loop checks it at a step boundary and leaves the block), or with ``cancel=True`` cancels the block at
    its next ``await``. Leaving the block after a signal then, shielded from cancellation: waits for
    every save in flight to commit, calls ``final_save()`` and saves what it returns (unless that step is
    committed already), and raises ``SystemExit(128 + signal)`` (with ``exit=False`` it returns instead).

    :attr:`requested` is set by a Python signal handler, which runs on the main thread between two
    bytecodes, not by the event loop: a loop of synchronous steps that never awaits sees it at its next
    check. Until the block is left, a repeated signal is ignored; a signal that arrives once the block
    was left without one goes to the handler from before, which is back in place (unless the application
    installed one of its own inside the block: that one stays).

    Example::

        async with aiockpt.Preemption(ckpt, final_save=lambda: (state, step)) as preemption:
            while step < total and not preemption.requested:
                step = train_one_step(step)  # synchronous: no await needed

    Args:
        ckpt: The Checkpointer whose saves must not be lost.
        final_save: Called after a signal; returns ``(state, step)`` to save one last time, or ``None``
            to save nothing more. ``None`` in its place saves nothing more either.
        signals: The signals to handle (default: SIGTERM): a sequence of them, or one signal.
        cancel: Cancel the block when the signal arrives instead of waiting for it to check
            :attr:`requested`.
        exit: Raise ``SystemExit`` after the final save.

    Raises:
        CheckpointError: An argument has a wrong type (``ckpt`` not an :class:`aiockpt.Checkpointer`, a
            signal not a signal number, ``signals`` neither a signal nor a sequence of them (a str),
            ``final_save`` not callable, a flag not a bool; names it). On
            entering the block: a signal cannot be handled (SIGKILL), or this is not the main thread
            (where Python runs signal handlers).
    """

    def __init__(
        self,
        ckpt: Checkpointer,
        *,
        final_save: Callable[[], tuple[Mapping[str, object], int] | None] | None = None,
        signals: signal.Signals | Sequence[signal.Signals] = (signal.SIGTERM,),
        cancel: bool = False,
        exit: bool = True,
    ) -> None:
        if not isinstance(ckpt, Checkpointer):
            raise CheckpointError(f"Preemption needs an aiockpt.Checkpointer, not {type(ckpt).__name__}")
        if final_save is not None and not callable(final_save):
            raise CheckpointError(f"final_save must be callable or None, not {final_save!r}")
        check_flags(cancel=cancel, exit=exit)
        given: object = signals  # (what a caller passes, whatever the annotation says)
        if isinstance(given, int) and not isinstance(given, bool):
            given = (given,)  # one signal, as signal.signal takes it
        elif isinstance(given, str | bytes) or not isinstance(given, Iterable):
            raise CheckpointError(
                f"signals must be a signal number or a sequence of them (signal.SIGTERM, ...), not {given!r}"
            )
        chosen = tuple(given)
        for sig in chosen:
            if isinstance(sig, bool) or not isinstance(sig, int) or sig not in signal.valid_signals():
                raise CheckpointError(f"signals must hold signal numbers (signal.SIGTERM, ...), not {sig!r}")
        self.ckpt = ckpt
        self.final_save = final_save
        # Once each: a second entry took the first for "before".
        self.signals = cast("tuple[signal.Signals, ...]", tuple(dict.fromkeys(chosen)))
        self.cancel = cancel
        self.exit = exit
        self.requested = False
        self.signal: signal.Signals | None = None
        # Made on entering (or by wait()), in a running loop: anyio's cannot be made outside one, and a
        # Preemption may be made before the loop runs, as a Checkpointer may.
        self._scope: anyio.CancelScope | None = None
        self._used = False  # entered before (the next entry starts afresh)
        self._requested_event: anyio.Event | None = None
        # Per signal, what handled it before: an asyncio handler of the loop, else Python's handler.
        self._before: dict[signal.Signals, tuple[asyncio.Handle | None, _Handler]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    async def wait(self) -> signal.Signals:
        """Wait until a signal is received; return it."""
        await self._event().wait()
        assert self.signal is not None
        return self.signal

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        """The handler (a Python one: it runs on the main thread, wherever that is in its code)."""
        if self.requested:
            return
        self.requested, self.signal = True, signal.Signals(signum)
        # The event and the cancel scope belong to the loop, which this may have interrupted mid-way.
        assert self._loop is not None  # (installed by __aenter__, which sets it)
        self._loop.call_soon_threadsafe(self._notify)

    def _event(self) -> anyio.Event:
        if self._requested_event is None:
            self._requested_event = anyio.Event()
        return self._requested_event

    def _notify(self) -> None:
        self._event().set()
        if self.cancel and self._scope is not None:
            self._scope.cancel()

    async def __aenter__(self) -> Preemption:
        if self._used:
            # Entered before: a cancel scope serves one block, and a signal the last block handled
            # must not end this one at once.
            self._requested_event = None
            self.requested, self.signal = False, None
        self._scope = scope = anyio.CancelScope()
        loop = self._loop = asyncio.get_running_loop()
        # asyncio keeps its handlers in a private table: the only place to find an application's own.
        handlers: dict[int, asyncio.Handle] = getattr(loop, "_signal_handlers", {})
        try:
            for sig in self.signals:
                handle = handlers.get(sig)
                before = (handle, signal.getsignal(sig))
                if handle is not None:  # (its Python handler is asyncio's no-op: the loop runs it)
                    loop.remove_signal_handler(sig)
                try:
                    signal.signal(sig, self._on_signal)
                except BaseException as exc:
                    if handle is not None:
                        loop.add_signal_handler(sig, handle._callback, *handle._args)  # type: ignore[attr-defined]
                    if isinstance(exc, OSError | ValueError):  # SIGKILL, say, or not the main thread
                        raise CheckpointError(
                            f"Preemption cannot handle {signal.Signals(sig).name}: {exc}"
                        ) from exc
                    raise
                self._before[sig] = before
        except BaseException:
            self._restore()  # those taken already (a signal that cannot be handled: SIGKILL, say)
            raise
        scope.__enter__()
        self._used = True
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        # The handlers stay until the final save is done: a repeated signal (Slurm sends SIGTERM again
        # at the time limit) is ignored meanwhile, where the default action would kill the process.
        try:
            assert self._scope is not None  # (made by __aenter__)
            swallowed = bool(self._scope.__exit__(exc_type, exc, tb))
            if exc_type is not None and not swallowed:
                return swallowed  # the block failed: its exception goes on
            if not self.requested:
                # The handlers go back first, then ``requested`` is read again: a signal that came in
                # between was handled here (it is acted on), one that comes later by the handler before.
                self._restore()
                if not self.requested:
                    return swallowed
            with anyio.CancelScope(shield=True):
                await self.ckpt.wait()
                last = self.final_save() if self.final_save is not None else None
                if last is not None:
                    state, step = last
                    await self.ckpt.refresh()
                    if step not in self.ckpt.steps():
                        await self.ckpt.save(state, step=step)
        finally:
            self._restore()
        if self.exit:
            assert self.signal is not None
            raise SystemExit(128 + int(self.signal))
        return swallowed

    def _restore(self) -> None:
        """Give each signal back to what handled it before (the default action if nothing did).

        A signal whose handler is no longer this block's was given a handler of the application's inside
        the block (``loop.add_signal_handler`` for a server started there, say): it keeps that one.
        """
        for sig, (handle, handler) in self._before.items():
            if signal.getsignal(sig) != self._on_signal:
                continue
            if handle is not None:  # an asyncio handler of the application's (Handle's fields are private)
                assert self._loop is not None
                self._loop.add_signal_handler(sig, handle._callback, *handle._args)  # type: ignore[attr-defined]
            else:  # (None: a handler installed outside Python; the default action is the nearest)
                signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        self._before.clear()
