"""A load's checker threads: blocks verified beside their reader, both pinned to a CPU left by the loop."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import anyio
import pytest
import torch
from conftest import assert_tree_equal, cancelled_once, file_size, flip_byte

import aiockpt
from aiockpt import CorruptionError, IOConfig
from aiockpt._load import _checker, _read
from aiockpt._load._checker import Checker, checker_cpus, pinned
from aiockpt._runs import read_run
from aiockpt._threads import Aborted

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(sys.platform != "linux", reason="threads are pinned to CPUs on Linux only"),
]

DATA = "data-r00000.bin"
MIB = 1 << 20


def _threads_named(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == name]


def _task_cpus() -> dict[str, str]:
    """Each thread of this process (by kernel thread id): the CPUs it may run on, as the kernel lists them."""
    out = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            status = (task / "status").read_text()
        except (FileNotFoundError, ProcessLookupError):  # the thread ended meanwhile (ENOENT or ESRCH)
            continue
        for line in status.splitlines():
            if line.startswith("Cpus_allowed_list:"):
                out[task.name] = line.split(":", 1)[1].strip()
    return out


@pytest.fixture
def restored() -> Iterator[None]:
    """After the test: no checker thread left, no CPU claimed, every thread's CPU set as it was."""
    before = _task_cpus()
    yield
    assert _threads_named("aiockpt-check") == []
    assert _checker._claimed == set()
    after = _task_cpus()
    assert {tid: cpus for tid, cpus in after.items() if tid in before} == {
        tid: cpus for tid, cpus in before.items() if tid in after
    }
    # Threads started meanwhile (anyio's pool grows) have one of the CPU sets seen before, none narrowed.
    assert set(after.values()) <= set(before.values())


@pytest.fixture
def one_cpu(monkeypatch: pytest.MonkeyPatch) -> int:
    """Make every load pin its reader and checker to one allowed CPU, whatever this machine has."""
    cpu = min(os.sched_getaffinity(0))
    monkeypatch.setattr(_checker, "_claim", lambda lanes: [cpu] * lanes)
    return cpu


# --- Where checkers run ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("allowed", "loop_cpu", "lanes", "expected"),
    [
        ([0, 1], 0, 1, [1]),  # two vCPUs: the reader and its checker share the CPU the loop is not on
        ([0, 1], 1, 1, [0]),
        ([0, 1], 0, 2, None),  # no CPU left to the loop: readers check their own runs
        ([0, 1, 2, 3], 1, 2, [2, 3]),  # the next CPUs after the loop's
        ([0, 1, 2, 3], 2, 2, [3, 0]),  # ... wrapping around
        ([0, 1, 2, 3], 3, 3, [0, 1, 2]),
        ([4, 5, 6, 7], 1, 2, [4, 5]),  # the loop's thread on a CPU outside this thread's set
        ([0, 1, 2, 3], 0, 1, [None]),  # a CPU for everyone: checkers unpinned
        ([0, 1, 2, 3, 4], 0, 2, [None, None]),
        ([0], 0, 1, None),
    ],
)
def test_checker_cpus_leave_the_loops_cpu_free(
    allowed: list[int],
    loop_cpu: int,
    lanes: int,
    expected: list[int | None] | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_checker, "_allowed", lambda: allowed)
    monkeypatch.setattr(_checker, "_GETCPU", lambda: loop_cpu)
    with checker_cpus(lanes) as cpus:
        assert cpus == expected
    assert _checker._claimed == set()


def test_concurrent_loads_never_pin_to_the_same_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    allowed = [0, 1]
    monkeypatch.setattr(_checker, "_allowed", lambda: allowed)
    monkeypatch.setattr(_checker, "_GETCPU", lambda: 0)
    with checker_cpus(1) as first:
        assert first == [1]
        with checker_cpus(1) as second:
            assert second is None  # the one CPU besides the loop's is taken: this reader checks alone
    with checker_cpus(1) as again:
        assert again == [1]
    allowed = [0, 1, 2, 3, 4]
    with checker_cpus(3) as first:
        assert first == [1, 2, 3]
        with checker_cpus(3) as second:
            assert second is None
        with checker_cpus(2) as third:
            assert third == [None, None]  # unpinned checkers need no claim
    assert _checker._claimed == set()


def test_without_sched_getcpu_readers_check_their_own_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_checker, "_GETCPU", None)
    with checker_cpus(1) as cpus:
        assert cpus is None


