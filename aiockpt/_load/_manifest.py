"""Reading and verifying a checkpoint's manifest."""

from __future__ import annotations

import itertools
import math
import os
import stat
from collections.abc import Callable, Collection, Iterable, Sequence
from pathlib import Path

import crc32c
import msgspec

from .._body import decode_body, tree_blobs
from .._errors import CheckpointNotFoundError, CorruptionError, FormatError, StateError, StorageError
from .._format import (
    ENVELOPE_DECODER,
    FORMAT_VERSION,
    MAGIC,
    MANIFEST_NAME,
    MAX_READ_DEPTH,
    PART_RE,
    RANKS_VERSION,
    Chunk,
    DictNode,
    Key,
    KeyPath,
    ListNode,
    Manifest,
    Node,
    RanksNode,
    TensorEntry,
    TensorNode,
    TupleNode,
    part_dir_name,
)
from .._fs import IrregularFileError, read_regular
from .._gc import paused
from .._merge import Signature, merge, reindex
from .._tree import UNSUPPORTED_DTYPES, dtype_from_name, render


def _read_one(path: Path) -> Manifest:
    """Read, verify and decode ``path / manifest.msgpack``. Blocking.

    Raises:
        CheckpointNotFoundError: ``path`` does not exist or holds no manifest (not a committed checkpoint).
        FormatError: The manifest is not an aiockpt manifest or has a newer format version.
        CorruptionError: The manifest's checksum does not match (names the file).
        StorageError: The system refused to read the manifest (``EACCES``, ``EIO``; names it).
    """
    return _decode(*_raw(path))[0]


def _raw(path: Path) -> tuple[bytes, str]:
    """The bytes of ``path / manifest.msgpack``, and its name for errors (see :func:`_read_one`)."""
    file = path / MANIFEST_NAME
    try:
        raw = read_regular(file)
    except FileNotFoundError:
        if not path.exists():
            raise CheckpointNotFoundError(f"no checkpoint at {path}: it does not exist") from None
        raise CheckpointNotFoundError(
            f"{path} is not an aiockpt checkpoint: it has no {MANIFEST_NAME}"
        ) from None
    except NotADirectoryError:
        raise CheckpointNotFoundError(f"{path} is not an aiockpt checkpoint: it is not a directory") from None
    except (IsADirectoryError, IrregularFileError) as exc:  # (something else in a manifest's place)
        raise FormatError(f"cannot read {file}: {exc.strerror or exc}", file=str(file)) from exc
    except OSError as exc:  # the system refused the read (EACCES, EIO): not the format's doing
        raise StorageError(f"cannot read {file}: {exc.strerror or exc}", path=str(file)) from exc
    return raw, str(file)


def decode_manifest(raw: bytes, file: str) -> Manifest:
    """Verify and decode the bytes of a manifest read from ``file`` (named in errors).

    Raises:
        FormatError: The bytes are not an aiockpt manifest or have a newer format version.
        CorruptionError: The manifest's checksum does not match.
    """
    return _decode(raw, file)[0]


def _decode(raw: bytes, file: str) -> tuple[Manifest, int]:
    """:func:`decode_manifest`, also returning the checksum of the manifest's body.

    Damage is told from the rest by the body's checksum, which covers the body but not the envelope's
    other fields (magic, format version, the checksum itself). Bytes that are not an envelope, or whose
    checksum does not match, are damage (:class:`CorruptionError`), whichever field was hit, but for an
    envelope of a newer format version (a later format may checksum otherwise: :class:`FormatError`,
    which says both); so is an envelope whose body's checksum matches but whose magic or version is one
    no writer writes (the unprotected header was hit). Only a manifest whose checksum matches is judged
    by its contents: a newer format version, or contents no save writes, are a :class:`FormatError`,
    which no copy of the same bytes would cure.
    """
    try:
        env = ENVELOPE_DECODER.decode(raw)
    except (msgspec.DecodeError, ValueError) as exc:  # invalid UTF-8 surfaces as UnicodeDecodeError
        raise CorruptionError(f"{file} is damaged or not an aiockpt manifest: {exc}", file=file) from exc
    if crc32c.crc32c(env.body) != env.body_crc32c:
        if env.magic == MAGIC and env.format_version > FORMAT_VERSION:
            # A later format may checksum otherwise: this release cannot tell damage from a newer writer.
            raise FormatError(
                f"{file} has format version {env.format_version}; this aiockpt reads up to {FORMAT_VERSION} "
                "(upgrade aiockpt; if no newer aiockpt wrote it, it is damaged: its checksum does not match)",
                file=file,
            )
        what = (
            "damaged" if env.magic == MAGIC else f"damaged or not an aiockpt manifest (magic {env.magic!r})"
        )
        raise CorruptionError(f"{file} is {what}: its checksum does not match", file=file)
    if env.magic != MAGIC:
        raise CorruptionError(
            f"{file} is damaged or not an aiockpt manifest: its magic is {env.magic!r}, not {MAGIC!r} "
            "(its body's checksum matches)",
            file=file,
        )
    if env.format_version < 1:
        raise CorruptionError(f"{file} is damaged: invalid format version {env.format_version}", file=file)
    if env.format_version > FORMAT_VERSION:
        inner = _body_version(env.body)
        if inner is not None and inner != env.format_version:
            raise CorruptionError(
                f"{file} is damaged: envelope says format version {env.format_version}, the manifest {inner}",
                file=file,
            )
        raise FormatError(
            f"{file} has format version {env.format_version}; this aiockpt reads up to {FORMAT_VERSION}: "
            "upgrade aiockpt",
            file=file,
        )
    try:
        with paused():
            manifest = decode_body(env.body, env.format_version)
    except (msgspec.DecodeError, ValueError) as exc:  # invalid UTF-8 surfaces as UnicodeDecodeError
        raise FormatError(f"{file} cannot be decoded: {exc}", file=file) from exc
    except RecursionError:  # a format-1 tree nested deeper than msgspec's decoder recurses
        raise FormatError(
            f"{file} cannot be decoded: its tree nests containers more than {MAX_READ_DEPTH} levels deep",
            file=file,
        ) from None
    if manifest.format_version != env.format_version:
        raise CorruptionError(
            f"{file} is damaged: envelope says format version {env.format_version}, "
            f"the manifest {manifest.format_version}",
            file=file,
        )
    check_manifest(manifest, file)
    return manifest, env.body_crc32c


