"""Reading a ``torch.save`` file of a state dict (with ``weights_only=True`` unless pickle is allowed).

The file is loaded with ``torch.load``, memory-mapped where it allows it, and its tensors copied from.
A zip archive (every file since torch 1.6) stores a CRC-32 of each record, which ``torch.load`` never
checks (see ``_torchblob``); here every record a load uses is checked against it:

- ``data.pkl`` and the other small records ``torch.load`` reads (``byteorder``...) when the file is
  opened, before ``torch.load`` unpickles anything: a damaged pickle could fail to unpickle, or unpickle
  into other values;
- the record of each storage a load copies tensors from, before it copies them, in the mapped memory the
  tensors are copied from (see ``_records``), which :func:`_locate` finds the record of. Where it cannot
  tell, and for records no tensor of the tree is a view of (a tensor inside a pickled object), every
  such record is checked, read from the file.

Records saved without CRCs (``torch.serialization.set_crc32_options(False)``: a CRC of 0) and compressed
records (``torch.save`` writes none) cannot be checked, as in DCP blobs. The legacy format has no CRCs.
"""

from __future__ import annotations

import io
import mmap
import os
import pickle
import re
import struct
import sys
import zipfile
import zlib
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any, cast

import anyio
import torch

from .._errors import CorruptionError, FormatError, StateError, StorageError
from .._format import Chunk, Key, KeyPath, Manifest, TensorEntry
from .._fs import open_regular
from .._load._match import Destination
from .._memory import nbytes_of, view_at
from .._tree import a_or_an, dtype_name, flatten, render, type_name
from ._records import Check, check_crcs
from ._source import DecodingSource
from ._torchblob import Record, stored_records

# A torch.save file is a zip archive, or (legacy format) a pickle opening with torch's magic number.
_ZIP_MAGIC = b"PK\x03\x04"
# torch's magic number as the legacy format pickles it first: a LONG1 of 10 bytes. Before it, the pickle's
# PROTO opcode (protocols 2 to 5: torch.save's pickle_protocol) and, from protocol 4, maybe a FRAME opcode
# with its 8-byte length.
_MAGIC_LONG = b"\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19"
_HEAD = 2 + 9 + len(_MAGIC_LONG)


def _starts_legacy(head: bytes) -> bool:
    """Whether ``head`` (a file's first :data:`_HEAD` bytes) starts a legacy ``torch.save`` file."""
    if len(head) < 2 or head[0] != 0x80 or not 2 <= head[1] <= 5:
        return False
    rest = head[2:]
    if head[1] >= 4 and rest[:1] == b"\x95":
        rest = rest[9:]
    return rest.startswith(_MAGIC_LONG)


def is_torch_file(path: Path) -> bool:
    """Whether the regular file ``path`` starts like a ``torch.save`` file. Blocking."""
    try:
        with open(open_regular(path), "rb") as f:  # (a FIFO swapped in since detection would block open)
            head = f.read(_HEAD)
    except OSError:
        return False
    return head.startswith(_ZIP_MAGIC) or _starts_legacy(head)


