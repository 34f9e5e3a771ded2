"""``_gc``: only the youngest generation is collected inside a pause, and everything is restored after; and a
save collects its large bookkeeping deliberately, while it is in the CPU's cache."""

from __future__ import annotations

import gc
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import pytest
import torch

import aiockpt
from aiockpt._gc import collect_young, paused

pytestmark = pytest.mark.skipif(
    sys.version_info >= (3, 14), reason="Python 3.14's incremental collector is disabled instead"
)


@pytest.fixture(autouse=True)
def _restore_gc() -> Iterator[None]:
    enabled, threshold = gc.isenabled(), gc.get_threshold()
    yield
    gc.set_threshold(*threshold)
    (gc.enable if enabled else gc.disable)()


def _generations_collected(body: object) -> set[int]:
    seen: set[int] = set()

    def callback(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            seen.add(info["generation"])

    gc.callbacks.append(callback)
    try:
        body()  # type: ignore[operator]
    finally:
        gc.callbacks.remove(callback)
    return seen


def test_only_young_collections_run_inside_and_thresholds_come_back() -> None:
    gc.enable()
    gc.set_threshold(700, 10, 10)
    kept: list[object] = []

    def allocate() -> None:
        with paused():
            assert gc.get_threshold()[0] == 700
            assert min(gc.get_threshold()[1:]) > 10**6
            with paused():  # nested: still paused after the inner block
                pass
            assert gc.get_threshold()[1] > 10**6
            # Enough tracked objects for hundreds of young collections, and so, unpaused, older ones.
            kept.extend((i, str(i)) for i in range(200_000))

    assert _generations_collected(allocate) == {0}
    assert gc.get_threshold() == (700, 10, 10)
    # Young collections untracked tuples of atomic values (a manifest's shapes, offsets and checksums):
    # they will never weigh on the older generations.
    assert not any(gc.is_tracked(t) for t in kept[: len(kept) // 2])


def test_the_pause_ends_with_the_last_of_concurrent_users() -> None:
    gc.set_threshold(700, 10, 10)
    entered, release = threading.Barrier(2), threading.Event()

    def other() -> None:
        with paused():
            entered.wait()
            release.wait(10)

    thread = threading.Thread(target=other)
    thread.start()
    with paused():
        entered.wait()
    assert gc.get_threshold()[1] > 10**6, "the other thread's pause is still running"
    release.set()
    thread.join(10)
    assert gc.get_threshold() == (700, 10, 10)


def test_a_disabled_collector_stays_disabled_and_an_exception_still_restores() -> None:
    gc.disable()
    with pytest.raises(RuntimeError), paused():
        raise RuntimeError
    assert not gc.isenabled()
    assert gc.get_threshold()[1] < 10**6


def test_disabled_pause_changes_nothing() -> None:
    before = gc.get_threshold()
    with paused(enabled=False):
        assert gc.get_threshold() == before


def test_collect_young_collects_only_the_youngest_generation_and_never_a_disabled_collector() -> None:
    gc.enable()
    assert _generations_collected(collect_young) == {0}
    gc.disable()
    assert _generations_collected(collect_young) == set()
    gc.enable()
    gc.set_threshold(0)  # also "off"
    assert _generations_collected(collect_young) == set()


# A container of this many items that a collection of the youngest generation meets is walked item by item
# in one C call, holding the GIL (2-14 ms for 20,000 items long after they were made).
_LARGE = 10_000


def _deliberate(frame: FrameType | None) -> bool:
    while frame is not None:
        if frame.f_code is collect_young.__code__:
            return True
        frame = frame.f_back
    return False


async def test_a_save_of_many_tensors_leaves_no_large_container_to_chance_collections(tmp_path: Path) -> None:
    # Bookkeeping that makes a list or tuple of 10^4 items whole (a tuple of keys, a list of checksums)
    # allocates nothing tracked, so it stays young until whatever collection comes next, maybe after the
    # writes. The save collects it itself right after (collect_young); no other collection meets it.
    gc.enable()
    gc.set_threshold(700, 10, 10)
    state = {f"t{i}": torch.full((4,), float(i)) for i in range(20_000)}
    chance: list[str] = []
    deliberate = 0

    def callback(phase: str, info: dict[str, int]) -> None:
        nonlocal deliberate
        if phase != "start":
            return
        large = [
            f"{type(o).__name__} of {len(o)}"
            for o in gc.get_objects(0)
            if isinstance(o, list | tuple | dict) and len(o) >= _LARGE
        ]
        if not large:
            return
        try:
            frame: FrameType | None = sys._getframe(1)
        except ValueError:  # set off by C code that runs no Python frame (a thread starting, say)
            frame = None
        if _deliberate(frame):
            deliberate += 1
            return
        where = f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame else "C code"
        chance.append(f"{', '.join(large)} at {where}")

    gc.callbacks.append(callback)
    try:
        async with aiockpt.Checkpointer(tmp_path, keep_last=1) as ckpt:
            await ckpt.save(state, step=1)
            handle = await ckpt.save(state, step=2, async_op=True)
            await handle
    finally:
        gc.callbacks.remove(callback)
    assert chance == []
    assert deliberate > 0  # (the check saw the bookkeeping)