class _BodyVersion(msgspec.Struct, frozen=True, gc=False):
    """The one field of a manifest's body that every version has (the others are skipped)."""

    format_version: int


_BODY_VERSION_DECODER = msgspec.msgpack.Decoder(_BodyVersion)


def _body_version(body: memoryview) -> int | None:
    """The format version the body of a manifest names, or ``None`` where it cannot be read as one."""
    try:
        return _BODY_VERSION_DECODER.decode(body).format_version
    except (msgspec.DecodeError, ValueError, RecursionError):
        return None


# The latest time ``created_at`` may hold (year 10000): later ones have no calendar date to show.
_MAX_TIME = 253402300800.0
# The largest byte count or file offset: the operating system's offsets (and torch's sizes) are int64.
MAX_BYTES = (1 << 63) - 1


def check_manifest(manifest: Manifest, file: str) -> None:
    """Refuse a decoded manifest that no save writes: fields out of range, or that contradict each other.

    The body's checksum only shows that the bytes are those the writer wrote, and the schema only their
    types; a forged manifest, or one from a faulty writer, can hold any values. Everything the readers
    index, allocate, recurse or open files by is checked here, once, so that they can trust it: tensor
    indices of the tree, its depth, chunk boxes inside their tensor's shape, byte counts that match the
    boxes, one checksum per block, and data file names that stay inside the checkpoint. Dtypes this
    torch does not know are left to the readers, which report them by key.

    Per-rank state (a :class:`RanksNode`) is refused where no save writes it, so that projecting the
    tree for a rank (``_load._ranks.project``) can trust it too: in a manifest of a format version before
    3, in a part of a collective-free checkpoint, inside another rank's item, or with ranks that are
    none, out of increasing order, outside ``0 .. world_size - 1`` or not one per item; and as an item of
    a list or tuple, unless it lists every rank (a rank cannot lack an item).

    Raises:
        FormatError: Names ``file`` and, for a tensor entry or per-rank state, its key.
    """

    def bad(what: str) -> FormatError:
        return FormatError(f"{file} is damaged or forged: {what}", file=file)

    if manifest.world_size < 1:
        raise bad(f"world size {manifest.world_size}")
    if manifest.part_rank is not None and not 0 <= manifest.part_rank < manifest.world_size:
        raise bad(f"part rank {manifest.part_rank} of world size {manifest.world_size}")
    if manifest.checksum_algorithm != "crc32c":
        raise bad(f"unknown checksum algorithm {manifest.checksum_algorithm!r}")
    if manifest.checksum_block < 1:
        raise bad(f"checksum block of {manifest.checksum_block} bytes")
    if not 0 <= manifest.created_at < _MAX_TIME:  # (also refuses nan)
        raise bad(f"creation time {manifest.created_at}")
    for info in manifest.files:
        if not _plain_name(info.name) or not 0 <= info.nbytes <= MAX_BYTES:
            raise bad(f"data file {info.name!r} of {info.nbytes} bytes")
    _check_tree(manifest, bad)
    found = _Entries(manifest.checksum_block).first_problem(manifest.tensors)
    if found is not None:
        entry, problem = found
        raise bad(f"tensor {render(entry.path)!r}: {problem}")
    shared = _shared_bytes(manifest.tensors)
    if shared is not None:
        a, b, name = shared
        whose = (
            f"tensor {render(a.path)!r}" if a is b else f"tensors {render(a.path)!r} and {render(b.path)!r}"
        )
        raise bad(f"{whose}: chunks over the same bytes of {name}")


