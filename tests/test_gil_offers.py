"""A save's per-tensor Python loops offer the GIL every ``OFFER_ITEMS`` items (``_threads.yield_gil``).

Run in a worker thread, each loop over 10^4 tensors is tens of milliseconds of Python work; without the
offers the event loop's thread waited behind it (see ``OFFER_ITEMS``). What the offers buy is measured
by the benchmark (docs/benchmarks.md), not here: these tests check that each loop makes them, and that
what it computes is unchanged.
"""

from __future__ import annotations

import types

import pytest
import torch

from aiockpt import _tree
from aiockpt._save import _global_plan, _local_plan, _stage, _write
from aiockpt._threads import OFFER_ITEMS

_COUNT = 1000


def _state() -> dict[str, object]:
    return {f"t{i}": torch.full((4,), float(i)) for i in range(_COUNT)}


def _counting(monkeypatch: pytest.MonkeyPatch, *modules: types.ModuleType) -> dict[str, int]:
    calls = {module.__name__: 0 for module in modules}
    for module in modules:

        def counting(name: str = module.__name__) -> None:
            calls[name] += 1

        monkeypatch.setattr(module, "yield_gil", counting)
    return calls


def test_flattening_a_large_mapping_offers_the_gil(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _counting(monkeypatch, _tree)
    flat = _tree.flatten({"model": _state()}, allow_pickle=False)
    assert len(flat.tensors) == _COUNT
    assert calls[_tree.__name__] >= _COUNT // OFFER_ITEMS


def test_a_small_mapping_makes_no_offer(monkeypatch: pytest.MonkeyPatch) -> None:
    # The clock is not even read for the many small dicts of an optimizer's state.
    calls = _counting(monkeypatch, _tree)
    _tree.flatten(
        {f"k{i}": {"step": i, "v": torch.zeros(2)} for i in range(OFFER_ITEMS - 1)}, allow_pickle=False
    )
    assert calls[_tree.__name__] == 0


def test_each_planning_loop_of_a_save_offers_the_gil(monkeypatch: pytest.MonkeyPatch) -> None:
    state = _state()
    layout = _stage.plan_stage(state, copy=False, allow_pickle=False)  # unpatched: the reference
    calls = _counting(monkeypatch, _stage, _local_plan, _global_plan, _write)
    again = _stage.plan_stage(state, copy=False, allow_pickle=False)
    local = _local_plan.local_plan(0, layout.flat, layout.specs)
    plan = _global_plan.global_plan([local])
    pieces = _write._pieces(plan.ranks[0], layout.sources, 1 << 20)
    for module in (_stage, _local_plan, _global_plan, _write):
        # _global_plan goes over every item twice: the assignment, then each rank's writes.
        assert calls[module.__name__] >= _COUNT // OFFER_ITEMS, module.__name__
    # Unchanged by the offers: the same layout, one chunk per tensor, one piece per write.
    assert (again.nbytes, again.small, again.offsets) == (layout.nbytes, layout.small, layout.offsets)
    assert [t.data_ptr() for t in again.flat.tensors] == [t.data_ptr() for t in layout.flat.tensors]
    assert [len(e.chunks) for e in plan.tensors] == [1] * _COUNT
    assert len(pieces) == _COUNT