def load_file(path: Path, *, allow_pickle: bool, compressed: bool = False) -> object:
    """``torch.load`` of ``path`` onto the CPU, memory-mapped where the file allows it. Blocking.

    ``compressed``: the file is a zip archive with a compressed record (``torch.save`` stores them all).

    Raises:
        StateError: The file holds objects ``weights_only`` refuses and ``allow_pickle`` is false.
        CorruptionError: The file starts like a ``torch.save`` file but its archive is broken (truncated,
            say) or its legacy pickle ends early; names the file.
        FormatError: The file is not a ``torch.save`` file.
        StorageError: It cannot be read.
    """
    try:
        if compressed:
            # torch.load(mmap=True) would map a compressed record's bytes as the tensor's, unchecked.
            return torch.load(path, map_location="cpu", weights_only=not allow_pickle)
        try:
            return torch.load(path, map_location="cpu", weights_only=not allow_pickle, mmap=True)
        except RuntimeError as exc:
            if "mmap" not in str(exc):
                raise
            # The legacy (pre-zip) serialization cannot be memory-mapped.
            return torch.load(path, map_location="cpu", weights_only=not allow_pickle)
    except pickle.UnpicklingError as exc:
        if (damage := _damaged(path, exc)) is not None:
            raise damage from exc
        if allow_pickle:
            raise FormatError(f"{path} is not a readable torch.save file: {exc}", file=str(path)) from exc
        raise _refused(path, str(exc)) from exc
    except OSError as exc:
        # torch's zip reader fails on a truncated archive with an OSError (EINVAL, from a seek past its
        # end): damage, told from a read the system refused by zipfile's view of the same file.
        if (damage := _damaged(path, exc)) is not None:
            raise damage from exc
        raise StorageError(f"cannot read {path}: {exc.strerror or exc}", path=str(path)) from exc
    except Exception as exc:
        if (damage := _damaged(path, exc)) is not None:
            raise damage from exc
        raise FormatError(f"{path} is not a readable torch.save file: {exc}", file=str(path)) from exc


# What torch.load says of a zip archive it cannot parse, and of a legacy pickle that ends early.
_BAD_ZIP = "failed reading zip archive"
_EOF = "unexpected EOF"
# What Python's unpickler says of a pickle cut in the middle of an opcode's argument.
_CUT = "pickle data was truncated"


def _damaged(path: Path, exc: BaseException) -> CorruptionError | None:
    """The error for a file ``torch.load`` failed on with ``exc`` where the file itself is broken. Blocking.

    The file was taken for a ``torch.save`` file by how it starts (``is_torch_file``): a zip archive whose
    structure zipfile cannot read (its central directory cut off, say) or that torch's reader calls
    broken, or a legacy pickle that ends early, is such a file damaged, not some other kind of file.
    ``None`` where the failure is another (a refused global, a read error the system reports).
    """
    try:
        with open(open_regular(path), "rb") as f:
            head = f.read(_HEAD)
    except OSError:
        return None
    text = str(exc)
    if head.startswith(_ZIP_MAGIC):
        try:
            with zipfile.ZipFile(path):
                pass
        except zipfile.BadZipFile as bad:
            why = f"is not a valid zip archive (truncated?): {bad}"
        except OSError:
            return None
        else:
            if _BAD_ZIP not in text:
                return None
            why = f"torch cannot read its zip archive: {text.split('. ', 1)[0]}"  # (advice follows)
    elif _starts_legacy(head) and (
        isinstance(exc, EOFError | IndexError | struct.error)
        or _EOF in text
        or _CUT in text
        or not _walks(path)
    ):
        # (A pickle cut short fails in many ways: an opcode's argument cut, read as a refused global...)
        why = "its pickle ends early or is broken (truncated?)"
    else:
        return None
    return CorruptionError(f"{path} is damaged: it starts as a torch.save file, but {why}", file=str(path))


# torch.load(weights_only=True) wraps its unpickler's one-line reason in paragraphs of advice, some in ANSI
# bold. The reason names the global it stopped at ("Unsupported global: GLOBAL numpy.x.y was not an
# allowed global by default", "... GLOBAL posix.system whose module posix is blocked") or, for other
# refusals, follows "WeightsUnpickler error:" or "Weights only load failed.".
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_REFUSED_GLOBAL = re.compile(r"GLOBAL (\S+) (?:was not an allowed global|whose module \S+ is blocked)")
_CAUSE = "WeightsUnpickler error:"
_FAILED = "Weights only load failed."
# Lines of torch's advice, never the reason itself.
_ADVICE = (
    "This file can still be loaded",
    "(1)",
    "(2)",
    "In PyTorch",
    "Please file an issue",
    "Check the doc",
)
_MAX_REASON = 300
# torch's weights-only unpickler knows no FRAME opcode (149, 0x95), which protocols 4 and 5 start with.
_FRAMED = re.compile(r"\bUnsupported operand 149\b")
# data.pkl holds only the structure (a few hundred bytes per tensor): a larger one is not walked.
_MAX_PICKLE = 1 << 28


