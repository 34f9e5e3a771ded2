"""Merging the trees of several ranks into one that keeps each rank's own where they differ.

A distributed save (``_save/_ranks.py``) and the merge of a collective-free checkpoint's parts
(``_load/_manifest.py``) both hold one tree per rank and one :class:`Signature` per tensor of each. Where
the trees agree, the merged tree is rank 0's; at each key where they differ (structure, plain values,
tensors whose signatures differ) it holds a :class:`~aiockpt._format.RanksNode` with each rank's own
subtree, and the tensors in those subtrees become their rank's own.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Mapping, Sequence

import msgspec

from ._errors import StateError
from ._format import DictNode, KeyPath, ListNode, Node, RanksNode, TensorNode, TupleNode, ValueNode
from ._tree import render


class Signature(msgspec.Struct, frozen=True, gc=False, array_like=True):
    """What two ranks' tensors at one key are compared by: alike, the tensor is shared.

    ``shard``: a DTensor's local shard (``shape`` is then the global shape, ``crc`` -1); ``crc``: a
    digest of a plain tensor's contents (at a save, the CRC32C of its bytes; in a collective-free
    part, a hash of its chunk's checksums), or -1 where they are not compared (alike, then, if dtype
    and shape are). A shard and a whole copy of one DTensor are alike where dtype and shape agree.
    """

    shard: bool
    dtype: str
    shape: tuple[int, ...]
    crc: int


class Merged(msgspec.Struct, frozen=True, gc=False):
    """Every rank's tree merged.

    ``tree`` holds a RanksNode where they differ, whose items index each rank's own tensors (its local
    indices until :func:`reindex`); ``own[r]``: rank ``r``'s tensors under such a node, written by ``r``
    alone.
    """

    tree: DictNode
    own: tuple[frozenset[int], ...]
    # Per rank, each of its tensors the merged tree shares, by its index: rank 0's tensor it stands for
    # (a tie may file it under another key on another rank; rank 0's own map is empty).
    shared: tuple[dict[int, int], ...] = ()


def _value_key(value: object) -> object:
    """What a plain value is compared by: its type and value, a float by its bits.

    ``1 == 1.0 == True`` in Python, not in a checkpoint; ``0.0 == -0.0`` but the sign is state; a NaN
    saved by every rank is the same value although ``nan != nan``.
    """
    return (float, struct.pack("<d", value)) if type(value) is float else (type(value), value)


class _Merger:
    def __init__(self, sigs: Sequence[Sequence[Signature]]) -> None:
        self.sigs = sigs
        self.own: list[set[int]] = [set() for _ in sigs]
        self.shared: list[dict[int, int]] = [{} for _ in sigs]

    def alike(self, nodes: Sequence[Node]) -> bool:
        """Whether the leaves ``nodes`` (one per rank) are the same value."""
        first = nodes[0]
        if type(first) is TensorNode:
            if not all(type(n) is TensorNode for n in nodes):
                return False
            sigs = [self.sigs[r][n.index] for r, n in enumerate(nodes)]  # type: ignore[union-attr]
            s0 = sigs[0]
            if all(s == s0 for s in sigs):
                return True
            # Pieces of one DTensor (a part may hold the whole of it beside others' shards): one tensor
            # where dtype and global shape agree.
            tensor = (s0.dtype, s0.shape)
            return any(s.shard for s in sigs) and all((s.dtype, s.shape) == tensor for s in sigs)
        if type(first) is ValueNode:
            key = _value_key(first.value)
            return all(type(n) is ValueNode and _value_key(n.value) == key for n in nodes)
        return all(n == first for n in nodes)

    def merge(self, nodes: Sequence[Node], path: KeyPath) -> Node:
        """The merged node at ``path``, where every rank holds one (``nodes``, in rank order)."""
        first = nodes[0]
        kind = type(first)
        if not all(type(n) is kind for n in nodes):
            return self.per_rank(range(len(nodes)), nodes, path)
        if kind is DictNode:
            return self.merge_dicts(nodes, path)  # type: ignore[arg-type]
        if kind is ListNode or kind is TupleNode:
            items = [n.items for n in nodes]  # type: ignore[union-attr]
            if any(len(i) != len(items[0]) for i in items):
                return self.per_rank(range(len(nodes)), nodes, path)
            merged = tuple(self.merge([i[k] for i in items], (*path, k)) for k in range(len(items[0])))
            if all(m is o for m, o in zip(merged, items[0], strict=True)):
                return first
            return ListNode(items=merged) if kind is ListNode else TupleNode(items=merged)
        if self.alike(nodes):
            if kind is TensorNode:
                for r in range(1, len(nodes)):
                    self.shared[r].setdefault(nodes[r].index, first.index)  # type: ignore[union-attr]
            return first
        if kind is TensorNode:
            self.check_shards(nodes, path)  # type: ignore[arg-type]
        return self.per_rank(range(len(nodes)), nodes, path)

    def check_shards(self, nodes: Sequence[TensorNode], path: KeyPath) -> None:
        """Refuse DTensors at ``path`` whose dtype or global shape differ between ranks.

        Raises:
            StateError: Names the key, two of the ranks and what each holds.
        """
        sigs = [self.sigs[r][n.index] for r, n in enumerate(nodes)]
        if not any(s.shard for s in sigs):
            return
        other = next(r for r, s in enumerate(sigs) if s != sigs[0])

        def what(s: Signature) -> str:
            return f"{'a DTensor' if s.shard else 'a plain tensor'} {s.dtype}{list(s.shape)}"

        key = render(path)
        raise StateError(
            f"ranks 0 and {other} disagree on tensor {key!r}: {what(sigs[0])} vs {what(sigs[other])}",
            key=key,
        )

    def merge_dicts(self, nodes: Sequence[DictNode], path: KeyPath) -> Node:
        first = nodes[0]
        if any(n.origin != first.origin for n in nodes):
            return self.per_rank(range(len(nodes)), nodes, path)
        if all(n.keys == first.keys for n in nodes):
            values = tuple(
                self.merge([n.values[i] for n in nodes], (*path, k)) for i, k in enumerate(first.keys)
            )
            if all(v is o for v, o in zip(values, first.values, strict=True)):
                return first
            return DictNode(keys=first.keys, values=values, origin=first.origin)
        # Keys differ: rank 0's order, then each key another rank adds, in rank order.
        maps = [dict(zip(n.keys, n.values, strict=True)) for n in nodes]
        keys = dict.fromkeys(k for n in nodes for k in n.keys)
        out: list[Node] = []
        for k in keys:
            held = [r for r, m in enumerate(maps) if k in m]
            values_at = [maps[r][k] for r in held]
            if len(held) == len(nodes):
                out.append(self.merge(values_at, (*path, k)))
            else:
                out.append(self.per_rank(held, values_at, (*path, k)))
        return DictNode(keys=tuple(keys), values=tuple(out), origin=first.origin)

    def per_rank(self, ranks: Sequence[int], nodes: Sequence[Node], path: KeyPath) -> RanksNode:
        """A RanksNode of ``nodes``, held by ``ranks``; their tensors become those ranks' own."""
        for r, node in zip(ranks, nodes, strict=True):
            for sub, index in tensors_in(node, path):
                if self.sigs[r][index].shard:
                    raise StateError(
                        f"rank {r} holds a DTensor at key {render(sub)!r}, under state that differs between "
                        f"the ranks at key {render(path)!r}: a DTensor is every rank's, so every rank must "
                        "save it at the same key",
                        key=render(sub),
                    )
                self.own[r].add(index)
        return RanksNode(ranks=tuple(ranks), items=tuple(nodes))


