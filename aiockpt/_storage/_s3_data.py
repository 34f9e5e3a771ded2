"""Moving tensor bytes to and from data objects: multipart uploads out, ranged GETs in.

Both directions reuse the local pipeline's planning: chunks are cut into checksum blocks (``_runs.split``)
and batched into runs of nearby blocks (``_runs.group``). An upload checksums every block in worker
threads, then streams the staged memoryviews themselves (and zero padding between them) to the client,
which cuts them into parts of ``S3Options.part_size``: no concatenated copy of the data object is ever
made. A load fetches each run with one ranged GET, bounded by ``S3Options.concurrency``, and lands it in
destination memory while checksumming it, in a worker thread.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING

import anyio
import anyio.lowlevel
import crc32c
import obstore
import torch

from .._errors import CorruptionError, StorageError
from .._format import Manifest
from .._gc import paused
from .._load._read import prepare, run_all
from .._runs import MAX_GAP, Piece, Run, group, split
from .._save._write import Checksums, WriteResult, _pieces
from .._threads import release, run_sync, run_workers
from .._tree import render
from ._s3 import ERRORS, _failed, store, url

if TYPE_CHECKING:
    from .._load._match import Destination
    from .._load._read import _Read
    from .._save._global_plan import RankPlan
    from . import S3Path

_ZEROS = memoryview(bytes(MAX_GAP))


def _body(pieces: Sequence[Piece], nbytes: int) -> list[memoryview]:
    """The data object as a sequence of views: every piece at its offset, zeros in between."""
    body: list[memoryview] = []
    pos = 0

    def pad(n: int) -> None:
        while n:
            body.append(_ZEROS[: min(n, len(_ZEROS))])
            n -= len(body[-1])

    for p in pieces:
        pad(p.offset - pos)
        if len(p.view):
            body.append(p.view)
        pos = p.offset + len(p.view)
    pad(nbytes - pos)
    return body


class _Stopped(Exception):
    """Raised into the client by :class:`_Body` so that it aborts the multipart upload."""


class _Body:
    """The views of a data object, fed to the client one by one, until ``stop`` is set.

    Dropping a running upload (cancelling the client's future) would leave its multipart upload open on
    the server; failing its input instead makes the client abort it, as it does after any error.
    """

    def __init__(self, views: list[memoryview]) -> None:
        self._views = iter(views)
        self.stop = False

    def __aiter__(self) -> _Body:
        return self

    async def __anext__(self) -> memoryview:
        if self.stop:
            raise _Stopped("the save was cancelled")
        try:
            return next(self._views)
        except StopIteration:
            raise StopAsyncIteration from None


async def _put(path: S3Path, key: str, views: list[memoryview], nbytes: int) -> None:
    """Upload ``views`` as object ``key``; on cancellation, abort the upload before propagating it.

    The client's request runs shielded; a watcher task sees the cancellation and stops the body, the
    client aborts the multipart upload and fails, and the pending cancellation is then delivered.
    """
    opts = path.options
    body = _Body(views)
    done = anyio.Event()

    async def watch() -> None:
        try:
            await done.wait()
        except anyio.get_cancelled_exc_class():
            body.stop = True
            raise

    failure: Exception | None = None
    async with anyio.create_task_group() as tg:
        tg.start_soon(watch)
        try:
            with anyio.CancelScope(shield=True):
                await obstore.put_async(
                    store(path),
                    key,
                    body,
                    use_multipart=nbytes > opts.part_size,
                    chunk_size=opts.part_size,
                    max_concurrency=opts.concurrency,
                )
        except Exception as exc:  # raised below, outside the task group (not in an exception group)
            failure = exc
        finally:
            done.set()
    if failure is not None:
        if body.stop:
            await anyio.lowlevel.checkpoint()  # delivers the cancellation that stopped the body
        raise failure


async def concurrently(worker: Callable[[], Awaitable[None]], count: int) -> None:
    """Run ``count`` copies of ``worker`` at once; the first failure cancels the others.

    The failure is re-raised as it is, not inside an exception group, so callers see the library's errors.
    """
    errors: list[Exception] = []

    async with anyio.create_task_group() as tg:

        async def guarded() -> None:
            try:
                await worker()
            except Exception as exc:
                errors.append(exc)
                tg.cancel_scope.cancel()

        for _ in range(count):
            tg.start_soon(guarded)
    if errors:
        raise errors[0]


async def upload(
    path: S3Path,
    plan: RankPlan,
    sources: Sequence[memoryview],
    *,
    block: int,
    threads: int,
    limiter: anyio.CapacityLimiter | None = None,
) -> WriteResult:
    """Upload ``plan``'s chunks, whose bytes are ``sources[item]``, as object ``path / plan.file``.

    The object's size is checked (HEAD) once the upload completed.

    Returns:
        The checksums of every block written.

    Raises:
        StorageError: The upload failed after retries, or the stored object has the wrong size; the
            message names the object's URL. A failed multipart upload is aborted by the client.
    """
    if not plan.writes:
        return WriteResult(rank=plan.rank, checksums=(), nbytes=0)
    where = url(path, plan.file)

    def cut() -> tuple[deque[Run], Checksums, list[memoryview]]:
        # Per-chunk Python work, proportional to the number of tensors: kept off the event loop's thread.
        pieces = _pieces(plan, sources, block)
        return deque(group(pieces)), Checksums(pieces, len(plan.writes)), _body(pieces, plan.nbytes)

    runs, sums, body = await run_sync(cut, limiter)
    try:
        await run_workers(partial(sums.fill, runs), min(threads, max(1, len(runs))), limiter)
        key = (path / plan.file).key
        try:
            await _put(path, key, body, plan.nbytes)
            size = (await obstore.head_async(store(path), key))["size"]
        except ERRORS as exc:
            raise _failed("upload", where, exc) from exc
        if size != plan.nbytes:
            raise StorageError(f"{where} holds {size} bytes after its upload, not {plan.nbytes}", path=where)
        checksums = await run_sync(sums.by_write, limiter)
    finally:
        # A piece and a memoryview or two per block: freed in a worker, a slice at a time (as in write()).
        box: list[object] = [runs, sums, body]
        del runs, sums, body
        await release(box, limiter)
    return WriteResult(rank=plan.rank, checksums=checksums, nbytes=plan.nbytes)


async def download(
    path: S3Path,
    manifest: Manifest,
    destinations: dict[int, Destination],
    *,
    limiter: anyio.CapacityLimiter | None = None,
) -> int:
    """Fill every destination from the data objects under ``path``; return the bytes read.

    Raises:
        CorruptionError: A block's checksum does not match, or a data object is missing or too short;
            the message names the key and the object's URL.
        StorageError: A request failed after retries.
    """
    block = manifest.checksum_block
    jobs: deque[tuple[str, Run]] = deque()
    # Per data object: (end of the last byte needed, a read in it to name when it is missing or short).
    needs: dict[str, tuple[int, int]] = {}

    def plan_reads() -> tuple[list[_Read], list[Callable[[], None]], list[torch.Tensor]]:
        with paused():
            reads, copies, keep = prepare(manifest, destinations)
            by_file: dict[str, list[Piece]] = {}
            for i, r in enumerate(reads):
                by_file.setdefault(r.chunk.file, []).extend(split(r.chunk.offset, r.view, i, block))
            for name, pieces in by_file.items():
                pieces.sort(key=lambda p: p.offset)
                jobs.extend((name, run) for run in group(pieces))
                last = max(pieces, key=lambda p: p.offset + len(p.view))
                needs[name] = (last.offset + len(last.view), last.item)
        return reads, copies, keep

    reads, copies, keep = await run_sync(plan_reads, limiter)

    def corrupt(item: int, what: str) -> CorruptionError:
        r = reads[item]
        key = render(manifest.tensors[r.tensor].path)
        where = url(path, r.chunk.file)
        return CorruptionError(
            f"{what} in {where} for key {key!r} (bytes {r.chunk.offset}..{r.chunk.offset + r.chunk.nbytes})",
            file=where,
            key=key,
        )

    def land(run: Run, data: memoryview) -> None:
        for p in run.pieces:
            at = p.offset - run.offset
            n = len(p.view)
            if at + n > len(data):
                raise corrupt(p.item, "data object is truncated")
            p.view[:] = data[at : at + n]
            if crc32c.crc32c(p.view) != reads[p.item].chunk.checksums[p.block]:
                raise corrupt(p.item, f"checksum mismatch in block {p.block}")

    unchecked = deque(needs)

    async def check_sizes() -> None:
        while unchecked:
            name = unchecked.popleft()
            end, item = needs[name]
            try:
                size = (await obstore.head_async(store(path), (path / name).key))["size"]
            except FileNotFoundError:
                raise corrupt(item, "data object is missing") from None
            except ERRORS as exc:
                raise _failed("read", url(path, name), exc) from exc
            if size < end:
                raise corrupt(item, "data object is truncated")

    async def fetcher() -> None:
        while jobs:
            name, run = jobs.popleft()
            data = memoryview(b"")
            if run.end > run.offset:
                try:
                    got = await obstore.get_range_async(
                        store(path), (path / name).key, start=run.offset, end=run.end
                    )
                except FileNotFoundError:
                    raise corrupt(run.pieces[0].item, "data object is missing") from None
                except ERRORS as exc:
                    raise _failed("read", url(path, name), exc) from exc
                data = memoryview(got)
            await run_sync(partial(land, run, data), limiter)

    def release() -> None:
        copies.clear()
        keep.clear()

    try:
        # Every object is checked before the first byte lands in a destination, as the local read
        # opens every file first: a load of a vanished checkpoint leaves the target untouched.
        await concurrently(check_sizes, min(path.options.concurrency, len(unchecked)))
        await concurrently(fetcher, min(path.options.concurrency, len(jobs)))
        if copies:
            await run_sync(partial(run_all, copies), limiter)  # outside autograd, as local loads
    finally:
        # Host buffers are freed in a thread: unmapping large ones would stall the event loop.
        with anyio.CancelScope(shield=True):
            await run_sync(release, limiter)
    return sum(len(r.view) for r in reads)