def _shared_bytes(tensors: Sequence[TensorEntry]) -> tuple[TensorEntry, TensorEntry, str] | None:
    """Two entries with chunks over some of the same bytes of a data file (and the file), or ``None``.

    No save writes two chunks over the same bytes (a tie is one entry, a replicated box one chunk). A
    manifest that does can make a small checkpoint claim any size: 4,096 rows of a 16 GiB tensor, every
    one the same 4 MiB of its file, each with the right checksum, and a read allocated all 16 GiB.
    """
    # A save lists each file's chunks in file order: one pass tells, with nothing sorted or kept but each
    # file's end so far (20,000 chunks: a few ms, where sorting them took 30).
    ends: dict[str, int] = {}
    ordered = True
    for entry in tensors:
        for c in entry.chunks:
            if c.nbytes:
                if c.offset < ends.get(c.file, 0):
                    ordered = False
                    break
                ends[c.file] = c.offset + c.nbytes
        if not ordered:
            break
    if ordered:
        return None
    # file -> (offset, end, entry, box) of each chunk. A chunk listed twice (the same box of the same entry
    # over the same bytes) is no overlap: a load reads each distinct box once.
    by_file: dict[str, list[tuple[int, int, int, tuple[tuple[int, ...], tuple[int, ...]]]]] = {}
    for i, entry in enumerate(tensors):
        for c in entry.chunks:
            if c.nbytes:
                by_file.setdefault(c.file, []).append(
                    (c.offset, c.offset + c.nbytes, i, (c.offsets, c.sizes))
                )
    for name, ranges in by_file.items():
        ranges.sort()
        end, holder, last = -1, 0, None
        for chunk in ranges:
            start, stop, i, _ = chunk
            if chunk == last:
                continue
            if start < end:
                return tensors[holder], tensors[i], name
            if stop > end:
                end, holder = stop, i
            last = chunk
    return None


def _plain_name(name: str) -> bool:
    """Whether ``name`` names a file in the checkpoint's own directory (no other directory, no NUL)."""
    return name not in ("", ".", "..") and "/" not in name and "\0" not in name


def _check_tree(manifest: Manifest, bad: Callable[[str], FormatError]) -> None:
    """Refuse a tree that indexes past the tensors, nests too deep, or holds per-rank state no save writes.

    Too deep: more than MAX_READ_DEPTH levels. Per-rank state: see :func:`check_manifest`. A walk with
    a stack of its own: a format-1 tree is decoded nested as it is stored, and this is the first code
    to meet its depth. (Format 2's decoder refuses too deep a tree while it rebuilds it.) A
    RanksNode counts as a level of nesting, and its items are checked as any container's children.
    """
    count = len(manifest.tensors)
    world = manifest.world_size
    # Why this manifest cannot hold per-rank state at all, or ``None``.
    no_ranks = (
        f"in a manifest of format version {manifest.format_version} (per-rank state is version "
        f"{RANKS_VERSION}'s)"
        if manifest.format_version < RANKS_VERSION
        else "in a part of a collective-free checkpoint (each part is one rank's state)"
        if manifest.part_rank is not None
        else None
    )
    # Per container: the node, its key path, how many containers hold it, the rank whose own state (an
    # item of a RanksNode) holds it or ``None``, and whether it is an item of a list or tuple.
    stack: list[tuple[Node, KeyPath, int, int | None, bool]] = [(manifest.tree, (), 0, None, False)]
    while stack:
        node, path, depth, rank, in_sequence = stack.pop()
        if isinstance(node, RanksNode):
            problem = _ranks_problem(node, world, rank, in_sequence, no_ranks)
            if problem is not None:
                raise bad(f"the per-rank state at key {render(path)!r} {problem}")
            if depth >= MAX_READ_DEPTH:
                raise bad(f"containers nest more than {MAX_READ_DEPTH} levels deep, at key {render(path)!r}")
            # A rank's item stands at the RanksNode's own key path.
            for r, item in zip(node.ranks, node.items, strict=True):
                if type(item) is TensorNode:
                    if not 0 <= item.index < count:
                        raise bad(
                            f"key {render(path)!r} of rank {r} refers to tensor {item.index} of {count}"
                        )
                elif type(item) in _CONTAINERS:
                    stack.append((item, path, depth + 1, r, False))
            continue
        if isinstance(node, DictNode):
            if len(node.keys) != len(node.values):
                raise bad(
                    f"the dict at key {render(path)!r} has {len(node.keys)} keys, {len(node.values)} values"
                )
            if len(set(node.keys)) != len(node.keys):  # (a read would keep the last value of a key)
                seen: set[Key] = set()
                for key in node.keys:
                    if key in seen:
                        raise bad(f"the dict at key {render(path)!r} lists key {key!r} twice")
                    seen.add(key)
            children: Iterable[tuple[Key, Node]] = zip(node.keys, node.values, strict=True)
            sequence = False
        elif isinstance(node, (ListNode, TupleNode)):
            children = enumerate(node.items)
            sequence = True
        else:
            if isinstance(node, TensorNode) and not 0 <= node.index < count:
                raise bad(f"key {render(path)!r} refers to tensor {node.index} of {count}")
            continue
        if depth >= MAX_READ_DEPTH:
            raise bad(f"containers nest more than {MAX_READ_DEPTH} levels deep, at key {render(path)!r}")
        for key, child in children:
            if type(child) is TensorNode:  # (the bulk of a tree: no stack entry for it)
                if not 0 <= child.index < count:
                    of = "" if rank is None else f" of rank {rank}"
                    raise bad(f"key {render((*path, key))!r}{of} refers to tensor {child.index} of {count}")
            elif type(child) in _CONTAINERS:
                stack.append((child, (*path, key), depth + 1, rank, sequence))


