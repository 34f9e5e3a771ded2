"""A per-event-loop task group that hosts background saves (``async_op=True``) and other background work.

A background save must outlive the call that started it, so it cannot live in the caller's task. Each
running asyncio loop gets one long-lived task owning an anyio task group; saves are started into it with
``tg.start``, which returns once the save reports "staged". When the loop shuts down (``asyncio.run``
cancels leftover tasks) the group is cancelled and every unfinished save aborts cleanly, with a
``RuntimeWarning`` naming it: its caller never waited for it.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import anyio
import anyio.abc

from ._errors import CheckpointError
from ._handle import Interrupted, Metadata, SaveHandle, SaveState
from ._insulate import calling_task


class _Runner:
    def __init__(self) -> None:
        self.tg: anyio.abc.TaskGroup | None = None
        self.task: asyncio.Task[None] | None = None
        # Set once ``tg`` exists. The runner is registered before its task first runs, so a second
        # save started meanwhile finds it without a task group yet and must wait for this too.
        self.ready = anyio.Event()

    async def serve(self) -> None:
        async with anyio.create_task_group() as tg:
            self.tg = tg
            self.ready.set()
            await anyio.sleep_forever()


_runners: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Runner] = weakref.WeakKeyDictionary()


def _usable(runner: _Runner) -> bool:
    """Whether a save started into ``runner`` now would run, rather than be cancelled with it.

    Its task is cancelled when the loop ends (``asyncio.run`` cancels every task left), but also by an
    application that cancels every other task and then goes on: saves it starts after that get a new
    runner. The cancellation is pending until the task next runs (``cancelling()``; on Python 3.10, the
    task's ``_must_cancel``), then its task group's scope is cancelled while it winds down. A caller
    that is being cancelled itself (a task saving on its way out as the loop ends) still starts into the
    ending runner, where its save is cancelled and says so: a new runner would be left pending as the
    loop closes, its save neither finished nor cleaned up.
    """
    task = runner.task
    if task is None or task.done():
        return False
    if not (_cancelling(task) or (runner.tg is not None and runner.tg.cancel_scope.cancel_called)):
        return True
    caller = calling_task()
    return caller is not None and _cancelling(caller)


def _cancelling(task: asyncio.Task[Any]) -> bool:
    """Whether ``task`` has a cancellation pending or in progress."""
    cancelling = getattr(task, "cancelling", None)  # Python 3.11+
    return bool(cancelling() if cancelling is not None else getattr(task, "_must_cancel", False))


async def _runner() -> _Runner:
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        raise CheckpointError("async_op=True needs a running asyncio event loop") from None
    runner = _runners.get(loop)
    if runner is None or not _usable(runner):
        runner = _Runner()
        runner.task = loop.create_task(runner.serve(), name="aiockpt-background-saves")
        _runners[loop] = runner
    await runner.ready.wait()
    return runner


async def start_background(
    handle: SaveHandle, body: Callable[[Callable[[SaveState], None]], Awaitable[Metadata]]
) -> SaveHandle:
    """Run ``body`` as ``handle``'s save in the background; return once it is staged.

    Raises:
        BaseException: Whatever the save raised before it was staged (``KeyboardInterrupt`` and
            ``SystemExit`` included).
    """
    runner = await _runner()
    assert runner.tg is not None
    handle._background = True
    handle._starting = True
    interrupt: BaseException | None = None
    try:
        result: SaveHandle = await runner.tg.start(handle._drive, body)
    except Interrupted as carried:
        interrupt = carried.interrupt
    finally:
        handle._starting = False
    if interrupt is not None:
        raise interrupt  # (outside the except clause: no context from the carrier)
    return result


async def start_soon(work: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run ``work`` in the background, in the event loop's task group; return at once.

    ``work`` must not raise but for cancellation: an exception would cancel every background save.
    """
    runner = await _runner()
    assert runner.tg is not None
    runner.tg.start_soon(work)
