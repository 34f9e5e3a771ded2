"""Reading a ``torch.save`` file of a state dict (with ``weights_only=True`` unless pickle is allowed)."""

from __future__ import annotations

import pickle
import zipfile
from collections.abc import Mapping
from pathlib import Path

import torch

from .._errors import FormatError, StateError, StorageError
from .._format import Chunk, Manifest, TensorEntry
from .._memory import nbytes_of
from .._tree import dtype_name, flatten, type_name
from ._source import DecodingSource

# A torch.save file is a zip archive, or (legacy format) a pickle opening with torch's magic number.
_ZIP_MAGIC = b"PK\x03\x04"
_LEGACY_MAGIC = b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19"


def is_torch_file(path: Path) -> bool:
    """Whether the regular file ``path`` starts like a ``torch.save`` file. Blocking."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(_LEGACY_MAGIC))
    except OSError:
        return False
    return head.startswith(_ZIP_MAGIC) or head == _LEGACY_MAGIC


def _compressed(path: Path) -> bool:
    """Whether the zip archive ``path`` holds a compressed record (``torch.save`` stores them all). Blocking.

    ``False`` for anything else (a legacy file, an unreadable archive): ``torch.load`` reports those.
    """
    try:
        with zipfile.ZipFile(path) as zf:
            return any(info.compress_type != zipfile.ZIP_STORED for info in zf.infolist())
    except (OSError, zipfile.BadZipFile, ValueError):
        return False


def load_file(path: Path, *, allow_pickle: bool) -> object:
    """``torch.load`` of ``path`` onto the CPU, memory-mapped where the file allows it. Blocking.

    Raises:
        StateError: The file holds objects ``weights_only`` refuses and ``allow_pickle`` is false.
        FormatError: The file is not a ``torch.save`` file.
        StorageError: It cannot be read.
    """
    try:
        if _compressed(path):
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
        if allow_pickle:
            raise FormatError(f"{path} is not a readable torch.save file: {exc}", file=str(path)) from exc
        raise StateError(
            f"{path} holds objects that torch.load(weights_only=True) refuses (loading them can run code): "
            f"pass allow_pickle=True if you trust this file. {str(exc).splitlines()[0]}"
        ) from exc
    except OSError as exc:
        raise StorageError(f"cannot read {path}: {exc.strerror or exc}", path=str(path)) from exc
    except Exception as exc:
        raise FormatError(f"{path} is not a readable torch.save file: {exc}", file=str(path)) from exc


class TorchFileSource(DecodingSource):
    """A ``torch.save`` file of a mapping; matched like a native checkpoint (by nested keys)."""

    def __init__(self, path: Path, *, allow_pickle: bool) -> None:
        self.location = path.parent
        obj = load_file(path, allow_pickle=allow_pickle)
        if not isinstance(obj, Mapping):
            raise FormatError(
                f"{path} holds a {type_name(obj)}, not a state dict (a mapping)", file=str(path)
            )
        flat = flatten(obj, allow_pickle=True)
        self.tensors = flat.tensors
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

    def chunk(self, index: int, number: int) -> torch.Tensor:
        return self.tensors[index]

    def close(self) -> None:
        self.tensors = []
