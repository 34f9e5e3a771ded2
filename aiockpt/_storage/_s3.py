"""The S3 backend: objects, listings, the save target and the manifest read, over ``obstore``.

An object store has no rename, so the commit point is the manifest object itself: every rank uploads its
data object straight under the checkpoint's prefix and verifies its size, then the coordinator puts
``manifest.msgpack`` with a create-only (``If-None-Match: *``) request. Every object of a save carries a
token unique to that save in its name (``data-rNNNNN-<token>.bin``), so that saves racing to one prefix
never touch each other's objects: one commits, the others fail and delete their own. A prefix without a
manifest is an uncommitted save: never listed, never loaded, deleted by the save that wrote it when it
fails, or, once abandoned, by a :class:`~aiockpt.Checkpointer` or a later save of it. The save's lease
tells an abandoned save from a running one (``_s3_lease``).

``obstore`` (Rust ``object_store``) is async-native: no request blocks the event loop and no thread is
held while waiting on the network. It signs requests, retries 5xx, throttling and dropped connections
with backoff, and runs multipart uploads (aborting them on failure).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Awaitable, Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, TypeVar

import anyio
import obstore
from obstore.exceptions import AlreadyExistsError, BaseError
from obstore.store import S3Store

from .._errors import CheckpointError, CheckpointExistsError, CheckpointNotFoundError, StorageError
from .._format import MANIFEST_NAME, Manifest
from .._load._manifest import decode_manifest, decode_summary
from .._threads import run_sync
from . import S3Options, S3Path

if TYPE_CHECKING:
    from anyio.abc import TaskGroup
    from obstore import ObjectMeta
    from obstore.store import ClientConfig, RetryConfig, S3Config

    from .._options import IOConfig
    from .._save._global_plan import RankPlan
    from .._save._write import WriteResult
    from ._s3_lease import Lease

T = TypeVar("T")

# Errors a request may end with: the client's own, and the OS-level ones it re-raises as built-ins.
ERRORS = (BaseError, OSError)

# Part of the cache key: the same options mean another store once the environment changed.
_ENV = (
    "AWS_ENDPOINT_URL",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
)
_stores: dict[tuple[str, S3Options, tuple[str | None, ...]], S3Store] = {}


def store(path: S3Path) -> S3Store:
    """The client of ``path``'s bucket (cached; building one reads the environment, no network)."""
    env = tuple(os.environ.get(k) for k in _ENV)
    cache_key = (path.bucket, path.options, env)
    found = _stores.get(cache_key)
    if found is not None:
        return found
    opts = path.options
    config: S3Config = {}
    if opts.endpoint is not None:
        config["endpoint"] = opts.endpoint
    if opts.region is not None:
        config["region"] = opts.region
    endpoint = opts.endpoint or os.environ.get("AWS_ENDPOINT_URL") or ""
    client: ClientConfig = {"timeout": timedelta(seconds=opts.request_timeout)}
    if endpoint.startswith("http://"):
        client["allow_http"] = True
    retry: RetryConfig = {
        "max_retries": opts.max_retries,
        "retry_timeout": timedelta(seconds=opts.retry_timeout),
        "backoff": {"init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=15)},
    }
    made = S3Store(path.bucket, config=config, client_options=client, retry_config=retry)
    _stores[cache_key] = made
    return made


def url(path: S3Path, name: str) -> str:
    """The URL of object ``name`` under ``path``."""
    return str(path / name)


def _failed(what: str, where: str, exc: BaseException) -> StorageError:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return StorageError(f"cannot {what} {where}: {first}", path=where)


# --- Objects ---------------------------------------------------------------------------------------------


async def get(path: S3Path, name: str) -> bytes | None:
    """The bytes of object ``name`` under ``path``, or ``None`` if there is none.

    Raises:
        StorageError: The request failed (after retries).
    """
    try:
        result = await obstore.get_async(store(path), (path / name).key)
        return bytes(await result.bytes_async())
    except FileNotFoundError:
        return None
    except ERRORS as exc:
        raise _failed("read", url(path, name), exc) from exc


async def fetch(path: S3Path, name: str) -> tuple[bytes, ObjectMeta] | None:
    """The bytes and metadata of object ``name`` under ``path``, or ``None`` if there is none.

    Raises:
        StorageError: The request failed (after retries).
    """
    try:
        result = await obstore.get_async(store(path), (path / name).key)
        return bytes(await result.bytes_async()), result.meta
    except FileNotFoundError:
        return None
    except ERRORS as exc:
        raise _failed("read", url(path, name), exc) from exc


async def head(path: S3Path, name: str) -> ObjectMeta | None:
    """The metadata of object ``name`` under ``path``, or ``None`` if there is none.

    Raises:
        StorageError: The request failed (after retries).
    """
    try:
        return await obstore.head_async(store(path), (path / name).key)
    except FileNotFoundError:
        return None
    except ERRORS as exc:
        raise _failed("read", url(path, name), exc) from exc


def object_size(path: S3Path, name: str) -> int | None:
    """The size of object ``name`` under ``path``, or ``None`` if there is none. Blocking (a worker thread's).

    Raises:
        StorageError: The request failed (after retries).
    """
    try:
        return int(obstore.head(store(path), (path / name).key)["size"])
    except FileNotFoundError:
        return None
    except ERRORS as exc:
        raise _failed("read", url(path, name), exc) from exc


async def put(path: S3Path, name: str, data: bytes, *, create: bool) -> None:
    """Put object ``name`` under ``path``; with ``create``, only if it does not exist.

    Raises:
        FileExistsError: ``create`` and the object exists.
        StorageError: The request failed (after retries).
    """
    try:
        await obstore.put_async(
            store(path), (path / name).key, data, mode="create" if create else "overwrite"
        )
    except AlreadyExistsError as exc:
        raise FileExistsError(url(path, name)) from exc
    except ERRORS as exc:
        raise _failed("write", url(path, name), exc) from exc


async def listing(path: S3Path) -> list[ObjectMeta]:
    """Every object under ``path`` (recursively), keys relative to the bucket.

    Raises:
        StorageError: The request failed (after retries).
    """
    try:
        return [m for batch in await _list(path) for m in batch]
    except ERRORS as exc:
        raise _failed("list", str(path), exc) from exc


async def _list(path: S3Path) -> list[Sequence[ObjectMeta]]:
    # One future for the whole listing, and no reference to the stream kept here: a stream given up
    # part-way (its task cancelled while a page was in flight) is dropped by Python, outside obstore's
    # runtime, which panics there and leaves the store's client broken for every later request of the
    # process. The future alone is dropped inside the runtime.
    return [await obstore.list(store(path), path.key + "/", chunk_size=1000).collect_async()]


async def delete(path: S3Path, keys: Sequence[str]) -> None:
    """Delete objects (keys relative to the bucket); missing ones are fine.

    Raises:
        StorageError: The request failed (after retries).
    """
    if not keys:
        return
    try:
        await obstore.delete_async(store(path), list(keys))
    except FileNotFoundError:
        pass
    except ERRORS as exc:
        raise _failed("delete objects under", str(path), exc) from exc


async def remove(path: S3Path) -> None:
    """Delete the checkpoint at ``path``: its manifest first (it stops being one), then the rest."""
    await delete(path, [(path / MANIFEST_NAME).key])
    await delete(path, [m["path"] for m in await listing(path)])


# --- Manifests -------------------------------------------------------------------------------------------


async def read_manifest(path: S3Path) -> Manifest:
    """Read, verify and decode the manifest of the checkpoint at ``path``.

    Raises:
        CheckpointNotFoundError: There is no manifest (no objects at all, or an incomplete save).
        FormatError: The manifest is not an aiockpt manifest or has a newer format version.
        CorruptionError: The manifest's checksum does not match (names its URL).
        StorageError: A request failed.
    """
    raw = await get(path, MANIFEST_NAME)
    if raw is None:
        if await listing(path):
            raise CheckpointNotFoundError(
                f"{path} is incomplete: it has no {MANIFEST_NAME} (a save in progress, failed or abandoned)"
            )
        raise CheckpointNotFoundError(f"no checkpoint at {path}: it does not exist")
    return await run_sync(lambda: decode_manifest(raw, url(path, MANIFEST_NAME)))


# --- Saving ----------------------------------------------------------------------------------------------


class S3Target:
    """The storage side of one save to ``path`` on one rank (see the module docstring).

    The coordinator's :meth:`prepare` makes the save's token and takes its lease, renewed by a task of the
    task group that :meth:`hold` runs the save in; every rank's data object is named with the token.
    """

    def __init__(self, path: S3Path, limiter: anyio.CapacityLimiter | None = None) -> None:
        self.path = path
        self.limiter = limiter
        self._written: list[str] = []
        self._committed = False
        self._lease: Lease | None = None
        self._group: TaskGroup | None = None
        # Keys of saves whose process died while committing (see ``Cleared.beside``): this save goes on
        # beside them, and deletes them once its own manifest is in place.
        self._beside: tuple[tuple[str, ...], ...] = ()

    async def hold(self, body: Callable[[], Awaitable[T]]) -> T:
        """Run ``body``, the save on this rank, in a task group where the lease can be renewed.

        Raises:
            Exception: Whatever ``body`` raises, as it is (not in an exception group).
        """
        failure: Exception | None = None
        result: list[T] = []
        async with anyio.create_task_group() as tg:
            self._group = tg
            try:
                result.append(await body())
            except Exception as exc:
                failure = exc
            finally:
                self._group = None
                tg.cancel_scope.cancel()  # (the renewals end with the save: published or discard stop them)
        if failure is not None:
            raise failure
        return result[0]

    async def check(self) -> None:
        """Refuse a prefix that holds a checkpoint, or the objects of a save that may still run.

        The objects of abandoned saves (see ``_s3_lease``) are deleted first; those of a save that died
        while committing are left until this one committed.

        Raises:
            CheckpointExistsError: The prefix holds a checkpoint, or objects of a save that may still run.
            StorageError: A request failed.
        """
        from ._s3_lease import clear

        cleared = await clear(self.path, strict=True)
        if cleared.committed:
            raise CheckpointExistsError(f"{self.path} already exists; aiockpt never overwrites a checkpoint")
        if cleared.nested is not None:
            example = f"s3://{self.path.bucket}/{cleared.nested}"
            raise CheckpointExistsError(
                f"{self.path} holds objects under deeper prefixes ({example}): a Checkpointer's root, or "
                "checkpoints saved under it; a checkpoint goes to a prefix of its own"
            )
        if cleared.live:
            raise CheckpointExistsError(
                f"{self.path} holds the objects of an uncommitted save that may still be running "
                f"({cleared.live[0]}); nothing was written"
            )
        self._beside = cleared.beside

    async def prepare(self) -> str:
        """Check again, just before the uploads, then take this save's lease and start renewing it.

        Returns:
            The save's token, which every rank's data object is named with (see :meth:`tag`).

        Raises:
            CheckpointExistsError: See :meth:`check`.
            StorageError: A request failed.
        """
        from ._s3_lease import Lease, new_token

        await self.check()
        lease = self._lease = Lease(self.path, new_token())  # (set first: a put that failed late landed)
        await lease.take()
        if self._group is not None:  # (None only where a test drives the target without hold())
            await self._group.start(lease.keep)
        return lease.token

    def tag(self, token: str) -> str:
        """What data object names carry: the save's token, so that no two saves share an object."""
        return token

    async def write(
        self, token: str, plan: RankPlan, sources: Sequence[memoryview], io: IOConfig
    ) -> WriteResult:
        """Upload this rank's data object (see :func:`._s3_data.upload`)."""
        from ._s3_data import upload

        if plan.writes:
            self._written.append((self.path / plan.file).key)
        return await upload(
            self.path, plan, sources, block=io.checksum_block, threads=io.thread_count, limiter=self.limiter
        )

    async def commit(self, manifest: Sequence[bytes]) -> None:
        """Put the manifest (its pieces, joined), create-only: the commit point. Shielded, like a rename.

        Its first step marks the lease as committing, which fails if the lease may have expired.

        Raises:
            CheckpointExistsError: Another save committed this prefix meanwhile; nothing was replaced.
            StorageError: The lease lapsed, or a request failed.
        """
        with anyio.CancelScope(shield=True):
            if self._lease is not None:
                await self._lease.committing()
            data = await run_sync(lambda: b"".join(manifest))  # megabytes: not on the loop's thread
            try:
                await put(self.path, MANIFEST_NAME, data, create=True)
            except FileExistsError as exc:
                # A retried put whose first attempt landed also sees "exists": it is ours if the bytes are.
                if await get(self.path, MANIFEST_NAME) == data:
                    return
                raise CheckpointExistsError(
                    f"checkpoint {self.path} already exists; nothing was replaced"
                ) from exc
            except StorageError:
                # So may a put reported failed once its retries ran out (the answer lost on the way).
                with contextlib.suppress(StorageError):
                    if await get(self.path, MANIFEST_NAME) == data:
                        return
                raise

    async def published(self) -> None:
        """The manifest is in place: nothing of this save may be deleted any more but its lease.

        The objects of saves that died while committing beside this one go too: their manifest put, had
        it been still in flight, can no longer land.
        """
        from ._s3_lease import remove_save

        self._committed = True
        lease, self._lease = self._lease, None
        if lease is not None:
            await lease.stop()
        # The checkpoint is committed whatever happens here: objects left in a committed prefix are never
        # read, and go with the step.
        with contextlib.suppress(StorageError):
            if lease is not None:
                await lease.drop()
            for keys in self._beside:
                await remove_save(self.path, keys)

    async def discard(self) -> None:
        """Delete what this rank uploaded for a save that did not commit, then its lease. Call shielded.

        Raises:
            StorageError: A request failed.
        """
        lease, self._lease = self._lease, None
        if lease is not None:
            await lease.stop()  # before anything goes: a renewal must not put the lease back
        try:
            if not self._committed and self._written and not await self._ours_committed():
                await delete(self.path, self._written)
                self._written = []
        finally:
            if lease is not None:
                await lease.drop()

    async def _ours_committed(self) -> bool:
        """Whether the prefix's manifest is this save's (a commit reported failed may have landed).

        The manifest of a racing save that won names none of this save's objects, which are deleted.
        """
        raw = await get(self.path, MANIFEST_NAME)
        if raw is None:
            return False
        mine = {key.rpartition("/")[2] for key in self._written}
        try:
            found = await run_sync(lambda: decode_manifest(raw, url(self.path, MANIFEST_NAME)), self.limiter)
        except CheckpointError:
            return True  # cannot tell: leave the objects rather than risk a checkpoint
        return any(f.name in mine for f in found.files)

    async def summary(self) -> tuple[Manifest, int, int]:
        """What a non-coordinator rank reports about the checkpoint rank 0 committed.

        Raises:
            CheckpointNotFoundError: The manifest is missing.
        """
        raw = await get(self.path, MANIFEST_NAME)
        if raw is None:
            raise CheckpointNotFoundError(f"{self.path} has no {MANIFEST_NAME} after its commit")
        return await run_sync(lambda: decode_summary(raw, url(self.path, MANIFEST_NAME)), self.limiter)


# --- Checkpointer roots ----------------------------------------------------------------------------------


async def committed(path: S3Path) -> bool:
    """Whether ``path`` holds a committed checkpoint (its manifest exists).

    Raises:
        StorageError: The request failed.
    """
    try:
        await obstore.head_async(store(path), (path / MANIFEST_NAME).key)
    except FileNotFoundError:
        return False
    except ERRORS as exc:
        raise _failed("read", url(path, MANIFEST_NAME), exc) from exc
    return True
