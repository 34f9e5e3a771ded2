"""Worker threads lose nothing (a failure to lower a thread's priority or to start it is the work's failure),
and a process forked during a save starts with the settings the process had before the save paused them."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import sys
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
import torch
from conftest import assert_child_exits_cleanly, tmp_entries

import aiockpt
from aiockpt import IOConfig
from aiockpt._gc import paused
from aiockpt._threads import Aborted, each_in_thread, responsive, run_each, short_switches

pytestmark = pytest.mark.timeout(60)

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="only Linux lowers a worker thread alone")


class _Interrupt(BaseException):
    """A BaseException that is not an Exception, as KeyboardInterrupt and SystemExit are."""


def _nice_fails(exc: BaseException) -> object:
    def nice(increment: int) -> int:
        raise exc

    return nice


async def _save(state: Mapping[str, object], path: Path, async_op: bool, io: IOConfig) -> None:
    """Save ``state`` to ``path`` and wait until it is durable, staged first if ``async_op``."""
    if async_op:
        await (await aiockpt.save(state, path, async_op=True, io=io))
    else:
        await aiockpt.save(state, path, io=io)


@pytest.fixture
def state() -> dict[str, object]:
    # Large tensors (each copied in pieces over threads when staged) and a small one.
    gen = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(300_000, generator=gen),
        "v": torch.randn(70_000, generator=gen),
        "b": torch.ones(8),
    }


@linux_only
@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "staged"])
async def test_a_save_whose_worker_cannot_lower_its_priority_fails_and_publishes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, state: dict[str, object], async_op: bool
) -> None:
    # Was: the lowered thread died in os.nice before its work, unrecorded, and the save committed a
    # checkpoint whose data was never written. Staged (async_op=True), the threads are each_in_thread's.
    path = tmp_path / "ckpt"
    monkeypatch.setattr(os, "nice", _nice_fails(TypeError("nice() needs an int")))
    io = IOConfig(worker_nice=10)
    with pytest.raises(TypeError, match="needs an int"):
        await _save(state, path, async_op, io)
    assert not path.exists()
    assert tmp_entries(tmp_path) == []
    monkeypatch.undo()
    await aiockpt.save(state, path, io=io)  # the next save is unaffected
    assert (await aiockpt.verify(path)).ok


@linux_only
@pytest.mark.parametrize("exc", [TypeError("bad nice"), _Interrupt("interrupted")], ids=["Exception", "Base"])
def test_each_in_thread_reports_a_failure_to_lower_a_thread(
    monkeypatch: pytest.MonkeyPatch, exc: BaseException
) -> None:
    ran: list[int] = []
    monkeypatch.setattr(os, "nice", _nice_fails(exc))
    with responsive(IOConfig(worker_nice=5), lowered=True), pytest.raises(type(exc)):
        each_in_thread([lambda: ran.append(1), lambda: ran.append(2)])
    assert ran == []  # the lowering is part of each work: a failed one runs nothing


@linux_only
@pytest.mark.parametrize("exc", [TypeError("bad nice"), _Interrupt("interrupted")], ids=["Exception", "Base"])
async def test_run_each_reports_a_failure_to_lower_a_thread(
    monkeypatch: pytest.MonkeyPatch, exc: BaseException
) -> None:
    ran: list[str] = []

    def work(abort: threading.Event) -> None:
        ran.append("ran")

    monkeypatch.setattr(os, "nice", _nice_fails(exc))
    with responsive(IOConfig(worker_nice=5), lowered=True), pytest.raises(type(exc)):
        await run_each([work, work])
    assert ran == []


@linux_only
def test_os_refusing_to_lower_a_thread_is_not_a_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[int] = []
    monkeypatch.setattr(os, "nice", _nice_fails(PermissionError("not allowed")))
    with responsive(IOConfig(worker_nice=5), lowered=True):
        each_in_thread([lambda: ran.append(1), lambda: ran.append(2)])
    assert sorted(ran) == [1, 2]


class _FailsToStart(threading.Thread):
    """Starts the first of the library's worker threads made while patched in, then fails to start any."""

    started = 0

    def start(self) -> None:
        if self.name == "aiockpt-io":
            if _FailsToStart.started >= 1:
                raise RuntimeError("can't start new thread")
            _FailsToStart.started += 1
        super().start()