def test_pinned_narrows_the_thread_then_restores_it_even_on_error(restored: None) -> None:
    cpu = min(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)

    def narrowed() -> None:
        with pinned(cpu):
            assert os.sched_getaffinity(0) == {cpu}
            raise ValueError("inside")

    with pytest.raises(ValueError, match="inside"):
        narrowed()
    assert os.sched_getaffinity(0) == before
    with pinned(None):
        assert os.sched_getaffinity(0) == before


def test_pinned_falls_back_to_every_allowed_cpu_if_its_own_went_away(
    monkeypatch: pytest.MonkeyPatch, restored: None
) -> None:
    cpu = min(os.sched_getaffinity(0))
    everywhere = os.sched_getaffinity(0)
    real = os.sched_setaffinity
    calls: list[set[int]] = []
    after: list[set[int]] = []

    def setaffinity(pid: int, cpus: Iterable[int]) -> None:
        calls.append(set(cpus))
        if len(calls) == 2:  # the restore: none of the thread's CPUs is allowed any more
            raise OSError(22, "Invalid argument")
        real(pid, cpus)

    def in_a_thread() -> None:  # (the test's own thread must not stay pinned if this fails)
        with pinned(cpu):
            pass
        after.append(os.sched_getaffinity(0))

    monkeypatch.setattr(os, "sched_setaffinity", setaffinity)
    thread = threading.Thread(target=in_a_thread)
    thread.start()
    thread.join()
    assert calls[0] == {cpu}
    assert calls[2] == set(range(os.cpu_count() or 1))
    assert after == [everywhere]


# --- The checker thread ---------------------------------------------------------------------------------


def test_checks_run_in_order_on_their_own_pinned_thread(restored: None) -> None:
    cpu = min(os.sched_getaffinity(0))
    seen: list[tuple[int, str, set[int]]] = []

    def check(i: int) -> Callable[[], None]:
        return lambda: seen.append((i, threading.current_thread().name, os.sched_getaffinity(0)))

    with Checker(cpu, threading.Event()) as checker:
        for i in range(10):
            checker.put(check(i))
    assert [i for i, _, _ in seen] == list(range(10))
    assert {(name, frozenset(cpus)) for _, name, cpus in seen} == {("aiockpt-check", frozenset({cpu}))}


def test_a_failed_check_reaches_the_reader_and_never_blocks_it(restored: None) -> None:
    ran: list[int] = []
    failed = threading.Event()

    def check(i: int) -> None:
        if i == 0:
            failed.set()
            raise CorruptionError("block 0 is damaged")
        ran.append(i)

    def reader() -> None:
        with Checker(None, threading.Event()) as checker:
            checker.put(lambda: check(0))
            failed.wait(5)
            # The queue holds 4: a reader that kept handing over runs would block forever on a dead checker.
            for i in range(1, 50):
                checker.put(lambda i=i: check(i))  # type: ignore[misc]
                time.sleep(0.001)

    with pytest.raises(CorruptionError, match="block 0"):
        reader()
    assert ran == []


def test_the_failure_of_the_last_check_is_raised_on_leaving(restored: None) -> None:
    def bad() -> None:
        raise CorruptionError("the last block is damaged")

    def reader() -> None:
        with Checker(None, threading.Event()) as checker:
            checker.put(bad)

    with pytest.raises(CorruptionError, match="last block"):
        reader()


def test_leaving_on_an_error_skips_the_queued_checks(restored: None) -> None:
    release = threading.Event()
    ran: list[int] = []

    def first() -> None:
        release.wait(5)
        ran.append(0)

    def reader() -> None:
        with Checker(None, threading.Event()) as checker:
            checker.put(first)
            for i in range(1, 4):
                checker.put(lambda i=i: ran.append(i))  # type: ignore[misc]
            release.set()
            raise RuntimeError("the reader failed")

    with pytest.raises(RuntimeError, match="reader"):
        reader()
    assert ran in ([], [0])


def test_an_abort_skips_the_queued_checks_and_is_raised_on_leaving(restored: None) -> None:
    abort = threading.Event()
    started = threading.Event()
    ran: list[int] = []

    def first() -> None:
        started.set()
        time.sleep(0.05)
        ran.append(0)

    def reader() -> None:
        with Checker(None, abort) as checker:
            checker.put(first)
            for i in range(1, 4):
                checker.put(lambda i=i: ran.append(i))  # type: ignore[misc]
            started.wait(5)
            abort.set()

    with pytest.raises(Aborted):
        reader()
    assert ran == [0]  # the check under way ends; the queued ones are skipped