def _reason(message: str) -> tuple[str | None, str]:
    """The global ``torch.load`` refused (``None`` if another rule), and its reason as one clean line."""
    text = _ANSI.sub("", message)
    m = _REFUSED_GLOBAL.search(text)
    if m is not None:
        blocked = "whose module" in m.group(0)
        return m.group(1), f"{m.group(1)} is {'of a blocked module' if blocked else 'not an allowed global'}"
    if _CAUSE in text:
        text = text.rsplit(_CAUSE, 1)[1]
    for line in text.splitlines():
        line = line.strip().removeprefix(_FAILED).strip()
        if line and not line.startswith(_ADVICE):
            return None, line if len(line) <= _MAX_REASON else line[: _MAX_REASON - 3] + "..."
    return None, "torch.load gave no reason"


def _refused(path: Path, message: str) -> StateError:
    """The error for a file ``torch.load(weights_only=True)`` refused with ``message``: one line.

    It names the file, the global refused (or torch's reason) and, where the file's pickle can be walked
    (:func:`_holders`), the keys of the values that need that global.
    """
    name, reason = _reason(message)
    if _FRAMED.search(reason):
        return StateError(
            f"{path} is pickled with protocol 4 or 5, whose framing torch.load(weights_only=True) cannot "
            f"read ({reason}): pass allow_pickle=True (--allow-pickle on the command line) if you trust "
            "this file, or save it again with torch.save's default protocol"
        )
    paths = _holders(path, name) if name is not None else []
    keys = [render(p) for p in paths]
    if not keys:
        what = "objects"
    elif len(keys) == 1:
        what = f"an object at key {keys[0]!r}"
    else:
        shown = ", ".join(repr(k) for k in keys[:5])
        what = f"objects at keys {shown}" + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")
    return StateError(
        f"{path} holds {what} that torch.load(weights_only=True) refuses ({reason}; unpickling it can run "
        "code): pass allow_pickle=True (--allow-pickle on the command line) if you trust this file",
        key=keys[0] if keys else None,
    )


class _Stub:
    """What a global of a pickle stands for while :func:`_holders` walks it: a record, never a call.

    Every global resolves to a subclass named after it; calling one (REDUCE, NEWOBJ, INST) makes an
    instance keeping the arguments, and what the pickle then hands it (state, items, appended values) is
    kept too, under the key or index it came with, so the walk can descend through it.
    """

    name = ""
    parts: list[tuple[Key | None, object]]  # (key or index, value); None: an argument or state
    appended: int

    def __new__(cls, *args: object, **kwargs: object) -> _Stub:
        self = super().__new__(cls)
        self.parts = [(None, a) for a in (*args, *kwargs.values())]
        self.appended = 0
        return self

    def __call__(self, *args: object, **kwargs: object) -> _Stub:
        return type(self)(*args, **kwargs)

    def __setstate__(self, state: object) -> None:
        self.parts.append((None, state))

    def __setitem__(self, key: object, value: object) -> None:
        self.parts.append((_key(key), value))

    def append(self, value: object) -> None:
        self.parts.append((self.appended, value))
        self.appended += 1

    def extend(self, values: list[object]) -> None:
        for v in values:
            self.append(v)


def _key(key: object) -> Key:
    return key if type(key) in (str, int) else repr(key)  # type: ignore[return-value]


class _StubUnpickler(pickle.Unpickler):
    """Unpickles anything without importing or calling any of it: every global becomes a :class:`_Stub`."""

    def __init__(self, file: io.BytesIO | mmap.mmap) -> None:
        super().__init__(file)
        self.stubs: dict[str, type[_Stub]] = {}

    def find_class(self, module: str, name: str) -> Any:
        full = f"{module}.{name}"
        if full not in self.stubs:
            self.stubs[full] = cast("type[_Stub]", type("_Global", (_Stub,), {"name": full}))
        return self.stubs[full]

    def persistent_load(self, pid: Any) -> Any:
        return _Stub()  # a tensor's storage