@linux_only
def test_each_in_thread_waits_for_the_started_threads_when_one_cannot_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    finished = threading.Event()

    def slow() -> None:
        finished.wait(0.2)  # still running when the next thread fails to start
        finished.set()

    monkeypatch.setattr(_FailsToStart, "started", 0)
    monkeypatch.setattr(threading, "Thread", _FailsToStart)
    with responsive(IOConfig(worker_nice=5), lowered=True), pytest.raises(RuntimeError, match="can't start"):
        each_in_thread([slow, slow, slow])
    assert finished.is_set()  # raised only once the started thread had returned


@linux_only
async def test_run_each_reports_a_worker_thread_that_cannot_start_and_aborts_the_others(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[str] = []

    def waits(abort: threading.Event) -> None:
        seen.append("aborted" if abort.wait(10) else "timed out")
        raise Aborted

    monkeypatch.setattr(_FailsToStart, "started", 0)
    monkeypatch.setattr(threading, "Thread", _FailsToStart)
    with responsive(IOConfig(worker_nice=5), lowered=True), pytest.raises(RuntimeError, match="can't start"):
        await run_each([waits, waits])
    assert seen == ["aborted"]


@pytest.mark.parametrize("nice", [0, 5])
async def test_run_each_reports_an_aborted_raised_before_anything_set_abort(nice: int) -> None:
    # Dropped as a sibling's echo, it would hide a work left unfinished: run_each returned as if all ran.
    def quits(abort: threading.Event) -> None:
        raise Aborted

    def works(abort: threading.Event) -> None:
        pass

    with responsive(IOConfig(worker_nice=nice), lowered=True), pytest.raises(Aborted):
        await run_each([works, quits])


@pytest.mark.parametrize("nice", [0, 5])
async def test_run_each_reraises_a_base_exception_of_a_work(nice: int) -> None:
    def interrupted(abort: threading.Event) -> None:
        raise _Interrupt("stop")

    with responsive(IOConfig(worker_nice=nice), lowered=True), pytest.raises(_Interrupt, match="stop"):
        await run_each([interrupted])


# --- Fork -----------------------------------------------------------------------------------------------


@pytest.fixture
def _known_settings() -> Iterator[None]:
    enabled, threshold, interval = gc.isenabled(), gc.get_threshold(), sys.getswitchinterval()
    gc.enable()
    gc.set_threshold(700, 10, 10)
    sys.setswitchinterval(0.005)
    yield
    gc.set_threshold(*threshold)
    (gc.enable if enabled else gc.disable)()
    sys.setswitchinterval(interval)


def _settings() -> list[object]:
    return [gc.isenabled(), list(gc.get_threshold()), sys.getswitchinterval()]


class _Blocking:
    """A Stateful whose ``state_dict()``, called with the save's settings in force, waits to be let go."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def state_dict(self) -> Mapping[str, object]:
        self.entered.set()
        self.release.wait(30)
        return {"t": torch.ones(4)}

    def load_state_dict(self, state_dict: Mapping[str, object], /) -> None:
        pass


@pytest.mark.skipif(sys.platform != "linux", reason="fork with threads: Linux only")
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
@pytest.mark.usefixtures("_known_settings")
def test_a_child_forked_during_a_save_gets_the_settings_of_before_it(tmp_path: Path) -> None:
    before = _settings()
    blocking = _Blocking()
    outcome: list[BaseException | None] = []

    def save() -> None:
        try:
            asyncio.run(aiockpt.save({"s": blocking}, tmp_path / "ckpt", io=IOConfig(switch_interval=0.0002)))
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    saver = threading.Thread(target=save)
    saver.start()
    try:
        assert blocking.entered.wait(30)
        during = _settings()
        assert during != before  # the save's pause and short switches are in force
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: none of the parent's threads, and so none of its saves
            code = 1
            try:
                os.close(read_end)
                after_fork = _settings()
                with paused(), short_switches(0.0002):  # the child's own save, counted from zero
                    inside = _settings()
                findings = {"after_fork": after_fork, "inside": inside, "after": _settings()}
                os.write(write_end, json.dumps(findings).encode())
                code = 0
            finally:
                os._exit(code)
        os.close(write_end)
        with os.fdopen(read_end, "rb") as pipe:
            report = pipe.read()
        assert_child_exits_cleanly(pid)
    finally:
        blocking.release.set()
        saver.join(30)
    findings = json.loads(report)
    assert findings["after_fork"] == before
    assert findings["inside"] == during
    assert findings["after"] == before
    assert outcome == [None]
    assert _settings() == before  # the parent's save restored them too
