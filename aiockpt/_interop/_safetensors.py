"""Reading safetensors files and Hugging Face sharded directories, and writing them.

A safetensors file is an 8-byte little-endian header length, a JSON header mapping each tensor name to its
``dtype``, ``shape`` and ``data_offsets`` (relative to the end of the header), an optional
``__metadata__`` of str -> str, then raw little-endian row-major bytes. A Hugging Face checkpoint
directory holds either ``model.safetensors`` or shards plus ``model.safetensors.index.json``
(``{"metadata": {"total_size": N}, "weight_map": {name: shard file}}``).

Tensors lie raw at known offsets, so reads go through the native reader straight into destination memory;
the format has no checksums (the manifest says ``checksum_algorithm="none"``). The header is checked as the
reference reader checks it: each entry alone (``_entry``), then all of them tiling the data section
(``_check_tiling``).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path

import anyio

from .._errors import CorruptionError, FormatError, StorageError
from .._format import Chunk, FileInfo, Manifest, Node, TensorEntry, TensorNode
from .._fs import open_regular, read_regular
from .._load._match import Destination
from .._load._read import read_into
from .._tree import dtype_from_name
from ._names import tree_of
from ._source import Source

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
SUFFIX = ".safetensors"
# Headers beyond this are refused rather than read into memory (the reference reader uses 100 MB too).
MAX_HEADER = 100_000_000
# Only the checksum-block size the reader splits large chunks by; nothing is verified.
_BLOCK = 4 << 20

# safetensors dtype names <-> torch dtype names, as safetensors.torch maps them.
DTYPES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "U16": "uint16",
    "F16": "float16",
    "BF16": "bfloat16",
    "I32": "int32",
    "U32": "uint32",
    "F32": "float32",
    "F64": "float64",
    "I64": "int64",
    "U64": "uint64",
    "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
}
NAMES = {v: k for k, v in DTYPES.items()}
# The format's other dtypes (safetensors 0.6): valid in a header, but of no tensor torch reads here.
_UNREAD = frozenset({"F4", "F6_E2M3", "F6_E3M2", "F8_E8M0"})


def is_hf_dir(path: Path) -> bool:
    """Whether directory ``path`` is a Hugging Face safetensors checkpoint. Blocking."""
    return os.path.isfile(path / INDEX_NAME) or os.path.isfile(path / SINGLE_NAME)


def _header(file: Path) -> tuple[int, dict[str, object], int]:
    """``(data start, header, file size)`` of a safetensors file. Blocking."""
    try:
        with open(open_regular(file), "rb") as f:  # (a FIFO named in an index would block a plain open)
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise CorruptionError(f"{file} is truncated: it has no safetensors header", file=str(file))
            n = int.from_bytes(head, "little")
            if n > min(size - 8, MAX_HEADER):
                raise CorruptionError(
                    f"{file} is truncated or not safetensors: its header claims {n} bytes, "
                    f"the file has {size}",
                    file=str(file),
                )
            raw = f.read(n)
    except FileNotFoundError:
        raise CorruptionError(f"{file} is missing", file=str(file)) from None
    except OSError as exc:
        raise StorageError(f"cannot read {file}: {exc.strerror or exc}", path=str(file)) from exc
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # (RecursionError: arrays nested thousands deep)
        raise CorruptionError(f"{file} has a damaged safetensors header: {exc}", file=str(file)) from exc
    if not isinstance(header, dict):
        raise CorruptionError(f"{file} has a damaged safetensors header", file=str(file))
    return 8 + n, header, size


def _entry(
    file: Path, name: str, info: object, start: int, size: int
) -> tuple[str, tuple[int, ...], int, int]:
    """Validate one header entry: ``(torch dtype name, shape, file offset, nbytes)``."""
    if not isinstance(info, dict):
        raise CorruptionError(
            f"{file}: the header entry of {name!r} is not an object", file=str(file), key=name
        )
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str):
        raise CorruptionError(
            f"{file} has a damaged safetensors header: {name!r} has dtype {dtype!r}, not a name",
            file=str(file),
            key=name,
        )
    if dtype not in DTYPES:
        # A name this reader does not know: a dtype of the format this torch has no tensors of, one a
        # later safetensors added, or damage; it cannot tell which. (FormatError has no key.)
        known = "" if dtype in _UNREAD else " (or the header is damaged)"
        raise FormatError(
            f"{file}: {name!r} has dtype {dtype!r}, which aiockpt does not read{known}", file=str(file)
        )
    if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
        raise CorruptionError(f"{file}: {name!r} has an invalid shape {shape!r}", file=str(file), key=name)
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise CorruptionError(
            f"{file}: {name!r} has invalid data offsets {offsets!r}", file=str(file), key=name
        )
    nbytes = offsets[1] - offsets[0]
    torch_dtype = DTYPES[dtype]
    if nbytes != math.prod(shape) * dtype_from_name(torch_dtype).itemsize:
        raise CorruptionError(
            f"{file}: {name!r} is {dtype}{shape} but spans {nbytes} bytes", file=str(file), key=name
        )
    if start + offsets[1] > size:
        raise CorruptionError(
            f"{file} is truncated: {name!r} needs bytes {start + offsets[0]}..{start + offsets[1]}, "
            f"the file has {size}",
            file=str(file),
            key=name,
        )
    return torch_dtype, tuple(shape), start + offsets[0], nbytes


def _check_tiling(file: Path, spans: list[tuple[int, int, str]], data_size: int) -> None:
    """Check that the tensors' ``(start, end, name)`` byte spans tile the data section exactly.

    As the reference reader requires: sorted by offsets, the first starts at 0, each starts where the one
    before ends, the last ends where the file does. So no two tensors share bytes (a forged header could
    otherwise make two names views of the same bytes) and no byte belongs to none. Zero-size tensors
    (``[k, k]``) may sit at any boundary between tensors, as there, but not inside a tensor.

    Raises:
        CorruptionError: Names the file and the tensor at the overlap or gap (``key``), and the one before.
    """
    spans.sort()  # (by start, then end: a zero-size tensor before one that starts where it is)
    at, before = 0, None
    for start, end, name in spans:
        if start != at:
            if start < at:
                what = f"{name!r} (bytes {start}..{end}) starts inside {before!r}, which ends at {at}"
            elif before is None:
                what = f"bytes 0..{start}, before the first tensor {name!r}, belong to no tensor"
            else:
                what = f"bytes {at}..{start}, between {before!r} and {name!r}, belong to no tensor"
            raise CorruptionError(
                f"{file} has a damaged safetensors header: {what} (offsets in its data section)",
                file=str(file),
                key=name,
            )
        at, before = end, name
    if at != data_size:  # (never past it: each entry was checked against the file's size)
        what = f"bytes {at}..{data_size}" + (
            f", after the last tensor {before!r}," if before is not None else ""
        )
        raise CorruptionError(
            f"{file} has a damaged safetensors header: {what} belong to no tensor (offsets in its data "
            "section)",
            file=str(file),
            key=before,
        )


class SafetensorsSource(Source):
    """A ``*.safetensors`` file or a Hugging Face directory of them; read as a flat dict of names."""

    def __init__(self, path: Path) -> None:
        self.location = path
        if path.is_dir():
            self.directory = path
            files = self._shards(path)
        else:
            self.directory = path.parent
            files = {path.name: None}
        self.data = self.directory
        names: dict[str, Node] = {}
        tensors: list[TensorEntry] = []
        infos = []
        metadata: dict[str, str | int | float | bool | None] = {}
        for shard, expected in files.items():
            file = self.directory / shard
            start, header, size = _header(file)
            infos.append(FileInfo(name=shard, nbytes=size))
            meta = header.pop("__metadata__", None)
            if isinstance(meta, dict):
                metadata.update({str(k): str(v) for k, v in meta.items()})
            if expected is not None:
                absent = sorted(expected - header.keys())
                if absent:
                    raise CorruptionError(
                        f"{file} lacks {absent[:5]} that {INDEX_NAME} places there", file=str(file)
                    )
            spans: list[tuple[int, int, str]] = []
            for name, info in header.items():
                if name in names:
                    raise FormatError(f"{name!r} is stored twice in {path}", file=str(file))
                dtype, shape, offset, nbytes = _entry(file, name, info, start, size)
                spans.append((offset - start, offset - start + nbytes, name))
                names[name] = TensorNode(index=len(tensors))
                chunk = Chunk(
                    offsets=(0,) * len(shape),
                    sizes=shape,
                    file=shard,
                    offset=offset,
                    nbytes=nbytes,
                    checksums=(),
                )
                tensors.append(TensorEntry(path=(name,), dtype=dtype, shape=shape, chunks=(chunk,)))
            _check_tiling(file, spans, size - start)
        self.names = names
        self.manifest = Manifest(
            checksum_algorithm="none",
            checksum_block=_BLOCK,
            tree=tree_of(names, None),
            tensors=tuple(tensors),
            files=tuple(infos),
            library_version="safetensors",
            user_metadata=metadata,
        )

    @staticmethod
    def _shards(directory: Path) -> dict[str, set[str] | None]:
        index = directory / INDEX_NAME
        if not index.is_file():
            return {SINGLE_NAME: None}
        try:
            doc = json.loads(read_regular(index))
        except (OSError, ValueError, RecursionError) as exc:
            raise FormatError(f"cannot read {index}: {exc}", file=str(index)) from exc
        weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(weight_map, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise FormatError(f"{index} has no valid weight_map", file=str(index))
        shards: dict[str, set[str] | None] = {}
        for name, shard in weight_map.items():
            if os.path.isabs(shard) or ".." in Path(shard).parts or "\0" in shard:
                raise FormatError(
                    f"{index} points {name!r} outside the directory: {shard!r}", file=str(index)
                )
            names = shards.setdefault(shard, set())
            assert names is not None
            names.add(name)
        return dict(sorted(shards.items()))

    async def fill(
        self,
        manifest: Manifest,
        destinations: dict[int, Destination],
        *,
        threads: int,
        limiter: anyio.CapacityLimiter | None,
    ) -> None:
        """Read straight into destination memory through the native reader (no checksums to verify)."""
        await read_into(self.directory, manifest, destinations, threads=threads, limiter=limiter)
