"""Stage 3, coordinator: merge every rank's local plan into who writes what, where. Pure at its core.

Chunks held by several ranks (replicated tensors) are written once, by the candidate rank with the fewest
bytes assigned so far, taking the largest chunks first, which balances write bytes across ranks. Each rank
writes its chunks to its own data file at aligned offsets. The result also carries the manifest's tensor
table, with checksums left empty for the finish stage to fill in.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import msgspec

from .._errors import StateError
from .._format import Chunk, KeyPath, TensorEntry, data_file_name
from .._gc import collect_young
from .._load._manifest import box_inside, overlapping
from .._threads import OFFER_ITEMS, dismantle, yield_gil
from .._tree import render
from ._local_plan import LocalPlan, WriteItem

# Large chunks start on page boundaries (friendly to mmap and direct I/O); small ones are packed densely.
PAGE = 4096
SMALL_ALIGN = 64
LARGE = 64 * 1024


def align(offset: int, nbytes: int) -> int:
    """The aligned file offset at or after ``offset`` for a chunk of ``nbytes``."""
    a = PAGE if nbytes >= LARGE else SMALL_ALIGN
    return -(-offset // a) * a


class WriteAssignment(msgspec.Struct, frozen=True, kw_only=True, gc=False, array_like=True):
    """Rank-local item ``item`` goes to ``offset`` of the rank's file; it is chunk ``chunk`` of ``tensor``."""

    item: int
    offset: int
    tensor: int
    chunk: int


