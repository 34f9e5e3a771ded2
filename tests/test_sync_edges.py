"""The blocking facade's edges: interruptions, several threads, closing, garbage collection and exit."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import anyio
import pytest
import torch
from conftest import exists, tmp_entries

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


def test_an_interrupted_blocking_save_is_cancelled_before_the_call_returns(root: Path) -> None:
    """Ctrl-C during ``ckpt.save(state, step=...)`` used to return at once while the save went on reading
    the state in the background and then committed: the caller, free to train again, got a checkpoint
    of whatever the tensors held by then."""
    blocking = Blocking()
    main = threading.get_ident()

    def interrupt() -> None:
        assert blocking.entered.wait(30)
        signal.pthread_kill(main, signal.SIGINT)
        time.sleep(0.2)  # the fixed facade is waiting for the save to end; the old one had returned
        blocking.release.set()

    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with aiockpt.sync.Checkpointer(root) as ckpt:
            helper = threading.Thread(target=interrupt)
            helper.start()
            try:
                with pytest.raises(KeyboardInterrupt):
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


def test_an_unclosed_facade_finishes_its_saves_at_exit(tmp_path: Path) -> None:
    """A script that ends without closing used to lose the save in flight (its thread was a daemon,
    stopped mid-write), leaving temp data instead of the checkpoint."""
    script = tmp_path / "exits.py"
    script.write_text(EXITS_UNCLOSED)
    root = tmp_path / "run"
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, str(script), str(root)],
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
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
