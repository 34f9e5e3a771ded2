"""Per-rank state: a checkpoint's tree as one rank saved it, and which rank a reading process is.

A distributed save stores one tree. Where its ranks held different values under one key, the tree holds
a :class:`~.._format.RanksNode` listing each rank's own subtree; a load or a read sees the tree of one
rank (:func:`project`), in which a key that only other ranks saved is absent.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

from .._codec import SLICE
from .._errors import CheckpointError, StateError
from .._format import (
    LEAVES,
    DictNode,
    Key,
    KeyPath,
    ListNode,
    Node,
    RanksNode,
    TupleNode,
)
from .._merge import tensors_in
from .._tree import render


def this_rank() -> int:
    """This process's rank in ``torch.distributed``'s default group, or 0 outside a distributed job."""
    rank = job_rank()
    return 0 if rank is None else rank


def job_rank() -> int | None:
    """This process's rank in a distributed job of several processes, else ``None`` (none to name)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    rank: int = dist.get_rank()
    return rank


def checked_rank(rank: object) -> int:
    """``rank``, a rank given by the user, once it is one; for ``None``, this process's (:func:`this_rank`).

    Raises:
        CheckpointError: ``rank`` is not ``None`` nor an int of at least 0.
    """
    if rank is None:
        return this_rank()
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise CheckpointError(f"rank must be an int of at least 0, not {rank!r}")
    return rank


def project(tree: DictNode, rank: int, *, others: set[int] | None = None) -> DictNode:
    """``tree`` as rank ``rank`` saved it.

    A :class:`~.._format.RanksNode` that is a dict value becomes the item of ``rank``, or the key is
    left out where ``rank`` is not listed (only other ranks saved it); one that is an item of a list or
    tuple becomes the item of ``rank``. Tensor nodes are left as they are: one in rank ``r``'s item
    already indexes rank ``r``'s own entry of ``Manifest.tensors``.

    Only the containers on the way to a RanksNode are rebuilt: ``tree`` itself is returned when it holds
    none, and a container's children are looked at a slice at a time, a slice of leaves only (the bulk
    of a state) in one C call. ``tree`` is a checked one (``check_manifest``): no rank's item holds a
    RanksNode, and a list's or tuple's lists every rank of the saving world.

    Args:
        tree: A manifest's tree.
        rank: The rank whose tree to return.
        others: If given, receives the indices of the tensors that other ranks' items refer to (this
            rank's tree may refer to some of them too, through a tied tensor).

    Raises:
        StateError: A list or tuple item is per-rank state of ranks that do not include ``rank`` (a rank
            outside the world that saved the checkpoint); names the key and the rank.
    """
    projected = _Projector(rank, others).node(tree, ())
    assert projected is None or isinstance(projected, DictNode)  # (a dict is projected as a dict)
    return tree if projected is None else projected


class _Projector:
    """The walk of :func:`project`: each method returns ``None`` for a node that stays as it is."""

    def __init__(self, rank: int, others: set[int] | None) -> None:
        self.rank = rank
        self.others = others

    def node(self, node: Node, path: KeyPath) -> Node | None:
        """``node`` (a dict, list or tuple) as the rank saved it, or ``None`` if that is ``node``."""
        if isinstance(node, DictNode):
            changes = self.changes(node.values, node.keys, path)
            if not changes:
                return None
            keys, values = list(node.keys), list(node.values)
            # From the last: a key left out does not move those still to change.
            for i in sorted(changes, reverse=True):
                new = changes[i]
                if new is None:
                    del keys[i], values[i]
                else:
                    values[i] = new
            return DictNode(keys=tuple(keys), values=tuple(values), origin=node.origin)
        if isinstance(node, ListNode | TupleNode):
            changes = self.changes(node.items, None, path)
            if not changes:
                return None
            items = list(node.items)
            for i, new in changes.items():
                assert new is not None  # (an item is never left out: see pick)
                items[i] = new
            return (
                ListNode(items=tuple(items)) if isinstance(node, ListNode) else TupleNode(items=tuple(items))
            )
        return None

    def changes(
        self, children: tuple[Node, ...], keys: Sequence[Key] | None, path: KeyPath
    ) -> dict[int, Node | None]:
        """The children that differ for the rank: per position, its node as the rank saved it.

        ``children`` are a dict's values (with its ``keys``) or a list's or tuple's items; ``None``
        stands for a key the rank lacks.
        """
        out: dict[int, Node | None] = {}
        for start in range(0, len(children), SLICE):
            piece = children[start : start + SLICE]
            if LEAVES.issuperset(map(type, piece)):
                continue
            for i, child in enumerate(piece, start):
                if type(child) in LEAVES:
                    continue
                sub = (*path, i if keys is None else keys[i])
                if isinstance(child, RanksNode):
                    out[i] = self.pick(child, sub, in_dict=keys is not None)
                else:
                    new = self.node(child, sub)
                    if new is not None:
                        out[i] = new
        return out

    def pick(self, node: RanksNode, path: KeyPath, *, in_dict: bool) -> Node | None:
        """The rank's item of ``node``, or ``None`` where the rank lacks the key ``node`` is a value of."""
        ranks = node.ranks
        at = bisect_left(ranks, self.rank)  # (ranks increase strictly: see check_manifest)
        found = at < len(ranks) and ranks[at] == self.rank
        if self.others is not None:
            for j, item in enumerate(node.items):
                if j != at or not found:
                    self.others.update(i for _, i in tensors_in(item, path))
        if found:
            return node.items[at]
        if in_dict:
            return None
        key = render(path)
        raise StateError(
            f"rank {self.rank} has no state at key {key!r}: the item of a list or tuple there was saved "
            f"per rank by ranks {ranks[0]} to {ranks[-1]} only (a checkpoint of another world size)",
            key=key,
        )
