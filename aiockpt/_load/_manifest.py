"""Reading and verifying a checkpoint's manifest."""

from __future__ import annotations

import os
from pathlib import Path

import crc32c
import msgspec

from .._body import decode_body
from .._errors import CheckpointNotFoundError, CorruptionError, FormatError
from .._format import (
    ENVELOPE_DECODER,
    FORMAT_VERSION,
    MAGIC,
    MANIFEST_NAME,
    PART_RE,
    Chunk,
    KeyPath,
    Manifest,
    TensorEntry,
)
from .._gc import paused


def _read_one(path: Path) -> Manifest:
    """Read, verify and decode ``path / manifest.msgpack``. Blocking.

    Raises:
        CheckpointNotFoundError: ``path`` does not exist or holds no manifest (not a committed checkpoint).
        FormatError: The manifest is not an aiockpt manifest or has a newer format version.
        CorruptionError: The manifest's checksum does not match (names the file).
    """
    file = path / MANIFEST_NAME
    try:
        with open(file, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        if not path.exists():
            raise CheckpointNotFoundError(f"no checkpoint at {path}: it does not exist") from None
        raise CheckpointNotFoundError(
            f"{path} is not an aiockpt checkpoint: it has no {MANIFEST_NAME}"
        ) from None
    except NotADirectoryError:
        raise CheckpointNotFoundError(f"{path} is not an aiockpt checkpoint: it is not a directory") from None
    except OSError as exc:
        raise FormatError(f"cannot read {file}: {exc.strerror or exc}", file=str(file)) from exc
    return decode_manifest(raw, str(file))


def decode_manifest(raw: bytes, file: str) -> Manifest:
    """Verify and decode the bytes of a manifest read from ``file`` (named in errors).

    Raises:
        FormatError: The bytes are not an aiockpt manifest or have a newer format version.
        CorruptionError: The manifest's checksum does not match.
    """
    return _decode(raw, file)[0]


def _decode(raw: bytes, file: str) -> tuple[Manifest, int]:
    """:func:`decode_manifest`, also returning the checksum of the manifest's body."""
    try:
        env = ENVELOPE_DECODER.decode(raw)
    except (msgspec.DecodeError, ValueError) as exc:  # invalid UTF-8 surfaces as UnicodeDecodeError
        raise CorruptionError(f"{file} is damaged or not an aiockpt manifest: {exc}", file=file) from exc
    if env.magic != MAGIC:
        raise FormatError(f"{file} is not an aiockpt manifest (magic {env.magic!r})", file=file)
    if env.format_version < 1:
        raise FormatError(f"{file} has an invalid format version {env.format_version}", file=file)
    if env.format_version > FORMAT_VERSION:
        raise FormatError(
            f"{file} has format version {env.format_version}; this aiockpt reads up to {FORMAT_VERSION}: "
            "upgrade aiockpt",
            file=file,
        )
    if crc32c.crc32c(env.body) != env.body_crc32c:
        raise CorruptionError(f"{file} is damaged: its checksum does not match", file=file)
    try:
        with paused():
            manifest = decode_body(env.body, env.format_version)
    except (msgspec.DecodeError, ValueError) as exc:  # invalid UTF-8 surfaces as UnicodeDecodeError
        raise FormatError(f"{file} cannot be decoded: {exc}", file=file) from exc
    if manifest.format_version != env.format_version:
        raise CorruptionError(
            f"{file} is damaged: envelope says format version {env.format_version}, "
            f"the manifest {manifest.format_version}",
            file=file,
        )
    return manifest, env.body_crc32c


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


def published_parts(path: Path) -> tuple[int, list[Path]] | None:
    """The published parts of a collective-free checkpoint: ``(world size, part dirs)``, or ``None``."""
    try:
        names = os.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    found: dict[int, Path] = {}
    world = 0
    for name in names:
        m = PART_RE.fullmatch(name)
        if m and os.path.isfile(path / name / MANIFEST_NAME):
            found[int(m.group(1))] = path / name
            world = max(world, int(m.group(2)))
    if not found:
        return None
    return world, [found[r] for r in sorted(found)]


def is_checkpoint(path: Path) -> bool:
    """Whether ``path`` holds a committed checkpoint (cheap; verifies nothing). Blocking.

    A collective-free checkpoint is committed once every rank has published its part.
    """
    if os.path.isfile(path / MANIFEST_NAME):
        return True
    parts = published_parts(path)
    return parts is not None and len(parts[1]) == parts[0]


def read_manifest(path: Path, *, every_copy: bool = False) -> Manifest:
    """Read, verify and decode the manifest of the checkpoint at ``path``. Blocking.

    A collective-free checkpoint (one published part per rank) is read as the merge of its parts; with
    ``every_copy`` (verification), a chunk that several parts hold is listed once per part.

    Raises:
        CheckpointNotFoundError: ``path`` does not exist or holds no manifest, or parts are missing.
        FormatError: The manifest is not an aiockpt manifest or has a newer format version.
        CorruptionError: The manifest's checksum does not match (names the file).
    """
    if not os.path.isfile(path / MANIFEST_NAME):
        parts = published_parts(path)
        if parts is not None:
            world, dirs = parts
            if len(dirs) != world:
                have = sorted(int(PART_RE.fullmatch(d.name).group(1)) for d in dirs)  # type: ignore[union-attr]
                missing = sorted(set(range(world)) - set(have))
                raise CheckpointNotFoundError(
                    f"{path} is incomplete: the parts of ranks {missing} (of {world}) were never published"
                )
            return merge_parts([(d.name, _read_one(d)) for d in dirs], every_copy=every_copy)
    return _read_one(path)


def merge_parts(parts: list[tuple[str, Manifest]], *, every_copy: bool = False) -> Manifest:
    """One manifest for the parts of a collective-free checkpoint (``(part dir, manifest)`` by rank).

    The tree is rank 0's; tensors are merged by key path, a chunk held by several ranks (a replicated
    tensor, written by each) is read from the first. With ``every_copy``, every part's copy of such a
    chunk is kept (``aiockpt.verify`` checks each: a load may read any of them, such as a part read on
    its own). File names are made relative to the checkpoint.

    Raises:
        FormatError: Two parts disagree on a tensor's dtype or global shape.
    """
    entries: dict[KeyPath, tuple[TensorEntry, list[Chunk]]] = {}
    order: list[KeyPath] = []
    files = []
    for name, m in parts:
        files += [msgspec.structs.replace(f, name=f"{name}/{f.name}") for f in m.files]
        for t in m.tensors:
            chunks = [msgspec.structs.replace(c, file=f"{name}/{c.file}") for c in t.chunks]
            have = entries.get(t.path)
            if have is None:
                entries[t.path] = (t, chunks)
                order.append(t.path)
                continue
            first, merged = have
            if (first.dtype, first.shape) != (t.dtype, t.shape):
                raise FormatError(
                    f"parts disagree on tensor {'/'.join(map(str, t.path))!r}: "
                    f"{first.dtype}{list(first.shape)} vs {t.dtype}{list(t.shape)} (in {name})"
                )
            if every_copy:
                merged += chunks
                continue
            boxes = {(c.offsets, c.sizes) for c in merged}
            merged += [c for c in chunks if (c.offsets, c.sizes) not in boxes]
    base = parts[0][1]
    # Rank 0's tree refers to its tensors by index: they come first, in its order.
    tensors = tuple(msgspec.structs.replace(entries[p][0], chunks=tuple(entries[p][1])) for p in order)
    return msgspec.structs.replace(
        base, tensors=tensors, files=tuple(files), world_size=len(parts), part_rank=None
    )
