"""Per-rank state: where the ranks of a distributed save hold different trees, each rank's is kept.

SPMD ranks mostly save the same structure with the same plain values, and the manifest holds one tree.
But some state differs per rank: each rank's ``torch.get_rng_state()``, a dataloader's position, keys that
name the rank (``dp_rank_3``) and only that rank holds. Written as rank 0's alone, the others' would be
lost without a word. So every rank sends, with its local plan, a digest of its tree and of its tensors'
signatures (:func:`digest`); where all digests are alike (the common case) nothing more happens. Where
they differ, the ranks exchange their trees and signatures (:class:`RankTree`) and every rank merges them
the same way (:func:`merge`): where the ranks' trees differ, the manifest's tree holds a
:class:`~aiockpt._format.RanksNode` with each rank's own subtree, whose tensors that rank writes as its own
(never deduplicated with another rank's), and a load of rank ``r`` finds its own subtree there.

What counts as differing: the structure (keys, container kinds, a Stateful's class), plain values
(``1`` and ``1.0`` differ), and for a plain tensor its dtype, shape and, up to :data:`COMPARED` bytes, its
contents (a CRC32C of its staged bytes). Larger plain tensors are assumed identical where dtype and shape
agree (comparing them would checksum every replicated weight on every rank): a large tensor that differs
per rank belongs in a DTensor, or under a key that names the rank. A DTensor shard is never per-rank
state: one under state that differs between ranks is refused.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import crc32c
import msgspec

from .._body import tree_blobs, tree_from_blobs
from .._codec import slice_blobs
from .._errors import StateError
from .._format import (
    ENCODER,
    DictNode,
    KeyPath,
    ListNode,
    Node,
    RanksNode,
    TensorNode,
    TupleNode,
    ValueNode,
)
from .._threads import yield_gil
from .._tree import Box, render
from ._local_plan import WriteItem

# Plain tensors up to this many bytes are compared by contents between ranks (an RNG state: 5 KiB).
COMPARED = 64 << 10


class Signature(msgspec.Struct, frozen=True, gc=False, array_like=True):
    """What two ranks' tensors at one key are compared by: alike, the tensor is shared.

    ``shard``: a DTensor's local shard (``shape`` is then the global shape, ``crc`` -1); ``crc``: the
    CRC32C of a plain tensor's bytes where it has at most :data:`COMPARED`, else -1.
    """

    shard: bool
    dtype: str
    shape: tuple[int, ...]
    crc: int


class RankTree(msgspec.Struct, frozen=True, gc=False, array_like=True):
    """One rank's message in the ``trees`` exchange.

    Its tree (format 2's records) and the signature of each of its tensors (by index), each in slices
    of encoded msgpack (``_codec.slice_blobs``): no call encodes or decodes more than one slice.
    """

    tree: tuple[bytes, ...]
    signatures: tuple[bytes, ...]


_RANK_TREE = msgspec.msgpack.Decoder(RankTree)
_SIGNATURES = msgspec.msgpack.Decoder(tuple[Signature, ...])


def signatures(
    items: Sequence[WriteItem], boxes: Sequence[Box | None], sources: Sequence[memoryview]
) -> list[Signature]:
    """The signature of each tensor of a flattened state, from its local plan item and staged bytes.

    One pass with no torch call per tensor: 20,000 tensors of 4 KiB take about 14 ms here, 11 of them
    checksumming their 82 MB.
    """
    out: list[Signature] = []
    crc = crc32c.crc32c
    for item, box, src in zip(items, boxes, sources, strict=True):
        if box is not None:
            out.append(Signature(True, item.dtype, item.shape, -1))
        else:
            out.append(Signature(False, item.dtype, item.shape, crc(src) if len(src) <= COMPARED else -1))
    return out


def digest(tree: DictNode, sigs: Sequence[Signature]) -> tuple[int, RankTree]:
    """A CRC32C of ``tree`` and ``sigs``; and this rank's message for the ``trees`` exchange if it comes.

    Encoded a slice at a time, offering the GIL in between (see ``_codec``). Never 0, which stands for
    "no digest" (a world of one).
    """
    message = RankTree(tree=tree_blobs(tree), signatures=slice_blobs(sigs))
    crc = 0
    for blob in (*message.tree, *message.signatures):
        crc = crc32c.crc32c(blob, crc)
    return crc or 1, message


def encode_rank_tree(message: RankTree) -> bytes:
    """This rank's :class:`RankTree` message, encoded."""
    return ENCODER.encode(message)


def decode_rank_tree(payload: bytes | memoryview) -> tuple[DictNode, tuple[Signature, ...]]:
    """A rank's tree and signatures from its :func:`encode_rank_tree` message.

    Raises:
        msgspec.ValidationError, msgspec.DecodeError: The message is not a RankTree.
    """
    rt = _RANK_TREE.decode(payload)
    sigs: list[Signature] = []
    for blob in rt.signatures:
        yield_gil()
        sigs += _SIGNATURES.decode(blob)
    return tree_from_blobs(rt.tree), tuple(sigs)


class Merged(msgspec.Struct, frozen=True, gc=False):
    """Every rank's tree merged.

    ``tree`` holds a RanksNode where they differ, whose items index each rank's own tensors (its local
    indices until :func:`reindex`); ``own[r]``: rank ``r``'s tensors under such a node, written by ``r``
    alone.
    """

    tree: DictNode
    own: tuple[frozenset[int], ...]


class _Merger:
    def __init__(self, sigs: Sequence[Sequence[Signature]]) -> None:
        self.sigs = sigs
        self.own: list[set[int]] = [set() for _ in sigs]

    def alike(self, nodes: Sequence[Node]) -> bool:
        """Whether the leaves ``nodes`` (one per rank) are the same value."""
        first = nodes[0]
        if type(first) is TensorNode:
            sig = self.sigs[0][first.index]
            return all(type(n) is TensorNode and self.sigs[r][n.index] == sig for r, n in enumerate(nodes))
        if type(first) is ValueNode:  # (1 == 1.0 == True in Python, not in a checkpoint)
            kind = type(first.value)
            return all(type(n) is ValueNode and type(n.value) is kind and n == first for n in nodes)
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
            for sub, index in _tensors(node, path):
                if self.sigs[r][index].shard:
                    raise StateError(
                        f"rank {r} holds a DTensor at key {render(sub)!r}, under state that differs between "
                        f"the ranks at key {render(path)!r}: a DTensor is every rank's, so every rank must "
                        "save it at the same key",
                        key=render(sub),
                    )
                self.own[r].add(index)
        return RanksNode(ranks=tuple(ranks), items=tuple(nodes))


def _tensors(node: Node, path: KeyPath) -> Iterator[tuple[KeyPath, int]]:
    """The key path and index of every TensorNode in ``node`` (at ``path``)."""
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
    return Merged(tree=tree, own=tuple(frozenset(o) for o in merger.own))


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
