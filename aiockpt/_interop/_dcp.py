"""Reading ``torch.distributed.checkpoint`` (DCP) directories written by its ``FileSystemWriter``.

Layout (torch 2.x, ``torch/distributed/checkpoint/filesystem.py``): ``.metadata`` is a pickled
``Metadata`` whose ``state_dict_metadata`` maps each flat name (FQN) to a ``TensorStorageMetadata`` (dtype,
global size, chunk boxes) or a ``BytesStorageMetadata``, whose ``storage_data`` maps
``MetadataIndex(fqn, chunk offsets)`` to ``_StorageInfo(relative_path, offset, length,
transform_descriptors)``, and whose ``planner_data`` maps each FQN to its original key path. Every tensor
chunk and every bytes item is a ``torch.save`` blob at ``[offset, offset + length)`` of a ``*.distcp``
file, written by whichever rank held it.

A tensor chunk's blob normally holds its elements as one stored, row-major zip record: those chunks are
read by the native reader straight into destination memory (``_torchblob`` finds the record), then
checked against the record's CRC-32 (``_records``). Chunks saved otherwise (a channels-last layout, say)
are decoded whole and copied into place, once every record of their blob matched its CRC-32; so are
values. Records saved without CRCs (``torch.serialization.set_crc32_options(False)``: their CRC is 0)
cannot be checked.

Safety: ``.metadata`` is decoded by an unpickler that resolves only the classes such a file needs, so an
untrusted checkpoint cannot run code; blobs are decoded with ``torch.load(weights_only=True)``. Only
``allow_pickle=True`` lifts both restrictions.
"""

from __future__ import annotations

import io
import math
import os
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import anyio
import torch

from .._errors import CorruptionError, FormatError, StateError, StorageError
from .._format import MAX_READ_DEPTH, Chunk, KeyPath, Manifest, Node, PickleNode, TensorEntry, TensorNode
from .._fs import open_regular, read_regular
from .._load._manifest import MAX_BYTES, box_inside, dtype_itemsize
from .._load._match import Destination
from .._load._read import read_into
from .._tree import a_or_an, dtype_name
from ._names import tree_of, value_node
from ._records import check_records
from ._source import DecodingSource
from ._torchblob import Raw, damaged_record, raw_location

METADATA_NAME = ".metadata"
# Only the block size the native reader splits large chunks by (DCP's checksums are the records' CRC-32,
# checked by ``_records``, not by the reader).
_BLOCK = 4 << 20

_DCP = "torch.distributed.checkpoint"
# Every global a FileSystemWriter's .metadata refers to (dataclasses, torch.Size, dtypes, the layout
# lookup, the pathlib class of StorageMeta.checkpoint_id), and harmless builtins older writers used.
_ALLOWED = frozenset(
    {
        *(
            (f"{_DCP}.metadata", name)
            for name in (
                "Metadata",
                "MetadataIndex",
                "TensorStorageMetadata",
                "BytesStorageMetadata",
                "ChunkStorageMetadata",
                "TensorProperties",
                "StorageMeta",
                "_MEM_FORMAT_ENCODING",
            )
        ),
        (f"{_DCP}.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        *(
            (module, name)
            for module in ("pathlib", "pathlib._local")
            for name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path")
        ),
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
    }
)


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, name: Path) -> None:
        super().__init__(file)
        self.name = name

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise FormatError(
            f"{self.name} refers to {module}.{name}, which DCP metadata never holds; refusing to unpickle "
            "it (it could run code). Pass allow_pickle=True only if you trust this checkpoint",
            file=str(self.name),
        )

    def persistent_load(self, pid: Any) -> Any:
        raise FormatError(
            f"{self.name} holds a persistent reference; it is not DCP metadata", file=str(self.name)
        )


