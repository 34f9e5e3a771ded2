"""asyncio's own cancellation (``task.cancel()``, ``asyncio.timeout``, ``asyncio.wait_for``).

anyio's shields do not hold against it: before the public coroutines ran their bodies in a task of their
own, a save cancelled while a worker thread made its temp dir returned at once, the thread then left the
temp dir behind, and a load returned while its thread still ran on the caller's objects.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from anyio.from_thread import BlockingPortal

import aiockpt
import aiockpt._save
import aiockpt._save._write
from aiockpt import Checkpointer, SaveState

_HOLD_S = 0.3


def _state() -> dict[str, object]:
    return {"w": torch.arange(1 << 16, dtype=torch.float32), "step": 3}


def _leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith(".tmp"))


class _Gate:
    """Holds a worker thread in a patched call until released; records whether the call has returned."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.go = threading.Event()
        self.returned = threading.Event()

    def hold(self, call: Callable[[], object]) -> object:
        try:
            return call()
        finally:
            self.entered.set()
            assert self.go.wait(10), "the test never released the gate"
            self.returned.set()

    async def wait_entered(self) -> None:
        assert await anyio.to_thread.run_sync(self.entered.wait, 10), "the patched call never ran"

    def release_later(self) -> threading.Timer:
        timer = threading.Timer(_HOLD_S, self.go.set)
        timer.start()
        return timer


@pytest.fixture
def gated_prepare(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Gate]:
    """A save's temp dir is made by a worker thread that then waits at the gate."""
    gate = _Gate()
    real = aiockpt._save._prepare_target
    monkeypatch.setattr(aiockpt._save, "_prepare_target", lambda path: gate.hold(lambda: real(path)))
    yield gate
    gate.go.set()


async def test_task_cancel_waits_for_the_thread_and_leaves_no_temp_dir(
    tmp_path: Path, gated_prepare: _Gate
) -> None:
    task = asyncio.create_task(aiockpt.save(_state(), tmp_path / "c"))
    await gated_prepare.wait_entered()
    timer = gated_prepare.release_later()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # The call ended only once its thread had, and its clean-up then removed what the thread made.
    assert gated_prepare.returned.is_set()
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    timer.join()
    await anyio.sleep(0.05)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.skipif(sys.version_info < (3, 11), reason="asyncio.timeout is new in Python 3.11")
async def test_asyncio_timeout_raises_timeout_error_and_leaves_no_temp_dir(
    tmp_path: Path, gated_prepare: _Gate
) -> None:
    timeout: Any = getattr(asyncio, "timeout")  # noqa: B009 (mypy checks for Python 3.10)
    timer = gated_prepare.release_later()
    with pytest.raises(TimeoutError):
        async with timeout(0.05):
            await aiockpt.save(_state(), tmp_path / "c")
    assert gated_prepare.returned.is_set()
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    timer.join()
    await aiockpt.save(_state(), tmp_path / "c")  # nothing of the cancelled save is in the way


async def test_wait_for_on_a_checkpointer_frees_its_slot_and_step(
    tmp_path: Path, gated_prepare: _Gate
) -> None:
    async with Checkpointer(tmp_path / "root", max_inflight=1, on_busy="error") as ckpt:
        timer = gated_prepare.release_later()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(ckpt.save(_state(), step=1), timeout=0.05)
        assert gated_prepare.returned.is_set()
        assert _leftovers(tmp_path / "root") == []
        timer.join()
        gated_prepare.go.set()
        await ckpt.save(_state(), step=1)  # the slot (on_busy="error" would refuse) and the step are free
        assert ckpt.steps() == [1]


class _SlowLinear(torch.nn.Linear):
    """A module whose ``load_state_dict`` (run by a load's worker thread) waits at a gate."""

    def __init__(self, gate: _Gate) -> None:
        super().__init__(4, 4)
        self.gate = gate

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self.gate.hold(lambda: super(_SlowLinear, self).load_state_dict(*args, **kwargs))


async def test_a_cancelled_load_returns_only_once_its_thread_is_done_with_the_objects(tmp_path: Path) -> None:
    gate = _Gate()
    module = _SlowLinear(gate)
    await aiockpt.save({"model": torch.nn.Linear(4, 4)}, tmp_path / "c")
    task = asyncio.create_task(aiockpt.load({"model": module}, tmp_path / "c"))
    await gate.wait_entered()
    timer = gate.release_later()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert gate.returned.is_set(), "the load returned while its thread still ran load_state_dict"
    timer.join()


