"""The blocking facade's edges: interruptions, several threads, closing, garbage collection and exit."""

from __future__ import annotations

import gc
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import types
from collections.abc import AsyncGenerator, Generator
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import pytest
import torch
from conftest import Listings, exists, tmp_entries

import aiockpt
import aiockpt.sync
from aiockpt import SaveState

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[1]


class Blocking:
    """A Stateful whose ``state_dict()`` (called in a worker thread while a save stages) waits for
    :attr:`release`, having set :attr:`entered`."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.w = torch.ones(1 << 10)

    def state_dict(self) -> dict[str, object]:
        self.entered.set()
        assert self.release.wait(30), "never released"
        return {"w": self.w}

    def load_state_dict(self, state: dict[str, object]) -> None:
        pass


def sync_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "aiockpt-sync"]


@pytest.mark.parametrize("interruption", [KeyboardInterrupt, RuntimeError])
def test_an_interrupted_blocking_save_is_cancelled_before_the_call_returns(
    root: Path, interruption: type[BaseException]
) -> None:
    """Ctrl-C during ``ckpt.save(state, step=...)`` used to return at once while the save went on reading
    the state in the background and then committed: the caller, free to train again, got a checkpoint
    of whatever the tensors held by then. Any exception a signal handler raises is such an interruption
    (a ``RuntimeError`` was once taken for the call's own and let the save go on)."""

    def handler(signum: int, frame: object) -> None:
        raise interruption("interrupted")

    blocking = Blocking()
    main = threading.get_ident()

    def interrupt() -> None:
        assert blocking.entered.wait(30)
        signal.pthread_kill(main, signal.SIGINT)
        time.sleep(0.2)  # the fixed facade is waiting for the save to end; the old one had returned
        blocking.release.set()

    before = signal.signal(signal.SIGINT, handler)
    try:
        with aiockpt.sync.Checkpointer(root) as ckpt:
            helper = threading.Thread(target=interrupt)
            helper.start()
            try:
                with pytest.raises(interruption, match="interrupted"):
                    ckpt.save({"m": blocking}, step=1)
                # Returned only once the save had ended: nothing reads the state any more.
                assert blocking.release.is_set()
            finally:
                blocking.release.set()
                helper.join()
            ckpt.wait()
            assert ckpt.steps() == []
            # The Checkpointer goes on working.
            ckpt.save({"w": torch.ones(4)}, step=2)
            assert ckpt.steps() == [2]
    finally:
        signal.signal(signal.SIGINT, before)
    assert tmp_entries(root) == []


def test_an_unclosed_facade_stops_its_thread_when_collected(root: Path) -> None:
    """Each one dropped without ``close()`` used to leave its event-loop thread (and the loop's
    descriptors) running until the process ended."""
    before = len(sync_threads())

    def use() -> None:
        ckpt = aiockpt.sync.Checkpointer(root)
        ckpt.save({"w": torch.ones(4)}, step=len(os.listdir(root)))

    for _ in range(3):
        use()
    gc.collect()
    assert len(sync_threads()) == before


EXITS_UNCLOSED = """
import sys, torch, aiockpt.sync
ckpt = aiockpt.sync.Checkpointer(sys.argv[1])
ckpt.save({"w": torch.ones(1 << 22)}, step=1, async_op=True)
"""


def run_script(tmp_path: Path, text: str, root: Path) -> subprocess.CompletedProcess[str]:
    """Run the Python program ``text`` on ``root`` in a child that imports the aiockpt under test."""
    script = tmp_path / "script.py"
    script.write_text(text)
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, str(script), str(root)],
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=45,
        check=False,
    )


def test_an_unclosed_facade_finishes_its_saves_at_exit(tmp_path: Path) -> None:
    """A script that ends without closing used to lose the save in flight (its thread was a daemon,
    stopped mid-write), leaving temp data instead of the checkpoint."""
    root = tmp_path / "run"
    proc = run_script(tmp_path, EXITS_UNCLOSED, root)
    assert proc.returncode == 0, proc.stderr
    assert exists(root / "step-00000001" / "manifest.msgpack"), sorted(os.listdir(root))
    assert tmp_entries(root) == []


def test_calls_on_a_facade_whose_loop_is_stopping_say_it_is_closed(root: Path) -> None:
    """Between its portal's stop and its thread's end (another thread closing it), calls used to fail
    with anyio's bare ``RuntimeError: This portal is not running``, and a second ``close()`` too."""
    ckpt = aiockpt.sync.Checkpointer(root)
    portal = ckpt._portal
    lingering = threading.Event()

    async def linger() -> None:  # keeps the loop thread alive after the portal stopped
        lingering.set()
        await anyio.sleep(1)

    portal.start_task_soon(linger)
    assert lingering.wait(10)
    portal.call(portal.stop)
    assert ckpt._thread.is_alive()
    with pytest.raises(aiockpt.CheckpointError, match="closed"):
        ckpt.steps()
    with pytest.raises(aiockpt.CheckpointError, match="closed"):
        ckpt.save({"w": torch.ones(2)}, step=1)
    ckpt.wait()
    ckpt.close()
    assert not ckpt._thread.is_alive()


