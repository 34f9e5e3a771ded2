"""A manifest's body: encoded in the current format version, decoded from any, a slice at a time.

Format 1 stores the tree as nested nodes and the tensor entries as one msgpack array. Decoding that
takes two long calls that hold the GIL however the work is split, since msgspec must walk every entry to
find where a field ends even when it leaves the field undecoded: 3 ms for the entries of a 20,000-tensor
manifest and 3.5 ms for its tree, each a stall of the event loop. Format 2 stores both as arrays of
msgpack ``bin`` values of one slice (:data:`~._codec.SLICE` items) each. A decoder skips a ``bin`` by its
length, so no call does more than one slice's work. A nested tree has no slices to cut, so format 2
stores its nodes flat, in preorder, a container as an :class:`~._format.OpenNode` that says how many
children follow (:func:`tree_records`); :func:`tree_from_blobs` rebuilds the nesting. Format 3 is
format 2 whose tree may hold per-rank state (:class:`~._format.RanksNode`, an ``OpenNode`` of kind
``"ranks"``); a body is written as format 3 only when its tree does (:func:`body_version`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import repeat
from operator import itemgetter
from typing import Literal

import msgspec

from ._codec import SLICE, SlicedDecoder, encode_parts, slice_blobs
from ._format import (
    LEAVES,
    MAX_READ_DEPTH,
    PLAIN_VERSION,
    RANKS_VERSION,
    DictNode,
    Key,
    ListNode,
    Manifest,
    Node,
    OpenNode,
    RanksNode,
    Record,
    TensorEntry,
    TupleNode,
)
from ._threads import yield_gil

_RECORDS = msgspec.msgpack.Decoder(tuple[Record, ...])


def _only_leaves(nodes: tuple[Node, ...]) -> bool:
    """Whether no node of ``nodes`` is a container; checked a slice at a time (see :data:`SLICE`)."""
    return all(LEAVES.issuperset(map(type, nodes[i : i + SLICE])) for i in range(0, len(nodes), SLICE))


def holds_ranks(tree: DictNode) -> bool:
    """Whether ``tree`` holds per-rank state (a :class:`~._format.RanksNode`) anywhere.

    A walk with a stack of its own (of the children of each container met) that looks at the children
    a slice at a time: a slice of leaves only, the bulk of a state, costs one C call and no Python work
    per node, and no call holds the GIL for long (a dict of 20,000 tensors is 40 short calls).
    """
    stack: list[tuple[Node, ...]] = [tree.values]
    while stack:
        nodes = stack.pop()
        for start in range(0, len(nodes), SLICE):
            piece = nodes[start : start + SLICE]
            kinds = set(map(type, piece))
            if RanksNode in kinds:
                return True
            if LEAVES.issuperset(kinds):
                continue
            for node in piece:
                if isinstance(node, DictNode):
                    stack.append(node.values)
                elif isinstance(node, ListNode | TupleNode):
                    stack.append(node.items)
    return False


def body_version(manifest: Manifest) -> int:
    """The format version ``manifest``'s body is written in: 3 where its tree holds per-rank state, else 2.

    Version 2 where it can be, so that a checkpoint without per-rank state stays readable by releases
    that read up to version 2.
    """
    return RANKS_VERSION if holds_ranks(manifest.tree) else PLAIN_VERSION


def tree_records(tree: DictNode) -> Iterator[Record]:
    """The nodes of ``tree`` in preorder, each with its key in the dict that holds it.

    A container is an :class:`OpenNode` of its kind and size (a :class:`~._format.RanksNode`, one of
    kind ``"ranks"`` with its ranks); the records of its children follow it (each child's whole subtree
    before the next child).
    """
    # One iterator over the (key, child) pairs of each open container: a container of 10^4 children
    # is never copied whole (one C call that would hold the GIL for milliseconds).
    stack: list[Iterator[tuple[Key | None, Node]]] = [iter([(None, tree)])]
    while stack:
        entry = next(stack[-1], None)
        if entry is None:
            stack.pop()
            continue
        key, node = entry
        if isinstance(node, DictNode):
            yield key, OpenNode(kind="dict", size=len(node.values), origin=node.origin)
            if _only_leaves(node.values):
                # Only leaves (a model's or a flat state's dict): their records are the (key, node)
                # pairs themselves, made in C, with no Python work per child.
                yield from zip(node.keys, node.values, strict=True)
            else:
                stack.append(zip(node.keys, node.values, strict=True))
        elif isinstance(node, ListNode | TupleNode):
            kind: Literal["list", "tuple"] = "list" if isinstance(node, ListNode) else "tuple"
            yield key, OpenNode(kind=kind, size=len(node.items))
            stack.append(zip(repeat(None), node.items))
        elif isinstance(node, RanksNode):
            yield key, OpenNode(kind="ranks", size=len(node.items), ranks=node.ranks)
            stack.append(zip(repeat(None), node.items))
        else:
            yield key, node


def tree_blobs(tree: DictNode) -> tuple[bytes, ...]:
    """``tree``'s records (:func:`tree_records`) encoded a slice at a time (:func:`~._codec.slice_blobs`)."""
    return slice_blobs(tree_records(tree))