async def test_a_starter_cancelled_once_staged_gives_no_loop_end_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A cancellation that lands after the save reported "staged" but before its starter resumed: the
    # starter raises, and the save is cancelled with it (its handle never reached the caller), without
    # the RuntimeWarning meant for a loop that ends with a save in flight.
    caller: list[asyncio.Task[object]] = []

    async def staged_then_caller_cancelled(
        *args: object, report: Callable[[SaveState], None], **kw: object
    ) -> None:
        report(SaveState.STAGED)
        caller[0].cancel()
        await anyio.sleep(0.1)
        raise aiockpt.StorageError("the fake save's write failed")

    monkeypatch.setattr("aiockpt._checkpointer.run_save", staged_then_caller_cancelled)
    async with Checkpointer(tmp_path / "root") as ckpt:

        async def start() -> object:
            return await ckpt.save(_state(), step=1, async_op=True)

        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            caller.append(asyncio.create_task(start()))
            with pytest.raises(asyncio.CancelledError):
                await caller[0]
            await ckpt.wait()  # (nothing left: the save ended before the caller's cancellation went on)
        assert [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)] == []
        monkeypatch.undo()
        await ckpt.save(_state(), step=1)  # its slot and step were given back
        assert ckpt.steps() == [1]


async def test_cancelling_a_task_that_started_a_save_and_awaits_its_handle_does_not_cancel_the_save(
    tmp_path: Path, gated_prepare: _Gate
) -> None:
    # docs/concepts.md: "Cancelling a task that merely awaits a handle does not cancel the save", also
    # natively, and also the task that started it (in a child task of its own, see aiockpt._insulate).
    handles: list[aiockpt.SaveHandle] = []
    async with Checkpointer(tmp_path / "root") as ckpt:

        async def start_and_wait() -> None:
            handles.append(await ckpt.save(_state(), step=1, async_op=True))
            await handles[0]

        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            task = asyncio.create_task(start_and_wait())
            await gated_prepare.wait_entered()  # staged, the handle returned: its write is starting
            timer = gated_prepare.release_later()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            meta = await handles[0]
            timer.join()
        assert meta.step == 1
        assert ckpt.steps() == [1]
        assert [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)] == []


async def test_insulated_calls_raise_their_own_errors_not_exception_groups(tmp_path: Path) -> None:
    with pytest.raises(aiockpt.CheckpointNotFoundError):
        await aiockpt.read(tmp_path / "missing")
    await aiockpt.save(_state(), tmp_path / "d")
    with pytest.raises(aiockpt.CheckpointExistsError):
        await aiockpt.save(_state(), tmp_path / "d")


def _here() -> int:
    """The line after the caller's (where its next statement is)."""
    frame = inspect.currentframe()
    assert frame is not None
    assert frame.f_back is not None
    return frame.f_back.f_lineno + 1


def _located(seen: list[warnings.WarningMessage], category: type[Warning]) -> list[tuple[str, int]]:
    return [(w.filename, w.lineno) for w in seen if issubclass(w.category, category)]


async def test_warnings_about_a_call_point_at_the_line_of_the_call(tmp_path: Path) -> None:
    # The call's body runs in a task of its own, on whose stack the caller's frame is not: a stacklevel
    # pointed into asyncio, where the default filter shows a warning once for every caller.
    await aiockpt.save({"a": torch.ones(2), "b": torch.ones(2)}, tmp_path / "c")
    torch.save({"a": torch.ones(2), "b": torch.ones(2)}, tmp_path / "t.pt")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        line = _here()
        await aiockpt.load({"a": torch.zeros(2)}, tmp_path / "c", strict=False)
        foreign = _here()
        await aiockpt.load({"a": torch.zeros(2)}, tmp_path / "t.pt", strict=False)
        async with Checkpointer(tmp_path / "root", keep_last=1) as ckpt:
            await ckpt.save({"a": torch.ones(2)}, step=5)
            other = _here()
            await ckpt.load({"a": torch.zeros(2), "c": torch.zeros(1)}, strict=False)
            retained = _here()
            await ckpt.save({"a": torch.ones(2)}, step=3)  # retention deletes it at once
            background = _here()
            handle = await ckpt.save({"a": torch.ones(2)}, step=2, async_op=True)
            await handle
    assert _located(seen, aiockpt.StateMismatchWarning) == [
        (__file__, line),
        (__file__, foreign),
        (__file__, other),
    ]
    assert _located(seen, RuntimeWarning) == [(__file__, retained), (__file__, background)]


