"""Reading and verifying a checkpoint's manifest."""

from __future__ import annotations

import os
from pathlib import Path

import crc32c
import msgspec

from .._errors import CheckpointNotFoundError, CorruptionError, FormatError
from .._format import ENVELOPE_DECODER, FORMAT_VERSION, MAGIC, MANIFEST_DECODER, MANIFEST_NAME, Manifest
from .._gc import paused


def read_manifest(path: Path) -> Manifest:
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
    try:
        env = ENVELOPE_DECODER.decode(raw)
    except (msgspec.DecodeError, ValueError) as exc:  # invalid UTF-8 surfaces as UnicodeDecodeError
        raise CorruptionError(f"{file} is damaged or not an aiockpt manifest: {exc}", file=str(file)) from exc
    if env.magic != MAGIC:
        raise FormatError(f"{file} is not an aiockpt manifest (magic {env.magic!r})", file=str(file))
    if env.format_version < 1:
        raise FormatError(f"{file} has an invalid format version {env.format_version}", file=str(file))
    if env.format_version > FORMAT_VERSION:
        raise FormatError(
            f"{file} has format version {env.format_version}; this aiockpt reads up to {FORMAT_VERSION}: "
            "upgrade aiockpt",
            file=str(file),
        )
    if crc32c.crc32c(env.body) != env.body_crc32c:
        raise CorruptionError(f"{file} is damaged: its checksum does not match", file=str(file))
    try:
        with paused():
            manifest = MANIFEST_DECODER.decode(env.body)
    except (msgspec.DecodeError, ValueError) as exc:  # invalid UTF-8 surfaces as UnicodeDecodeError
        raise FormatError(f"{file} cannot be decoded: {exc}", file=str(file)) from exc
    if manifest.format_version != env.format_version:
        raise CorruptionError(
            f"{file} is damaged: envelope says format version {env.format_version}, "
            f"the manifest {manifest.format_version}",
            file=str(file),
        )
    return manifest


def is_checkpoint(path: Path) -> bool:
    """Whether ``path`` holds a manifest (cheap; does not verify it). Blocking."""
    return os.path.isfile(path / MANIFEST_NAME)