def _walks(path: Path) -> bool:
    """Whether the pickles of the ``torch.save`` file ``path`` can be walked (see :func:`_structure`)."""
    try:
        _structure(path)
    except Exception:
        return False
    return True


def _structure(path: Path) -> object:
    """The structure of the ``torch.save`` file ``path`` as :class:`_StubUnpickler` makes it. Blocking.

    Only the pickle is read, never the tensor data: a zip archive's ``data.pkl``, or the fourth pickle of a
    legacy file (after its magic number, protocol version and system info).

    Raises:
        Exception: Anything, for a file that cannot be walked so.
    """
    with open(path, "rb") as f:
        if f.read(len(_ZIP_MAGIC)) != _ZIP_MAGIC:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                for _ in range(3):
                    _StubUnpickler(m).load()
                return _StubUnpickler(m).load()
    with zipfile.ZipFile(path) as zf:
        (info,) = [
            i for i in zf.infolist() if i.filename.endswith("/data.pkl") and i.filename.count("/") == 1
        ]
        if info.file_size > _MAX_PICKLE:
            raise ValueError(f"data.pkl of {info.file_size} bytes")
        return _StubUnpickler(io.BytesIO(zf.read(info))).load()


def _holders(path: Path, name: str) -> list[KeyPath]:
    """The key paths of the values of the ``torch.save`` file ``path`` that need the global ``name``.

    In pickle order: the first is where ``torch.load`` stopped. Found by walking the file's structure as
    :class:`_StubUnpickler` makes it (:func:`_structure`), which runs no code of the file. Best effort and
    blocking: empty for a file that cannot be walked.
    """
    # torch names builtins without their module ("set" for builtins.set).
    wanted = {name, f"builtins.{name}"}
    try:
        root = _structure(path)
    except Exception:  # a damaged or foreign file: only the keys go unnamed
        return []
    found: list[KeyPath] = []
    seen: set[int] = set()
    stack: list[tuple[object, KeyPath]] = [(root, ())]
    while stack:  # depth first, in pickle order, without recursion (a pickle may nest deeply)
        obj, at = stack.pop()
        if isinstance(obj, type) and issubclass(obj, _Stub):
            if obj.name in wanted:
                found.append(at)
            continue
        if id(obj) in seen:
            continue
        children: list[tuple[object, KeyPath]] = []
        if isinstance(obj, _Stub):
            seen.add(id(obj))
            if type(obj).name in wanted:
                found.append(at)
                continue
            children = [(v, at if k is None else (*at, k)) for k, v in obj.parts]
        elif isinstance(obj, dict):
            seen.add(id(obj))
            children = [(v, (*at, _key(k))) for k, v in obj.items()]
        elif isinstance(obj, (list, tuple)):
            seen.add(id(obj))
            children = [(v, (*at, i)) for i, v in enumerate(obj)]
        stack.extend(reversed(children))
    return found


# Non-storage records are checked in reads of at most this many bytes.
_READ = 8 << 20
# The most candidate shifts :func:`_base` verifies; more means the storages fit the records several ways.
_MAX_SHIFTS = 8


def _archive(path: Path) -> tuple[list[Record], bool] | None:
    """The stored records of the ``torch.save`` archive ``path`` and whether it has compressed ones.

    ``None`` for a file that does not start like a zip archive (the legacy format) or that zipfile cannot
    read: ``torch.load`` reports those. Blocking.
    """
    try:
        with open(path, "rb") as f:
            if f.read(len(_ZIP_MAGIC)) != _ZIP_MAGIC:
                return None
    except OSError:
        return None
    return stored_records(path)


def _is_storage(record: Record) -> bool:
    """Whether ``record`` holds a storage's bytes (``<archive>/data/<key>``), not the pickle or metadata."""
    parts = record.name.split("/")
    return len(parts) == 3 and parts[1] == "data"


