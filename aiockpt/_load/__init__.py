"""The load pipeline, mirror of the save: manifest -> match against the target -> read -> hand over.

Nothing in the target is modified until the match found no difference (or ``strict=False``) and every
byte read has verified against its checksum: a load that fails leaves the target as it was, except for
tensors already filled in place when a later block fails verification.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from functools import partial

import anyio
import msgspec

from .._cuda import noting
from .._errors import (
    CheckpointNotFoundError,
    CorruptionError,
    FormatError,
    StateError,
    StateMismatchError,
    StateMismatchWarning,
)
from .._format import MANIFEST_NAME, RANKS_VERSION, Key, Manifest
from .._handle import Metadata
from .._insulate import warn_at_caller
from .._options import IOConfig
from .._storage import Location, S3Path
from .._threads import release, responsive, run_sync
from .._tree import render, type_name
from ._manifest import decode_summary, is_checkpoint, published_parts, read_manifest, read_summary
from ._mapped import Mapper
from ._match import LoadPlan, match
from ._ranks import job_rank, project
from ._read import cached_pages, read_into

__all__ = [
    "assign",
    "deleted_meanwhile",
    "exists",
    "hand_over",
    "is_checkpoint",
    "published_parts",
    "read_manifest",
    "readable",
    "run_load",
    "run_metadata",
    "run_read",
    "settle",
]


_Cached = dict[str, bytes | None] | None


async def _manifest(
    path: Location, io: IOConfig, limiter: anyio.CapacityLimiter | None, rank: int
) -> tuple[Manifest, _Cached, set[int]]:
    """The manifest as ``rank`` saved it, what of its data files was cached, other ranks' tensors.

    The manifest's tree is projected for ``rank`` (:func:`_projected`). The second value says what of
    the data files was cached before the load began: ``None`` where the read will not evict what it
    read (``drop_behind`` off, ``direct_reads=True``, object storage). The third holds the indices of
    the tensors that other ranks' items of per-rank state refer to, which a fresh read need not make.

    Raises:
        StateError: ``rank`` lacks an item of a list or tuple that is per-rank state (see ``project``).
    """
    others: set[int] = set()
    if isinstance(path, S3Path):
        from .._storage._s3 import read_manifest as read_object_manifest

        manifest = await read_object_manifest(path)
        if manifest.format_version >= RANKS_VERSION:  # (a walk of the tree: not on the event loop)
            manifest = await run_sync(partial(_projected, manifest, rank, others), limiter)
        return manifest, None, others

    def read() -> tuple[Manifest, _Cached]:
        manifest = _projected(read_manifest(path), rank, others)
        cached: _Cached = None
        if io.direct_reads is not True and io.drops_behind:
            cached = cached_pages(path, manifest)
        return manifest, cached

    return (*await run_sync(read, limiter), others)


def _projected(manifest: Manifest, rank: int, others: set[int]) -> Manifest:
    """``manifest`` with its tree as ``rank`` saved it (see :func:`~._ranks.project`).

    ``others`` receives the indices of the tensors of other ranks' per-rank state. Only a manifest of
    format version 3 or later can hold per-rank state (``check_manifest``): the others, nearly all, are
    returned as they are, without a walk of their tree.
    """
    if manifest.format_version < RANKS_VERSION:
        return manifest
    tree = project(manifest.tree, rank, others=others)
    return manifest if tree is manifest.tree else msgspec.structs.replace(manifest, tree=tree)


async def _fill(
    path: Location,
    manifest: Manifest,
    cached: _Cached,
    plan: LoadPlan,
    io: IOConfig,
    limiter: anyio.CapacityLimiter | None,
) -> None:
    if isinstance(path, S3Path):
        from .._storage._s3_data import download

        await download(path, manifest, plan.destinations, limiter=limiter)
    else:
        await read_into(
            path,
            manifest,
            plan.destinations,
            threads=io.thread_count,
            direct=io.direct_reads,
            direct_threads=io.direct_thread_count,
            cached=cached,
            checkers=io.checkers,
            limiter=limiter,
            shared=plan.aliasing,
        )
    await hand_over(plan, limiter)


async def hand_over(plan: LoadPlan, limiter: anyio.CapacityLimiter | None) -> None:
    """Call ``load_state_dict`` on the plan's Statefuls, innermost first, once their tensors are filled."""

    def call_all() -> None:
        for obj, sd, key, loose in plan.statefuls:
            try:
                if loose:
                    obj.load_state_dict(sd, strict=False)  # type: ignore[attr-defined]
                else:
                    obj.load_state_dict(sd)  # type: ignore[attr-defined]
            except Exception as exc:
                raise StateError(
                    f"load_state_dict of {type(obj).__name__} at key {render(key)!r} failed: {exc}",
                    key=render(key),
                ) from exc

    if plan.statefuls:
        await run_sync(call_all, limiter)


def settle(plan: LoadPlan, where: object, *, strict: bool) -> None:
    """Refuse (``strict``) or warn (at the caller's line) about the plan's differences before anything loads.

    Raises:
        StateMismatchError: ``strict`` and the plan lists differences.
    """
    if plan.differences:
        if strict:
            raise StateMismatchError(plan.differences, rank=job_rank())
        missing = "; ".join(plan.differences)
        warn_at_caller(f"loaded {where} partially; not loaded: {missing}", StateMismatchWarning)


def readable(plan: LoadPlan, where: object) -> None:
    """Refuse a fresh read of a checkpoint that holds what this torch cannot build (a dtype it lacks).

    Raises:
        FormatError: The plan lists differences, naming each key.
    """
    if plan.differences:
        raise FormatError(f"cannot read {where}: " + "; ".join(plan.differences), file=str(where))


