"""``_threads.dismantle``: bookkeeping of 10^4 objects freed a slice at a time, nothing shared touched."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import msgspec
import pytest

from aiockpt import _threads
from aiockpt._threads import dismantle


class Leaf:
    """A weak-referenceable stand-in for a tensor or a plan item."""


class Item(msgspec.Struct, frozen=True, gc=False):
    leaves: tuple[object, ...]


def test_everything_only_the_box_held_is_freed_in_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    yields = 0

    def counting() -> None:
        nonlocal yields
        yields += 1

    monkeypatch.setattr(_threads, "yield_gil", counting)
    leaves = [Leaf() for _ in range(3000)]
    refs = [weakref.ref(x) for x in leaves]
    keys = [Leaf() for _ in range(1000)]
    key_refs = [weakref.ref(k) for k in keys]
    # A dict (keys too), a gc=False struct holding a tuple, a plain list, nested as plans and trees are.
    tree = {
        "by_key": dict(zip(keys, leaves[:1000], strict=True)),
        "item": Item(leaves=tuple(leaves[1000:2000])),
        "rest": [[x] for x in leaves[2000:]],
    }
    box: list[object] = [tree]
    del tree, leaves, keys
    gc.disable()  # every object must go by reference counting alone, as dismantle runs
    try:
        dismantle(box)
        assert box == []
        assert [r() for r in refs + key_refs] == [None] * 4000
    finally:
        gc.enable()
    assert yields >= 4000 // 256  # the GIL was offered between slices


def test_objects_held_elsewhere_are_let_go_untouched() -> None:
    shared = [Leaf() for _ in range(1000)]
    kept = {"a": shared, "n": 3}
    mine = [Leaf() for _ in range(1000)]
    mine_refs = [weakref.ref(x) for x in mine]
    box: list[object] = [kept, [shared, mine]]
    del mine
    dismantle(box)
    # Still referenced by these names: intact, not emptied.
    assert kept == {"a": shared, "n": 3}
    assert len(shared) == 1000
    assert all(r() is None for r in mine_refs)


def test_cycles_are_left_to_the_collector() -> None:
    a: list[object] = [Leaf() for _ in range(600)]
    a.append(a)
    ref = weakref.ref(a[0])
    box: list[object] = [a]
    del a
    dismantle(box)
    gc.collect()
    assert ref() is None


def test_the_gil_is_offered_at_most_every_half_millisecond(monkeypatch: pytest.MonkeyPatch) -> None:
    def offer_in_a_new_thread() -> list[float]:
        # A zero-length sleep is the offer (it took 80 us here; a call per slice would dominate).
        sleeps: list[float] = []
        monkeypatch.setattr(time, "sleep", sleeps.append)
        try:
            start = time.perf_counter()
            while time.perf_counter() - start < 0.0045:
                _threads.yield_gil()
        finally:
            monkeypatch.undo()
        return sleeps

    box: list[list[float]] = []
    thread = threading.Thread(target=lambda: box.append(offer_in_a_new_thread()))
    thread.start()
    thread.join()
    (sleeps,) = box
    # Thousands of calls in 4.5 ms of work: an offer at the first, then one per 0.5 ms at most.
    assert 1 <= len(sleeps) <= 10
    assert set(sleeps) == {0}