# --- Loads ----------------------------------------------------------------------------------------------


def _state(n: int = 6, nbytes: int = 3 * MIB) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    return {f"w{i}": torch.randn(nbytes // 4, generator=gen) for i in range(n)}


def _zeros_like(state: dict[str, torch.Tensor]) -> dict[str, object]:
    return {k: torch.zeros_like(v) for k, v in state.items()}


# Blocks of 1 MiB, in runs of up to 8 MiB: every run goes to a checker (blocks of 64 KiB or more). Read
# through the page cache: by default such runs of a cold file are read with O_DIRECT, by readers that a
# finisher follows instead (see test_direct_reads).
IO = IOConfig(threads=1, checksum_block=MIB, direct_reads=False)


@pytest.fixture
def spied(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[tuple[str, frozenset[int]]]]:
    """Record the thread and CPU set of every read and every checksum comparison of a load."""
    seen: dict[str, list[tuple[str, frozenset[int]]]] = {"read": [], "check": []}

    def where() -> tuple[str, frozenset[int]]:
        return threading.current_thread().name, frozenset(os.sched_getaffinity(0))

    mismatched = _read.mismatched

    def spy_read(*args: object) -> int:
        seen["read"].append(where())
        return read_run(*args)  # type: ignore[arg-type]

    def spy_check(*args: object) -> object:
        seen["check"].append(where())
        return mismatched(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(_read, "read_run", spy_read)
    monkeypatch.setattr(_read, "mismatched", spy_check)
    return seen


async def test_a_load_checks_large_blocks_beside_its_reader_on_one_cpu(
    ckpt_path: Path, spied: dict[str, list[tuple[str, frozenset[int]]]], restored: None
) -> None:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("a reader is pinned only where a CPU is left to the event loop")
    saved = _state()
    await aiockpt.save(saved, ckpt_path, io=IO)
    target = _zeros_like(saved)
    await aiockpt.load(target, ckpt_path, io=IO)
    assert_tree_equal(target, saved)
    (reader,) = set(spied["read"])
    (checker,) = set(spied["check"])
    assert checker[0] == "aiockpt-check"
    assert reader[0] != "aiockpt-check"
    assert len(reader[1]) == 1
    assert checker[1] == reader[1]  # the same single CPU
    assert len(spied["check"]) == len(spied["read"]) > 1


async def test_a_mapped_read_hands_its_runs_to_a_checker(
    ckpt_path: Path, one_cpu: int, spied: dict[str, list[tuple[str, frozenset[int]]]], restored: None
) -> None:
    """Runs of mapped tensors are populated by the reader and checked beside it, like runs read."""
    saved = _state()
    await aiockpt.save(saved, ckpt_path, io=IO)
    tree = await aiockpt.read(ckpt_path, io=IO)
    assert_tree_equal(tree, saved)
    assert all(t.untyped_storage().nbytes() > t.nbytes for t in tree.values() if isinstance(t, torch.Tensor))
    assert spied["read"] == []  # nothing read into memory: populated in place
    (checker,) = set(spied["check"])
    assert checker[0] == "aiockpt-check"
    assert len(checker[1]) == 1  # pinned
    assert len(spied["check"]) > 1


async def test_small_blocks_are_checked_by_their_reader(
    ckpt_path: Path, one_cpu: int, spied: dict[str, list[tuple[str, frozenset[int]]]], restored: None
) -> None:
    saved = _state(n=64, nbytes=16 << 10)
    await aiockpt.save(saved, ckpt_path, io=IO)
    assert_tree_equal(await aiockpt.read(ckpt_path, io=IO), saved)
    readers = {name for name, _ in spied["read"]}
    assert len(readers) == 1
    assert {name for name, _ in spied["check"]} == readers  # no checker thread


async def test_a_lane_of_one_large_run_is_checked_by_its_reader(
    ckpt_path: Path, one_cpu: int, spied: dict[str, list[tuple[str, frozenset[int]]]], restored: None
) -> None:
    saved = _state(n=2)  # 6 MiB: one run
    await aiockpt.save(saved, ckpt_path, io=IO)
    # Read (not mapped), through the page cache.
    unmapped = IOConfig(threads=1, checksum_block=MIB, map_reads=False, direct_reads=False)
    assert_tree_equal(await aiockpt.read(ckpt_path, io=unmapped), saved)
    assert len(spied["read"]) == 1
    assert [name for name, _ in spied["check"]] == [spied["read"][0][0]]  # the reader's own thread


async def test_without_checkers_every_reader_checks_its_own_runs(
    ckpt_path: Path, one_cpu: int, spied: dict[str, list[tuple[str, frozenset[int]]]], restored: None
) -> None:
    saved = _state()
    await aiockpt.save(saved, ckpt_path, io=IO)
    target = _zeros_like(saved)
    await aiockpt.load(
        target, ckpt_path, io=IOConfig(threads=1, checksum_block=MIB, checkers=False, direct_reads=False)
    )
    assert_tree_equal(target, saved)
    readers = {name for name, _ in spied["read"]}
    assert len(readers) == 1
    assert {name for name, _ in spied["check"]} == readers
    assert len(spied["check"]) == len(spied["read"]) > 1
    assert {cpus for _, cpus in spied["read"]} == {frozenset(os.sched_getaffinity(0))}  # not pinned


@pytest.mark.parametrize("victim", [0, 5])
async def test_damage_found_by_a_checker_names_the_key_and_file(
    victim: int, ckpt_path: Path, one_cpu: int, restored: None
) -> None:
    saved = _state()
    await aiockpt.save(saved, ckpt_path, io=IO)
    data = ckpt_path / DATA
    offset = (ckpt_path / DATA).read_bytes().find(saved[f"w{victim}"].numpy().tobytes()[:4096])
    assert offset >= 0
    flip_byte(data, offset + 2 * MIB + 7)  # in the tensor's third block
    with pytest.raises(CorruptionError, match="checksum mismatch in block 2") as info:
        await aiockpt.load(_zeros_like(saved), ckpt_path, io=IO)
    assert info.value.key == f"w{victim}"
    assert info.value.file is not None
    assert Path(info.value.file).name == DATA


async def test_a_truncated_file_is_found_by_the_reader(ckpt_path: Path, one_cpu: int, restored: None) -> None:
    saved = _state()
    await aiockpt.save(saved, ckpt_path, io=IO)
    data = ckpt_path / DATA
    os.truncate(data, file_size(data) - 3 * MIB)
    with pytest.raises(CorruptionError, match="truncated") as info:
        await aiockpt.read(ckpt_path, io=IO)
    assert info.value.file is not None
    assert Path(info.value.file).name == DATA


async def test_a_load_cancelled_while_its_checker_works_leaves_nothing_behind(
    ckpt_path: Path, one_cpu: int, monkeypatch: pytest.MonkeyPatch, restored: None
) -> None:
    saved = _state(n=16)
    await aiockpt.save(saved, ckpt_path, io=IO)
    checks = 0
    checking = threading.Event()
    mismatched = _read.mismatched

    def slow(*args: object) -> object:
        nonlocal checks
        checks += 1
        checking.set()
        time.sleep(0.02)
        return mismatched(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(_read, "mismatched", slow)
    assert await cancelled_once(checking, lambda: aiockpt.load(_zeros_like(saved), ckpt_path, io=IO))
    assert 0 < checks < 6  # cancelled mid-load (6 runs of 8 MiB), not after it
    # Usable again at once.
    monkeypatch.setattr(_read, "mismatched", mismatched)
    target = _zeros_like(saved)
    await aiockpt.load(target, ckpt_path, io=IO)
    assert_tree_equal(target, saved)


async def test_loads_cancelled_at_random_moments_leave_nothing_behind(
    ckpt_path: Path, restored: None
) -> None:
    """Readers, checkers, CPU claims and file descriptors all go when a load is cancelled, wherever it is."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("a reader is pinned only where a CPU is left to the event loop")
    import random

    seed = 20261126
    rng = random.Random(seed)
    saved = _state(n=8)  # 24 MiB: three runs of 8 MiB
    await aiockpt.save(saved, ckpt_path, io=IO)
    fds = len(os.listdir("/proc/self/fd"))
    cancelled = 0
    for _ in range(40):
        target = _zeros_like(saved)
        with anyio.move_on_after(rng.uniform(0, 0.02)) as scope:
            await aiockpt.load(target, ckpt_path, io=IO)
        cancelled += scope.cancelled_caught
        if not scope.cancelled_caught:
            assert_tree_equal(target, saved)
        assert _threads_named("aiockpt-check") == [], f"seed {seed}"
        assert _checker._claimed == set(), f"seed {seed}"
    assert len(os.listdir("/proc/self/fd")) == fds, f"seed {seed}"
    assert cancelled > 0, f"seed {seed}: no load was cancelled"
    target = _zeros_like(saved)
    await aiockpt.load(target, ckpt_path, io=IO)
    assert_tree_equal(target, saved)
