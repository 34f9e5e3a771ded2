"""The save pipeline: stage -> local plan -> global plan -> write -> finish, one module per stage.

:func:`run_save` drives one save through the stages on every rank of a :class:`~aiockpt._world.World`.
Before the commit point any failure or cancellation removes the temp directory (shielded) and gives the
staging buffer back; the commit itself is shielded and always completes or fails as a whole.
"""

from __future__ import annotations

import contextlib
import os
import uuid
import warnings
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Protocol, cast

import anyio

from .._codec import SlicedDecoder
from .._codec import encode as sliced_encode
from .._cuda import noting
from .._errors import CheckpointExistsError, DistributedError, StorageError
from .._format import MANIFEST_NAME, DictNode, Manifest
from .._fs import LOCK_SUFFIX, NAME_MAX, OwnerLock, not_a_directory, read_regular, remove_tree, temp_name
from .._gc import collect_young, paused
from .._handle import Metadata, SaveMetrics, SaveState
from .._insulate import warn_at_caller
from .._load._manifest import decode_summary
from .._memory import StagingPool
from .._merge import Merged, Signature, merge, reindex
from .._options import IOConfig
from .._storage import Location, S3Path
from .._threads import acquire_sync, dismantle, release, responsive, run_sync
from .._world import World
from . import _ranks
from ._finish import UserMetadata as UserMetadata
from ._finish import build_manifest, check_metadata, commit, encode_manifest
from ._finish import metadata_of as metadata_of
from ._global_plan import GlobalPlan, RankPlan, global_plan
from ._local_plan import LocalPlan, WriteItem, local_plan
from ._protocol import Exchanges, Status, describe
from ._stage import Staged, reserve, stage
from ._write import WriteResult, write

# Messages between ranks: items in msgpack bin slices (see sliced_encode's ``blobs``).
_LOCAL_PLAN = SlicedDecoder(LocalPlan, "items", WriteItem, blobs=True)
_WRITE_RESULT = SlicedDecoder(WriteResult, "checksums", tuple[int, ...], blobs=True)


@dataclass(frozen=True, kw_only=True)
class SaveRequest:
    """One save: what to save, where, and how."""

    state: Mapping[str, object]
    path: Location
    step: int | None = None
    copy: bool = False
    allow_pickle: bool = False
    user_metadata: UserMetadata = field(default_factory=dict)
    io: IOConfig = field(default_factory=IOConfig)
    # Collective-free saves: (rank, world size) of the part this process writes alone.
    part: tuple[int, int] | None = None
    # Awaited by the coordinator before the plan is shared, so before any rank writes: a Checkpointer's
    # removal of the steps its retention deleted, whose space the save may need.
    settle: Callable[[], Awaitable[None]] | None = None


@dataclass
class _Local:
    """This rank's local plan, encoded, and (in a world of several) what the ``trees`` exchange needs."""

    plan: bytes
    digest: int = 0
    message: _ranks.RankTree | None = None


def _plan_local(rank: int, staged: Staged, world_size: int) -> _Local:
    with paused():
        local = local_plan(rank, staged.flat, staged.specs)
        encoded = sliced_encode(local, "items", blobs=True)
        out = _Local(encoded)
        sigs: list[Signature] = []
        if world_size > 1:
            sigs = _ranks.signatures(local.items, staged.flat.boxes, staged.sources)
            out = _Local(encoded, *_ranks.digest(staged.flat.tree, sigs))
        box: list[object] = [local, sigs]  # one item per tensor: freed in slices, not in one stall
        del local, sigs
        dismantle(box)
    return out


def _merge_trees(gathered: list[memoryview]) -> Merged:
    with paused():
        trees = [_ranks.decode_rank_tree(b) for b in gathered]
        return merge([t for t, _ in trees], [s for _, s in trees])


def _plan_global(gathered: list[memoryview], merged: Merged | None, tag: str) -> GlobalPlan:
    with paused():
        plans = [_LOCAL_PLAN.decode(b) for b in gathered]
        plan = global_plan(plans, *((merged.own, merged.shared) if merged is not None else ()), tag=tag)
        box: list[object] = [plans]
        del plans
        dismantle(box)
        collect_young()  # the plan's tuple of tensor entries, made whole
    return plan


