"""Stage 3 is a pure function: dedup of replicated chunks, byte balance, alignment, disagreements."""

from __future__ import annotations

import pytest

from aiockpt import StateError
from aiockpt._format import DictNode, ListNode, Node, RanksNode, TensorNode, ValueNode
from aiockpt._merge import Signature, merge, reindex
from aiockpt._save._global_plan import LARGE, PAGE, SMALL_ALIGN, global_plan
from aiockpt._save._local_plan import LocalPlan, WriteItem


def item(
    name: str,
    nbytes: int,
    *,
    replicated: bool = True,
    offsets: int = 0,
    size: int | None = None,
    shards: int = 4,
) -> WriteItem:
    n = size if size is not None else nbytes
    return WriteItem(
        path=(name,),
        dtype="uint8",
        shape=(n if replicated else shards * n,),
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
                item("s", 8, replicated=False, offsets=8 * r, size=8, shards=2),
                item("r1", 50),
                item("r2", 30),
                item("t", 8, replicated=False, offsets=8 * r, size=8, shards=2),
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


def _one_box_each(length: int, boxes: list[tuple[int, int, bool]]) -> list[LocalPlan]:
    """Rank ``r``'s plan: one item of the 1-d uint8 tensor 'w' of ``length``, box ``boxes[r]``.

    Each box is ``(offset, size, replicated)``.
    """
    return [
        LocalPlan(
            rank=r,
            items=(
                WriteItem(
                    path=("w",),
                    dtype="uint8",
                    shape=(length,),
                    offsets=(o,),
                    sizes=(n,),
                    nbytes=n,
                    replicated=rep,
                ),
            ),
        )
        for r, (o, n, rep) in enumerate(boxes)
    ]


@pytest.mark.parametrize(
    ("boxes", "message"),
    [
        # Rank 0 holds a DTensor's shard, rank 1 the whole tensor as a plain one.
        pytest.param(
            [(0, 4, False), (0, 8, True)], r"ranks 0 and 1 hold overlapping parts of tensor 'w'", id="overlap"
        ),
        # DTensor.from_local(run_check=False), shards of 6 and 4 rows of 10 at torch's offsets 0 and 5.
        pytest.param([(0, 6, False), (5, 4, False)], r"ranks 0 and 1 hold overlapping parts", id="uneven"),
        pytest.param(
            [(0, 5, False), (7, 5, False)], r"rank 1's part of tensor 'w', the box \[7\]", id="outside"
        ),
    ],
)
def test_ranks_whose_parts_of_a_tensor_a_load_would_refuse_are_named(
    boxes: list[tuple[int, int, bool]], message: str
) -> None:
    """Such a save was published (rank 0 reported it saved, retention deleted the step before it) and every
    load refused it: boxes overlapping, or outside the tensor, in a collective checkpoint."""
    with pytest.raises(StateError, match=message) as caught:
        global_plan(_one_box_each(10, boxes))
    assert caught.value.key == "w"


def test_a_box_several_ranks_hold_is_written_once() -> None:
    """A DTensor sharded over a tensor-parallel sub-mesh, alike in two data-parallel replicas (ranks 0-1
    and 2-3): its boxes were written once per replica."""
    plan = global_plan(_one_box_each(8, [(4 * (r % 2), 4, True) for r in range(4)]))
    (entry,) = plan.tensors
    assert sorted(c.offsets for c in entry.chunks) == [(0,), (4,)]
    assert sum(len(r.writes) for r in plan.ranks) == 2


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


def test_per_rank_tensors_are_each_their_ranks_own() -> None:
    """Items the tree merge found per-rank are written by their rank, never deduplicated with another
    rank's copy at the same key; rank 0's keep their index, the others' follow rank 0's."""
    a = LocalPlan(rank=0, items=(item("w", 8), item("rng", 4)))
    b = LocalPlan(rank=1, items=(item("w", 8), item("rng", 4), item("only1", 4)))
    plan = global_plan([a, b], (frozenset({1}), frozenset({1, 2})))
    assert [t.path for t in plan.tensors] == [("w",), ("rng",), ("rng",), ("only1",)]
    assert plan.own == ((0, 1, 1), (1, 1, 2), (1, 2, 3))
    writers = {w.tensor: r.rank for r in plan.ranks for w in r.writes}
    assert writers[1] == 0
    assert writers[2] == writers[3] == 1
    assert len(plan.tensors[0].chunks) == 1  # the shared one, written once
    # A per-rank tensor may differ in shape between ranks (a buffer of each rank's length).
    b2 = LocalPlan(rank=1, items=(item("w", 8), item("rng", 16)))
    plan = global_plan([a, b2], (frozenset({1}), frozenset({1})))
    assert [t.shape for t in plan.tensors] == [(8,), (4,), (16,)]


# --- The tree merge that finds per-rank state (``_merge.py``) --------------------------------------------


def _sig(crc: int = 1, shape: tuple[int, ...] = (4,), shard: bool = False) -> Signature:
    return Signature(shard, "float32", shape, crc)


def _d(**values: Node) -> DictNode:
    return DictNode(keys=tuple(values), values=tuple(values.values()))


def test_merge_keeps_what_ranks_share_and_splits_what_differs() -> None:
    t = TensorNode
    r0 = _d(w=t(index=0), rng=t(index=1), n=ValueNode(value=1), seq=ListNode(items=(ValueNode(value=1),)))
    r1 = _d(w=t(index=0), rng=t(index=1), n=ValueNode(value=1.0), seq=ListNode(items=()), extra=t(index=2))
    merged = merge([r0, r1], [[_sig(), _sig(crc=5)], [_sig(), _sig(crc=6), _sig()]])
    values = dict(zip(merged.tree.keys, merged.tree.values, strict=True))
    assert values["w"] == t(index=0)  # alike: shared
    assert values["rng"] == RanksNode(ranks=(0, 1), items=(t(index=1), t(index=1)))  # contents differ
    assert values["n"] == RanksNode(ranks=(0, 1), items=(ValueNode(value=1), ValueNode(value=1.0)))
    assert isinstance(values["seq"], RanksNode)  # lengths differ
    assert values["extra"] == RanksNode(ranks=(1,), items=(t(index=2),))  # only rank 1 holds it
    assert merged.own == (frozenset({1}), frozenset({1, 2}))
    renumbered = reindex(merged.tree, {(0, 1): 1, (1, 1): 3, (1, 2): 4})
    values = dict(zip(renumbered.keys, renumbered.values, strict=True))
    assert values["rng"] == RanksNode(ranks=(0, 1), items=(t(index=1), t(index=3)))
    assert values["extra"] == RanksNode(ranks=(1,), items=(t(index=4),))


def test_merge_of_alike_trees_is_rank_0s_tree() -> None:
    tree = _d(a=_d(x=TensorNode(index=0)), b=TensorNode(index=1))
    other = _d(a=_d(x=TensorNode(index=0)), b=TensorNode(index=1))
    merged = merge([tree, other], [[_sig(), _sig(crc=-1, shape=(10**6,))]] * 2)
    assert merged.tree is tree
    assert merged.own == (frozenset(), frozenset())


def test_merge_refuses_a_dtensor_under_per_rank_state() -> None:
    r0 = _d(w=TensorNode(index=0))
    r1 = _d(mine=_d(dt=TensorNode(index=0)))
    with pytest.raises(StateError, match="rank 1 holds a DTensor at key 'mine/dt'") as info:
        merge([r0, r1], [[_sig()], [_sig(shard=True)]])
    assert info.value.key == "mine/dt"


def test_merge_names_ranks_that_disagree_on_a_dtensor() -> None:
    tree = _d(w=TensorNode(index=0))
    with pytest.raises(
        StateError, match=r"ranks 0 and 1 disagree on tensor 'w': a DTensor float32\[8\] vs a DT"
    ):
        merge([tree, tree], [[_sig(shard=True, shape=(8,))], [_sig(shard=True, shape=(9,))]])


def test_merge_takes_pieces_of_one_dtensor_for_one_tensor() -> None:
    # A collective-free part may hold a DTensor whole (one box) where another holds a shard of it.
    tree = _d(w=TensorNode(index=0))
    merged = merge([tree, tree], [[_sig(crc=3, shape=(8,))], [_sig(shard=True, shape=(8,))]])
    assert merged.tree is tree
