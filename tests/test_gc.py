"""``_gc.paused``: only the youngest generation is collected inside, and everything is restored after."""

from __future__ import annotations

import gc
import sys
import threading
from collections.abc import Iterator

import pytest

from aiockpt._gc import paused

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
