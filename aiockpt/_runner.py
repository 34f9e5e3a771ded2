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


def _ending(runner: _Runner) -> bool:
    """Whether ``runner`` has ended or is ending: a save started into it now would be cancelled.

    Its task is cancelled when the loop ends (``asyncio.run`` cancels every task left), but also by an
    application that cancels every other task and then goes on: saves started after that get a runner
    of their own. The cancellation is pending until the task next runs (``cancelling()``; on Python
    3.10, the task's ``_must_cancel``), then its task group's scope is cancelled while it winds down.
    """
    task = runner.task
    if task is None or task.done():
        return True
    cancelling = getattr(task, "cancelling", None)
    if cancelling() if cancelling is not None else getattr(task, "_must_cancel", False):
        return True
    return runner.tg is not None and runner.tg.cancel_scope.cancel_called


async def _runner() -> _Runner:
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        raise CheckpointError("async_op=True needs a running asyncio event loop") from None
    runner = _runners.get(loop)
    if runner is None or _ending(runner):
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