def test_warnings_about_a_blocking_call_point_at_the_line_of_the_call(tmp_path: Path) -> None:
    """The blocking facade's calls run on another thread's event loop (a Checkpointer's) or in a loop of
    their own: their warnings pointed at aiockpt/sync.py."""
    aiockpt.sync.save({"a": torch.ones(2), "b": torch.ones(2)}, tmp_path / "c")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        line = _here()
        aiockpt.sync.load({"a": torch.zeros(2)}, tmp_path / "c", strict=False)
        with aiockpt.sync.Checkpointer(tmp_path / "root", keep_last=1) as ckpt:
            ckpt.save({"a": torch.ones(2)}, step=5)
            other = _here()
            ckpt.load({"a": torch.zeros(2), "c": torch.zeros(1)}, strict=False)
            retained = _here()
            ckpt.save({"a": torch.ones(2)}, step=3)  # retention deletes it at once
            background = _here()
            ckpt.save({"a": torch.ones(2)}, step=2, async_op=True).result()
    assert _located(seen, aiockpt.StateMismatchWarning) == [(__file__, line), (__file__, other)]
    assert _located(seen, RuntimeWarning) == [(__file__, retained), (__file__, background)]


def test_a_loop_that_ends_with_a_save_in_a_thread_waits_for_the_thread_and_cleans_up(
    tmp_path: Path, gated_prepare: _Gate
) -> None:
    # asyncio.run cancels every task left, one by one and natively, the background save's included,
    # while a worker thread of it is making its temp dir: the cancellation now waits for the thread,
    # and the save's clean-up then removes what the thread made.
    async def forgets() -> None:
        await aiockpt.save(_state(), tmp_path / "c", async_op=True)
        await gated_prepare.wait_entered()
        gated_prepare.release_later()

    with pytest.warns(RuntimeWarning, match="background saves was cancelled with it in flight"):
        asyncio.run(forgets())
    assert gated_prepare.returned.is_set()
    assert sorted(p.name for p in tmp_path.iterdir()) == []


async def test_saves_and_loads_cancel_no_anyio_scope(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # anyio's CancelScope.cancel() formats the current task's repr into its reason: 2-4 ms of the event
    # loop's thread in a fresh read of 2 GiB, where run_each called it once per I/O phase to stop its
    # watcher. Nothing cancels anything in a save or load that nobody cancels.
    import anyio._backends._asyncio as backend

    calls: list[object] = []
    real = backend.CancelScope.cancel

    def counted(self: backend.CancelScope, reason: str | None = None) -> None:
        calls.append(self)
        real(self, reason)

    monkeypatch.setattr(backend.CancelScope, "cancel", counted)
    state = {"big": torch.arange(1 << 20, dtype=torch.float32), "small": [torch.ones(8)] * 3}
    await aiockpt.save(state, tmp_path / "c")
    await aiockpt.load({"big": torch.empty(1 << 20), "small": [torch.empty(8)] * 3}, tmp_path / "c")
    tree = await aiockpt.read(tmp_path / "c")
    async with Checkpointer(tmp_path / "root") as ckpt:
        handle = await ckpt.save(state, step=1, async_op=True)
        await handle
    assert torch.equal(tree["big"], state["big"])  # type: ignore[arg-type]
    assert calls == []


@pytest.mark.skipif(sys.version_info < (3, 11), reason="asyncio.timeout is new in Python 3.11")
async def test_timeouts_around_async_saves_give_no_loop_end_warning(tmp_path: Path) -> None:
    # A timeout landing after the save reported "staged" but before tg.start() returned cancels the save
    # (its handle never reached the caller): said to be the loop ending, until the handle knew it was
    # still being started. Timeouts spread over staging hit that window in some of the saves.
    timeout: Any = getattr(asyncio, "timeout")  # noqa: B009 (mypy checks for Python 3.10)
    state = {f"w{i}": torch.ones(1 << 18) for i in range(16)}
    async with Checkpointer(tmp_path / "root", keep_last=2) as ckpt:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for step in range(1, 41):
                with contextlib.suppress(TimeoutError):
                    async with timeout(0.001 * (step % 20)):
                        await (await ckpt.save(state, step=step, async_op=True))
            await ckpt.wait()
    assert [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)] == []
    assert _leftovers(tmp_path / "root") == []


