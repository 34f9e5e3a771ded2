"""The save pipeline: stage -> local plan -> global plan -> write -> finish, one module per stage.

:func:`run_save` drives one save through the stages on every rank of a :class:`~aiockpt._world.World`.
Before the commit point any failure or cancellation removes the temp directory (shielded) and gives the
staging buffer back; the commit itself is shielded and always completes or fails as a whole.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import anyio
import msgspec

from .._errors import CheckpointExistsError, StorageError
from .._format import ENCODER, DictNode, Manifest
from .._fs import LOCK_SUFFIX, TMP_PREFIX, OwnerLock, remove_tree
from .._gc import paused
from .._handle import Metadata, SaveMetrics
from .._memory import StagingPool
from .._options import IOConfig
from .._threads import run_sync
from .._world import World
from ._finish import build_manifest, commit, encode_manifest
from ._global_plan import GlobalPlan, RankPlan, global_plan
from ._local_plan import LocalPlan, local_plan
from ._stage import Staged, stage
from ._write import WriteResult, write

_LOCAL_PLAN = msgspec.msgpack.Decoder(LocalPlan)
_RANK_PLAN = msgspec.msgpack.Decoder(RankPlan)
_WRITE_RESULT = msgspec.msgpack.Decoder(WriteResult)


@dataclass(frozen=True, kw_only=True)
class SaveRequest:
    """One save: what to save, where, and how."""

    state: Mapping[str, object]
    path: Path
    step: int | None = None
    copy: bool = False
    allow_pickle: bool = False
    user_metadata: dict[str, str | int | float | bool | None] = field(default_factory=dict)
    io: IOConfig = field(default_factory=IOConfig)


def _plan_local(rank: int, staged: Staged) -> bytes:
    with paused():
        return ENCODER.encode(local_plan(rank, staged.flat))


def _plan_global(gathered: list[bytes]) -> tuple[GlobalPlan, list[bytes]]:
    with paused():
        plan = global_plan([_LOCAL_PLAN.decode(b) for b in gathered])
        return plan, [ENCODER.encode(r) for r in plan.ranks]


def _manifest(
    plan: GlobalPlan, results: list[bytes], tree: DictNode, req: SaveRequest
) -> tuple[Manifest, bytes, int, int]:
    with paused():
        manifest = build_manifest(
            plan,
            [_WRITE_RESULT.decode(b) for b in results],
            tree=tree,
            step=req.step,
            block=req.io.checksum_block,
            user_metadata=req.user_metadata,
        )
        encoded, crc = encode_manifest(manifest)
        return manifest, encoded, crc, sum(c.nbytes for t in manifest.tensors for c in t.chunks)


def _check_target(path: Path) -> None:
    if os.path.lexists(path):
        raise CheckpointExistsError(f"{path} already exists; aiockpt never overwrites a checkpoint")
    path.parent.mkdir(parents=True, exist_ok=True)


def _open_tmp(path: Path) -> tuple[Path, OwnerLock]:
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}-{uuid.uuid4().hex[:12]}")
    lock = OwnerLock(tmp.with_name(tmp.name + LOCK_SUFFIX))
    try:
        tmp.mkdir()
    except BaseException:
        lock.release()
        raise
    return tmp, lock


def _discard_tmp(tmp: Path, lock: OwnerLock) -> None:
    try:
        remove_tree(tmp)
    finally:
        lock.release()


async def run_save(
    req: SaveRequest,
    *,
    world: World,
    pool: StagingPool,
    metrics: SaveMetrics,
    on_staged: Callable[[], None],
    limiter: anyio.CapacityLimiter | None = None,
) -> Metadata:
    """Save ``req.state`` to ``req.path``; call ``on_staged()`` once the caller may mutate the state.

    Raises:
        CheckpointExistsError: ``req.path`` exists.
        StateError: The state cannot be saved; names the key.
        StorageError: Writing failed (e.g. disk full); earlier checkpoints are untouched.
    """
    try:
        await run_sync(lambda: _check_target(req.path), limiter)
    except OSError as exc:
        raise StorageError(
            f"cannot create {req.path.parent}: {exc.strerror or exc}", path=str(req.path)
        ) from exc
    staged = await stage(req.state, copy=req.copy, pool=pool, allow_pickle=req.allow_pickle, limiter=limiter)
    metrics.phase("stage")
    metrics.nbytes, metrics.staged_bytes = staged.nbytes, staged.copied
    tmp: tuple[Path, OwnerLock] | None = None
    try:
        on_staged()

        local = await run_sync(partial(_plan_local, world.rank, staged), limiter)
        metrics.phase("local_plan")

        gathered = await world.gather(local)
        plan: GlobalPlan | None = None
        payloads: list[bytes] | None = None
        if gathered is not None:
            plan, payloads = await run_sync(partial(_plan_global, gathered), limiter)
        mine = _RANK_PLAN.decode(await world.scatter(payloads))
        metrics.phase("global_plan")

        try:
            tmp = await run_sync(lambda: _open_tmp(req.path), limiter)
        except OSError as exc:
            raise StorageError(
                f"cannot create a temp dir beside {req.path}: {exc}", path=str(req.path)
            ) from exc
        result = await write(
            mine, staged.sources, tmp[0], block=req.io.checksum_block, threads=req.io.threads, limiter=limiter
        )
        metrics.written_bytes = result.nbytes
        metrics.phase("write")
        if staged.buffer is not None:
            pool.release(staged.buffer)
            staged.buffer = None

        results = await world.gather(ENCODER.encode(result))
        assert plan is not None
        assert results is not None
        manifest, encoded, manifest_crc, nbytes = await run_sync(
            lambda: _manifest(plan, results, staged.flat.tree, req), limiter
        )
        await commit(tmp[0], req.path, encoded, limiter)
        await run_sync(tmp[1].release, limiter)
        tmp = None
        metrics.phase("finish")
    except BaseException:
        if tmp is not None:
            with anyio.CancelScope(shield=True):
                await run_sync(partial(_discard_tmp, *tmp), limiter)
        raise
    finally:
        if staged.buffer is not None:
            pool.release(staged.buffer)
    return Metadata(
        path=str(req.path),
        step=req.step,
        world_size=manifest.world_size,
        nbytes=nbytes,
        num_tensors=len(manifest.tensors),
        files=manifest.files,
        created_at=manifest.created_at,
        manifest_crc32c=manifest_crc,
        timings=dict(metrics.seconds),
    )
