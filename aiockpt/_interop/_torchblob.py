"""Finding the raw bytes of a tensor inside a ``torch.save`` blob, so they can be read in place.

``torch.save`` writes a zip archive (stored, not compressed) whose ``data.pkl`` rebuilds the tensor with
``torch._utils._rebuild_tensor_v2(storage, storage_offset, size, stride, ...)`` and whose ``data/<key>``
record holds the storage's bytes, 64-byte aligned. When the storage is exactly the tensor's elements in
row-major order (what DCP writes for every contiguous chunk: it clones views first), the record *is* the
chunk's raw bytes, and the native reader can read it straight into destination memory.

``data.pkl`` is read by an unpickler that knows only the names of that one recipe and calls nothing; any
other content means "not a plain tensor", and the caller decodes the blob with ``torch.load`` instead.
The storage's class (``torch.FloatStorage``...) names its element type: a record is only taken as raw
bytes of the dtype the caller expects (a forged DCP ``.metadata`` could otherwise have a bool chunk's
bytes read as int8, where ``torch.load`` would report the mismatch).

Every record's CRC-32 (zlib's) is in the archive's central directory, computed by ``torch.save`` unless
``torch.serialization.set_crc32_options(False)`` told it not to: then every CRC is 0, and nothing can be
checked. ``torch.load`` checks none of them. Here ``data.pkl`` is checked before it is trusted (a
damaged one means "not plain"), and the data record's CRC is handed to the caller, which checks it once
the record is read (see ``_records``); :func:`damaged_record` checks a whole blob before it is decoded.
:func:`stored_records` lists where the records of a whole ``torch.save`` file lie, for ``_torchfile``.
Compressed records (``torch.save`` writes none; a hand-made archive may hold some) are never checked.
"""

from __future__ import annotations

import collections
import io
import math
import os
import pickle
import struct
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

from .._fs import open_regular

_LOCAL_HEADER = struct.Struct("<4s5H3L2H")  # zip local file header: 30 bytes, then name and extra field


class _Window(io.RawIOBase):
    """A read-only, seekable view of bytes ``[start, start + length)`` of an open file (by ``pread``)."""

    def __init__(self, fd: int, start: int, length: int) -> None:
        self.fd, self.start, self.length, self.pos = fd, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self.pos, os.SEEK_END: self.length}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buffer: Any) -> int:
        n = max(0, min(len(buffer), self.length - self.pos))
        data = os.pread(self.fd, n, self.start + self.pos) if n else b""
        buffer[: len(data)] = data
        self.pos += len(data)
        return len(data)


# The typed storage classes ``_rebuild_tensor_v2`` recipes name, by the dtype of their elements. (Other
# dtypes are saved through ``_rebuild_tensor_v3`` and an untyped storage: never taken as plain here.)
_STORAGE_DTYPES = {
    "DoubleStorage": torch.float64,
    "FloatStorage": torch.float32,
    "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ShortStorage": torch.int16,
    "CharStorage": torch.int8,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
    "ComplexDoubleStorage": torch.complex128,
    "ComplexFloatStorage": torch.complex64,
}


@dataclass(frozen=True)
class _StorageType:
    """Stands for a ``torch.<X>Storage`` class: only its element dtype reaches the persistent id."""

    dtype: torch.dtype


@dataclass(frozen=True)
class _Stored:
    """A storage the pickle refers to: its record's key and its element dtype."""

    key: str
    dtype: torch.dtype


@dataclass(frozen=True)
class _Rebuild:
    key: str
    dtype: torch.dtype
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


class _NotPlain(Exception):
    pass


def _rebuild(
    storage: object,
    storage_offset: object,
    size: object,
    stride: object,
    requires_grad: object = False,
    hooks: object = None,
    metadata: object = None,
    *_: object,
) -> _Rebuild:
    # ``metadata`` holds lazy flags of the saved view ({"conj": True}, {"neg": True}): its stored bytes are
    # the un-conjugated, un-negated ones, so only ``torch.load`` (which applies them) gives its values.
    if metadata or not (
        isinstance(storage, _Stored)
        and type(storage_offset) is int
        and isinstance(size, tuple)
        and isinstance(stride, tuple)
        and all(type(s) is int for s in (*size, *stride))
    ):
        raise _NotPlain
    return _Rebuild(storage.key, storage.dtype, storage_offset, size, stride)


class _PlainTensorUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(_STORAGE_DTYPES[name])
        raise _NotPlain

    def persistent_load(self, pid: Any) -> Any:
        if (
            isinstance(pid, tuple)
            and len(pid) == 5
            and pid[0] == "storage"
            and isinstance(pid[1], _StorageType)
            and isinstance(pid[2], str)
        ):
            return _Stored(pid[2], pid[1].dtype)
        raise _NotPlain


