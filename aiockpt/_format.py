"""The on-disk format: versioned, frozen msgspec schemas and their codecs.

A committed checkpoint directory holds ``manifest.msgpack`` and one ``data-rNNNNN.bin`` per writing rank
(on an object store ``data-rNNNNN-<token>.bin``, the token unique to the save).
The manifest file is an :class:`Envelope` whose ``body`` is an encoded :class:`Manifest`; the envelope
carries the format version and a CRC32C of the body, so a reader can refuse a newer format, or detect a
damaged manifest, before decoding anything else. Data files hold raw little-endian tensor bytes at the
offsets the manifest gives. Nothing is pickled unless the user opted in (:class:`PickleNode`).

Compatibility rule: a new field always gets a default, so version-1 readers of a version-1 file keep
working, and a change that old readers would misread bumps :data:`FORMAT_VERSION`. Every version ever
written stays readable: ``aiockpt._body`` encodes the current one and decodes each.

Version history:

- 1: the tree nested as it is, the tensor entries one msgpack array.
- 2: the body stores its two large fields differently (see ``aiockpt._body``): the tree as its nodes in
  preorder (:data:`Record`), and both the tree and the tensor entries as ``bin`` values of one slice
  each.
- 3: version 2 and per-rank state (:class:`RanksNode`, stored as an :class:`OpenNode` of kind
  ``"ranks"``). A writer writes version 3 only for a tree that holds a :class:`RanksNode` and version 2
  otherwise, so that a checkpoint without per-rank state stays readable by releases that read up to 2
  (a version-2 reader would misread a ``"ranks"`` record as another container).

The in-memory :class:`Manifest` is the same for every version.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

import msgspec

FORMAT_VERSION = 3
# The version written for a tree that holds a :class:`RanksNode` (the first to hold one), and the one
# written for any other tree.
RANKS_VERSION = 3
PLAIN_VERSION = 2
MAGIC = "aiockpt"
MANIFEST_NAME = "manifest.msgpack"

Key = str | int
KeyPath = tuple[Key, ...]

# The deepest nesting of containers a reader accepts (a container under ``MAX_READ_DEPTH`` others is
# refused, the root dict being the first). Saves refuse more than ``_tree.MAX_DEPTH`` (100) levels; releases
# before that check wrote deeper states, of which loads read up to about 330 levels (each level costs the
# matcher two or three frames of recursion) and ended in a ``RecursionError`` beyond. A manifest deeper than
# this is damaged or forged, and refused before anything recurses into it.
MAX_READ_DEPTH = 256


def data_file_name(rank: int, tag: str = "") -> str:
    """Return the name of the data file written by ``rank``.

    ``tag`` (a save's token, on object stores) makes the name unique to one save: ``data-rNNNNN-<tag>.bin``.
    Local checkpoints use the plain name. Readers take any plain name a manifest gives.
    """
    return f"data-r{rank:05d}-{tag}.bin" if tag else f"data-r{rank:05d}.bin"


PART_RE = re.compile(r"rank-(\d{5,})-of-(\d{5,})")


def part_dir_name(rank: int, world_size: int) -> str:
    """The sub-directory where ``rank`` publishes its part of a collective-free checkpoint."""
    return f"rank-{rank:05d}-of-{world_size:05d}"


# Every struct here is immutable and holds only atoms, tuples and other such structs, so none can be part
# of a reference cycle: ``gc=False`` keeps the collector from tracking (and rescanning) them.

# --- The state tree -------------------------------------------------------------------------------------
# The structure of the saved state, with tensors replaced by indices into ``Manifest.tensors``. It lets
# ``read`` rebuild the nested containers exactly (dict vs list vs tuple, int vs str keys).


class DictNode(msgspec.Struct, frozen=True, kw_only=True, gc=False, tag="dict"):
    """A mapping. ``origin`` names the class of the Stateful it came from, if any."""

    keys: tuple[Key, ...]
    values: tuple[Node, ...]
    origin: str | None = None


class ListNode(msgspec.Struct, frozen=True, kw_only=True, gc=False, tag="list"):
    """A list."""

    items: tuple[Node, ...]


class TupleNode(msgspec.Struct, frozen=True, kw_only=True, gc=False, tag="tuple"):
    """A tuple."""

    items: tuple[Node, ...]


class TensorNode(msgspec.Struct, frozen=True, kw_only=True, gc=False, tag="tensor"):
    """A tensor; ``index`` points into ``Manifest.tensors``. Tied tensors share an index."""

    index: int


class ValueNode(msgspec.Struct, frozen=True, kw_only=True, gc=False, tag="value"):
    """A plain scalar value stored inline."""

    value: int | float | bool | str | None


class BytesNode(msgspec.Struct, frozen=True, kw_only=True, gc=False, tag="bytes"):
    """A ``bytes`` value stored inline."""

    value: bytes


class PickleNode(msgspec.Struct, frozen=True, kw_only=True, gc=False, tag="pickle"):
    """An arbitrary object, pickled; only written and read with ``allow_pickle=True``."""

    data: bytes
    type_name: str


class RanksNode(msgspec.Struct, frozen=True, kw_only=True, gc=False, tag="ranks"):
    """Per-rank state: rank ``ranks[i]`` saved ``items[i]`` here; a rank not listed lacks this key.

    Where the ranks of a distributed save hold different values under one key (each rank's RNG state, a
    key only one rank has), the tree holds this node instead of rank 0's value. It is a dict value or an
    item of a list or tuple (then every rank of the world is listed: an item cannot be absent), never
    the root, and no rank's item holds another one. ``ranks`` increase strictly; a :class:`TensorNode`
    in rank ``r``'s item indexes rank ``r``'s own entry of ``Manifest.tensors`` (entries of several
    ranks may share a key path). Only format version 3 and later hold it (see ``check_manifest``).
    """

    ranks: tuple[int, ...]
    items: tuple[Node, ...]


Node = DictNode | ListNode | TupleNode | TensorNode | ValueNode | BytesNode | PickleNode | RanksNode
# The node types that hold no other node (a tree's leaves).
LEAVES = frozenset({TensorNode, ValueNode, BytesNode, PickleNode})


class OpenNode(msgspec.Struct, frozen=True, kw_only=True, gc=False, tag="open", omit_defaults=True):
    """Format 2's flat tree: a container whose ``size`` children are the subtrees whose records follow.

    A :class:`RanksNode` (format 3) is one of kind ``"ranks"`` whose ``ranks`` are the node's and whose
    children are its items, in order; ``ranks`` is empty for the other kinds. Fields at their default
    are left out of the encoding: a version-2 record is then what releases before version 3 wrote
    (but for an ``origin`` of ``None``, which they wrote and read as the default).
    """

    kind: Literal["dict", "list", "tuple", "ranks"]
    size: Annotated[int, msgspec.Meta(ge=0)]
    origin: str | None = None
    ranks: tuple[int, ...] = ()


# One node of a format-2 tree in preorder: its key in the enclosing dict (``None`` in a list or tuple,
# in a RanksNode, and for the root), and the node itself, a container's children left out.
Record = tuple[Key | None, OpenNode | TensorNode | ValueNode | BytesNode | PickleNode]


# --- Tensors --------------------------------------------------------------------------------------------


class Chunk(msgspec.Struct, frozen=True, kw_only=True, gc=False, array_like=True):
    """One stored piece of a tensor: a box of the global tensor at a byte range of a data file.

    ``checksums[i]`` is the CRC32C of bytes ``[i * block, (i + 1) * block)`` of the chunk, where ``block`` is
    ``Manifest.checksum_block``; per-block checksums let large chunks be written and verified in parallel.
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    offset: int
    nbytes: int
    checksums: tuple[int, ...]


class TensorEntry(msgspec.Struct, frozen=True, kw_only=True, gc=False, array_like=True):
    """A logical (global) tensor and the chunks that store it."""

    path: KeyPath
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]


class FileInfo(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A data file of a checkpoint."""

    name: str
    nbytes: int


class Manifest(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Everything needed to read a checkpoint back; written last, after every data file is durable."""

    format_version: int = FORMAT_VERSION
    step: int | None = None
    world_size: int = 1
    created_at: float = 0.0
    library_version: str = ""
    checksum_algorithm: str = "crc32c"
    checksum_block: int
    tree: DictNode
    tensors: tuple[TensorEntry, ...]
    files: tuple[FileInfo, ...]
    user_metadata: dict[str, str | int | float | bool | None] = {}
    # Collective-free saves: the rank that wrote this part (``world_size`` is then the number of parts).
    part_rank: int | None = None


class Envelope(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """The outer layer of ``manifest.msgpack``; stable across format versions.

    ``body`` is decoded as a view into the file's bytes: copying megabytes of a large manifest into new
    memory holds the GIL for milliseconds.
    """

    magic: str
    format_version: int
    body_crc32c: int
    body: memoryview


# Module-level codecs are reused: building a msgspec Decoder is far costlier than using one.
ENCODER = msgspec.msgpack.Encoder()
ENVELOPE_DECODER = msgspec.msgpack.Decoder(Envelope)