def _ranks_problem(
    node: RanksNode, world: int, rank: int | None, in_sequence: bool, no_ranks: str | None
) -> str | None:
    """What no save writes about ``node``, or ``None``.

    ``rank``: the rank whose own state holds ``node``, if any; ``in_sequence``: whether ``node`` is an
    item of a list or tuple; ``no_ranks``: why the manifest cannot hold per-rank state, if it cannot.
    """
    ranks = node.ranks
    if no_ranks is not None:
        return no_ranks
    if rank is not None:
        return f"lies inside the state of rank {rank}, itself per-rank"
    if not ranks:
        return "lists no rank"
    if len(ranks) != len(node.items):
        return f"lists {len(ranks)} ranks and {len(node.items)} items"
    if any(a >= b for a, b in itertools.pairwise(ranks)):
        return f"lists ranks {_some(ranks)} out of increasing order"
    if ranks[0] < 0 or ranks[-1] >= world:  # (strictly increasing: the ends bound the others)
        return f"lists ranks {_some(ranks)} outside the world of {world}"
    if in_sequence and len(ranks) != world:  # (strictly increasing in [0, world): all of them or not)
        return (
            f"is an item of a list or tuple that ranks {missing_ranks(set(ranks), world)} (of {world}) lack "
            "(an item cannot be absent)"
        )
    return None


def _some(ranks: tuple[int, ...]) -> str:
    """``ranks`` as ``[0, 3, 2]``, or its first MAX_NAMED_RANKS as ``[0, 3, 2, and 97 more]``."""
    more = len(ranks) - MAX_NAMED_RANKS
    return f"[{', '.join(map(str, ranks[:MAX_NAMED_RANKS]))}{f', and {more} more' if more > 0 else ''}]"


_CONTAINERS = frozenset({DictNode, ListNode, TupleNode, RanksNode})