class _Open:
    """A container being rebuilt: its record's key, its :class:`OpenNode`, and the children so far."""

    __slots__ = ("key", "keys", "node", "values")

    def __init__(self, key: Key | None, node: OpenNode) -> None:
        self.key = key
        self.node = node
        self.keys: list[Key] = []
        self.values: list[Node] = []

    def close(self) -> Node:
        if self.node.kind == "dict":
            return DictNode(keys=tuple(self.keys), values=tuple(self.values), origin=self.node.origin)
        if self.node.kind == "list":
            return ListNode(items=tuple(self.values))
        if self.node.kind == "ranks":
            return RanksNode(ranks=self.node.ranks, items=tuple(self.values))
        return TupleNode(items=tuple(self.values))


def tree_from_blobs(blobs: Sequence[bytes | memoryview]) -> DictNode:
    """Rebuild the tree that :func:`tree_blobs` encoded.

    What a :class:`~._format.RanksNode` holds (its ranks against its items, where it stands) is left
    to ``check_manifest``, which refuses every such node of a version-2 manifest.

    Raises:
        msgspec.ValidationError: The records do not form one tree whose root is a dict: a record after
            the root is complete, a key where none belongs (or none where one does), a container whose
            records end early, containers nested more than :data:`~._format.MAX_READ_DEPTH` levels deep
            (per-rank state counting as a level), ranks on a record of another kind than ``"ranks"``.
            The message names the record by its index.
        msgspec.DecodeError: A blob is not valid msgpack.
    """
    stack: list[_Open] = []
    root: DictNode | None = None
    index = -1

    def bad(what: str) -> msgspec.ValidationError:
        return msgspec.ValidationError(f"{what} (in tree record {index})")

    for blob in blobs:
        yield_gil()
        records = _RECORDS.decode(blob)
        top = stack[-1] if stack else None
        if (
            top is not None
            and top.node.kind == "dict"
            and len(records) < top.node.size - len(top.values)
            and LEAVES.issuperset(map(type, map(itemgetter(1), records)))
            and None not in map(itemgetter(0), records)
        ):
            # A slice of leaf entries that the open dict takes whole, leaving it open (the bulk of a
            # flat state): added as they are, in C, with no Python work per record.
            top.keys.extend(map(itemgetter(0), records))
            top.values.extend(map(itemgetter(1), records))
            index += len(records)
            continue
        for key, record in records:
            index += 1
            if root is not None:
                raise bad("a record follows the complete tree")
            node: Node
            if isinstance(record, OpenNode):
                if record.ranks and record.kind != "ranks":
                    raise bad(f"a {record.kind} lists ranks")
                if len(stack) >= MAX_READ_DEPTH:
                    # (Refused before the nesting is built: nothing recurses into a tree deeper than this.)
                    raise bad(f"the tree nests containers more than {MAX_READ_DEPTH} levels deep")
                if record.size:
                    stack.append(_Open(key, record))
                    continue
                node = _Open(key, record).close()
            else:
                node = record
            # Attach ``node`` to the innermost open container; close every container that is now full.
            while stack:
                parent = stack[-1]
                if parent.node.kind == "dict":
                    if key is None:
                        raise bad("a dict entry has no key")
                    parent.keys.append(key)
                elif key is not None:
                    raise bad(f"an item of a {parent.node.kind} has a key")
                parent.values.append(node)
                if len(parent.values) < parent.node.size:
                    break
                stack.pop()
                key, node = parent.key, parent.close()
            else:
                if key is not None or not isinstance(node, DictNode):
                    raise bad("the root is not a dict without a key")
                root = node
    if root is None:
        raise bad("the records end before the tree is complete")
    return root


