"""Stage 3 is a pure function: dedup of replicated chunks, byte balance, alignment, disagreements."""

from __future__ import annotations

import pytest

from aiockpt import StateError
from aiockpt._save._global_plan import LARGE, PAGE, SMALL_ALIGN, global_plan
from aiockpt._save._local_plan import LocalPlan, WriteItem


def item(
    name: str, nbytes: int, *, replicated: bool = True, offsets: int = 0, size: int | None = None
) -> WriteItem:
    n = size if size is not None else nbytes
    return WriteItem(
        path=(name,),
        dtype="uint8",
        shape=(n if replicated else 4 * n,),
        offsets=(offsets,),
        sizes=(n,),
        nbytes=nbytes,
        replicated=replicated,
    )


def test_single_rank_writes_everything_in_order_aligned() -> None:
    items = (item("a", 10), item("b", LARGE), item("c", 3), item("d", LARGE + 1))
    plan = global_plan([LocalPlan(rank=0, items=items)])
    (rank,) = plan.ranks
    assert [w.item for w in rank.writes] == [0, 1, 2, 3]
    offsets = [w.offset for w in rank.writes]
    assert offsets == sorted(offsets)
    for w, it in zip(rank.writes, items, strict=True):
        assert w.offset % (PAGE if it.nbytes >= LARGE else SMALL_ALIGN) == 0
    last = rank.writes[-1]
    assert rank.nbytes == last.offset + items[-1].nbytes
    # Manifest tensor i is rank 0's item i: the coordinator's tree refers to tensors by that index.
    assert [t.path for t in plan.tensors] == [("a",), ("b",), ("c",), ("d",)]


def test_replicated_chunks_are_written_once_and_balanced() -> None:
    sizes = [800, 700, 600, 500, 400, 300, 200, 100]
    items = tuple(item(f"t{i}", n) for i, n in enumerate(sizes))
    plans = [LocalPlan(rank=r, items=items) for r in range(3)]
    plan = global_plan(plans)
    written = [sum(items[w.item].nbytes for w in r.writes) for r in plan.ranks]
    assert sum(written) == sum(sizes)  # bytes on disk == unique bytes
    assert max(written) - min(written) <= max(sizes)  # greedy balance bound
    for entry in plan.tensors:
        assert len(entry.chunks) == 1


def test_sharded_chunks_stay_with_their_owner() -> None:
    shard = [item("w", 8, replicated=False, offsets=8 * r, size=8) for r in range(4)]
    plans = [LocalPlan(rank=r, items=(shard[r],)) for r in range(4)]
    plan = global_plan(plans)
    for r, rank_plan in enumerate(plan.ranks):
        assert len(rank_plan.writes) == 1
        assert rank_plan.file == f"data-r{r:05d}.bin"
    (entry,) = plan.tensors
    assert sorted(c.offsets for c in entry.chunks) == [(0,), (8,), (16,), (24,)]
    assert entry.shape == (32,)


def test_each_rank_writes_in_its_item_order_when_shards_and_replicas_mix() -> None:
    # A rank's own shards are listed as they come and replicated chunks are handed out afterwards, so
    # its writes are out of item order until sorted: the file must follow the items (sequential reads).
    plans = [
        LocalPlan(
            rank=r,
            items=(
                item("r0", 100),
                item("s", 8, replicated=False, offsets=8 * r, size=8),
                item("r1", 50),
                item("r2", 30),
                item("t", 8, replicated=False, offsets=8 * r, size=8),
            ),
        )
        for r in range(2)
    ]
    plan = global_plan(plans)
    for rank_plan in plan.ranks:
        order = [w.item for w in rank_plan.writes]
        assert order == sorted(order)
        assert {1, 4} <= set(order)  # its own shards
        offsets = [w.offset for w in rank_plan.writes]
        assert offsets == sorted(offsets)
    assert sorted(w.item for r in plan.ranks for w in r.writes) == [0, 1, 1, 2, 3, 4, 4]


def test_ranks_disagreeing_on_a_tensor_are_named() -> None:
    a = LocalPlan(rank=0, items=(item("w", 8),))
    b = LocalPlan(rank=1, items=(item("w", 16),))
    with pytest.raises(StateError, match=r"ranks 0 and 1 disagree on tensor 'w'"):
        global_plan([a, b])


def test_a_tensor_rank_zero_lacks_is_refused_naming_it_and_the_rank() -> None:
    """The manifest's tree is rank 0's: such a tensor used to be written and never found again (the
    per-rank keys docs/distributed.md once suggested were lost so)."""
    a = LocalPlan(rank=0, items=(item("x", 4),))
    b = LocalPlan(rank=1, items=(item("y", 4), item("x", 4)))
    with pytest.raises(StateError, match="rank 1 holds tensor 'y', which rank 0's state lacks") as info:
        global_plan([a, b])
    assert info.value.key == "y"
    # The same tensors in another order are the same state.
    plan = global_plan([a, LocalPlan(rank=1, items=(item("x", 4),))])
    assert [t.path for t in plan.tensors] == [("x",)]
