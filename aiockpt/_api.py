"""One-shot save, load and read of a single checkpoint directory."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, MutableMapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar, overload

import anyio

from ._dist import DEFAULT_TIMEOUT
from ._errors import CheckpointError, CorruptionError, FormatError
from ._format import Key, part_dir_name
from ._handle import Metadata, SaveHandle, SaveState
from ._insulate import insulated
from ._interop import detect, load_foreign, read_foreign
from ._load import check_target, deleted_meanwhile, run_load, run_metadata, run_read
from ._load._ranks import checked_rank
from ._memory import ONE_SHOT_PINNED, StagingPool
from ._options import IOConfig, check_flags, check_timeout, io_config
from ._runner import start_background
from ._save import SaveRequest, metadata_of, run_save
from ._save._protocol import abort_unbegun, unbegun
from ._storage import S3Options, S3Path, resolve
from ._threads import run_sync
from ._world import LocalWorld, part_of, resolve_world

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
else:
    try:  # at run time too, so that typing.get_type_hints() resolves the annotations that name it
        from torch.distributed import ProcessGroup
    except ImportError:  # a torch built without distributed support: no group to pass
        ProcessGroup = object

# A load returns its target as it was given, so the caller keeps the target's own type.
StateT = TypeVar("StateT", bound=MutableMapping[str, Any])


@overload
async def save(
    state: Mapping[str, object],
    path: str | os.PathLike[str],
    *,
    async_op: Literal[False] = ...,
    allow_pickle: bool = ...,
    metadata: Mapping[str, str | int | float | bool | None] | None = ...,
    io: IOConfig | None = ...,
    process_group: ProcessGroup | None = ...,
    collective_timeout: float = ...,
    use_collectives: bool = ...,
    s3: S3Options | None = ...,
) -> Metadata: ...


@overload
async def save(
    state: Mapping[str, object],
    path: str | os.PathLike[str],
    *,
    async_op: Literal[True],
    allow_pickle: bool = ...,
    metadata: Mapping[str, str | int | float | bool | None] | None = ...,
    io: IOConfig | None = ...,
    process_group: ProcessGroup | None = ...,
    collective_timeout: float = ...,
    use_collectives: bool = ...,
    s3: S3Options | None = ...,
) -> SaveHandle: ...


@overload
async def save(
    state: Mapping[str, object],
    path: str | os.PathLike[str],
    *,
    async_op: bool,
    allow_pickle: bool = ...,
    metadata: Mapping[str, str | int | float | bool | None] | None = ...,
    io: IOConfig | None = ...,
    process_group: ProcessGroup | None = ...,
    collective_timeout: float = ...,
    use_collectives: bool = ...,
    s3: S3Options | None = ...,
) -> Metadata | SaveHandle: ...


@insulated
async def save(
    state: Mapping[str, object],
    path: str | os.PathLike[str],
    *,
    async_op: bool = False,
    allow_pickle: bool = False,
    metadata: Mapping[str, str | int | float | bool | None] | None = None,
    io: IOConfig | None = None,
    process_group: ProcessGroup | None = None,
    collective_timeout: float = DEFAULT_TIMEOUT,
    use_collectives: bool = True,
    s3: S3Options | None = None,
) -> Metadata | SaveHandle:
    """Save ``state`` as a new checkpoint directory ``path``.

    Args:
        state: A mapping with str keys of tensors, Statefuls (``state_dict()``/``load_state_dict()``),
            nested dicts/lists/tuples and plain values.
        path: The checkpoint directory to create; it must not exist. Parents are created. An
            ``s3://bucket/prefix`` URL saves to an S3-compatible object store instead (``aiockpt[s3]``).
        async_op: Return once the state is staged (copied aside), with a :class:`SaveHandle` to await for
            durability, instead of once the checkpoint is durable. Nothing may modify the state until
            ``save`` returns (another task included): staged, the state is the caller's again; without
            it, its tensors are written from their own memory, and one changed meanwhile fails its
            checksum on load.
        allow_pickle: Pickle objects of other types instead of refusing them.
        metadata: Small user values stored in the manifest: str keys, each value a str, an int (within
            int64/uint64), a float, a bool or ``None``.
        io: I/O tuning.
        process_group: Save collectively over this ``torch.distributed`` group (default: the default
            group when ``torch.distributed`` is initialised, else this process alone). Every rank of it
            must call ``save`` with the same ``path``; each writes only its own shards, replicated
            tensors are written once.
        collective_timeout: Seconds each checkpoint collective may take before the save fails with
            :class:`DistributedError` (a dead or stuck rank).
        use_collectives: With ``False`` in a distributed job, each rank saves alone, without any
            collective: it publishes its own part (``path/rank-RRRRR-of-NNNNN``), replicated tensors are
            written by every rank, and the checkpoint counts as committed once every part is there.
        s3: Object-store settings for an ``s3://`` path (default: from the AWS environment variables).

    Returns:
        The checkpoint's :class:`Metadata`, or with ``async_op=True`` a :class:`SaveHandle`.

    Raises:
        CheckpointExistsError: ``path`` exists.
        StateError: The state or ``metadata`` holds something that cannot be saved (the message names
            the key); nothing was written.
        StorageError: Writing failed, ``path``'s name is too long, or an ancestor of ``path`` is a file,
            not a directory (the message and ``path`` name it); nothing was published and temp data is
            removed.
        DistributedError: Another rank failed or did not answer in time (names the ranks).
        CheckpointError: A flag (``async_op``, ``allow_pickle``, ``use_collectives``) is not a bool,
            ``collective_timeout`` is not a positive, finite number of seconds, or ``path`` is empty.
    """
    check_flags(async_op=async_op, allow_pickle=allow_pickle, use_collectives=use_collectives)
    check_timeout(collective_timeout)
    target = resolve(path, s3)
    part = part_of(process_group) if not use_collectives else None
    if part is not None:
        target = target / part_dir_name(*part)
    world = LocalWorld() if not use_collectives else await resolve_world(process_group, collective_timeout)
    try:
        user_metadata = metadata_of(metadata)
    except CheckpointError as exc:
        if (unbegun_save := unbegun(world, str(target))) is not None:
            await abort_unbegun(unbegun_save, exc)  # (the other ranks would wait for this one)
        raise
    req = SaveRequest(
        state=state,
        path=target,
        part=part,
        copy=async_op,
        allow_pickle=allow_pickle,
        user_metadata=user_metadata,
        io=io_config(io),
    )
    handle = SaveHandle(path=str(req.path), step=None)
    pool = StagingPool(pinned_from=ONE_SHOT_PINNED)

    async def body(report: Callable[[SaveState], None]) -> Metadata:
        try:
            return await run_save(req, world=world, pool=pool, metrics=handle.metrics, report=report)
        finally:
            with anyio.CancelScope(shield=True):
                await run_sync(pool.close)

    if async_op:
        return await start_background(handle, body)
    await handle._drive(body)
    return await handle


@insulated
async def load(
    state: StateT,
    path: str | os.PathLike[str],
    *,
    strict: bool = True,
    allow_pickle: bool = False,
    io: IOConfig | None = None,
    s3: S3Options | None = None,
    rank: int | None = None,
) -> StateT:
    """Load the checkpoint at ``path`` into ``state``, in place.

    Tensors of ``state`` are filled in place (read straight into their memory when they are contiguous
    CPU tensors), Statefuls get ``load_state_dict``, other values are replaced in the mapping. Entries a
    Stateful lacks (an optimizer that never stepped) are created from the checkpoint.

    Args:
        state: The target: a mutable mapping shaped like the saved state.
        path: A checkpoint directory, an ``s3://bucket/prefix`` URL, or a foreign checkpoint read-only
            (see ``docs/interop.md``): a DCP directory, a ``*.safetensors`` file or Hugging Face directory
            (matched by key paths joined with ``"."``), or a ``torch.save`` file.
        strict: Refuse any difference between checkpoint and target (missing or unexpected keys, shape
            or dtype mismatch), listing all of them; with ``False``, load what matches and warn about the
            rest with :class:`StateMismatchWarning`.
        allow_pickle: Unpickle stored objects (only for checkpoints you trust).
        io: I/O tuning.
        s3: Object-store settings for an ``s3://`` path (default: from the AWS environment variables).
        rank: Whose per-rank state to load (values that the ranks of a distributed save held differently
            under one key, such as each rank's RNG state): a key that only other ranks saved is missing
            from the checkpoint for this rank (a strict load reports it). ``None``: this process's rank
            in ``torch.distributed``'s default group when it is initialised, else 0. Pass
            ``dist.get_rank(group)`` for a checkpoint saved with ``process_group=group`` (its ranks are
            the group's). Foreign checkpoints have no per-rank state.

    Returns:
        ``state``.

    Raises:
        CheckpointNotFoundError: ``path`` is not a committed checkpoint, or it was deleted while it was
            read (by another process's retention; nothing was loaded).
        FormatError: The manifest is unreadable or from a newer format.
        CorruptionError: Stored bytes fail verification (names the key and file).
        StorageError: The system refused to read a file of the checkpoint (``EACCES``, ``EIO``; names
            it, the cause chained).
        StateMismatchError: ``strict`` and the target differs; nothing was loaded.
        StateError: This rank has no item of a list or tuple saved per rank (a checkpoint of a smaller
            world); names the key. Or ``state`` is not a mutable mapping (nothing was read). Or a
            Stateful's ``load_state_dict`` raised (its key named, the cause chained): every tensor
            filled in place, its own included, keeps the checkpoint's values, and so do the Statefuls
            handed their state before it (innermost first); those after it and the plain values of
            ``state`` are left as they were.
        CheckpointError: ``rank`` is not an int of at least 0, ``strict`` or ``allow_pickle`` is not a
            bool, or ``path`` is empty.
    """
    check_flags(strict=strict, allow_pickle=allow_pickle)
    check_target(state)
    chosen = checked_rank(rank)
    target = resolve(path, s3)
    kind = "aiockpt" if isinstance(target, S3Path) else await run_sync(lambda: detect(target))
    if kind != "aiockpt":
        assert isinstance(target, Path)
        await load_foreign(state, target, kind, strict=strict, allow_pickle=allow_pickle, io=io_config(io))
        return state
    try:
        await run_load(state, target, strict=strict, allow_pickle=allow_pickle, io=io_config(io), rank=chosen)
    except CorruptionError as exc:
        gone = await deleted_meanwhile(target, exc)
        if gone is None:
            raise
        raise gone from exc
    return state


@insulated
async def read(
    path: str | os.PathLike[str],
    *,
    allow_pickle: bool = False,
    io: IOConfig | None = None,
    s3: S3Options | None = None,
    rank: int | None = None,
) -> dict[Key, object]:
    """Read the checkpoint at ``path`` as a fresh nested structure of CPU tensors and plain values.

    Statefuls come back as their state dicts; tied tensors come back tied. ``path`` may also be a DCP
    directory (full tensors, nested as saved), a safetensors file or Hugging Face directory (a flat
    ``{name: tensor}`` dict) or a ``torch.save`` file; see ``docs/interop.md``. The large tensors of an
    aiockpt checkpoint on a local file system are copy-on-write views of its data files, verified when
    read (see ``IOConfig.map_reads``). Its tensors under 64 KiB are views of shared slabs (up to 16
    MiB): one kept alive keeps its slab alive, and ``torch.save`` of it writes the whole slab
    (``clone()`` one to keep it alone). Tensors that share storage so must not be grown in place
    (``resize_`` within the storage succeeds, and overlaps the next tensor). Mappings come back as
    plain dicts, whatever their type when saved (a ``defaultdict``'s factory and an ``OrderedDict``'s
    type are not kept; lists and tuples of other types are refused at save, unless pickled).

    Args:
        path: A checkpoint directory, an ``s3://bucket/prefix`` URL, or a foreign checkpoint.
        allow_pickle: Unpickle stored objects (only for checkpoints you trust).
        io: I/O tuning.
        s3: Object-store settings for an ``s3://`` path (default: from the AWS environment variables).
        rank: Whose per-rank state to return (values that the ranks of a distributed save held
            differently under one key, such as each rank's RNG state): a key that only other ranks saved
            is absent. ``None``: this process's rank in ``torch.distributed``'s default group when it is
            initialised, else 0. An int reads any rank's, say to export rank 3's RNG state offline (a
            rank outside the world that saved it gets the state every rank shared). Foreign checkpoints
            have no per-rank state.

    Raises:
        CheckpointNotFoundError: ``path`` is not a committed checkpoint, or it was deleted while it was
            read (by another process's retention; nothing was loaded).
        FormatError: The manifest is unreadable or from a newer format, or a tensor's dtype is unknown
            to this torch (names the key).
        CorruptionError: Stored bytes fail verification (names the key and file).
        StorageError: The system refused to read a file of the checkpoint (``EACCES``, ``EIO``; names
            it, the cause chained).
        StateError: A pickled object is stored and ``allow_pickle`` is false, or ``rank`` has no item of
            a list or tuple saved per rank (a rank outside the world that saved it; names the key).
        CheckpointError: ``rank`` is not an int of at least 0, ``allow_pickle`` is not a bool, or
            ``path`` is empty.
    """
    check_flags(allow_pickle=allow_pickle)
    chosen = checked_rank(rank)
    target = resolve(path, s3)
    kind = "aiockpt" if isinstance(target, S3Path) else await run_sync(lambda: detect(target))
    if kind != "aiockpt":
        assert isinstance(target, Path)
        return await read_foreign(target, kind, allow_pickle=allow_pickle, io=io_config(io))
    try:
        return await run_read(target, allow_pickle=allow_pickle, io=io_config(io), rank=chosen)
    except CorruptionError as exc:
        gone = await deleted_meanwhile(target, exc)
        if gone is None:
            raise
        raise gone from exc


@insulated
async def read_metadata(path: str | os.PathLike[str], *, s3: S3Options | None = None) -> Metadata:
    """What the committed checkpoint at ``path`` holds, from its manifest alone (no tensor is read).

    ``user_metadata`` is the ``metadata=`` it was saved with, to pick a checkpoint by a value saved
    with it (an evaluation loss, say) without loading any. ``timings``, ``written_bytes`` and
    ``direct_bytes`` describe a save as it ran and are not stored: they are empty here. For a
    collective-free checkpoint (one part per rank) the parts' merge is described, with a
    ``manifest_crc32c`` of 0 (there is no one manifest).

    Args:
        path: A checkpoint directory or an ``s3://bucket/prefix`` URL.
        s3: Object-store settings for an ``s3://`` path (default: from the AWS environment variables).

    Raises:
        CheckpointNotFoundError: ``path`` is not a committed checkpoint.
        FormatError: The manifest is unreadable or from a newer format, or ``path`` is a foreign
            checkpoint (DCP, safetensors, ``torch.save``), which has no aiockpt metadata.
        CorruptionError: The manifest's checksum does not match (names the file).
        StorageError: The system refused to read the manifest (``EACCES``, ``EIO``; names it).
        CheckpointError: ``path`` is empty.
    """
    target = resolve(path, s3)
    if not isinstance(target, S3Path):
        kind = await run_sync(lambda: detect(target))
        if kind != "aiockpt":
            raise FormatError(
                f"{target} is a {kind} checkpoint, which has no aiockpt metadata", file=str(target)
            )
    return await run_metadata(target)