def body_parts(manifest: Manifest, *, version: int | None = None) -> list[bytes]:
    """``manifest`` encoded as the body of a manifest file, a slice at a time, in pieces.

    The body is of format ``version``, 2 or 3, by default :func:`body_version`'s (a caller that must
    name the version in the envelope too passes the one it computed). Its ``format_version`` field says
    so. The pieces joined are :func:`encode_body`'s bytes; the blobs are not copied (see
    :func:`~._codec.encode_parts`).

    Raises:
        ValueError: ``version`` is not 2 or 3.
    """
    if version is None:
        version = body_version(manifest)
    if version not in (PLAIN_VERSION, RANKS_VERSION):
        raise ValueError(f"no encoder for format version {version}")
    wire = msgspec.structs.replace(manifest, format_version=version)
    blobs = {"tree": tree_blobs(manifest.tree), "tensors": slice_blobs(manifest.tensors)}
    return encode_parts(wire, blobs)


def encode_body(manifest: Manifest, *, version: int | None = None) -> bytes:
    """``manifest`` encoded as the body of a manifest file, a slice at a time (see :func:`body_parts`).

    Raises:
        ValueError: ``version`` is not 2 or 3.
    """
    return b"".join(body_parts(manifest, version=version))


# A manifest's body names its version: one without (which the default would take for the newest) is
# no manifest any version of aiockpt wrote.
_REQUIRED = ("format_version",)
# Format 1: the tree decoded in a call of its own, the tensor entries 512 at a time from the raw array
# (one decode of a 20,000-tensor manifest in one call holds the GIL 10-20 ms).
_V1 = SlicedDecoder(
    Manifest,
    "tensors",
    TensorEntry,
    converted={"tree": (msgspec.Raw, msgspec.msgpack.Decoder(DictNode).decode)},
    item_name="tensor entry",
    required=_REQUIRED,
)
_V2 = SlicedDecoder(
    Manifest,
    "tensors",
    TensorEntry,
    converted={"tree": (tuple[memoryview, ...], tree_from_blobs)},
    item_name="tensor entry",
    required=_REQUIRED,
    blobs=True,
)
# Format 3 is format 2 whose tree may hold a RanksNode, which format 2's decoder rebuilds as well
# (``check_manifest`` refuses one in a version-2 manifest).
_DECODERS = {1: _V1, 2: _V2, 3: _V2}


def decode_body(body: bytes | memoryview, version: int) -> Manifest:
    """Decode the body of a manifest file of format ``version`` (1 to :data:`~._format.FORMAT_VERSION`).

    Raises:
        ValueError: ``version`` is not one this aiockpt reads.
        msgspec.ValidationError: The body does not match its format; the message names the bad tensor
            entry or tree record.
        msgspec.DecodeError: The body is not valid msgpack.
    """
    decoder = _DECODERS.get(version)
    if decoder is None:
        raise ValueError(f"no decoder for format version {version}")
    return decoder.decode(body)