def read_metadata(directory: Path, *, allow_pickle: bool) -> Any:
    """Decode ``directory/.metadata`` (restricted unless ``allow_pickle``). Blocking.

    Raises:
        CorruptionError: The file's pickle ends early (truncated).
        FormatError: The file refers to a class DCP metadata never holds, or is not DCP metadata.
        StorageError: The file cannot be read.
    """
    from torch.distributed.checkpoint.metadata import Metadata

    file = directory / METADATA_NAME
    try:
        raw = read_regular(file)
    except OSError as exc:
        raise StorageError(f"cannot read {file}: {exc.strerror or exc}", path=str(file)) from exc
    try:
        md = pickle.loads(raw) if allow_pickle else _MetadataUnpickler(io.BytesIO(raw), file).load()
    except FormatError:
        raise
    except Exception as exc:
        if isinstance(exc, EOFError) or "truncated" in str(exc):  # (Python's words for a pickle cut short)
            raise CorruptionError(
                f"{file} is damaged: its pickle ends early (truncated?)", file=str(file)
            ) from exc
        raise FormatError(f"{file} is not readable DCP metadata: {exc}", file=str(file)) from exc
    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict):
        raise FormatError(f"{file} holds {a_or_an(type(md).__name__)}, not DCP Metadata", file=str(file))
    if not isinstance(md.storage_data, dict):
        raise FormatError(f"{file} has no storage data: not written by a FileSystemWriter", file=str(file))
    return md