def assign(plan: LoadPlan) -> None:
    """Put the entries the template lacked (built from the checkpoint) into their containers."""
    for container, key, value in plan.assign:
        container[key] = value


def check_target(state: object) -> None:
    """Refuse a load target that is not a mutable mapping, before anything is read.

    A load fills its target in place, key by key: given ``None`` it would read the whole checkpoint for
    nothing, and given a module every key would count as unexpected.

    Raises:
        StateError: ``state`` is not a mutable mapping (names its type).
    """
    if not isinstance(state, MutableMapping):
        raise StateError(
            f"a load fills a mutable mapping in place (a dict of the state), not {type_name(state)}: wrap "
            "a module or optimizer as {'model': model}, or use read() for a fresh copy"
        )


async def run_load(
    state: MutableMapping[str, object],
    path: Location,
    *,
    strict: bool,
    allow_pickle: bool,
    io: IOConfig,
    rank: int,
    limiter: anyio.CapacityLimiter | None = None,
) -> None:
    """Load the checkpoint at ``path`` into ``state`` in place (see :func:`aiockpt.load`).

    Per-rank state is ``rank``'s: a key that only other ranks saved is missing from the checkpoint.
    """
    with responsive(io), noting():
        await _load(state, path, strict=strict, allow_pickle=allow_pickle, io=io, rank=rank, limiter=limiter)


async def _load(
    state: MutableMapping[str, object],
    path: Location,
    *,
    strict: bool,
    allow_pickle: bool,
    io: IOConfig,
    rank: int,
    limiter: anyio.CapacityLimiter | None,
) -> None:
    manifest, cached, _ = await _manifest(path, io, limiter, rank)
    data = path
    plan = await run_sync(partial(match, manifest, state, allow_pickle=allow_pickle, data=data), limiter)
    settle(plan, path, strict=strict)
    await _fill(path, manifest, cached, plan, io, limiter)
    await run_sync(partial(assign, plan), limiter)
    # Neither name may keep the bookkeeping alive once it is handed to the thread that frees it.
    box: list[object] = [manifest, plan]
    del manifest, plan
    await release(box, limiter)


async def run_read(
    path: Location,
    *,
    allow_pickle: bool,
    io: IOConfig,
    rank: int,
    limiter: anyio.CapacityLimiter | None = None,
) -> dict[Key, object]:
    """Read the checkpoint at ``path`` into a fresh tree of CPU tensors (see :func:`aiockpt.read`).

    Per-rank state is ``rank``'s: a key that only other ranks saved is absent.
    """
    with responsive(io):
        return await _read_fresh(path, allow_pickle=allow_pickle, io=io, rank=rank, limiter=limiter)


async def _read_fresh(
    path: Location, *, allow_pickle: bool, io: IOConfig, rank: int, limiter: anyio.CapacityLimiter | None
) -> dict[Key, object]:
    manifest, cached, others = await _manifest(path, io, limiter, rank)
    mapper = None if isinstance(path, S3Path) or io.direct_reads is True or not io.map_reads else Mapper(path)
    data = path
    read_plan = partial(
        match, manifest, None, allow_pickle=allow_pickle, mapper=mapper, data=data, unwanted=others
    )
    plan = await run_sync(read_plan, limiter)
    readable(plan, path)
    await _fill(path, manifest, cached, plan, io, limiter)
    result = plan.result
    # As in _load, ``read_plan`` included (it holds the manifest); ``result`` stays alive through its name.
    box: list[object] = [manifest, plan, read_plan]
    del manifest, plan, read_plan
    await release(box, limiter)
    return result


async def run_metadata(path: Location, limiter: anyio.CapacityLimiter | None = None) -> Metadata:
    """The :class:`Metadata` of the committed checkpoint at ``path`` (see :func:`aiockpt.read_metadata`).

    Raises:
        CheckpointNotFoundError: ``path`` is not a committed checkpoint.
        FormatError: The manifest is unreadable or from a newer format.
        CorruptionError: The manifest's checksum does not match (names the file).
        StorageError: Object storage could not be read.
    """
    if isinstance(path, S3Path):
        from .._storage._s3 import get, url
        from .._storage._s3 import read_manifest as read_object_manifest

        raw = await get(path, MANIFEST_NAME)
        if raw is None:
            await read_object_manifest(path)  # (raises the right CheckpointNotFoundError)
        assert raw is not None
        summary = await run_sync(partial(decode_summary, raw, url(path, MANIFEST_NAME)), limiter)
    else:
        summary = await run_sync(partial(read_summary, path), limiter)
    manifest, crc, nbytes = summary
    metadata = Metadata.of(str(path), manifest, crc, nbytes)
    box: list[object] = [summary, manifest]  # a large manifest's bookkeeping: freed in a worker thread
    del summary, manifest
    await release(box, limiter)
    return metadata


async def exists(path: Location) -> bool:
    """Whether the checkpoint directory ``path`` (on object storage: a committed checkpoint) is there."""
    if isinstance(path, S3Path):
        from .._storage._s3 import committed

        return await committed(path)
    return await run_sync(path.exists)


async def deleted_meanwhile(path: Location, exc: CorruptionError) -> CheckpointNotFoundError | None:
    """The error to raise instead of ``exc`` if the checkpoint ``path`` is gone now, else ``None``.

    A checkpoint that another process's retention deletes while it is read makes the read fail as if it
    were damaged (a data file missing, once its manifest was read): it was deleted, not damaged, and
    nothing was loaded (every data file is opened before the first byte is handed out).
    """
    if await exists(path):
        return None
    return CheckpointNotFoundError(
        f"{path} was deleted while it was read (retention by another process?); nothing was loaded"
    )