def _tree(flat_tree: DictNode, merged: Merged | None, plan: GlobalPlan) -> DictNode:
    """The manifest's tree: this (rank 0's) tree, or where ranks' trees differ, the merged one."""
    if merged is None:
        return flat_tree
    return reindex(merged.tree, {(r, j): t for r, j, t in plan.own})


def _manifest(
    plan: GlobalPlan,
    results: list[memoryview],
    tree: DictNode,
    merged: Merged | None,
    req: SaveRequest,
) -> tuple[Manifest, list[bytes], int, int]:
    with paused():
        manifest = build_manifest(
            plan,
            [_WRITE_RESULT.decode(b) for b in results],
            tree=_tree(tree, merged, plan),
            step=req.step,
            block=req.io.checksum_block,
            user_metadata=req.user_metadata,
            part=req.part,
        )
        encoded, crc = encode_manifest(manifest)
        collect_young()  # the manifest's tuple of tensor entries, made whole
        return manifest, encoded, crc, sum(c.nbytes for t in manifest.tensors for c in t.chunks)


def _check_target(path: Path) -> None:
    if os.path.lexists(path):
        if os.path.isdir(path) and not os.path.lexists(path / MANIFEST_NAME):
            # Never one of aiockpt's (a save publishes its directory whole, manifest included): a copy
            # being made, a checkpoint whose manifest was removed... not aiockpt's to replace either.
            raise CheckpointExistsError(
                f"{path} already exists, and holds no checkpoint (no {MANIFEST_NAME}: not one that a save "
                "completed); aiockpt never overwrites what is there: remove it to save there"
            )
        if not os.path.isdir(path):
            raise CheckpointExistsError(
                f"{path} already exists, and is no directory (a file where the checkpoint would go); aiockpt "
                "never overwrites what is there: remove it to save there"
            )
        raise CheckpointExistsError(f"{path} already exists; aiockpt never overwrites a checkpoint")
    # The temp name is cut to fit (see temp_name): a name too long would only fail at the commit.
    if len(os.fsencode(path.name)) > NAME_MAX:
        raise StorageError(
            f"cannot save to {path}: its name is {len(os.fsencode(path.name))} bytes, longer than the "
            f"{NAME_MAX} a file name may have",
            path=str(path),
        )