def _row_major(size: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    expected = 1
    for n, s in zip(reversed(size), reversed(stride), strict=True):
        if n > 1 and s != expected:
            return False
        expected *= n
    return True


class Raw(NamedTuple):
    """Where a tensor's raw bytes lie in a file, and the CRC-32 of their zip record (0: none computed)."""

    offset: int
    crc: int


def _data_start(f: io.RawIOBase | io.BufferedIOBase, info: zipfile.ZipInfo, length: int) -> int | None:
    """Where the bytes of the stored record ``info`` start in ``f``, if all of them lie in its ``length``."""
    f.seek(info.header_offset)
    header = f.read(_LOCAL_HEADER.size)
    if header is None or len(header) != _LOCAL_HEADER.size or header[:4] != b"PK\x03\x04":
        return None
    name_len, extra_len = _LOCAL_HEADER.unpack(header)[-2:]
    data = info.header_offset + _LOCAL_HEADER.size + int(name_len) + int(extra_len)
    return data if data + info.file_size <= length else None


def _record(window: _Window, info: zipfile.ZipInfo) -> bytes | None:
    """The bytes of the stored record ``info``, if they match its CRC-32 (unless 0). Blocking.

    Read by hand, not by ``ZipFile.read``: that refuses the CRC of 0 of an archive saved without CRCs.
    ``None`` for a compressed record (``torch.save`` writes none; one could inflate to any size).
    """
    if info.compress_type != zipfile.ZIP_STORED:
        return None
    at = _data_start(window, info, window.length)
    if at is None:
        return None
    data = os.pread(window.fd, info.file_size, window.start + at)
    return None if info.CRC and zlib.crc32(data) != info.CRC else data


def raw_location(fd: int, start: int, length: int, sizes: tuple[int, ...], dtype: torch.dtype) -> Raw | None:
    """Where the raw row-major bytes of the tensor saved at ``[start, +length)`` lie, with their CRC-32.

    Found only for a tensor of ``sizes`` and ``dtype``, as the metadata says it is.

    ``None`` when the blob is anything else (another dtype or layout, a storage larger than the tensor, a
    big-endian file, an unexpected recipe, a ``data.pkl`` that fails its CRC-32): the caller then decodes
    it with ``torch.load``, after :func:`damaged_record`. Blocking.
    """
    window = _Window(fd, start, length)
    try:
        with zipfile.ZipFile(window) as zf:
            pkl = next((n for n in zf.namelist() if n.endswith("/data.pkl")), None)
            if pkl is None:
                return None
            prefix = pkl[: -len("data.pkl")]
            order = f"{prefix}byteorder"
            if order in zf.namelist() and _record(window, zf.getinfo(order)) != b"little":
                return None
            pickled = _record(window, zf.getinfo(pkl))
            if pickled is None:
                return None
            found = _PlainTensorUnpickler(io.BytesIO(pickled)).load()
            if not isinstance(found, _Rebuild):
                return None
            info = zf.getinfo(f"{prefix}data/{found.key}")
        nbytes = math.prod(sizes) * dtype.itemsize
        if (
            found.dtype != dtype
            or found.size != sizes
            or len(found.stride) != len(sizes)
            or found.storage_offset != 0
            or not _row_major(found.size, found.stride)
            or info.compress_type != zipfile.ZIP_STORED
            or info.file_size != nbytes
        ):
            return None
        data = _data_start(window, info, length)
        return None if data is None else Raw(start + data, info.CRC)
    except Exception:  # anything unexpected: the caller decodes the blob with torch.load, which checks it
        return None


def damaged_record(blob: bytes) -> str | None:
    """The name of the first stored record of the zip archive ``blob`` whose bytes fail its CRC-32.

    Records whose CRC is 0 (saved without CRCs) are not checked, nor are compressed ones (``torch.save``
    writes none). ``None`` also when ``blob`` is no archive this can walk: ``torch.load`` reports that.
    Blocking.
    """
    f = io.BytesIO(blob)
    try:
        with zipfile.ZipFile(f) as zf:
            infos = zf.infolist()
        for info in infos:
            if info.CRC and info.compress_type == zipfile.ZIP_STORED:
                at = _data_start(f, info, len(blob))
                if at is not None and zlib.crc32(memoryview(blob)[at : at + info.file_size]) != info.CRC:
                    return info.filename
    except Exception:  # not an archive zipfile reads: torch.load reports it
        return None
    return None


class Record(NamedTuple):
    """A stored record of a zip archive: its name, where its bytes lie in the file, and their CRC-32."""

    name: str
    offset: int
    nbytes: int
    crc: int  # 0: saved without CRCs


def stored_records(path: Path) -> tuple[list[Record], bool] | None:
    """The stored records of the zip archive ``path``, by offset, and whether it has compressed ones.

    A record whose bytes do not all lie in the file is left out. ``None`` when ``path`` is no archive
    zipfile reads (``torch.load`` reports that). Blocking.
    """
    try:
        with open(open_regular(path), "rb", buffering=0) as f:  # (a local header: one read of 30 bytes)
            length = os.fstat(f.fileno()).st_size
            with zipfile.ZipFile(f) as zf:
                infos = zf.infolist()
            records: list[Record] = []
            compressed = False
            for info in infos:
                if info.compress_type != zipfile.ZIP_STORED:
                    compressed = True
                    continue
                at = _data_start(f, info, length)
                if at is not None:
                    records.append(Record(info.filename, at, info.file_size, info.CRC))
    except Exception:  # not an archive zipfile reads (or not readable): torch.load reports it
        return None
    records.sort(key=lambda r: r.offset)
    return records, compressed
