"""``IOConfig``: validation, the default thread count, and the thread layout of the write stage."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import anyio.to_thread
import pytest
import torch

import aiockpt
from aiockpt import CheckpointError, IOConfig, StorageError, _options
from aiockpt._runs import Run, write_run
from aiockpt._save import _write
from aiockpt._threads import Aborted, responsive, run_each, short_switches


@pytest.mark.parametrize(
    ("cpus", "expected"),
    [(1, 1), (2, 1), (3, 2), (5, 4), (64, 4)],
)
def test_default_threads_leave_one_cpu_to_the_event_loop(
    monkeypatch: pytest.MonkeyPatch, cpus: int, expected: int
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)), raising=False)
    assert _options.auto_threads() == expected
    assert IOConfig().threads is None
    assert IOConfig().thread_count == expected
    assert IOConfig(threads=7).thread_count == 7


@pytest.mark.parametrize(
    ("name", "make"),
    [
        ("threads", lambda: IOConfig(threads=0)),
        ("checksum_block", lambda: IOConfig(checksum_block=1000)),
        ("checksum_block", lambda: IOConfig(checksum_block=0)),
        # Beyond 64 bits the manifest could not record it: the save failed at its end, OverflowError.
        ("checksum_block", lambda: IOConfig(checksum_block=2**64)),
        ("checksum_block", lambda: IOConfig(checksum_block=(1 << 40) + 4096)),
        ("worker_nice", lambda: IOConfig(worker_nice=-1)),
        ("worker_nice", lambda: IOConfig(worker_nice=20)),
        # Of the wrong type, as a config file gives them: a float nice value used to kill the save's
        # worker threads (which then committed a checkpoint of unwritten blocks), a "false" to turn
        # direct writes on.
        ("worker_nice", lambda: IOConfig(worker_nice=10.0)),  # type: ignore[arg-type]
        ("worker_nice", lambda: IOConfig(worker_nice=True)),
        ("threads", lambda: IOConfig(threads="4")),  # type: ignore[arg-type]
        ("threads", lambda: IOConfig(threads=2.0)),  # type: ignore[arg-type]
        ("checksum_block", lambda: IOConfig(checksum_block=4096.0)),  # type: ignore[arg-type]
        ("switch_interval", lambda: IOConfig(switch_interval="0.001")),  # type: ignore[arg-type]
        ("switch_interval", lambda: IOConfig(switch_interval=float("nan"))),
        ("direct_writes", lambda: IOConfig(direct_writes="false")),  # type: ignore[arg-type]
        ("pause_gc", lambda: IOConfig(pause_gc="no")),  # type: ignore[arg-type]
        ("checkers", lambda: IOConfig(checkers=1)),  # type: ignore[arg-type]
        ("map_reads", lambda: IOConfig(map_reads=None)),  # type: ignore[arg-type]
        ("direct_reads", lambda: IOConfig(direct_reads="auto")),  # type: ignore[arg-type]
        ("drop_behind", lambda: IOConfig(drop_behind=0)),  # type: ignore[arg-type]
    ],
)
def test_invalid_settings_are_refused_by_name(name: str, make: Callable[[], IOConfig]) -> None:
    with pytest.raises(CheckpointError, match=f"IOConfig.{name}"):
        make()


async def test_an_io_that_is_not_an_ioconfig_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    state = {"w": torch.ones(4)}
    bad: object = {"threads": 2}
    with pytest.raises(CheckpointError, match=r"io must be an aiockpt\.IOConfig or None, not dict"):
        await aiockpt.save(state, tmp_path / "ckpt", io=bad)  # type: ignore[call-overload]
    assert not (tmp_path / "ckpt").exists()
    await aiockpt.save(state, tmp_path / "ckpt")
    for call in (
        lambda: aiockpt.load(state, tmp_path / "ckpt", io=bad),  # type: ignore[arg-type]
        lambda: aiockpt.read(tmp_path / "ckpt", io=bad),  # type: ignore[arg-type]
        lambda: aiockpt.verify(tmp_path / "ckpt", io=bad),  # type: ignore[arg-type]
    ):
        with pytest.raises(CheckpointError, match="io must be"):
            await call()
    with pytest.raises(CheckpointError, match="io must be"):
        aiockpt.Checkpointer(tmp_path / "root", io=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("threads", [1, 2, 4])
async def test_checksums_computed_by_several_writers_verify_on_load(tmp_path: Path, threads: int) -> None:
    # Many blocks and runs, so that the writers interleave.
    gen = torch.Generator().manual_seed(threads)
    state = {f"t{i}": torch.randn(3000 + 17 * i, generator=gen) for i in range(40)}
    io = IOConfig(threads=threads, checksum_block=4096)
    await aiockpt.save(state, tmp_path / "ckpt", io=io)
    target: dict[str, object] = {k: torch.zeros_like(v) for k, v in state.items()}
    await aiockpt.load(target, tmp_path / "ckpt", io=io)
    for key, value in state.items():
        assert torch.equal(target[key], value), key  # type: ignore[arg-type]
    assert (await aiockpt.verify(tmp_path / "ckpt")).problems == ()


async def test_a_failing_writer_fails_the_save_by_file_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = 0

    def failing(fd: int, run: Run) -> None:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise OSError(5, "Input/output error")
        write_run(fd, run)

    monkeypatch.setattr("aiockpt._save._write.write_run", failing)
    state = {f"t{i}": torch.full((1 << 20,), float(i)) for i in range(8)}
    # The buffered writer's failure (a direct write's: test_direct_writes).
    io = IOConfig(threads=1, checksum_block=1 << 20, direct_writes=False)
    with pytest.raises(StorageError, match=r"data-r00000\.bin.*Input/output error"):
        await aiockpt.save(state, tmp_path / "ckpt", io=io)
    assert calls == 3, "the writer stopped at the failing run"
    assert [p.name for p in tmp_path.iterdir()] == []  # no checkpoint, no temp dir
    monkeypatch.undo()
    await aiockpt.save(state, tmp_path / "ckpt", io=io)  # the next save is unaffected
    assert (await aiockpt.verify(tmp_path / "ckpt")).problems == ()


async def test_run_each_raises_the_first_failure_and_aborts_the_others() -> None:
    stopped: list[str] = []

    def fails(abort: threading.Event) -> None:
        raise ValueError("boom")

    def waits(abort: threading.Event) -> None:
        if not abort.wait(10):
            stopped.append("timed out")
            return
        stopped.append("aborted")
        raise Aborted

    with pytest.raises(ValueError, match="boom"):
        await run_each([waits, fails, waits])
    assert stopped == ["aborted", "aborted"]


def test_short_switches_lowers_the_interval_while_any_user_runs_and_restores_it() -> None:
    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.004)
        with short_switches(0.0005):
            assert sys.getswitchinterval() == pytest.approx(0.0005)
            with short_switches(0.001):  # nested: never raises it
                assert sys.getswitchinterval() == pytest.approx(0.0005)
            assert sys.getswitchinterval() == pytest.approx(0.0005)
        assert sys.getswitchinterval() == pytest.approx(0.004)
        with short_switches(None):
            assert sys.getswitchinterval() == pytest.approx(0.004)
        sys.setswitchinterval(0.0001)  # already shorter: left alone, and restored as it was
        with short_switches(0.0005):
            assert sys.getswitchinterval() == pytest.approx(0.0001, rel=0.02)
        assert sys.getswitchinterval() == pytest.approx(0.0001, rel=0.02)
    finally:
        sys.setswitchinterval(before)


async def test_a_save_and_load_restore_the_switch_interval(tmp_path: Path) -> None:
    before = sys.getswitchinterval()
    seen: list[float] = []

    class Probe:
        def state_dict(self) -> dict[str, object]:
            seen.append(sys.getswitchinterval())
            return {"w": torch.ones(3)}

        def load_state_dict(self, sd: dict[str, object]) -> None:
            seen.append(sys.getswitchinterval())

    await aiockpt.save({"p": Probe()}, tmp_path / "ckpt", io=IOConfig(switch_interval=0.0007))
    await aiockpt.load({"p": Probe()}, tmp_path / "ckpt", io=IOConfig(switch_interval=0.0007))
    assert seen == [pytest.approx(0.0007)] * 3  # saved, then the load's template and hand-over
    assert sys.getswitchinterval() == before


def test_switch_interval_must_be_positive() -> None:
    with pytest.raises(CheckpointError, match=r"IOConfig\.switch_interval"):
        IOConfig(switch_interval=0.0)


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@pytest.mark.skipif(sys.platform != "linux", reason="only Linux gives each thread its own nice value")
@pytest.mark.parametrize("nice", [0, 7])
async def test_workers_run_at_the_lower_priority_in_threads_of_their_own(nice: int) -> None:
    seen: list[tuple[int, int, str]] = []
    pooled: list[int] = []

    def work(abort: threading.Event) -> None:
        seen.append((threading.get_native_id(), _nice(), threading.current_thread().name))

    def pooled_nice() -> None:
        pooled.append(_nice())

    caller = _nice()
    with responsive(IOConfig(worker_nice=nice), lowered=True):  # a save
        await run_each([work, work])
    with responsive(IOConfig(worker_nice=nice)):  # a load: readers keep the caller's priority
        await run_each([work])
    await run_each([work])  # outside a save or load: the caller's priority
    with responsive(IOConfig(worker_nice=nice), lowered=True):  # a save whose work holds the GIL
        await run_each([work], lower=False)
    assert [n for _, n, _ in seen] == [min(caller + nice, 19)] * 2 + [caller] * 3
    if nice:
        assert [name for _, _, name in seen[:2]] == ["aiockpt-io"] * 2
        assert len({tid for tid, _, _ in seen[:2]}) == 2
    # No pooled thread was left at the lower priority: every one of them runs at the caller's.
    for _ in range(4):
        await anyio.to_thread.run_sync(pooled_nice)
    assert set(pooled) == {caller}


@pytest.mark.skipif(sys.platform != "linux", reason="only Linux gives each thread its own nice value")
@pytest.mark.parametrize(
    ("state", "lowered"),
    [
        ({"w": torch.zeros(1 << 18)}, True),  # 1 MiB: the writer's time goes to the kernel's copy
        ({f"t{i}": torch.zeros(16) for i in range(300)}, False),  # 300 blocks of 64 B: to GIL-bound calls
        ({"w": torch.zeros(1 << 18), **{f"t{i}": torch.zeros(16) for i in range(300)}}, False),
    ],
    ids=["large", "small", "mostly_small_blocks"],
)
async def test_writers_are_lowered_only_where_blocks_are_large(
    state: dict[str, object], lowered: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[int] = []
    write_runs = _write.write_runs

    def spy(*args: object) -> None:
        seen.append(_nice())
        write_runs(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(_write, "write_runs", spy)
    caller = _nice()
    await aiockpt.save(state, tmp_path / "ckpt", io=IOConfig(worker_nice=7, threads=1))
    assert seen == [min(caller + 7, 19) if lowered else caller]
