"""Stage 5: fill the manifest with every rank's checksums and publish the checkpoint atomically.

Commit protocol (the coordinator alone): data files are already fsynced by the write stage; the manifest
is written into the temp directory and fsynced, the temp directory is fsynced, then renamed to its final
name without replacing anything, and the parent directory is fsynced. The rename is the commit point: a
crash before it leaves only temp data (collected later), after it a complete checkpoint. Once begun, the
commit is shielded from cancellation so that it always completes or fails as a whole. A failure after
the rename (the parent's fsync) leaves the save committed: it is a ``RuntimeWarning``, not an error.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import cast, get_args, get_type_hints

import anyio
import crc32c
import msgspec

from .._body import body_parts, body_version
from .._codec import bin_header
from .._errors import CheckpointExistsError, StateError, StorageError
from .._format import (
    ENCODER,
    MAGIC,
    MANIFEST_NAME,
    DictNode,
    Envelope,
    FileInfo,
    Manifest,
)
from .._fs import fsync_dir, rename_noreplace, write_durable
from .._insulate import warn_at_caller
from .._threads import run_sync
from .._tree import a_or_an, int_text, type_name
from .._version import __version__
from ._global_plan import GlobalPlan
from ._write import WriteResult

# A user metadata value as the manifest declares it, decoded as strictly as a load decodes a manifest.
_METADATA_VALUE = msgspec.msgpack.Decoder(get_args(get_type_hints(Manifest)["user_metadata"])[1])


UserMetadata = dict[str, str | int | float | bool | None]


def metadata_of(metadata: object) -> UserMetadata:
    """A copy of a save's ``metadata=`` argument, checked (see :func:`check_metadata`) as the call begins.

    Checked before the save takes anything (a Checkpointer's in-flight slot, a handle): a bad argument
    used to fail there, with a bare error, and keep the slot for good.

    Raises:
        StateError: ``metadata`` is neither ``None`` nor a mapping, or it holds a key or value that a
            manifest cannot (named).
    """
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise StateError(f"metadata must be a dict of str keys, or None, not {a_or_an(type_name(metadata))}")
    copied = dict(metadata)
    check_metadata(copied)
    return cast("UserMetadata", copied)


def check_metadata(metadata: Mapping[object, object]) -> None:
    """Refuse user metadata that a manifest cannot hold, before anything is written.

    A value is accepted when it encodes and decodes back as ``Manifest.user_metadata`` declares it: one
    that does not would commit a checkpoint that no load can read.

    Raises:
        StateError: A key is not a str, a value is not a str, int (within int64/uint64), float, bool or
            ``None``, or a str is not valid Unicode; the message names the metadata key.
    """
    for key, value in metadata.items():
        problem = _metadata_problem(key, value)
        if problem is not None:
            raise StateError(f"cannot save metadata key {key!r}: {problem}")


def _metadata_problem(key: object, value: object) -> str | None:
    """Why ``key: value`` cannot be user metadata, or ``None`` if it can."""
    if not isinstance(key, str):
        return f"the key is {a_or_an(type_name(key))}; metadata keys must be str"
    try:
        ENCODER.encode(key)
    except UnicodeEncodeError:
        return "the key is not valid Unicode (a lone surrogate) and cannot be encoded as UTF-8"
    try:
        _METADATA_VALUE.decode(ENCODER.encode(value))
    except (TypeError, OverflowError, UnicodeEncodeError, msgspec.ValidationError):
        pass
    else:
        return None
    if type(value) is int:
        return f"the value {int_text(value)} is outside the ints a manifest can store ([-2**63, 2**64 - 1])"
    if type(value) is str:
        return "the value is not valid Unicode (a lone surrogate) and cannot be encoded as UTF-8"
    return f"the value is {a_or_an(type_name(value))}; metadata values must be str, int, float, bool or None"


def build_manifest(
    plan: GlobalPlan,
    results: Sequence[WriteResult],
    *,
    tree: DictNode,
    step: int | None,
    block: int,
    user_metadata: dict[str, str | int | float | bool | None],
    part: tuple[int, int] | None = None,
) -> Manifest:
    """The manifest of a checkpoint whose ranks wrote ``plan`` and reported ``results`` (in rank order)."""
    chunks = [list(t.chunks) for t in plan.tensors]
    for rank_plan, result in zip(plan.ranks, results, strict=True):
        for w, sums in zip(rank_plan.writes, result.checksums, strict=True):
            old = chunks[w.tensor][w.chunk]
            chunks[w.tensor][w.chunk] = msgspec.structs.replace(old, checksums=sums)
    pairs = zip(plan.tensors, chunks, strict=True)
    tensors = tuple([msgspec.structs.replace(t, chunks=tuple(c)) for t, c in pairs])  # (see global_plan)
    files = tuple(FileInfo(name=r.file, nbytes=r.nbytes) for r in plan.ranks if r.writes)
    return Manifest(
        step=step,
        world_size=len(plan.ranks) if part is None else part[1],
        part_rank=None if part is None else part[0],
        created_at=time.time(),
        library_version=__version__,
        checksum_block=block,
        tree=tree,
        tensors=tensors,
        files=files,
        user_metadata=user_metadata,
    )


def encode_manifest(manifest: Manifest) -> tuple[list[bytes], int]:
    """Encode ``manifest`` inside its checksummed :class:`Envelope`; return the pieces and the body CRC.

    The pieces joined are the file's bytes (:func:`~.._codec.encode_parts`: the body's megabytes are
    not copied into one buffer). The envelope and the body say one format version, 3 where the tree
    holds per-rank state, else 2 (:func:`~.._body.body_version`).
    """
    version = body_version(manifest)
    body = body_parts(manifest, version=version)
    crc = 0
    for part in body:
        crc = crc32c.crc32c(part, crc)
    empty = ENCODER.encode(
        Envelope(magic=MAGIC, format_version=version, body_crc32c=crc, body=memoryview(b""))
    )
    # The body is the envelope's last field: its empty ``bin`` ends the encoding, and the body's own
    # header and bytes take its place.
    assert empty.endswith(bin_header(0)), "the envelope's last field must be its body"
    return [empty[: -len(bin_header(0))] + bin_header(sum(map(len, body))), *body], crc


async def commit(
    tmpdir: Path, final: Path, manifest: Sequence[bytes], limiter: anyio.CapacityLimiter | None = None
) -> None:
    """Write the manifest (its pieces) into ``tmpdir``; publish ``tmpdir`` as ``final`` (module docstring).

    A failure of the parent directory's fsync, after the rename, is a ``RuntimeWarning``: the checkpoint
    is committed (a load finds it, a save of its name is refused), so the save must end as one that
    committed, with its caller's bookkeeping done (``latest``, retention). Only a crash before the file
    system writes the directory back could still undo the rename.

    Raises:
        CheckpointExistsError: ``final`` appeared meanwhile; nothing was replaced.
        StorageError: A write, fsync or the rename failed; nothing was published.
    """

    def publish() -> OSError | None:
        """Publish; the parent's fsync's error (past the commit point) is returned, not raised."""
        write_durable(tmpdir / MANIFEST_NAME, manifest)
        fsync_dir(tmpdir)
        rename_noreplace(tmpdir, final)
        try:
            fsync_dir(final.parent)
        except OSError as exc:
            return exc
        return None

    with anyio.CancelScope(shield=True):
        try:
            unsynced = await run_sync(publish, limiter)
        except FileExistsError as exc:
            raise CheckpointExistsError(f"checkpoint {final} already exists; nothing was replaced") from exc
        except OSError as exc:
            raise StorageError(f"cannot publish {final}: {exc.strerror or exc}", path=str(final)) from exc
    if unsynced is not None:
        warn_at_caller(
            f"saved {final}, but fsyncing {final.parent} after the rename that committed it failed: "
            f"{unsynced.strerror or unsynced}; the checkpoint is committed, but a crash before the file "
            "system writes the directory back may undo its rename",
            RuntimeWarning,
        )