def _check_metadata(path: Path, records: list[Record]) -> bytes:
    """Check every record but the storages' (``data.pkl``, ``byteorder``...) against its CRC-32. Blocking.

    Returns:
        The content of the ``byteorder`` record (``b""`` if there is none).

    Raises:
        CorruptionError: A record does not match its CRC-32; names the record and the file.
        StorageError: The file cannot be read.
    """
    order = b""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise StorageError(f"cannot read {path}: {exc.strerror or exc}", path=str(path)) from exc
    try:
        for record in records:
            if _is_storage(record):
                continue
            crc, end = 0, record.offset + record.nbytes
            for at in range(record.offset, end, _READ):
                data = os.pread(fd, min(_READ, end - at), at)
                crc = zlib.crc32(data, crc)
            if record.crc and crc != record.crc:
                raise CorruptionError(
                    f"checksum mismatch in {path}: its zip record {record.name!r} (bytes {record.offset}.."
                    f"{end}) does not match its CRC-32",
                    file=str(path),
                )
            if record.name.count("/") == 1 and record.name.endswith("/byteorder"):
                order = os.pread(fd, min(record.nbytes, 16), record.offset)
    except OSError as exc:
        raise StorageError(f"cannot read {path}: {exc.strerror or exc}", path=str(path)) from exc
    finally:
        os.close(fd)
    return order


def _swapped(order: bytes) -> bool:
    """Whether ``torch.load`` swaps the bytes of a file whose ``byteorder`` record holds ``order``."""
    if not order:  # (an old file: torch.load's default load endianness decides)
        endianness = torch.serialization.get_default_load_endianness()
        if endianness == torch.serialization.LoadEndianness.NATIVE:
            return False
        order = b"big" if endianness == torch.serialization.LoadEndianness.BIG else b"little"
    return order != sys.byteorder.encode()


def _locate(tensors: list[torch.Tensor], data: list[Record]) -> list[tuple[Record, int] | None] | None:
    """The record each tensor's storage was memory-mapped from, and the storage's address. Blocking.

    ``torch.load(mmap=True)`` maps the whole file and makes each storage the slice of the mapping that
    holds its record's bytes, so a storage's address less the mapping's is its record's offset. The
    mapping's address is not exposed: it is the one shift that takes every storage to the start of a
    record of its size (``torch.save`` writes each storage as one record of exactly its bytes), among
    those that do so for the lowest and the highest storage. A tensor without bytes or storage (a meta
    tensor, a wrapper subclass) has no record (``None``). The result is ``None`` when no shift or several
    do so: a storage was not mapped from the file (a compressed archive, a tensor rebuilt from data in the
    pickle), or the storages fit the records several ways (a few of many records of one size).

    Args:
        tensors: The loaded tensors.
        data: The file's stored, non-empty storage records.
    """
    spans: dict[int, int] = {}  # address -> bytes, of each storage
    where: list[int | None] = []
    for t in tensors:
        address = None
        try:
            storage = t.untyped_storage() if t.is_cpu else None
        except (RuntimeError, NotImplementedError):  # (a tensor subclass with no storage of its own)
            storage = None
        if storage is not None and storage.nbytes():
            address, nbytes = storage.data_ptr(), storage.nbytes()
            if spans.setdefault(address, nbytes) != nbytes:
                return None
        where.append(address)
    if not spans:
        return [None] * len(tensors)
    base = _base(spans, data)
    if base is None:
        return None
    at = {r.offset: r for r in data}
    return [None if a is None else (at[a - base], a) for a in where]


def _base(spans: dict[int, int], data: list[Record]) -> int | None:
    """The one shift that takes every storage (address -> bytes) to a record of its size (see ``_locate``)."""
    low, high = min(spans), max(spans)
    shifts = {low - r.offset for r in data if r.nbytes == spans[low]}
    shifts &= {high - r.offset for r in data if r.nbytes == spans[high]}
    if len(shifts) > _MAX_SHIFTS:
        return None
    sizes = {r.offset: r.nbytes for r in data}
    # (Highest first: a wrong shift of regularly laid out records fails at the end of the file.)
    ordered = sorted(spans.items(), reverse=True)
    fits = [s for s in shifts if all(sizes.get(a - s) == n for a, n in ordered)]
    return fits[0] if len(fits) == 1 else None