class _WhenStaged:
    """Calls what is put in ``calls`` as the next save reports "staged", then holds that save.

    The save stays in its write phase, before its commit point, until cancelled (a small save could
    otherwise commit before the cancellation reaches it, which it then rightly completes). :meth:`done`
    lets the next saves write.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[Callable[[], object]] = []
        self.hold = False
        real, write = aiockpt.SaveMetrics.staged, aiockpt._save._write.write

        def staged(metrics: aiockpt.SaveMetrics) -> None:
            real(metrics)
            while self.calls:
                self.calls.pop()()
                self.hold = True

        async def held_write(*args: Any, **kwargs: Any) -> Any:
            if self.hold:
                await anyio.sleep_forever()
            return await write(*args, **kwargs)

        monkeypatch.setattr(aiockpt.SaveMetrics, "staged", staged)
        monkeypatch.setattr("aiockpt._save.write", held_write)

    def done(self) -> None:
        self.hold = False


@pytest.fixture
def when_staged(monkeypatch: pytest.MonkeyPatch) -> _WhenStaged:
    return _WhenStaged(monkeypatch)


@pytest.mark.parametrize("how", ["task.cancel", "anyio scope"])
async def test_a_caller_cancelled_as_its_async_save_returns_cancels_the_save(
    tmp_path: Path, when_staged: _WhenStaged, how: str
) -> None:
    # The cancellation reaches the caller after the save is staged and its handle made, before the call
    # returned it: nobody can see or await that save. It used to go on, commit, and hold the in-flight
    # slot meanwhile (a save right after raised BusyError).
    root = tmp_path / "root"
    async with Checkpointer(root, on_busy="error") as ckpt:
        got: list[aiockpt.SaveHandle] = []

        async def start() -> None:
            got.append(await ckpt.save(_state(), step=1, async_op=True))

        if how == "task.cancel":
            task = asyncio.create_task(start())
            when_staged.calls.append(task.cancel)
            with pytest.raises(asyncio.CancelledError):
                await task
        else:
            with anyio.CancelScope() as scope:
                when_staged.calls.append(scope.cancel)
                await start()
            assert scope.cancelled_caught
        when_staged.done()
        assert got == []
        # Ended before the cancellation went on: the slot and step are free at once.
        assert ckpt._inflight == {}
        await (await ckpt.save(_state(), step=2, async_op=True))
        assert ckpt.steps() == [2]
    assert _leftovers(root) == []


@pytest.mark.parametrize("interruption", [KeyboardInterrupt, RuntimeError])
@pytest.mark.parametrize("async_op", [False, True])
def test_a_sync_caller_interrupted_while_handing_its_save_over_cancels_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, async_op: bool, interruption: type[BaseException]
) -> None:
    # Ctrl-C landing in the portal's hand-over, once the loop has spawned the save but before its future
    # reached the caller (a loaded machine leaves the caller's thread off the CPU there), escaped with
    # nothing to cancel: the save went on and committed behind the caller's back, or hung a later wait().
    # A RuntimeError from a signal handler there was taken for anyio's "portal is not running".
    root = tmp_path / "root"
    real = BlockingPortal.start_task_soon

    handed: list[object] = []

    def interrupted(self: BlockingPortal, *args: Any, **kwargs: Any) -> Any:
        future = real(self, *args, **kwargs)  # spawned on the loop, where it runs on
        if handed:  # (the portal's later calls, its cancellation's among them, go through)
            return future
        handed.append(future)
        raise interruption("interrupted")

    with aiockpt.sync.Checkpointer(root) as ckpt:
        monkeypatch.setattr(BlockingPortal, "start_task_soon", interrupted)
        with pytest.raises(interruption, match="interrupted"):
            ckpt.save(_state(), step=1, async_op=async_op)
        monkeypatch.undo()
        ckpt.wait()
        assert ckpt.steps() == []
        ckpt.save(_state(), step=2)
        assert ckpt.steps() == [2]
    assert _leftovers(root) == []


def test_a_sync_caller_interrupted_as_its_async_save_returns_cancels_the_save(
    tmp_path: Path, when_staged: _WhenStaged
) -> None:
    # Ctrl-C in the facade's caller as the save is staged: the caller gets KeyboardInterrupt and no
    # handle, so the save must not commit behind its back.
    root = tmp_path / "root"
    main = threading.get_ident()

    def interrupt() -> None:
        import _thread

        assert threading.get_ident() != main  # (on the facade's event-loop thread)
        _thread.interrupt_main()

    with aiockpt.sync.Checkpointer(root) as ckpt:
        when_staged.calls.append(interrupt)
        with pytest.raises(KeyboardInterrupt):  # (raised by the main thread's next bytecode)
            ckpt.save(_state(), step=1, async_op=True)
        when_staged.done()
        ckpt.wait()
        assert ckpt.steps() == []
        ckpt.save(_state(), step=2)
        assert ckpt.steps() == [2]
    assert _leftovers(root) == []
