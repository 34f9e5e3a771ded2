"""Graceful preemption: on SIGTERM, let the saves in flight finish (and save once more) before exiting."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType

import anyio

from ._checkpointer import Checkpointer


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
        final_save: Returns ``(state, step)`` to save one last time after a signal, or ``None``.
        signals: The signals to handle (default: SIGTERM).
        cancel: Cancel the block when the signal arrives instead of waiting for it to check
            :attr:`requested`.
        exit: Raise ``SystemExit`` after the final save.
    """

    def __init__(
        self,
        ckpt: Checkpointer,
        *,
        final_save: Callable[[], tuple[Mapping[str, object], int]] | None = None,
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
        self._requested_event = anyio.Event()

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
        loop = asyncio.get_running_loop()
        for sig in self.signals:
            loop.add_signal_handler(sig, self._on_signal, sig)
        self._scope.__enter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        swallowed = bool(self._scope.__exit__(exc_type, exc, tb))
        loop = asyncio.get_running_loop()
        for sig in self.signals:
            loop.remove_signal_handler(sig)
        if not self.requested or (exc_type is not None and not swallowed):
            return swallowed  # no signal, or the block failed: its exception goes on
        with anyio.CancelScope(shield=True):
            await self.ckpt.wait()
            if self.final_save is not None:
                state, step = self.final_save()
                await self.ckpt.refresh()
                if step not in self.ckpt.steps():
                    await self.ckpt.save(state, step=step)
        if self.exit:
            assert self.signal is not None
            raise SystemExit(128 + int(self.signal))
        return swallowed