def test_close_from_several_threads_at_once(root: Path) -> None:
    for step in range(5):
        ckpt = aiockpt.sync.Checkpointer(root)
        handle = ckpt.save({"w": torch.ones(1 << 20)}, step=step, async_op=True)
        errors: list[BaseException] = []

        def close(ckpt: aiockpt.sync.Checkpointer = ckpt, errors: list[BaseException] = errors) -> None:
            try:
                ckpt.close()
            except BaseException as exc:  # reported below
                errors.append(exc)

        closers = [threading.Thread(target=close) for _ in range(3)]
        for t in closers:
            t.start()
        for t in closers:
            t.join()
        assert errors == []
        assert handle.state is SaveState.COMMITTED


def test_result_with_a_timeout_raises_the_builtin_timeout_error(root: Path) -> None:
    """Python 3.10's ``concurrent.futures.TimeoutError`` is not the built-in one the docstring promises."""
    blocking = Blocking()
    blocking.release.set()
    with aiockpt.sync.Checkpointer(root, max_inflight=2) as ckpt:
        gate = threading.Event()
        real = ckpt._ckpt._after_commit

        async def slow_after_commit(step: int, newest: int | None = None) -> None:
            await anyio.to_thread.run_sync(gate.wait, 30)
            await real(step, newest)

        ckpt._ckpt._after_commit = slow_after_commit  # type: ignore[method-assign]
        handle = ckpt.save({"w": torch.ones(8)}, step=1, async_op=True)
        with pytest.raises(TimeoutError):
            handle.result(timeout=0.05)
        gate.set()
        assert handle.result(timeout=30).step == 1


# --- watch() --------------------------------------------------------------------------------------------


if TYPE_CHECKING:
    Watch = types.AsyncGeneratorType[int, None]


def spied(ckpt: aiockpt.sync.Checkpointer) -> list[Watch]:
    """The async watches that ``ckpt``'s watches run on its event-loop thread, as they are made."""
    made: list[Watch] = []
    real = ckpt._ckpt.watch

    def watch(*, poll_interval: float = 1.0, coalesce: bool = True) -> AsyncGenerator[int, None]:
        agen = real(poll_interval=poll_interval, coalesce=coalesce)
        assert isinstance(agen, types.AsyncGeneratorType)
        made.append(agen)
        return agen

    ckpt._ckpt.watch = watch  # type: ignore[method-assign]
    return made


def is_open(agen: Watch) -> bool:
    """Whether ``agen`` has not finished: it was never closed (nor ended by an exception)."""
    frame: object = agen.ag_frame  # (None once it has finished)
    return frame is not None


def in_thread(
    steps: Generator[int, None, None], watcher: aiockpt.sync.Checkpointer
) -> tuple[threading.Thread, list[int | BaseException]]:
    """A thread blocked in ``next(steps)``, once ``watcher``'s watch listed the root since the call; what
    it got, or raised, is listed."""
    got: list[int | BaseException] = []
    listings = Listings.of(watcher._ckpt)
    seen = listings.count

    def take() -> None:
        try:
            got.append(next(steps))
        except BaseException as exc:  # checked by the test
            got.append(exc)

    thread = threading.Thread(target=take, name="watching")
    thread.start()
    listings.wait_past(seen)  # the watch has listed the root, and waits
    assert not got, got
    return thread, got


def test_leaving_a_watch_loop_closes_the_async_watch_at_once(root: Path) -> None:
    with aiockpt.sync.Checkpointer(root) as watcher, aiockpt.sync.Checkpointer(root) as writer:
        made = spied(watcher)
        enough = threading.Event()

        def write() -> None:
            # Until the watch yields one (bounded): a step committed before its first listing is not new.
            for step in range(1, 1000):
                time.sleep(0.05)
                writer.save({"w": torch.ones(4)}, step=step)
                if enough.is_set():
                    return

        thread = threading.Thread(target=write)
        thread.start()
        try:
            for _ in watcher.watch(poll_interval=0.02):
                assert is_open(made[0])  # suspended where it yielded
                break
        finally:
            enough.set()
            thread.join()
        assert not is_open(made[0])  # closed on the event-loop thread, not left to the loop's end

        steps = watcher.watch(poll_interval=0.02)
        assert len(made) == 1  # nothing runs before the first next()
        thread, got = in_thread(steps, watcher)
        writer.save({"w": torch.ones(4)}, step=1000)
        thread.join(10)
        assert got == [1000]
        steps.close()
        assert not is_open(made[1])
        with pytest.raises(StopIteration):
            next(steps)


