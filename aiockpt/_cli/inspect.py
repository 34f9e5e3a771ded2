"""``aiockpt inspect PATH``: what a checkpoint holds, from its manifest alone (no data is read)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TypedDict

import click
from rich import box
from rich.table import Table
from rich.text import Text

from .._format import (
    MANIFEST_NAME,
    BytesNode,
    DictNode,
    KeyPath,
    ListNode,
    Manifest,
    Node,
    PickleNode,
    RanksNode,
    TensorEntry,
    TensorNode,
    TupleNode,
    ValueNode,
)
from .._load import published_parts, read_manifest
from .._tree import dtype_from_name, render
from ._common import (
    human_bytes,
    iso_utc,
    json_option,
    jsonable,
    key_column,
    local_time,
    print_json,
    printable,
    resolve_checkpoint,
    shown,
    stdout,
    step_option,
)

SCHEMA = "aiockpt.inspect/1"
_REPR_WIDTH = 60


def _leaves(node: Node, path: KeyPath, rank: int | None = None) -> Iterator[tuple[KeyPath, Node, int | None]]:
    """Every leaf of the tree with its key path and rank; empty containers count as leaves.

    The rank is the one whose per-rank state holds the leaf, ``None`` for state every rank shares. Every
    rank's per-rank state is listed, at the key path of its RanksNode.
    """
    if isinstance(node, DictNode):
        if not node.keys:
            yield path, node, rank
        for key, value in zip(node.keys, node.values, strict=True):
            yield from _leaves(value, (*path, key), rank)
    elif isinstance(node, (ListNode, TupleNode)):
        if not node.items:
            yield path, node, rank
        for i, item in enumerate(node.items):
            yield from _leaves(item, (*path, i), rank)
    elif isinstance(node, RanksNode):
        for r, item in zip(node.ranks, node.items, strict=True):  # (an item stands at the node's key)
            yield from _leaves(item, path, r)
    else:
        yield path, node, rank


def _statefuls(
    node: Node, path: KeyPath, rank: int | None = None
) -> Iterator[tuple[KeyPath, str, int | None]]:
    """``(key path, class, rank)`` of every Stateful whose ``state_dict()`` was saved.

    ``rank`` as in :func:`_leaves`.
    """
    if isinstance(node, DictNode):
        if node.origin is not None:
            yield path, node.origin, rank
        for key, value in zip(node.keys, node.values, strict=True):
            yield from _statefuls(value, (*path, key), rank)
    elif isinstance(node, (ListNode, TupleNode)):
        for i, item in enumerate(node.items):
            yield from _statefuls(item, (*path, i), rank)
    elif isinstance(node, RanksNode):
        for r, item in zip(node.ranks, node.items, strict=True):
            yield from _statefuls(item, path, r)


class ChunkDoc(TypedDict):
    """A stored piece of a tensor: its box of the global tensor and where its bytes are."""

    offsets: list[int]
    sizes: list[int]
    file: str
    offset: int
    nbytes: int


class TensorDoc(TypedDict):
    """A tensor (``aliases``: the other key paths of a tied tensor).

    ``rank``: the rank whose per-rank state it is; ``None`` for a tensor of the state every rank shares
    (or of several ranks' per-rank state).
    """

    key: str
    path: list[str | int]
    rank: int | None
    dtype: str
    shape: list[int]
    nbytes: int
    replicated: bool | None
    files: list[str]
    chunks: list[ChunkDoc]
    aliases: list[str]


class ValueDoc(TypedDict):
    """A leaf that is not a tensor.

    ``value`` is null for bytes and pickled objects (see ``nbytes``); ``rank`` as in :class:`TensorDoc`.
    """

    key: str
    path: list[str | int]
    rank: int | None
    type: str
    value: object
    nbytes: int | None
    pickled: bool


class StatefulDoc(TypedDict):
    """An object saved through its ``state_dict()``; ``type`` is its class, ``rank`` as in TensorDoc."""

    key: str
    path: list[str | int]
    rank: int | None
    type: str


class FileDoc(TypedDict):
    """A data file."""

    name: str
    nbytes: int


class InspectDoc(TypedDict):
    """The JSON document of ``aiockpt inspect --json`` (schema ``aiockpt.inspect/1``)."""

    schema: str
    path: str
    note: str | None
    format_version: int
    step: int | None
    world_size: int
    created_at: float
    created: str
    library_version: str
    checksum_algorithm: str
    checksum_block: int
    user_metadata: dict[str, object]
    files: list[FileDoc]
    nbytes: int
    tensors: list[TensorDoc]
    values: list[ValueDoc]
    statefuls: list[StatefulDoc]


def _value(path: KeyPath, node: Node, rank: int | None) -> ValueDoc:
    """The JSON form of a leaf that is not a tensor."""
    doc = ValueDoc(
        key=render(path), path=list(path), rank=rank, type="", value=None, nbytes=None, pickled=False
    )
    if isinstance(node, ValueNode):
        doc["type"] = type(node.value).__name__ if node.value is not None else "None"
        doc["value"] = jsonable(node.value)
    elif isinstance(node, BytesNode):
        doc["type"], doc["nbytes"] = "bytes", len(node.value)
    elif isinstance(node, PickleNode):
        doc["type"], doc["nbytes"], doc["pickled"] = node.type_name, len(node.data), True
    elif isinstance(node, DictNode):
        doc["type"], doc["value"] = "dict", {}
    elif isinstance(node, (ListNode, TupleNode)):
        doc["type"], doc["value"] = "list" if isinstance(node, ListNode) else "tuple", []
    return doc


def _tensor_bytes(entry: TensorEntry) -> int:
    """The bytes of the whole tensor; for a dtype this torch lacks, those its distinct chunks hold."""
    try:
        itemsize = dtype_from_name(entry.dtype).itemsize
    except ValueError:  # a newer torch's dtype, say: still listed, as what is stored of it
        return sum(c.nbytes for c in {(c.offsets, c.sizes): c for c in entry.chunks}.values())
    return math.prod(entry.shape) * itemsize


def _tensor(
    entry: TensorEntry, rank: int | None, replicated: bool | None, aliases: list[KeyPath]
) -> TensorDoc:
    """The JSON form of a tensor entry."""
    return TensorDoc(
        key=render(entry.path),
        path=list(entry.path),
        rank=rank,
        dtype=entry.dtype,
        shape=list(entry.shape),
        nbytes=_tensor_bytes(entry),
        replicated=replicated,
        files=sorted({c.file for c in entry.chunks}),
        chunks=[
            ChunkDoc(
                offsets=list(c.offsets), sizes=list(c.sizes), file=c.file, offset=c.offset, nbytes=c.nbytes
            )
            for c in entry.chunks
        ],
        aliases=[render(a) for a in aliases],
    )


def part_holders(directory: Path) -> dict[KeyPath, int] | None:
    """For a collective-free checkpoint, per tensor: how many parts stored one same chunk of it. Blocking.

    ``None`` for other checkpoints: a collective save writes a chunk that several ranks hold once, and
    records neither who held it nor how many did.
    """
    parts = None if (directory / MANIFEST_NAME).is_file() else published_parts(directory)
    if parts is None:
        return None
    boxes: Counter[tuple[KeyPath, tuple[int, ...], tuple[int, ...]]] = Counter()
    for part in parts[1]:
        boxes.update({(t.path, c.offsets, c.sizes) for t in read_manifest(part).tensors for c in t.chunks})
    holders: dict[KeyPath, int] = {}
    for (path, _, _), count in boxes.items():
        holders[path] = max(holders.get(path, 0), count)
    return holders


def describe(
    directory: Path, manifest: Manifest, note: str | None, holders: dict[KeyPath, int] | None
) -> InspectDoc:
    """The documented JSON form of a checkpoint (schema ``aiockpt.inspect/1``, see docs/cli.md).

    Args:
        directory: The checkpoint directory.
        manifest: Its manifest.
        note: How the directory was chosen, if not named directly.
        holders: :func:`part_holders` of the checkpoint.
    """

    def replicated(entry: TensorEntry, rank: int | None) -> bool | None:
        if manifest.world_size == 1 or rank is not None:  # (one rank's per-rank state: its alone)
            return False
        return None if holders is None else holders.get(entry.path, 1) > 1

    # Per tensor entry: the key paths that refer to it, and the ranks whose state does (``None``: the
    # state every rank shares). An entry of one rank's per-rank state is listed as that rank's.
    paths: dict[int, list[KeyPath]] = {}
    ranks: dict[int, set[int | None]] = {}
    values = []
    for path, node, rank in _leaves(manifest.tree, ()):
        if isinstance(node, TensorNode):
            paths.setdefault(node.index, []).append(path)
            ranks.setdefault(node.index, set()).add(rank)
        else:
            values.append(_value(path, node, rank))

    def rank_of(i: int) -> int | None:
        held = ranks.get(i, set())
        return next(iter(held)) if len(held) == 1 else None

    owners = [rank_of(i) for i in range(len(manifest.tensors))]
    tensors = [
        _tensor(entry, owner, replicated(entry, owner), [p for p in paths.get(i, []) if p != entry.path])
        for i, (entry, owner) in enumerate(zip(manifest.tensors, owners, strict=True))
    ]
    return InspectDoc(
        schema=SCHEMA,
        path=str(directory),
        note=note,
        format_version=manifest.format_version,
        step=manifest.step,
        world_size=manifest.world_size,
        created_at=manifest.created_at,
        created=iso_utc(manifest.created_at),
        library_version=manifest.library_version,
        checksum_algorithm=manifest.checksum_algorithm,
        checksum_block=manifest.checksum_block,
        user_metadata={k: jsonable(v) for k, v in manifest.user_metadata.items()},
        files=[FileDoc(name=f.name, nbytes=f.nbytes) for f in manifest.files],
        nbytes=sum(f.nbytes for f in manifest.files),
        tensors=tensors,
        values=values,
        statefuls=[
            StatefulDoc(key=render(p), path=list(p), rank=r, type=t)
            for p, t, r in _statefuls(manifest.tree, ())
        ],
    )


def _shape(shape: list[int]) -> str:
    return "(" + ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "") + ")"


def _short(text: str) -> str:
    return text if len(text) <= _REPR_WIDTH else text[: _REPR_WIDTH - 3] + "..."


def _keyed(key: str, rank: int | None) -> str:
    """A key as the text output shows it: marked with its rank where it is one rank's per-rank state.

    ``key`` is ``render``'s, which quotes a key with a character that is not printable; escaped here too,
    so that no key reaches the terminal raw whatever rendered it.
    """
    return printable(key) if rank is None else f"{printable(key)} (rank {rank})"


def _render(doc: InspectDoc, metadata: Mapping[str, object]) -> None:
    """Print ``doc`` as text; ``metadata`` is the manifest's own (``doc`` holds NaN as the string ``nan``)."""
    out = stdout()
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column(overflow="fold")
    head.add_row("checkpoint", Text(printable(doc["path"])))
    if doc["note"]:
        head.add_row("", Text(printable(f"({doc['note']})")))
    head.add_row("format version", str(doc["format_version"]))
    head.add_row("step", str(doc["step"]) if doc["step"] is not None else "-")
    head.add_row("world size", str(doc["world_size"]))
    head.add_row("created", f"{local_time(doc['created_at'])} ({doc['created']})")
    head.add_row("library version", Text(shown(doc["library_version"]) if doc["library_version"] else "-"))
    algorithm = shown(doc["checksum_algorithm"])
    head.add_row("checksums", Text(f"{algorithm} per {human_bytes(doc['checksum_block'])} block"))
    for key, value in metadata.items():  # (a float nan shows as nan, the string "nan" as 'nan')
        head.add_row("metadata", Text(f"{shown(key)} = {printable(repr(value))}"))
    for f in doc["files"]:
        head.add_row("file", Text(f"{shown(f['name'])}  {human_bytes(f['nbytes'])}"))
    tensors = doc["tensors"]
    head.add_row(
        "total", f"{human_bytes(doc['nbytes'])}, {len(tensors)} tensor(s), {len(doc['values'])} value(s)"
    )
    out.print(head)

    if tensors:
        table = Table(box=box.SIMPLE, title="tensors", title_justify="left")
        key_column(table, (_keyed(t["key"], t["rank"]) for t in tensors))
        table.add_column("dtype")
        table.add_column("shape")
        table.add_column("bytes", justify="right")
        table.add_column("chunks", justify="right")
        table.add_column("files", overflow="fold")
        table.add_column("replicated")
        for t in tensors:
            table.add_row(
                Text(_keyed(t["key"], t["rank"]) + "".join(f"\n= {printable(a)}" for a in t["aliases"])),
                Text(shown(t["dtype"])),
                _shape(t["shape"]),
                human_bytes(t["nbytes"]),
                str(len(t["chunks"])),
                Text(", ".join(map(shown, t["files"]))),
                {True: "yes", False: "no", None: "-"}[t["replicated"]],
            )
        out.print(table)

    if doc["values"]:
        vt = Table(box=box.SIMPLE, title="values", title_justify="left")
        key_column(vt, (_keyed(v["key"], v["rank"]) for v in doc["values"]))
        vt.add_column("type")
        vt.add_column("value", overflow="fold")
        for v in doc["values"]:
            if v["nbytes"] is not None:
                value = f"<{v['nbytes']} bytes{', pickled' if v['pickled'] else ''}>"
            elif v["type"] == "float" and isinstance(v["value"], str):  # nan, inf: stringified for JSON
                value = v["value"]
            else:
                value = _short(printable(repr(v["value"])))
            vt.add_row(Text(_keyed(v["key"], v["rank"])), Text(shown(v["type"])), Text(value))
        out.print(vt)

    if doc["statefuls"]:
        st = Table(box=box.SIMPLE, title="objects saved through state_dict()", title_justify="left")
        key_column(st, (_keyed(s["key"], s["rank"]) for s in doc["statefuls"]))
        st.add_column("type", overflow="fold")
        for s in doc["statefuls"]:
            st.add_row(Text(_keyed(s["key"], s["rank"])), Text(shown(s["type"])))
        out.print(st)


@click.command("inspect", short_help="Describe a checkpoint: header, tensors, values.")
@click.argument("path")
@step_option
@json_option
def command(path: str, step: int | None, as_json: bool) -> None:
    """Describe the checkpoint at PATH: header, every tensor, plain values.

    PATH is a checkpoint directory, or a Checkpointer root (then its newest step, or --step). Only the
    manifest is read; `aiockpt verify` checks the data.
    """
    directory, note = resolve_checkpoint(path, step)
    manifest = read_manifest(directory)
    doc = describe(directory, manifest, note, part_holders(directory))
    if as_json:
        print_json(doc)
    else:
        _render(doc, manifest.user_metadata)