class RankPlan(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """What one rank writes, in file order."""

    rank: int
    file: str
    nbytes: int
    writes: tuple[WriteAssignment, ...]


class GlobalPlan(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """The coordinator's view: every rank's plan and the manifest tensor table (checksums empty).

    ``own``: for each tensor a rank holds as per-rank state, ``(rank, its item, the manifest's tensor)``.
    """

    ranks: tuple[RankPlan, ...]
    tensors: tuple[TensorEntry, ...]
    own: tuple[tuple[int, int, int], ...] = ()


def _append(writes: list[tuple[int, int]], j: int, t: int) -> bool:
    """Add item ``j`` (tensor ``t``) to a rank's ``writes``; return whether it breaks their item order."""
    late = bool(writes) and writes[-1] > (j, t)
    writes.append((j, t))
    return late


def _check_boxes(item: WriteItem, boxes: dict[tuple[tuple[int, ...], tuple[int, ...]], int]) -> None:
    """Refuse a tensor whose chunks (distinct ``boxes``, each with a rank writing it) a load would refuse.

    Each box must lie inside the tensor and none overlap another (they need not hold every element: a
    save over a sub-group of a DTensor's mesh holds the shards of its ranks). Every rank makes the same
    plan, so every rank refuses it before a byte is written; the checkpoint was published otherwise, and
    refused by every load.

    Raises:
        StateError: Names the key and the ranks.
    """
    key = render(item.path)
    for (offsets, sizes), rank in boxes.items():
        if not box_inside(offsets, sizes, item.shape):
            raise StateError(
                f"rank {rank}'s part of tensor {key!r}, the box {list(offsets)} + {list(sizes)}, is not "
                f"inside its shape {list(item.shape)}",
                key=key,
            )
    found = overlapping(list(boxes))
    if found is not None:
        a, b = found
        raise StateError(
            f"ranks {boxes[a]} and {boxes[b]} hold overlapping parts of tensor {key!r}: the boxes "
            f"{list(a[0])} + {list(a[1])} and {list(b[0])} + {list(b[1])} (a DTensor on one rank and a "
            "plain tensor on the other?)",
            key=key,
        )


def global_plan(
    plans: Sequence[LocalPlan],
    own: Sequence[frozenset[int]] = (),
    paired: Sequence[Mapping[int, int]] = (),
    *,
    tag: str = "",
) -> GlobalPlan:
    """Assign every chunk held by any rank to exactly one writer and a file offset.

    Tensor ``i`` of the manifest is item ``i`` of rank 0 (the coordinator's tree refers to tensors by that
    index); every rank holds the same tensors (SPMD), if not all of them in the same order, except its
    per-rank state: ``own[r]`` (empty: none), the items of rank ``r`` that are its own (see ``_ranks``),
    each a tensor of its own in the manifest that ``r`` writes, after rank 0's. ``paired[r]`` (with
    ``own``) maps each other item of rank ``r`` to the tensor of rank 0 it stands for, as the tree merge
    paired them (a tie may list it under another key on another rank); a rank 0 tensor that is also its
    per-rank state (a tie) is rank 0's to write, and the others' copies of it are let go. ``tag`` goes
    into every data file's name (see :func:`~aiockpt._format.data_file_name`).

    Raises:
        StateError: Ranks disagree on a tensor's dtype or global shape, naming the key and the ranks, a
            rank holds a tensor that rank 0 does not, or the ranks' parts of a tensor overlap or lie
            outside it (naming the key and the ranks).
    """
    world = len(plans)
    assert all(p.rank == r for r, p in enumerate(plans)), "local plans must be in rank order"
    tensor_index: dict[KeyPath, int] = {}
    first: list[WriteItem] = []  # the item that introduced each tensor
    first_rank: list[int] = []
    per_rank: list[list[tuple[int, int]]] = [[] for _ in range(world)]  # (item, tensor) each rank writes
    unsorted = [False] * world  # whether a rank's list was appended to out of item order
    load = [0] * world
    # (tensor, offsets, sizes) -> (rank, item) pairs holding that replicated chunk
    holders: dict[tuple[int, tuple[int, ...], tuple[int, ...]], list[tuple[int, int]]] = {}
    base = plans[0].items if plans else ()
    owned: list[tuple[int, int, int]] = []
    no_own: frozenset[int] = frozenset()
    own0 = own[0] if own else no_own
    for plan in plans:
        rank = plan.rank
        mine = per_rank[rank]
        theirs = own[rank] if own else no_own
        for j, item in enumerate(plan.items):
            if not j % OFFER_ITEMS:
                yield_gil()
            if j in theirs:  # per-rank state: a tensor of its own (rank 0's: t == j), this rank's alone
                t = len(first)
                first.append(item)
                first_rank.append(rank)
                owned.append((rank, j, t))
                mine.append((j, t))
                load[rank] += item.nbytes
                continue
            if rank and paired:
                known: int | None = paired[rank].get(j)  # (the merge paired every item not per-rank)
                if known is not None and known in own0:
                    # Rank 0 ties this tensor to a key of its own (per-rank state): rank 0 writes it, and
                    # the merged tree refers to rank 0's entry alone. This rank's alike copy is let go.
                    continue
            # SPMD ranks list the same tensors in the same order: comparing with rank 0's item at the same
            # position avoids hashing every key path of every rank.
            elif rank and j < len(base) and base[j].path == item.path:
                known = j
            else:
                known = tensor_index.get(item.path)
            if known is None:
                if rank:
                    # Where it is not per-rank state (``own``), the manifest's tree is rank 0's: nothing in
                    # it would lead to this tensor, whose bytes would be written and never found again.
                    # (The save merges differing trees first, so only a caller without ``own`` gets here.)
                    raise StateError(
                        f"rank {rank} holds tensor {render(item.path)!r}, which rank 0's state lacks",
                        key=render(item.path),
                    )
                t = tensor_index[item.path] = len(first)
                first.append(item)
                first_rank.append(rank)
            else:
                t = known
                it0 = first[t]
                if it0.shape != item.shape or it0.dtype != item.dtype:
                    raise StateError(
                        f"ranks {first_rank[t]} and {rank} disagree on tensor {render(item.path)!r}: "
                        f"{it0.dtype}{list(it0.shape)} vs {item.dtype}{list(item.shape)}",
                        key=render(item.path),
                    )
            if item.replicated:
                holders.setdefault((t, item.offsets, item.sizes), []).append((rank, j))
            else:  # this rank's alone
                mine.append((j, t))
                load[rank] += item.nbytes

    # A replicated chunk goes, largest first, to its least-loaded holder: a greedy balance of bytes.
    shared = []
    for n, ((t, _, _), cands) in enumerate(holders.items()):
        if not n % OFFER_ITEMS:
            yield_gil()
        if len(cands) == 1:
            rank, j = cands[0]
            unsorted[rank] |= _append(per_rank[rank], j, t)
            load[rank] += plans[rank].items[j].nbytes
        else:
            shared.append((plans[cands[0][0]].items[cands[0][1]].nbytes, t, cands))
    shared.sort(key=lambda s: -s[0])
    for nbytes, t, cands in shared:
        rank, j = min(cands, key=lambda c: (load[c[0]], c[0]))
        load[rank] += nbytes
        unsorted[rank] |= _append(per_rank[rank], j, t)

    chunks: list[list[Chunk]] = [[] for _ in first]
    # Of each tensor written in several chunks, its distinct boxes and the rank writing each.
    parts: dict[int, dict[tuple[tuple[int, ...], tuple[int, ...]], int]] = {}
    first_writer = [0] * len(first)  # the rank writing each tensor's first chunk
    rank_plans = []
    for rank, assigned in enumerate(per_rank):
        # File order follows the rank's item order: sequential reads of a whole state. Usually the list
        # was built in that order (noted as it grew): sorting 10^4 pairs is one C call holding the GIL.
        if unsorted[rank]:
            assigned.sort()
        file = data_file_name(rank, tag)
        items = plans[rank].items
        pos = 0
        writes = []
        for n, (j, t) in enumerate(assigned):
            if not n % OFFER_ITEMS:
                yield_gil()
            item = items[j]
            nbytes = item.nbytes
            a = PAGE if nbytes >= LARGE else SMALL_ALIGN
            pos = -(-pos // a) * a
            held = chunks[t]
            if not held:
                first_writer[t] = rank
            else:
                boxes = parts.setdefault(t, {(held[0].offsets, held[0].sizes): first_writer[t]})
                boxes.setdefault((item.offsets, item.sizes), rank)
            writes.append(WriteAssignment(item=j, offset=pos, tensor=t, chunk=len(held)))
            held.append(
                Chunk(
                    offsets=item.offsets, sizes=item.sizes, file=file, offset=pos, nbytes=nbytes, checksums=()
                )
            )
            pos += nbytes
        rank_plans.append(RankPlan(rank=rank, file=file, nbytes=pos, writes=tuple(writes)))
    for t, boxes in parts.items():
        _check_boxes(first[t], boxes)

    collect_young()  # ``first`` and the ranks' writes, made whole without setting off a collection
    # From a list: a tuple grown from a generator is tracked anew by the garbage collector at each resize,
    # so that collections of the youngest generation walk it again and again as it grows.
    tensors = tuple(
        [
            TensorEntry(path=item.path, dtype=item.dtype, shape=item.shape, chunks=tuple(chunks[t]))
            for t, item in enumerate(first)
        ]
    )
    # The indexes above hold a few objects per chunk: freed in slices rather than in one stall at return.
    box: list[object] = [tensor_index, per_rank, holders, shared, chunks, parts, first_writer]
    del tensor_index, per_rank, holders, shared, chunks, parts, first_writer
    dismantle(box)
    return GlobalPlan(ranks=tuple(rank_plans), tensors=tensors, own=tuple(owned))