def test_closing_the_checkpointer_ends_a_watch_another_thread_waits_in(root: Path) -> None:
    """Its ``next()`` raises ``CheckpointError`` at once, as the async watch does at its next poll: the
    close does not wait a poll interval (here a minute) for it, nor does any thread linger."""
    before = len(sync_threads())
    watcher = aiockpt.sync.Checkpointer(root)
    try:
        made = spied(watcher)
        steps = watcher.watch(poll_interval=60)
        thread, got = in_thread(steps, watcher)
        started = time.monotonic()
        watcher.close()
        thread.join(10)
    finally:
        watcher.close()
    assert time.monotonic() - started < 10
    assert not thread.is_alive()
    (error,) = got
    assert type(error) is aiockpt.CheckpointError, repr(error)
    assert "closed" in str(error)
    assert not is_open(made[0])
    assert len(sync_threads()) == before
    with pytest.raises(StopIteration):  # a watch that raised is over
        next(steps)


def test_a_watch_left_open_is_closed_with_its_checkpointer(root: Path) -> None:
    with aiockpt.sync.Checkpointer(root) as watcher, aiockpt.sync.Checkpointer(root) as writer:
        made = spied(watcher)
        steps = watcher.watch(poll_interval=0.02)
        thread, got = in_thread(steps, watcher)
        writer.save({"w": torch.ones(4)}, step=1)
        thread.join(10)
        assert got == [1]
    assert not is_open(made[0])  # the loop's shutdown closed it
    with pytest.raises(aiockpt.CheckpointError, match="closed"):
        next(steps)
    steps.close()


def test_an_interrupted_watch_is_cancelled_and_ended_before_next_returns(root: Path) -> None:
    """As a blocking save is: Ctrl-C in ``next()`` cancels the poll on the event-loop thread and waits
    for it, which ends the watch (as cancelling a pending ``anext`` does); the Checkpointer goes on."""
    main = threading.get_ident()

    def interrupt() -> None:
        time.sleep(0.2)
        signal.pthread_kill(main, signal.SIGINT)

    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with aiockpt.sync.Checkpointer(root) as watcher:
            made = spied(watcher)
            steps = watcher.watch(poll_interval=0.02)
            helper = threading.Thread(target=interrupt)
            helper.start()
            try:
                with pytest.raises(KeyboardInterrupt):
                    next(steps)
            finally:
                helper.join()
            assert not is_open(made[0])
            assert watcher._watches.pending == set()
            with pytest.raises(StopIteration):
                next(steps)
            watcher.save({"w": torch.ones(4)}, step=1)
            assert watcher.steps() == [1]
    finally:
        signal.signal(signal.SIGINT, before)


def test_watch_errors_are_raised_in_the_caller_thread_as_they_are(root: Path) -> None:
    with aiockpt.sync.Checkpointer(root) as watcher:
        steps = watcher.watch(poll_interval=0)  # refused at the first next(), as the async watch does
        with pytest.raises(aiockpt.CheckpointError, match="poll_interval must be positive"):
            next(steps)

        steps = watcher.watch(poll_interval=0.02)
        thread, got = in_thread(steps, watcher)
        shutil.rmtree(root)
        root.write_text("not a directory")
        thread.join(10)
        (error,) = got
        assert type(error) is aiockpt.StorageError, repr(error)


FORKED = """
import os, sys, threading, warnings
import anyio.to_thread, torch
import aiockpt, aiockpt._save, aiockpt.sync

warnings.simplefilter("ignore", DeprecationWarning)  # (Python 3.12: a fork of a process with threads)
go = threading.Event()
commit = aiockpt._save.commit


async def held(*args, **kwargs):  # the save stays in flight until the child has tried it
    await anyio.to_thread.run_sync(go.wait)
    await commit(*args, **kwargs)


aiockpt._save.commit = held
ckpt = aiockpt.sync.Checkpointer(sys.argv[1])
handle = ckpt.save({"w": torch.ones(4)}, step=1, async_op=True)
if os.fork() == 0:
    for call in (lambda: handle.result(2), handle.cancel, lambda: ckpt.save({"w": torch.ones(4)}, step=2)):
        try:
            call()
            print("returned", flush=True)
        except aiockpt.CheckpointError as exc:
            print(exc, flush=True)
    os._exit(0)
os.wait()
go.set()
print(handle.result(30).step)
ckpt.close()
"""


def test_a_forked_child_is_refused_the_parents_save_handle_and_checkpointer(tmp_path: Path) -> None:
    """A child forked during a background save waited for ever in ``handle.result(timeout=2)`` and
    ``handle.cancel()`` (the portal's thread is not in the child; the timeout applied only after the
    hand-over), and its Checkpointer said "closed"."""
    proc = run_script(tmp_path, FORKED, tmp_path / "root")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 4, proc.stdout
    assert all("of which this process is a fork" in line for line in lines[:3]), lines
    assert lines[3] == "1"  # the parent's save, unharmed