def tensors_in(node: Node, path: KeyPath) -> Iterator[tuple[KeyPath, int]]:
    """The key path and index of every TensorNode in ``node`` (at ``path``; it holds no RanksNode)."""
    stack: list[tuple[Node, KeyPath]] = [(node, path)]
    while stack:
        n, p = stack.pop()
        if type(n) is TensorNode:
            yield p, n.index
        elif isinstance(n, DictNode):
            stack += [(v, (*p, k)) for k, v in zip(n.keys, n.values, strict=True)]
        elif isinstance(n, (ListNode, TupleNode)):
            stack += [(v, (*p, i)) for i, v in enumerate(n.items)]


def merge(trees: Sequence[DictNode], sigs: Sequence[Sequence[Signature]]) -> Merged:
    """Merge every rank's tree (in rank order) as the module docstring says.

    Raises:
        StateError: A DTensor is under state that differs between ranks (names the key and the rank).
    """
    merger = _Merger(sigs)
    tree = merger.merge(trees, ())
    assert isinstance(tree, DictNode)  # (roots are dicts on every rank: never per-rank as a whole)
    return Merged(tree=tree, own=tuple(frozenset(o) for o in merger.own), shared=tuple(merger.shared))


def reindex(tree: DictNode, index: Mapping[tuple[int, int], int]) -> DictNode:
    """``tree`` (from :func:`merge`) with the tensors in each rank's items of a RanksNode renumbered.

    ``index[(rank, local index)]`` is the tensor's index in the manifest; rank 0's keep theirs (its
    local tensor ``i`` is the manifest's tensor ``i``).
    """

    def walk(node: Node, rank: int) -> Node:
        if type(node) is TensorNode:
            return node if rank == 0 else TensorNode(index=index[(rank, node.index)])
        if isinstance(node, RanksNode):
            return RanksNode(
                ranks=node.ranks, items=tuple(walk(n, r) for r, n in zip(node.ranks, node.items, strict=True))
            )
        if isinstance(node, DictNode):
            values = tuple(walk(v, rank) for v in node.values)
            return DictNode(keys=node.keys, values=values, origin=node.origin)
        if isinstance(node, ListNode):
            return ListNode(items=tuple(walk(v, rank) for v in node.items))
        if isinstance(node, TupleNode):
            return TupleNode(items=tuple(walk(v, rank) for v in node.items))
        return node

    out = walk(tree, 0)
    assert isinstance(out, DictNode)
    return out