def _prepare_target(path: Path) -> tuple[Path, OwnerLock]:
    _check_target(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return open_tmp(path)
    except (FileExistsError, NotADirectoryError) as exc:
        blocked = not_a_directory(path.parent)
        if blocked is None:  # (not a file in the way: the temp dir's own name was taken, say)
            why = exc.strerror or exc
            raise StorageError(f"cannot create a temp dir beside {path}: {why}", path=str(path)) from exc
        raise StorageError(
            f"cannot create a temp dir beside {path}: {blocked} is not a directory", path=str(blocked)
        ) from exc
    except OSError as exc:
        reason = exc.strerror or exc
        raise StorageError(f"cannot create a temp dir beside {path}: {reason}", path=str(path)) from exc


async def _give_back(pool: StagingPool, staged: Staged, limiter: anyio.CapacityLimiter | None) -> None:
    """Return the staging buffer to the pool from a worker thread.

    If the pool is closed the buffer is freed, and unmapping gigabytes takes long enough to stall the
    event loop: the thread must hold the last reference, hence the hand-over through a list.
    """
    if staged.buffer is not None:
        box = [staged.buffer]
        staged.buffer = None
        # Shielded: a cancellation must not stop the hand-back after the buffer left `staged`.
        with anyio.CancelScope(shield=True):
            await run_sync(lambda: pool.release(box.pop()), limiter)
        pool.notify()


def _read_summary(path: Path) -> tuple[Manifest, int, int]:
    """What a non-coordinator rank reports about a checkpoint rank 0 published (checked as a load would)."""
    file = path / MANIFEST_NAME
    return decode_summary(read_regular(file), str(file))


def open_tmp(path: Path) -> tuple[Path, OwnerLock]:
    """A new temp directory beside ``path`` and its owner lock (garbage collection spares it). Blocking."""
    tmp = path.with_name(temp_name(path.name, uuid.uuid4().hex[:12]))
    lock = OwnerLock(tmp.with_name(tmp.name + LOCK_SUFFIX))
    try:
        tmp.mkdir()
    except BaseException:
        with contextlib.suppress(OSError):  # the mkdir's error is the one to report; the lock is gone
            lock.release()
        raise
    return tmp, lock


def discard_tmp(tmp: Path, lock: OwnerLock) -> None:
    """Remove what is left of ``tmp`` (nothing, once renamed into place), then its lock. Blocking."""
    try:
        remove_tree(tmp)
    finally:
        lock.release()


class Target(Protocol):
    """The storage side of one save on one rank: a local directory or an S3 prefix.

    Every rank runs the whole save inside :meth:`hold`. Rank 0 (the coordinator) calls :meth:`check` and
    :meth:`prepare`, whose token reaches every rank's :meth:`tag` (what the global plan names data files
    with) and :meth:`write`, then :meth:`commit` and :meth:`published`; other ranks call :meth:`summary`
    once rank 0 committed. Every rank calls :meth:`discard` (shielded) when the save fails before its commit.
    :meth:`published` runs past the commit point: what fails there is warned about, never raised (the
    save stands).
    """

    async def hold(self, body: Callable[[], Awaitable[Metadata]]) -> Metadata: ...
    async def check(self) -> None: ...
    async def prepare(self) -> str: ...
    def tag(self, token: str) -> str: ...
    async def write(
        self, token: str, plan: RankPlan, sources: Sequence[memoryview], io: IOConfig
    ) -> WriteResult: ...
    async def commit(self, manifest: Sequence[bytes]) -> None: ...
    async def published(self) -> None: ...
    async def discard(self) -> None: ...
    async def summary(self) -> tuple[Manifest, int, int]: ...


class _LocalTarget:
    """A checkpoint directory: a temp directory beside it, renamed into place (see ``_finish``)."""

    def __init__(self, path: Path, limiter: anyio.CapacityLimiter | None) -> None:
        self.path = path
        self.limiter = limiter
        self.tmp: tuple[Path, OwnerLock] | None = None

    async def hold(self, body: Callable[[], Awaitable[Metadata]]) -> Metadata:
        return await body()

    async def check(self) -> None:
        await run_sync(partial(_check_target, self.path), self.limiter)

    async def prepare(self) -> str:
        self.tmp = await acquire_sync(partial(_prepare_target, self.path), self.limiter)
        return self.tmp[0].name

    def tag(self, token: str) -> str:
        return ""  # the temp directory is the save's own: its files keep their plain names

    async def write(
        self, token: str, plan: RankPlan, sources: Sequence[memoryview], io: IOConfig
    ) -> WriteResult:
        directory = self.path.with_name(token)
        return await write(
            plan,
            sources,
            directory,
            block=io.checksum_block,
            threads=io.thread_count,
            direct=io.direct_writes,
            direct_threads=io.direct_thread_count,
            limiter=self.limiter,
        )

    async def commit(self, manifest: Sequence[bytes]) -> None:
        assert self.tmp is not None
        await commit(self.tmp[0], self.path, manifest, self.limiter)

    async def published(self) -> None:
        if self.tmp is None:
            return
        # Only the temp dir's lock remains. It is let go of first: the save is committed, so nothing may
        # release (or discard) it again, whatever the release below does.
        lock = self.tmp[1]
        self.tmp = None
        try:
            await run_sync(lock.release, self.limiter)
        except OSError as exc:
            # Past the commit point: the save stands. The lock is dropped all the same; a lock file left
            # behind has no owner, and goes when a Checkpointer next opens the directory (collect_garbage).
            warn_at_caller(
                f"saved {self.path}, but releasing its temp dir's lock {lock.path} then failed: "
                f"{exc.strerror or exc}; the checkpoint is committed (a lock file left behind is removed "
                f"when a Checkpointer next opens {self.path.parent})",
                RuntimeWarning,
            )

    async def discard(self) -> None:
        if self.tmp is not None:
            await run_sync(partial(discard_tmp, *self.tmp), self.limiter)
            self.tmp = None

    async def summary(self) -> tuple[Manifest, int, int]:
        return await run_sync(lambda: _read_summary(self.path), self.limiter)


async def _discard(target: Target, where: object) -> None:
    """Remove what a failed save left; a failure to is warned about, never raised over the save's own.

    The save's error (or cancellation) is what its caller must see: a write refused, say, with the
    deletes refused too (a store whose policy lacks DeleteObject), raised the delete's ``StorageError``.
    What is left is collected later: a local temp directory when its root is next opened, an object
    store's objects with their lease.
    """
    try:
        await target.discard()
    except Exception as exc:
        warnings.warn(
            f"cleaning up after the failed save to {where} failed, and what it wrote is left until it is "
            f"collected: {exc}",
            RuntimeWarning,
            stacklevel=2,
        )


def _target(req: SaveRequest, limiter: anyio.CapacityLimiter | None) -> Target:
    if isinstance(req.path, S3Path):
        if req.part is not None:
            raise StorageError(
                f"use_collectives=False is not supported on object storage ({req.path})", path=str(req.path)
            )
        from .._storage._s3 import S3Target  # the client is imported only by those who use it

        return S3Target(req.path, limiter)
    return _LocalTarget(req.path, limiter)


async def run_reserve(
    state: Mapping[str, object], *, pool: StagingPool, allow_pickle: bool, io: IOConfig
) -> int:
    """Allocate and keep in ``pool`` the staging buffer a save of ``state`` with ``copy=True`` needs.

    As a save would: at its lowered priority, on the caller's CUDA device (see ``_stage.reserve``).

    Raises:
        StateError: The state holds something that cannot be saved; the message names the key.
        BusyError: The staging budget cannot hold the buffer.
    """
    with responsive(io, lowered=True), noting():
        return await reserve(state, pool=pool, allow_pickle=allow_pickle)


async def run_save(
    req: SaveRequest,
    *,
    world: World,
    pool: StagingPool,
    metrics: SaveMetrics,
    report: Callable[[SaveState], None],
    limiter: anyio.CapacityLimiter | None = None,
) -> Metadata:
    """Save ``req.state`` to ``req.path`` on every rank of ``world`` (a collective call).

    The cyclic garbage collector is paused for the whole save (see ``_gc``): the save's own bookkeeping
    objects are freed by reference counting when :func:`_save` returns, before it resumes, so they never
    trigger a full collection, which would hold the GIL, and so stall the event loop, for a long time.
    The save runs inside its target's :meth:`Target.hold` (on S3, where its lease is renewed).

    ``report(SaveState.STAGED)`` is called once the caller may mutate the state again, and
    ``report(SaveState.WRITING)`` when this rank starts writing.

    Raises:
        CheckpointExistsError: ``req.path`` exists.
        StateError: The state or the user metadata cannot be saved; names the key.
        StorageError: Writing failed (e.g. disk full); earlier checkpoints are untouched.
        DistributedError: Another rank failed or was cancelled (names the ranks), or a collective timed out.
    """
    with responsive(req.io, lowered=True), noting():
        target = _target(req, limiter)
        body = partial(
            _save, target, req, world=world, pool=pool, metrics=metrics, report=report, limiter=limiter
        )
        return await target.hold(body)


async def _save(
    target: Target,
    req: SaveRequest,
    *,
    world: World,
    pool: StagingPool,
    metrics: SaveMetrics,
    report: Callable[[SaveState], None],
    limiter: anyio.CapacityLimiter | None = None,
) -> Metadata:
    """Body of :func:`run_save`, on ``target``."""
    coordinator = world.rank == 0
    exchanges = Exchanges(world, save=str(req.path))
    staged: Staged | None = None
    try:
        # --- stage and local plan: this rank alone
        check_metadata(cast("Mapping[object, object]", req.user_metadata))  # before a byte is written
        if coordinator:  # fail fast; the temp dir is made after staging, off the caller's critical path
            await target.check()
        staged = await stage(
            req.state,
            copy=req.copy,
            pool=pool,
            allow_pickle=req.allow_pickle,
            waiting=metrics.waiting,
            limiter=limiter,
        )
        metrics.phase("stage")
        metrics.nbytes, metrics.staged_bytes = staged.nbytes, staged.copied
        report(SaveState.STAGED)
        token = await target.prepare() if coordinator else ""
        local = await run_sync(partial(_plan_local, world.rank, staged, world.size), limiter)
        metrics.phase("local_plan")

        # --- global plan: every rank computes the same pure plan from everyone's local plans
        if coordinator and req.settle is not None:
            with metrics.waiting():
                await req.settle()
        mine = Status(ok=True, payload=memoryview(local.plan), tmp=token, digest=local.digest)
        statuses = await exchanges.exchange("plan", mine)
        exchanges.check("plan", statuses)
        merged = None
        if exchanges.next_step == "trees":  # the ranks' trees differ: per-rank state (see _ranks)
            assert local.message is not None  # (digests are exchanged in worlds of several only)
            payload = await run_sync(partial(_ranks.encode_rank_tree, local.message), limiter)
            trees = await exchanges.exchange("trees", Status(ok=True, payload=memoryview(payload)))
            exchanges.check("trees", trees)
            merged = await run_sync(partial(_merge_trees, [s.payload for s in trees]), limiter)
            del trees
        del local
        tag = target.tag(statuses[0].tmp)  # (rank 0's token, the same on every rank)
        plan = await run_sync(partial(_plan_global, [s.payload for s in statuses], merged, tag), limiter)
        metrics.phase("global_plan")

        # --- write: this rank's chunks
        report(SaveState.WRITING)
        result = await target.write(statuses[0].tmp, plan.ranks[world.rank], staged.sources, req.io)
        metrics.written_bytes, metrics.direct_bytes = result.nbytes, result.direct_nbytes
        metrics.phase("write")
        await _give_back(pool, staged, limiter)

        # --- finish: votes, then the coordinator commits and tells everyone
        payload = await run_sync(partial(sliced_encode, result, "checksums", blobs=True), limiter)
        vote = Status(ok=True, payload=memoryview(payload))
        statuses = await exchanges.exchange("vote", vote)
        outcome = Status(ok=True)
        summary: tuple[Manifest, int, int] | None = None
        if coordinator:
            try:
                exchanges.check("vote", statuses)
                manifest, encoded, crc, nbytes = await run_sync(
                    partial(_manifest, plan, [s.payload for s in statuses], staged.flat.tree, merged, req),
                    limiter,
                )
                await target.commit(encoded)
                summary = (manifest, crc, nbytes)
            except Exception as exc:
                culprits = tuple(exc.ranks) if isinstance(exc, DistributedError) and exc.ranks else (0,)
                outcome = Status(ok=False, error=describe(exc), culprits=culprits)
                with anyio.CancelScope(shield=True):
                    await exchanges.exchange("outcome", outcome)
                raise
        # Past the commit point (or waiting to learn whether rank 0 reached it) nothing is cancellable:
        # a save that published must end as committed, with its bookkeeping done.
        with anyio.CancelScope(shield=True):
            if summary is not None:
                await target.published()
            try:
                statuses = await exchanges.exchange("outcome", outcome)
            except DistributedError as exc:
                if summary is not None:
                    raise
                # Rank 0 may have died after its commit: the checkpoint is then there, complete.
                raise DistributedError(
                    f"{exc}; whether rank 0 published {req.path} before that is unknown here: a load "
                    "finds it if it did",
                    ranks=exc.ranks,
                ) from exc
            exchanges.settled = True
            if not statuses[0].ok:
                raise DistributedError(
                    f"rank 0 did not publish {req.path}: {statuses[0].error}",
                    ranks=list(statuses[0].culprits) or [0],
                )
            metrics.phase("finish")
            if summary is None:
                summary = await target.summary()
    except BaseException as exc:
        with anyio.CancelScope(shield=True):
            await exchanges.abort(describe(exc))
            await _discard(target, req.path)
        raise
    finally:
        exchanges.close()  # the next save over this group may take its exchanges
        if staged is not None:
            with anyio.CancelScope(shield=True):
                await _give_back(pool, staged, limiter)
    assert summary is not None
    manifest, crc, nbytes = summary
    metadata = Metadata.of(str(req.path), manifest, crc, nbytes, metrics)
    # Neither name may keep the bookkeeping alive once it is handed to the thread that frees it.
    box: list[object] = [staged, plan, result, summary, manifest]
    del staged, plan, result, summary, manifest
    await release(box, limiter)
    return metadata