class DcpSource(DecodingSource):
    """A DCP checkpoint directory (see the module docstring)."""

    def __init__(self, directory: Path, *, allow_pickle: bool) -> None:
        self.location = directory
        self.data = directory
        self.allow_pickle = allow_pickle
        # Where each chunk's torch.save blob is: (file, offset, length), by (tensor index, chunk number).
        self.blobs: dict[tuple[int, int], tuple[str, int, int]] = {}
        # Tensors with a chunk whose blob is not plain raw bytes: decoded with torch.load.
        self.decoded: set[int] = set()
        # The CRC-32 of each plain chunk's record, by (tensor index, chunk number); 0s left out.
        self.crcs: dict[tuple[int, int], int] = {}
        self._fds: dict[str, int | None] = {}
        md = read_metadata(directory, allow_pickle=allow_pickle)
        self.paths = _paths(md.planner_data)
        try:
            names, tensors = self._translate(md)
        except (AttributeError, TypeError, ValueError, KeyError) as exc:
            self.close()
            file = directory / METADATA_NAME
            raise FormatError(f"{file} is malformed DCP metadata: {exc!r}", file=str(file)) from exc
        except BaseException:
            self.close()
            raise
        self.close()
        self.names = names
        self.manifest = Manifest(
            checksum_algorithm="none",
            checksum_block=_BLOCK,
            tree=tree_of(names, self.paths),
            tensors=tuple(tensors),
            files=(),
            library_version=f"dcp {md.version or ''}".strip(),
        )

    def _translate(self, md: Any) -> tuple[dict[str, Node], list[TensorEntry]]:
        """Each FQN as a node (a tensor index, or the decoded value of a bytes item), and the tensors."""
        from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

        names: dict[str, Node] = {}
        tensors: list[TensorEntry] = []
        for fqn, item in md.state_dict_metadata.items():
            if not isinstance(fqn, str):
                raise TypeError(f"key {fqn!r} is not a str")
            if isinstance(item, TensorStorageMetadata):
                index = len(tensors)
                dtype = self._tensor_dtype(fqn, item)
                itemsize = dtype.itemsize
                chunks = []
                for number, c in enumerate(item.chunks):
                    info = self._info(md.storage_data, MetadataIndex(fqn, c.offsets), fqn)
                    sizes = tuple(c.sizes)
                    self.blobs[index, number] = (info.relative_path, info.offset, info.length)
                    raw = self._raw(info.relative_path, info.offset, info.length, sizes, dtype)
                    if raw is None:
                        self.decoded.add(index)
                    elif raw.crc:
                        self.crcs[index, number] = raw.crc
                    chunks.append(
                        Chunk(
                            offsets=tuple(c.offsets),
                            sizes=sizes,
                            file=info.relative_path,
                            offset=info.offset if raw is None else raw.offset,
                            nbytes=info.length if raw is None else math.prod(sizes) * itemsize,
                            checksums=(),
                        )
                    )
                names[fqn] = TensorNode(index=index)
                tensors.append(
                    TensorEntry(
                        path=(fqn,),
                        dtype=dtype_name(dtype),
                        shape=tuple(item.size),
                        chunks=tuple(chunks),
                    )
                )
            else:
                info = self._info(md.storage_data, MetadataIndex(fqn), fqn)
                names[fqn] = self._value(fqn, info)
        return names, tensors

    def _tensor_dtype(self, fqn: str, item: Any) -> torch.dtype:
        """The dtype of the tensor ``fqn``, once its metadata is found sound.

        Everything the readers allocate or index by is checked here, as ``check_manifest`` checks aiockpt's
        own manifests: a dtype with a byte layout, a shape of non-negative ints of at most 2^63 - 1 bytes,
        and chunk boxes of its rank that lie inside it. (A box outside the shape would be read into
        nothing, leaving the elements it stands for unread.)

        Raises:
            FormatError: Names the key and ``.metadata``.
        """
        file = self.location / METADATA_NAME
        dtype: torch.dtype = item.properties.dtype
        shape = tuple(item.size)
        problem = None
        if not isinstance(dtype, torch.dtype) or not dtype_itemsize(dtype_name(dtype)):
            problem = f"dtype {dtype}, which aiockpt does not read"
        elif not all(type(n) is int and n >= 0 for n in shape):
            problem = f"shape {list(shape)}"
        elif math.prod(shape) * dtype.itemsize > MAX_BYTES:
            problem = f"shape {list(shape)}, too large"
        else:
            for c in item.chunks:
                offsets, sizes = tuple(c.offsets), tuple(c.sizes)
                ints = all(type(n) is int for n in (*offsets, *sizes))
                if not (ints and box_inside(offsets, sizes, shape)):
                    problem = f"a chunk box {list(offsets)} + {list(sizes)} outside the shape {list(shape)}"
                    break
        if problem is not None:
            raise FormatError(f"{file} is damaged or forged: tensor {fqn!r} has {problem}", file=str(file))
        return dtype

    def _info(self, storage_data: Mapping[Any, Any], index: Any, fqn: str) -> Any:
        from torch.distributed.checkpoint.filesystem import _StorageInfo

        info = storage_data.get(index)
        file = self.location / METADATA_NAME
        if not isinstance(info, _StorageInfo):
            raise FormatError(f"{file} lists {fqn!r} but says nowhere where it is stored", file=str(file))
        if not (
            isinstance(info.relative_path, str)
            and type(info.offset) is int
            and type(info.length) is int
            and 0 <= info.offset <= MAX_BYTES - info.length
            and info.length >= 0
        ):
            raise FormatError(f"{file} gives {fqn!r} an invalid location {info!r}", file=str(file))
        if info.transform_descriptors:
            raise FormatError(
                f"{fqn!r} in {self.location} is stored with transforms {list(info.transform_descriptors)} "
                "(a DCP extension such as compression), which aiockpt does not read",
                file=str(file),
            )
        if os.path.isabs(info.relative_path) or ".." in Path(info.relative_path).parts:
            raise FormatError(f"{file} points {fqn!r} outside the checkpoint: {info.relative_path!r}")
        return info

    def _raw(
        self, file: str, offset: int, length: int, sizes: tuple[int, ...], dtype: torch.dtype
    ) -> Raw | None:
        """Where the chunk's raw bytes start, if its blob holds them plainly (see ``_torchblob``)."""
        if file not in self._fds:
            try:
                self._fds[file] = open_regular(self.location / file)
            except OSError:  # reported, naming the key, when the chunk is decoded
                self._fds[file] = None
        fd = self._fds[file]
        return None if fd is None else raw_location(fd, offset, length, sizes, dtype)

    def close(self) -> None:
        """Close the data files opened while locating raw chunks."""
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            if fd is not None:
                os.close(fd)

    async def fill(
        self,
        manifest: Manifest,
        destinations: dict[int, Destination],
        *,
        threads: int,
        limiter: anyio.CapacityLimiter | None,
    ) -> None:
        """Read plain chunks straight into destination memory; decode the others with ``torch.load``.

        Every record read is checked against its CRC-32 (see ``_records``), before values are handed over.
        """
        direct = {i: d for i, d in destinations.items() if i not in self.decoded}
        if direct:
            await read_into(self.location, manifest, direct, threads=threads, limiter=limiter)
            await check_records(self.location, manifest, direct, self.crcs, threads=threads, limiter=limiter)
        if len(direct) < len(destinations):
            rest = {i: d for i, d in destinations.items() if i in self.decoded}
            await super().fill(manifest, rest, threads=threads, limiter=limiter)

    def _blob(self, file: str, offset: int, length: int, key: str) -> bytes:
        """The ``torch.save`` blob of ``key``, once every record in it matched its CRC-32. Blocking.

        Raises:
            CorruptionError: The file is missing or too short, or a record fails its CRC-32.
            StorageError: The file cannot be read.
        """
        path = self.location / file
        try:
            with open(open_regular(path), "rb") as f:  # (a FIFO would block a plain open)
                # (The file's size bounds the read: the metadata can say any length.)
                size = os.fstat(f.fileno()).st_size
                data = b""
                if offset + length <= size:
                    f.seek(offset)
                    data = f.read(length)
        except FileNotFoundError:
            raise CorruptionError(f"{path} is missing (it holds {key!r})", file=str(path), key=key) from None
        except OSError as exc:
            raise StorageError(f"cannot read {path}: {exc.strerror or exc}", path=str(path)) from exc
        if len(data) != length:
            raise CorruptionError(
                f"{path} is truncated: {key!r} needs bytes {offset}..{offset + length}",
                file=str(path),
                key=key,
            )
        damaged = damaged_record(data)
        if damaged is not None:
            raise CorruptionError(
                f"checksum mismatch in {path} for key {key!r}: its zip record {damaged!r} (in bytes "
                f"{offset}..{offset + length}) does not match its CRC-32",
                file=str(path),
                key=key,
            )
        return data

    def _value(self, fqn: str, info: Any) -> Node:
        data = self._blob(info.relative_path, info.offset, info.length, fqn)
        try:
            value = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError:
            if not self.allow_pickle:
                # Refused by the matcher, naming the key, if the load needs this value.
                return PickleNode(data=b"", type_name="object that torch.load(weights_only=True) refuses")
            value = self._unpickled(fqn, info, data)
        except Exception as exc:
            path = self.location / info.relative_path
            raise CorruptionError(f"cannot decode {fqn!r} in {path}: {exc}", file=str(path), key=fqn) from exc
        return value_node(value, fqn)

    def _unpickled(self, fqn: str, info: Any, data: bytes) -> object:
        """The value ``torch.load`` rebuilds from ``data`` with pickle (``allow_pickle``).

        Raises:
            StateError: It cannot be rebuilt here (a class this process cannot import, a damaged pickle);
                the message names the key and the file.
        """
        try:
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
        except Exception as exc:
            path = self.location / info.relative_path
            raise StateError(f"cannot unpickle {fqn!r} in {path}: {exc}", key=fqn) from exc

    def chunk(self, index: int, number: int) -> torch.Tensor:
        key = self.manifest.tensors[index].path[0]
        assert isinstance(key, str)
        file, offset, length = self.blobs[index, number]
        data = self._blob(file, offset, length, key)
        try:
            t = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as exc:
            path = self.location / file
            raise CorruptionError(f"cannot decode {key!r} in {path}: {exc}", file=str(path), key=key) from exc
        return self._check(index, number, t)


def _paths(planner_data: object) -> dict[str, KeyPath] | None:
    """DCP's ``planner_data`` of a default planner: FQN -> original key path (str keys, int list indices).

    A path deeper than aiockpt's trees nest (``MAX_READ_DEPTH``) is left out, so that its name stays flat:
    the trees built from paths are walked recursively.
    """
    if not isinstance(planner_data, dict):
        return None
    return {
        fqn: path
        for fqn, path in planner_data.items()
        if isinstance(fqn, str)
        and isinstance(path, tuple)
        and 0 < len(path) <= MAX_READ_DEPTH
        and all(type(k) in (str, int) for k in path)
    }