class _Entries:
    """Checks tensor entries, each (dtype, shape) and data file name once: most entries share them."""

    def __init__(self, block: int) -> None:
        self.block = block
        # Per (dtype, shape) met: the size of an element and the bytes of the whole tensor (both ``None``
        # for a dtype this torch lacks, whose byte counts cannot be checked: the readers refuse it by key).
        self.wholes: dict[tuple[str, tuple[int, ...]], tuple[int | None, int | None]] = {}
        self.names: set[str] = set()  # data file names found plain
        # Per (dtype, shape) of an entry found sound that was one chunk holding the whole tensor: the
        # chunk's offsets (zeros), byte count and number of checksums. Most entries are such, and
        # :meth:`first_problem` checks one against these with a few comparisons (20,000 entries: about
        # 3 ms against 6.5 ms through the general checks).
        self.plain: dict[tuple[str, tuple[int, ...]], tuple[tuple[int, ...], int, int]] = {}

    def first_problem(self, entries: Iterable[TensorEntry]) -> tuple[TensorEntry, str] | None:
        """The first of ``entries`` that something is wrong with, and what; ``None`` if none."""
        plain, names = self.plain, self.names
        for entry in entries:
            chunks = entry.chunks
            if len(chunks) == 1:  # (inline: a call per entry would be a third of the time)
                c = chunks[0]
                known = plain.get((entry.dtype, c.sizes))
                if (
                    known is not None
                    and c.sizes == entry.shape
                    and c.offsets == known[0]
                    and c.nbytes == known[1]
                    and len(c.checksums) == known[2]
                    and c.file in names
                    and 0 <= c.offset <= MAX_BYTES - c.nbytes
                ):
                    continue
            problem = self.problem(entry)
            if problem is not None:
                return entry, problem
        return None

    def problem(self, entry: TensorEntry) -> str | None:
        """What is wrong with ``entry``, or ``None``."""
        chunks = entry.chunks
        problem = self._problem(entry)
        if problem is None and len(chunks) == 1:
            c = chunks[0]
            if c.sizes == entry.shape and not any(c.offsets):
                self.plain[entry.dtype, c.sizes] = (c.offsets, c.nbytes, len(c.checksums))
        return problem

    def _problem(self, entry: TensorEntry) -> str | None:
        shape = entry.shape
        kind = (entry.dtype, shape)
        if kind in self.wholes:
            itemsize, whole = self.wholes[kind]
        else:
            if any(n < 0 for n in shape):
                return f"shape {list(shape)}"
            itemsize = dtype_itemsize(entry.dtype)
            if itemsize == 0:
                return f"dtype {entry.dtype} has no byte layout aiockpt reads"
            if math.prod(shape) * (itemsize or 1) > MAX_BYTES:
                return f"shape {list(shape)} is too large"
            whole = None if itemsize is None else math.prod(shape) * itemsize
            self.wholes[kind] = itemsize, whole
        for c in entry.chunks:
            if c.sizes == shape and len(c.offsets) == len(shape) and not any(c.offsets):
                nbytes = whole  # the common case: one chunk holds the whole tensor
            elif box_inside(c.offsets, c.sizes, shape):
                nbytes = None if itemsize is None else math.prod(c.sizes) * itemsize
            else:
                return f"chunk box {list(c.offsets)} + {list(c.sizes)} is not inside the shape {list(shape)}"
            if c.file not in self.names:
                if not _plain_name(c.file):
                    return f"chunk in data file {c.file!r}, outside the checkpoint"
                self.names.add(c.file)
            wrong = c.nbytes < 0 if nbytes is None else c.nbytes != nbytes
            if wrong or not 0 <= c.offset <= MAX_BYTES - c.nbytes:
                return (
                    f"chunk of {c.nbytes} bytes at offset {c.offset} of {c.file} for the box {list(c.sizes)}"
                )
            if len(c.checksums) != (1 if c.nbytes <= self.block else -(-c.nbytes // self.block)):
                return (
                    f"chunk of {c.nbytes} bytes has {len(c.checksums)} checksums of {self.block}-byte blocks"
                )
        if len(entry.chunks) > 1:
            # A save writes each box of a tensor once, and no two overlap: a load counts the elements its
            # chunks hold to decide that they cover its target, which overlapping boxes would fool (rows
            # 0-1 and 1-2 of a 4-row tensor count as all of it, and row 3 is never read).
            found = overlapping(list({(c.offsets, c.sizes) for c in entry.chunks}))
            if found is not None:
                (a, b) = found
                return f"chunk boxes {list(a[0])} + {list(a[1])} and {list(b[0])} + {list(b[1])} overlap"
        return None


def box_inside(offsets: tuple[int, ...], sizes: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    """Whether the chunk box ``offsets`` + ``sizes`` has ``shape``'s dimensions and lies inside it."""
    return len(offsets) == len(sizes) == len(shape) and all(
        min(o, n) >= 0 and o + n <= dim for o, n, dim in zip(offsets, sizes, shape, strict=True)
    )


# Per dtype name: the size of an element, ``0`` for a dtype no save writes (quantized, sub-byte), ``None``
# for a name this torch does not know.
_ITEMSIZES: dict[str, int | None] = {}


def dtype_itemsize(name: str) -> int | None:
    """The size of an element of dtype ``name``: ``0`` for one no save writes, ``None`` for an unknown one."""
    size = _ITEMSIZES.get(name, -1)
    if size == -1:
        try:
            dtype = dtype_from_name(name)
        except ValueError:
            size = None
        else:
            size = 0 if dtype in UNSUPPORTED_DTYPES else dtype.itemsize
        _ITEMSIZES[name] = size
    return size


def decode_summary(raw: bytes, file: str) -> tuple[Manifest, int, int]:
    """What a rank that did not commit a save reports of it: the manifest it reads back, decoded.

    Returns:
        The manifest, the checksum of its body and the bytes of tensor data it describes.

    Raises:
        FormatError: As :func:`decode_manifest`.
        CorruptionError: As :func:`decode_manifest`.
    """
    manifest, crc = _decode(raw, file)
    return manifest, crc, sum(c.nbytes for t in manifest.tensors for c in t.chunks)


# The published parts of a collective-free checkpoint, per world size: rank -> (part dir, the time its
# manifest was written, in ns).
_PartSets = dict[int, dict[int, tuple[Path, int]]]


def _part_sets(path: Path) -> _PartSets:
    """Every published part under ``path``, grouped by the world size its name says. Blocking.

    Only the name a save gives a part counts (``part_dir_name``): one name per rank and world size, so
    no two directories can claim one rank (``rank-000001-of-00002`` next to ``rank-00001-of-00002``,
    which a listing in name order used to pick first, or digits other than ASCII ones). A part whose
    rank is not below its world size belongs to no set and is left out.

    Raises:
        OSError: ``path`` exists but cannot be listed (``EACCES``, ``EIO``, a name too long); raised as
            such, for a scan of many steps to tell one unreadable step from the others.
    """
    try:
        names = os.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        return {}
    sets: _PartSets = {}
    for name in names:
        m = PART_RE.fullmatch(name)
        if m is None:
            continue
        rank, world = int(m.group(1)), int(m.group(2))
        if rank >= world or name != part_dir_name(rank, world):
            continue
        try:
            st = os.stat(path / name / MANIFEST_NAME)
        except OSError:  # not published (yet): a part's manifest is written before its rename
            continue
        if not stat.S_ISREG(st.st_mode):
            continue
        sets.setdefault(world, {})[rank] = (path / name, st.st_mtime_ns)
    return sets


def _chosen(sets: _PartSets) -> int:
    """The world size whose parts are the checkpoint, of ``sets`` (not empty).

    Parts of different world sizes never merge: each set holds its own ranks' shards, so a mix reads some
    elements from one save and some from another (or from none). A step can hold several sets when a
    save of it failed part way and another job, of another size, saved it again. The complete set
    counts (every rank ``0..N-1`` published); the others are leftovers. Of several complete sets, the
    one completed first (the newest of its manifests is the oldest): the step was committed as that one,
    and a commit never changes what a committed checkpoint holds (a part, like a collective save, is
    published without replacing anything). Of incomplete sets only, the one that lacks the fewest parts
    (the larger world on a tie), whose missing ranks an error then names.
    """
    complete = [w for w, ranks in sets.items() if len(ranks) == w]
    if complete:
        return min(complete, key=lambda w: (max(t for _, t in sets[w].values()), -w))
    return min(sets, key=lambda w: (w - len(sets[w]), -w))


def _in_rank_order(ranks: dict[int, tuple[Path, int]]) -> list[Path]:
    """The part directories of one set of :func:`_part_sets`, by rank."""
    return [ranks[r][0] for r in sorted(ranks)]


def published_parts(path: Path) -> tuple[int, list[Path]] | None:
    """The published parts of a collective-free checkpoint: ``(world size, part dirs by rank)``, or ``None``.

    The parts are those of one world size only (see ``_chosen``): the complete set where there is one.
    Blocking.
    """
    sets = _part_sets(path)
    if not sets:
        return None
    world = _chosen(sets)
    ranks = sets[world]
    return world, _in_rank_order(ranks)


def is_checkpoint(path: Path) -> bool:
    """Whether ``path`` holds a committed checkpoint (cheap; verifies nothing). Blocking.

    A collective-free checkpoint is committed once every rank of one world size has published its part;
    parts of several world sizes that only together name every rank are not a checkpoint.
    """
    if os.path.isfile(path / MANIFEST_NAME):
        return True
    parts = published_parts(path)
    return parts is not None and len(parts[1]) == parts[0]


def read_summary(path: Path) -> tuple[Manifest, int, int]:
    """The manifest of the checkpoint at ``path``, the checksum of its body, and its tensor bytes. Blocking.

    As :func:`read_manifest` (a collective-free checkpoint is read as the merge of its parts, whose
    checksum is then 0: there is no one manifest), and raises as it does.
    """
    if os.path.isfile(path / MANIFEST_NAME):
        manifest, crc = _decode(*_raw(path))
    else:  # parts (or nothing: read_manifest says so), listed once
        manifest, crc = read_manifest(path), 0
    return manifest, crc, sum(c.nbytes for t in manifest.tensors for c in t.chunks)


def read_manifest(path: Path, *, every_copy: bool = False) -> Manifest:
    """Read, verify and decode the manifest of the checkpoint at ``path``. Blocking.

    A collective-free checkpoint (one published part per rank) is read as the merge of the parts of one
    world size (see ``_chosen``); with ``every_copy`` (verification), a chunk that several parts hold is
    listed once per part. Where the parts' states differ, the merge keeps each rank's own (see
    :func:`merge_parts`).

    Raises:
        CheckpointNotFoundError: ``path`` does not exist or holds no manifest, or parts are missing (no
            world size has all of its parts).
        FormatError: The manifest is not an aiockpt manifest or has a newer format version, or the parts
            cannot be merged (see :func:`merge_parts`).
        CorruptionError: The manifest's checksum does not match (names the file).
        StorageError: ``path`` holds no manifest and cannot be listed for parts, or the system refused
            to read a manifest (``EACCES``, ``EIO``); names the path or file.
    """
    if not os.path.isfile(path / MANIFEST_NAME):
        try:
            sets = _part_sets(path)
        except OSError as exc:
            raise StorageError(f"cannot read {path}: {exc.strerror or exc}", path=str(path)) from exc
        if sets:
            world = _chosen(sets)
            ranks = sets[world]
            if len(ranks) != world:
                raise CheckpointNotFoundError(_incomplete(path, sets, world))
            parts = [(d.name, _read_part(d)) for d in _in_rank_order(ranks)]
            return merge_parts(parts, every_copy=every_copy, where=path)
    return _read_one(path)


def _read_part(part: Path) -> Manifest:
    """:func:`_read_one` of a part directory, refused when its manifest says it is another rank's part.

    A save names a part's directory after the ``part_rank`` and ``world_size`` of its manifest; a part
    moved, copied or forged under another rank's name would otherwise be merged as that rank's shards.
    A manifest without ``part_rank`` (a single-process save put there by hand) is taken as it is.

    Raises:
        FormatError: The manifest's rank or world size contradicts the directory's name (names the file).
    """
    manifest = _read_one(part)
    m = PART_RE.fullmatch(part.name)
    assert m is not None  # (only directories named as parts are read as parts)
    rank, world = int(m.group(1)), int(m.group(2))
    if manifest.part_rank is not None and (manifest.part_rank, manifest.world_size) != (rank, world):
        file = str(part / MANIFEST_NAME)
        raise FormatError(
            f"{file} is damaged or forged: it is the part of rank {manifest.part_rank} of "
            f"{manifest.world_size}, but its directory {part.name} is that of rank {rank} of {world}",
            file=file,
        )
    return manifest


# The most missing ranks an error or ``aiockpt ls`` names (a directory name can say a world of 10^240).
MAX_NAMED_RANKS = 16


def first_missing(have: Collection[int], world: int) -> list[int]:
    """The first MAX_NAMED_RANKS ranks below ``world`` that ``have`` lacks.

    Never a set of ``world`` ranks: a part's name says its world size, and a damaged or forged one can
    say any (``rank-00000-of-99999999999``).
    """
    return list(itertools.islice((r for r in range(world) if r not in have), MAX_NAMED_RANKS))


def missing_ranks(have: Collection[int], world: int) -> str:
    """The ranks below ``world`` that ``have`` lacks, as ``[1, 2]`` or ``[1, 2, and 7 more]``.

    Those of :func:`first_missing`, and how many more.
    """
    named = first_missing(have, world)
    more = world - len(have) - len(named)  # (``have`` holds ranks below ``world`` only)
    return f"[{', '.join(map(str, named))}{f', and {more} more' if more > 0 else ''}]"


def _incomplete(path: Path, sets: _PartSets, world: int) -> str:
    """Why ``path``, whose parts are ``sets`` and none of them complete, is no checkpoint."""
    missing = missing_ranks(sets[world], world)
    why = f"{path} is incomplete: the parts of ranks {missing} (of {world}) were never published"
    others = [f"{len(sets[w])} of {w}" for w in sorted(sets) if w != world]
    if others:
        why += f"; the parts of other world sizes ({', '.join(others)}) never merge with them"
    return why


def merge_parts(
    parts: list[tuple[str, Manifest]],
    *,
    every_copy: bool = False,
    where: Path | None = None,
) -> Manifest:
    """One manifest for the parts of a collective-free checkpoint (``(part dir, manifest)`` by rank).

    ``where``, the checkpoint's directory, is named in errors with the part's.

    Each part holds its rank's whole tree. Where the parts' trees agree (SPMD state) the merged tree is
    rank 0's; where they differ (structure, plain values, a plain tensor's dtype, shape or contents, by
    its chunk's checksums) it holds each rank's own value, as a collective save's manifest does
    (:class:`~.._format.RanksNode`, see ``_merge``), and the tensors under such a key are each rank's
    own entries, read from its part. Shared tensors are merged by key path, a chunk held by several
    ranks (a replicated tensor, written by each) read from the first part. With ``every_copy``, every
    part's copy of such a chunk is kept (``aiockpt.verify`` checks each: a load may read any of them,
    such as a part read on its own). File names are made relative to the checkpoint.

    The parts must be of one save: one step and one checksum block (the merged manifest has one of
    each, by which every chunk is checked), each tensor entry found in its part's tree at its key path
    (the merge goes by key path, rank 0's tree by index). Of the merged boxes of a tensor, two that
    differ must not overlap, except that a box holding the whole tensor makes every other redundant: a
    load counts the elements its chunks hold to decide that they cover its target, which overlapping
    boxes would fool (some elements read twice, others never).

    Raises:
        FormatError: Two parts disagree on the step, the checksum block, or a shared tensor's dtype or
            global shape; a part's entry is not at its key path in its tree; boxes of a tensor overlap;
            or a part holds a DTensor shard under a key whose state differs between the parts (names
            the key and the parts).
    """

    def at(name: str) -> str:  # (a part as errors name it)
        return name if where is None else str(where / name)

    base = parts[0][1]
    for name, m in parts:
        if (m.step, m.checksum_block) != (base.step, base.checksum_block):
            raise FormatError(
                f"cannot merge the parts of a collective-free checkpoint: part {at(name)} is of step "
                f"{m.step} with {m.checksum_block}-byte checksum blocks, part {at(parts[0][0])} of step "
                f"{base.step} with {base.checksum_block}-byte blocks (parts of different saves)",
                file=f"{at(name)}/{MANIFEST_NAME}",
            )
        _check_paths(at(name), m)
    own, tree = _per_rank(parts, at)
    # Rank 0's tree refers to its tensors by index: they come first, in its order (its paths are its
    # own tree's, one per entry: see _check_paths), its own per-rank ones included; the other parts'
    # own follow, and ``index`` maps each (part, entry) to its place.
    entries: dict[KeyPath | int, _Merged] = {}
    index: dict[tuple[int, int], int] = {}
    files = []
    for r, (name, m) in enumerate(parts):
        files += [msgspec.structs.replace(f, name=f"{name}/{f.name}") for f in m.files]
        mine = own[r]
        for j, t in enumerate(m.tensors):
            chunks = [msgspec.structs.replace(c, file=f"{name}/{c.file}") for c in t.chunks]
            if j in mine:  # this rank's own: an entry of its own, never merged with another part's
                index[(r, j)] = len(entries)
                alone = entries[len(entries)] = _Merged(t, at(name))
                alone.add(at(name), chunks, every_copy=every_copy)
                continue
            merged = entries.get(t.path)
            if merged is None:
                entries[t.path] = merged = _Merged(t, at(name))
            elif (merged.entry.dtype, merged.entry.shape) != (t.dtype, t.shape):
                first = merged.entry
                raise FormatError(
                    f"parts disagree on tensor {render(t.path)!r}: {first.dtype}{list(first.shape)} "
                    f"(in {merged.part}) vs {t.dtype}{list(t.shape)} (in {at(name)})",
                    file=f"{at(name)}/{MANIFEST_NAME}",
                )
            merged.add(at(name), chunks, every_copy=every_copy)
    tensors = tuple(
        msgspec.structs.replace(merged.entry, chunks=merged.result(every_copy)) for merged in entries.values()
    )
    merged_manifest = msgspec.structs.replace(
        base, tensors=tensors, files=tuple(files), world_size=len(parts), part_rank=None
    )
    if tree is None:
        return merged_manifest
    # (Format 3 in memory: the readers project per-rank state for their rank, see _load._ranks.)
    return msgspec.structs.replace(
        merged_manifest, tree=reindex(tree, index), format_version=max(base.format_version, RANKS_VERSION)
    )


def _per_rank(
    parts: list[tuple[str, Manifest]], at: Callable[[str], str]
) -> tuple[list[frozenset[int]], DictNode | None]:
    """Each part's own entries (per-rank state), and the merged tree, ``None`` where the parts agree.

    Compared as a distributed save compares its ranks (``_merge``), a plain tensor by its checksums.

    Raises:
        FormatError: A part holds a DTensor shard under state that differs between the parts.
    """
    trees = [m.tree for _, m in parts]
    sigs = [_signatures(m) for _, m in parts]
    # By their encodings: trees whose values Python finds equal (1, 1.0, True; 0.0, -0.0) are not alike.
    blobs = [tree_blobs(t) for t in trees]
    if all(b == blobs[0] for b in blobs[1:]) and all(s == sigs[0] for s in sigs[1:]):
        return [frozenset()] * len(parts), None  # (the common case: the same state everywhere)
    try:
        merged = merge(trees, sigs)
    except StateError as exc:  # (it names the rank, whose part is rank-<rank>-of-<world>)
        place = at("")
        raise FormatError(
            f"cannot merge the parts of a collective-free checkpoint{' at ' + place if place else ''}: {exc}",
            file=place,
        ) from exc
    return list(merged.own), merged.tree


def _signatures(m: Manifest) -> list[Signature]:
    """What each tensor entry of a part is compared by: a whole tensor in one chunk by its checksums."""
    out = []
    for t in m.tensors:
        chunks = t.chunks
        if not chunks:
            out.append(Signature(False, t.dtype, t.shape, 0))
        elif len(chunks) == 1 and chunks[0].sizes == t.shape and not any(chunks[0].offsets):
            # (One process compares: the tuple's hash stands for its checksums, and is never -1.)
            out.append(Signature(False, t.dtype, t.shape, hash(chunks[0].checksums)))
        else:
            out.append(Signature(True, t.dtype, t.shape, -1))
    return out


_Box = tuple[tuple[int, ...], tuple[int, ...]]


class _Merged:
    """The chunks of one tensor that the parts hold, merged (see :func:`merge_parts`)."""

    def __init__(self, entry: TensorEntry, part: str) -> None:
        self.entry = entry
        self.part = part  # the part ``entry`` is from
        self.copies: list[Chunk] = []  # every part's every chunk (``every_copy``)
        self.boxes: dict[_Box, tuple[Chunk, str]] = {}  # per box, its first chunk and that chunk's part

    def add(self, part: str, chunks: list[Chunk], *, every_copy: bool) -> None:
        """Merge ``chunks``, the entry's in ``part``: a box met before is read from its first part."""
        if every_copy:
            self.copies += chunks
        for c in chunks:
            self.boxes.setdefault((c.offsets, c.sizes), (c, part))

    def result(self, every_copy: bool) -> tuple[Chunk, ...]:
        """The merged chunks: one per box, or with ``every_copy`` every part's.

        Raises:
            FormatError: Two different boxes overlap, neither holding the whole tensor.
        """
        whole = ((0,) * len(self.entry.shape), self.entry.shape)
        if whole in self.boxes:
            first = self.boxes[whole][0]  # the others hold nothing it lacks
            return tuple(self.copies) if every_copy else (first,)
        found = overlapping(list(self.boxes))
        if found is not None:
            (a, b), key = found, render(self.entry.path)
            raise FormatError(
                f"the chunks of key {key!r} overlap without being copies of one box: "
                f"{list(a[0])} + {list(a[1])} in {self.boxes[a][1]}, {list(b[0])} + {list(b[1])} in "
                f"{self.boxes[b][1]} (no save writes such; a load could not tell which elements it read)",
                file=f"{self.boxes[b][1]}/{MANIFEST_NAME}",
            )
        return tuple(self.copies) if every_copy else tuple(c for c, _ in self.boxes.values())


def overlapping(boxes: list[_Box]) -> tuple[_Box, _Box] | None:
    """Two of ``boxes`` (all different) that share an element, or ``None``.

    A sweep along the first dimension: a box is compared only with those whose rows it meets (shards of
    a tensor split by rows, the usual layout, meet none).
    """
    boxes = [b for b in boxes if all(b[1])]  # (an empty box holds no element to share)
    if len(boxes) < 2 or not boxes[0][1]:
        return None  # (a 0-dimensional tensor has a single box)
    boxes.sort(key=lambda b: b[0][0])
    active: list[_Box] = []
    for box in boxes:
        start = box[0][0]
        active = [a for a in active if a[0][0] + a[1][0] > start]
        for other in active:
            if all(
                o1 < o2 + n2 and o2 < o1 + n1
                for o1, n1, o2, n2 in zip(box[0], box[1], other[0], other[1], strict=True)
            ):
                return other, box
        active.append(box)
    return None


def _check_paths(name: str, m: Manifest) -> None:
    """Refuse a part whose tensor entries are not each at its own key path in the part's tree.

    The merge finds a part's entries by key path and rank 0's tree refers to its entries by index: an
    entry listed under another key (or twice) would be merged into another tensor, or shift the indices
    of rank 0's entries.

    Raises:
        FormatError: Names the part and the key.
    """
    found: dict[KeyPath, int] = {}  # per key path of the tree holding a tensor, its index
    stack: list[tuple[Node, KeyPath]] = [(m.tree, ())]  # (its depth is checked: check_manifest)
    while stack:
        node, path = stack.pop()
        if isinstance(node, DictNode):
            stack += [(v, (*path, k)) for k, v in zip(node.keys, node.values, strict=True)]
        elif isinstance(node, (ListNode, TupleNode)):
            stack += [(v, (*path, i)) for i, v in enumerate(node.items)]
        elif isinstance(node, TensorNode):
            found.setdefault(path, node.index)
    for i, t in enumerate(m.tensors):
        if found.get(t.path) != i:
            key = render(t.path)
            raise FormatError(
                f"{name}/{MANIFEST_NAME} is damaged or forged: its tensor entry {i} says key {key!r}, "
                "where its tree holds " + ("no tensor" if t.path not in found else f"entry {found[t.path]}"),
                file=f"{name}/{MANIFEST_NAME}",
            )
