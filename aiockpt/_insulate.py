"""Native asyncio cancellation turned into anyio cancellation at the public coroutines.

anyio's shielded scopes (clean-up that must finish, a thread whose result owns a resource) hold against
anyio cancellation only. ``task.cancel()``, which ``asyncio.timeout``, ``asyncio.wait_for`` and
``asyncio.run`` (on the tasks left when its coroutine returns) call, raises ``CancelledError`` at
whatever the task awaits, shielded or not. A wait for a worker thread then ends at once while the
thread goes on: a save's clean-up removed its temp directory before the thread made it, or a load
returned while its readers still wrote into the caller's tensors.

So each public coroutine runs its body in a task of its own, in a task group of the caller's task. A
native cancellation of the caller reaches the task group's wait, which cancels the body the anyio way
(its shields hold), waits for it to end, and re-raises the caller's ``CancelledError``, which
``asyncio.timeout`` turns into ``TimeoutError`` as usual.

The caller's frame is not on the child task's stack, so warnings about the call cannot find it by
``stacklevel``: the outermost public call notes where it was made, and :func:`warn_at_caller` warns
there. A blocking facade (``aiockpt.sync``), whose caller is on another thread or outside the event
loop, notes its caller's line itself (:func:`caller_line`, :func:`warnings_at`); the public coroutine
it runs keeps that.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import sys
import warnings
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from contextvars import ContextVar
from typing import Any, ParamSpec, TypeVar

import anyio

P = ParamSpec("P")
T = TypeVar("T")

# Where the outermost public call was made (file, line, the module's globals), in its child task and in
# the tasks that one starts (a background save): warnings about the call point there.
_caller: ContextVar[tuple[str, int, dict[str, Any]] | None] = ContextVar("aiockpt_caller", default=None)
# Set in the child task of a public call, and so in the tasks it starts: a public coroutine called from
# there (Checkpointer.save opening the Checkpointer, say) is insulated already and runs as it is.
_inside: ContextVar[bool] = ContextVar("aiockpt_insulated", default=False)
# The task that made the outermost public call, in its child task and the tasks that one starts.
_outer: ContextVar[asyncio.Task[Any] | None] = ContextVar("aiockpt_outer_task", default=None)


def calling_task() -> asyncio.Task[Any] | None:
    """The task that made the public call this runs in (``None``: not in an asyncio task)."""
    outer = _outer.get()
    if outer is not None:
        return outer
    try:
        return asyncio.current_task()
    except RuntimeError:  # no asyncio loop runs here
        return None


_Line = tuple[str, int, dict[str, Any]]


def caller_line(depth: int) -> _Line | None:
    """Where the frame ``depth`` levels above the caller of this function is (``None``: no such frame)."""
    try:
        frame = sys._getframe(depth + 1)
    except ValueError:
        return None
    return frame.f_code.co_filename, frame.f_lineno, frame.f_globals


@contextlib.contextmanager
def warnings_at(where: _Line | None) -> Iterator[None]:
    """Inside the block, warnings about the public calls made there point at ``where`` (if given)."""
    token = _caller.set(where) if where is not None else None
    try:
        yield
    finally:
        if token is not None:
            _caller.reset(token)


def warn_at_caller(message: str, category: type[Warning]) -> None:
    """Warn as :func:`warnings.warn` does, at the line of the public call this one runs in.

    Outside one (or where it was called from no Python frame), at this function's caller.
    """
    where = _caller.get()
    if where is None:
        warnings.warn(message, category, stacklevel=2)
        return
    filename, lineno, module_globals = where
    warnings.warn_explicit(
        message,
        category,
        filename,
        lineno,
        module=module_globals.get("__name__"),
        registry=module_globals.setdefault("__warningregistry__", {}),
        module_globals=module_globals,
    )


def insulated(fn: Callable[P, Awaitable[T]]) -> Callable[P, Coroutine[Any, Any, T]]:
    """Run ``fn`` in a child task, so that a native cancellation of the caller is an anyio one for it.

    Called from such a child task (or a task it started), ``fn`` runs as it is, in the caller's task.

    Its result or exception reaches the caller as it is (not in an exception group). A cancellation of
    the caller still propagates once ``fn`` has ended, also where ``fn`` completed meanwhile (a save that
    committed, say), as it would with anyio cancellation. A result so lost that has an ``_abandoned()``
    coroutine method is told, and awaited (a :class:`~aiockpt.SaveHandle` of a background save cancels
    that save and waits for it to end).
    """

    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
        if _inside.get():
            return await fn(*args, **kwargs)
        results: list[T] = []
        failures: list[BaseException] = []
        outer = calling_task()

        async def body() -> None:
            _inside.set(True)  # in this task's own context (a copy of the caller's)
            _outer.set(outer)
            try:
                results.append(await fn(*args, **kwargs))
            except anyio.get_cancelled_exc_class() as exc:
                if tg.cancel_scope.cancel_called:
                    raise
                # Raised by code ``fn`` called (a Stateful's state_dict, say), with nothing cancelled:
                # the task group would swallow it, and the caller get no outcome at all.
                failures.append(exc)
            except BaseException as exc:  # handed to the caller as is, KeyboardInterrupt included
                failures.append(exc)

        token = None
        if _caller.get() is None:  # (else a blocking facade noted its caller's line: see warnings_at)
            where = caller_line(1)  # the awaiting frame: the caller's code (None: driven from C)
            if where is not None:
                token = _caller.set(where)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(body)
        except BaseException:
            # The caller was cancelled (or interrupted) after ``fn`` returned: the result never reaches
            # it. What it started must not go on unseen (a background save would still commit, and hold
            # its in-flight slot meanwhile), and is ended before the caller's cancellation goes on, as
            # ``fn`` itself would have been.
            for result in results:
                abandoned = getattr(result, "_abandoned", None)
                if abandoned is not None:
                    with anyio.CancelScope(shield=True):
                        await abandoned()
            raise
        finally:
            if token is not None:
                _caller.reset(token)
        if failures:
            failure = failures.pop()
            try:
                raise failure
            finally:
                del failure  # no cycle through this frame's traceback
        return results[0]

    return wrapper