class TorchFileSource(DecodingSource):
    """A ``torch.save`` file of a mapping; matched like a native checkpoint (by nested keys).

    Its records are checked against their CRC-32 (see the module docstring): the metadata when it is
    opened, the storages a load copies tensors from in :meth:`fill`, before they are copied.
    """

    def __init__(self, path: Path, *, allow_pickle: bool) -> None:
        self.location = path.parent
        self.file = path.name
        archive = _archive(path)
        records, compressed = archive if archive is not None else ([], False)
        self.swapped = _swapped(_check_metadata(path, records)) if records else False
        obj = load_file(path, allow_pickle=allow_pickle, compressed=compressed)
        if not isinstance(obj, Mapping):
            raise FormatError(
                f"{path} holds {a_or_an(type_name(obj))}, not a state dict (a mapping)", file=str(path)
            )
        try:
            flat = flatten(obj, allow_pickle=True)
        except StateError as exc:  # (its words are a save's: the file it is read from is named here)
            raise StateError(f"{path} holds what aiockpt cannot read: {exc}", key=exc.key) from exc
        self.tensors = flat.tensors
        data = [r for r in records if r.nbytes and _is_storage(r)]
        located = _locate(flat.tensors, data) if data else None
        # Each tensor's storage record and address (see ``_locate``), and the records none of them is
        # known to be read from: a tensor's inside a pickled object, or all of them where none is known.
        self.located = located if located is not None else [None] * len(flat.tensors)
        held = {found[0].offset for found in self.located if found is not None}
        self.unheld = [r for r in data if r.crc and r.offset not in held]
        self.checked = any(r.crc for r in data)  # (not a legacy file, nor one saved without CRCs)
        entries = []
        for t, key in zip(flat.tensors, flat.paths, strict=True):
            shape = tuple(t.shape)
            chunk = Chunk(
                offsets=(0,) * len(shape),
                sizes=shape,
                file=path.name,
                offset=0,
                nbytes=nbytes_of(t),
                checksums=(),
            )
            entries.append(TensorEntry(path=key, dtype=dtype_name(t.dtype), shape=shape, chunks=(chunk,)))
        self.manifest = Manifest(
            checksum_algorithm="none",
            checksum_block=1 << 62,
            tree=flat.tree,
            tensors=tuple(entries),
            files=(),
            library_version="torch.save",
        )

    async def fill(
        self,
        manifest: Manifest,
        destinations: dict[int, Destination],
        *,
        threads: int,
        limiter: anyio.CapacityLimiter | None,
    ) -> None:
        """Check the records the destinations are filled from, then copy the tensors into them.

        Raises:
            CorruptionError: A record does not match its CRC-32; names the key (or the record) and the file.
            StorageError: The file cannot be read.
        """
        if self.checked and (destinations or self.unheld):
            await check_crcs(
                self.location, partial(self._checks, destinations), threads=threads, limiter=limiter
            )
        await super().fill(manifest, destinations, threads=threads, limiter=limiter)

    def _checks(self, destinations: Mapping[int, Destination]) -> list[Check]:
        """The checks of the records ``destinations`` are filled from, and of the unheld ones. Blocking.

        Each record once, named by the first key read from it, in file order. Checked in the mapped
        memory the tensors are copied from, unless ``torch.load`` swapped its bytes there.
        """
        tensors = self.manifest.tensors
        found: dict[int, Check] = {}
        for index in destinations:
            at = self.located[index]
            if at is None or not at[0].crc or at[0].offset in found:
                continue
            record, address = at
            view = None if self.swapped else view_at(address, record.nbytes)
            found[record.offset] = Check(
                tensors[index].path, self.file, record.offset, record.nbytes, record.crc, view
            )
        for r in self.unheld:
            found[r.offset] = Check(None, self.file, r.offset, r.nbytes, r.crc, None, name=r.name)
        return sorted(found.values(), key=lambda c: c.offset)

    def chunk(self, index: int, number: int) -> torch.Tensor:
        return self.tensors[index]

    def close(self) -> None:
        self.tensors = []
