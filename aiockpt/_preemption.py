"""Graceful preemption: on SIGTERM, let the saves in flight finish (and save once more) before exiting."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable, Mapping, Sequence
from types import FrameType, TracebackType
from typing import Any

import anyio

from ._checkpointer import Checkpointer

# What ``signal.getsignal`` returns.
_Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


class Preemption:
    """An async context manager that turns a termination signal into a clean, checkpointed exit.

    Schedulers (Kubernetes, Slurm, spot instances) send SIGTERM some seconds before killing a job.
    Inside ``async with Preemption(ckpt) as preemption:`` the signal sets :attr:`requested` (the training
    loop checks it at a step boundary and leaves the block), or with ``cancel=True`` cancels the block at
    once. Leaving the block after a signal then, shielded from cancellation: waits for every save in
    flight to commit, calls ``final_save()`` and saves what it returns (unless that step is committed
    already), and raises ``SystemExit(128 + signal)`` (with ``exit=False`` it returns instead).

    Example::

        async with aiockpt.Preemption(ckpt, final_save=lambda: (state, step)) as preemption:
            while step < total and not preemption.requested:
                step = train_one_step(step)

    Args:
        ckpt: The Checkpointer whose saves must not be lost.
        final_save: Called after a signal; returns ``(state, step)`` to save one last time, or ``None``
            to save nothing more. ``None`` in its place saves nothing more either.
        signals: The signals to handle (default: SIGTERM).
        cancel: Cancel the block when the signal arrives instead of waiting for it to check
            :attr:`requested`.
        exit: Raise ``SystemExit`` after the final save.
    """

    def __init__(
        self,
        ckpt: Checkpointer,
        *,
        final_save: Callable[[], tuple[Mapping[str, object], int] | None] | None = None,
        signals: Sequence[signal.Signals] = (signal.SIGTERM,),
        cancel: bool = False,
        exit: bool = True,
    ) -> None:
        self.ckpt = ckpt
        self.final_save = final_save
        self.signals = tuple(signals)
        self.cancel = cancel
        self.exit = exit
        self.requested = False
        self.signal: signal.Signals | None = None
        self._scope = anyio.CancelScope()
        self._used = False  # entered before (the next entry starts afresh)
        self._requested_event = anyio.Event()
        # Per signal, what handled it before: an asyncio handler of the loop, else Python's handler.
        self._before: dict[signal.Signals, tuple[asyncio.Handle | None, _Handler]] = {}

    async def wait(self) -> signal.Signals:
        """Wait until a signal is received; return it."""
        await self._requested_event.wait()
        assert self.signal is not None
        return self.signal

    def _on_signal(self, sig: signal.Signals) -> None:
        if self.requested:
            return
        self.requested, self.signal = True, sig
        self._requested_event.set()
        if self.cancel:
            self._scope.cancel()

    async def __aenter__(self) -> Preemption:
        if self._used:
            # Entered before: a cancel scope serves one block, and a signal the last block handled
            # must not end this one at once.
            self._scope = anyio.CancelScope()
            self._requested_event = anyio.Event()
            self.requested, self.signal = False, None
        loop = asyncio.get_running_loop()
        # asyncio keeps its handlers in a private table: the only place to find an application's own.
        handlers: dict[int, asyncio.Handle] = getattr(loop, "_signal_handlers", {})
        try:
            for sig in self.signals:
                before = (handlers.get(sig), signal.getsignal(sig))
                loop.add_signal_handler(sig, self._on_signal, sig)
                self._before[sig] = before
        except BaseException:
            self._restore()  # those taken already (a signal that cannot be handled: SIGKILL, say)
            raise
        self._scope.__enter__()
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
            swallowed = bool(self._scope.__exit__(exc_type, exc, tb))
            if not self.requested or (exc_type is not None and not swallowed):
                return swallowed  # no signal, or the block failed: its exception goes on
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
        """Give each signal back to what handled it before (the default action if nothing did)."""
        loop = asyncio.get_running_loop()
        for sig, (handle, handler) in self._before.items():
            loop.remove_signal_handler(sig)
            if handle is not None:  # an asyncio handler of the application's (Handle's fields are private)
                loop.add_signal_handler(sig, handle._callback, *handle._args)  # type: ignore[attr-defined]
            elif handler is not None:  # (None: a handler installed outside Python, left as it is)
                signal.signal(sig, handler)
        self._before.clear()
