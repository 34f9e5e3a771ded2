"""Verifying a checkpoint without loading it: every block of every chunk is read back and checksummed.

Verification reuses the load path's pieces (``_runs``: checksum blocks grouped into runs, runs split
into sequential lanes, one per thread) and its check (``read_checked``), but reads each run into a
buffer its thread reuses, so memory stays bounded (about ``RUN_BYTES`` per thread) whatever the size of
the checkpoint. The runs a load would read with ``O_DIRECT`` (``IOConfig.direct_reads``) go through the
load's direct pipeline (``_load._direct``): its readers fill bounce buffers from the shared pool and
its finisher only checksums them. Unlike a load it does not stop at the first damage: it reports every
damaged chunk, and every run it cannot read. Beside the chunks it checks what a load checks of the
tensors (that their chunks hold all of them), and each data file's size against the manifest's.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import anyio

from ._errors import CheckpointError, CheckpointNotFoundError, CorruptionError, StorageError
from ._format import Chunk, Manifest
from ._fs import irregular, open_readable
from ._gc import paused
from ._insulate import insulated
from ._load import exists, read_manifest
from ._load._direct import DirectReads, copy_checked, reads_direct, split_direct
from ._load._read import check_whole, chunk_error, close_files, read_checked
from ._options import IOConfig, io_config
from ._pagecache import drop_behind, resident
from ._runs import MAX_GAP, Piece, Run, group, lanes
from ._storage import local
from ._threads import release, responsive, run_sync, run_workers

# How often ``progress`` hears about the bytes verified so far.
_PROGRESS_INTERVAL = 0.1


@dataclass(frozen=True, kw_only=True)
class VerifyReport:
    """What :func:`verify` found.

    Attributes:
        path: The checkpoint directory verified.
        problems: One :class:`CorruptionError` per damaged chunk (or for a damaged manifest), per tensor
            its chunks do not hold all of (which a load refuses; ``error.file`` is the checkpoint) and
            per data file of another size than the manifest records (``error.key`` is ``None``): those
            of tensors first, then in file order. Each names the key (``error.key``) and the file
            (``error.file``). Empty when every checksum matched and nothing else is amiss.
        num_tensors: Tensors whose chunks were checked.
        num_chunks: Chunks checked.
        nbytes: Bytes of tensor data the manifest describes (all of them are read unless a file is
            missing or truncated).
    """

    path: str
    problems: tuple[CorruptionError, ...]
    num_tensors: int
    num_chunks: int
    nbytes: int

    @property
    def ok(self) -> bool:
        """Whether the manifest and every chunk verified."""
        return not self.problems


# A problem with where it sorts among the others (see ``_Problems``).
_Ordered = tuple[tuple[str, int], CorruptionError]


@dataclass(frozen=True)
class _Item:
    tensor: int
    chunk: Chunk


class _Problems:
    """The damage found so far, at most one report per chunk (workers add to it from their threads)."""

    def __init__(self, directory: Path, manifest: Manifest, items: list[_Item]) -> None:
        self._directory = directory
        self._manifest = manifest
        self._items = items
        self._lock = threading.Lock()
        self._found: dict[int, CorruptionError] = {}
        # Damage of no one chunk, with where it sorts: a whole tensor's (``("", index)``, first), or a
        # data file's (``(name, recorded size)``, after its chunks).
        self._other: list[_Ordered] = []

    def add(self, item: int, what: str) -> None:
        i = self._items[item]
        error = chunk_error(self._directory, self._manifest, i.tensor, i.chunk, what)
        with self._lock:
            self._found.setdefault(item, error)

    def add_other(self, order: tuple[str, int], error: CorruptionError) -> None:
        with self._lock:
            self._other.append((order, error))

    def in_file_order(self) -> tuple[CorruptionError, ...]:
        items = self._items
        ordered = [((items[k].chunk.file, items[k].chunk.offset), e) for k, e in self._found.items()]
        ordered += self._other
        ordered.sort(key=lambda pair: pair[0])
        return tuple(e for _, e in ordered)


@dataclass(frozen=True)
class _Files:
    """The data files as found: each one's size (``None``: missing).

    ``kinds`` says what those are that are no regular file (see :func:`aiockpt._fs.irregular`).
    """

    sizes: dict[str, int | None]
    kinds: dict[str, str]


def _look_up(directory: Path, manifest: Manifest) -> _Files:
    """The data files the chunks name and the manifest lists, looked up. Blocking.

    Raises:
        StorageError: A data file exists but cannot be looked up.
    """
    sizes: dict[str, int | None] = {}
    kinds: dict[str, str] = {}
    names = [info.name for info in manifest.files]
    names += (chunk.file for entry in manifest.tensors for chunk in entry.chunks)
    for name in names:
        if name in sizes:
            continue
        try:
            found = os.stat(directory / name)
        except FileNotFoundError:
            sizes[name] = None
            continue
        except OSError as exc:
            file = directory / name
            raise StorageError(f"cannot open {file}: {exc.strerror or exc}", path=str(file)) from exc
        sizes[name] = found.st_size
        if (kind := irregular(found.st_mode)) is not None:
            kinds[name] = kind
    return _Files(sizes, kinds)


def _plan(
    manifest: Manifest, files: _Files
) -> tuple[list[_Item], dict[str, list[Piece]], list[tuple[int, str]]]:
    """Every chunk; per data file the checksum blocks of its chunks as pieces sorted by offset; the rest.

    The pieces' views are placeholders of the right length (slices of one shared zero block); a worker
    points them into its own buffer just before reading their run. A chunk that does not lie inside a
    regular data file (``files``, see :func:`_look_up`) gets no pieces: it is one of the rest, ``(item,
    what is wrong)``, so that no placeholder is longer than the data files (the manifest of a damaged
    checkpoint can say any byte count).
    """
    block = manifest.checksum_block
    items: list[_Item] = []
    unfit: list[tuple[int, str]] = []
    fit: list[int] = []
    for t, entry in enumerate(manifest.tensors):
        for chunk in entry.chunks:
            item = len(items)
            items.append(_Item(t, chunk))
            size = files.sizes.get(chunk.file)
            kind = files.kinds.get(chunk.file)
            if size is None:
                unfit.append((item, "data file is missing"))
            elif kind is not None:
                unfit.append((item, f"data file is {kind}"))
            elif chunk.offset + chunk.nbytes > size:
                unfit.append((item, "data file is truncated"))
            else:
                fit.append(item)
    # No piece is longer than a block, nor than its chunk: a checkpoint saved with a huge block (any
    # multiple of 4096 is allowed) needs no placeholder of that size.
    longest = max((items[i].chunk.nbytes for i in fit), default=0)
    blank = memoryview(bytes(min(block, longest)))
    by_file: dict[str, list[Piece]] = {}
    for item in fit:
        chunk = items[item].chunk
        pieces = by_file.setdefault(chunk.file, [])
        starts = range(0, chunk.nbytes, block) or range(1)  # an empty chunk is one empty block
        pieces.extend(
            Piece(chunk.offset + s, blank[: min(block, chunk.nbytes - s)], item, i)
            for i, s in enumerate(starts)
        )
    for pieces in by_file.values():
        pieces.sort(key=lambda p: p.offset)
    return items, by_file, unfit


def _whole_damage(directory: Path, manifest: Manifest, files: _Files, damaged: set[str]) -> list[_Ordered]:
    """The damage of no one chunk, each with where it sorts (see ``_Problems``). Blocking.

    A tensor that its chunks do not hold all of, which a load refuses (see :func:`check_whole`); and a
    data file whose size is not the manifest's (``files[].nbytes``): bytes appended to it, which no load
    reads, or a file that is missing, no regular file or short where no chunk says so already (those
    that ``damaged`` names).
    """
    found: list[_Ordered] = []
    for index, entry in enumerate(manifest.tensors):
        try:
            check_whole(entry, str(directory))
        except CorruptionError as exc:
            found.append((("", index), exc))
    for info in manifest.files:
        size = files.sizes.get(info.name)
        kind = files.kinds.get(info.name)
        file = str(directory / info.name)
        if size is None or kind is not None or size < info.nbytes:
            if info.name in damaged:
                continue
            what = "missing" if size is None else kind or f"{size} bytes long, not {info.nbytes}"
        elif size > info.nbytes:
            what = f"{size} bytes long: {size - info.nbytes} past the {info.nbytes} the manifest records"
        else:
            continue
        found.append(((info.name, info.nbytes), CorruptionError(f"data file {file} is {what}", file=file)))
    return found


async def _reporting(run: Callable[[], Awaitable[None]], report: Callable[[], object]) -> None:
    """Await ``run()``, calling ``report()`` every ``_PROGRESS_INTERVAL`` meanwhile and once at the end.

    An exception of either is raised as it is (not in an exception group), after the other is cancelled.
    """
    errors: list[Exception] = []

    async def ticking() -> None:
        while True:
            report()
            await anyio.sleep(_PROGRESS_INTERVAL)

    async with anyio.create_task_group() as tg:

        async def guarded(fn: Callable[[], Awaitable[None]]) -> None:
            try:
                await fn()
            except Exception as exc:
                errors.append(exc)
            finally:
                tg.cancel_scope.cancel()  # the first to end (``run``, or a failure) ends both

        tg.start_soon(guarded, run)
        tg.start_soon(guarded, ticking)
    if errors:
        raise errors[0]
    report()


def _close_all(
    directory: Path,
    fds: dict[str, int],
    before: dict[str, bytes | None],
    direct_fds: dict[str, int],
    pipeline: DirectReads | None,
) -> StorageError | None:
    """Close every data file verify opened; return the first close that failed (see ``close_files``)."""
    if pipeline is not None:
        pipeline.close()
    return close_files(directory, fds, before, direct_fds)


def check_progress(progress: object) -> None:
    """Refuse a ``progress`` that cannot be called, before any work: it failed with a bare ``TypeError``.

    Its result is ignored, so any callable taking ``(done, total)`` will do (``tqdm``'s ``update`` in a
    lambda, a method returning a bool).

    Raises:
        CheckpointError: ``progress`` is neither callable nor ``None``; the message names it.
    """
    if progress is not None and not callable(progress):
        raise CheckpointError(
            f"progress must be a callable taking (bytes done, bytes total), or None, not {progress!r}"
        )


@insulated
async def verify(
    path: str | os.PathLike[str],
    *,
    io: IOConfig | None = None,
    progress: Callable[[int, int], object] | None = None,
) -> VerifyReport:
    """Check a checkpoint's integrity without loading it: its manifest, and every block of every chunk.

    Each data file is read in full (by ``io.thread_count`` threads, each through a buffer of a few MiB it
    reuses, so memory use does not grow with the checkpoint) and every block's CRC32C compared with the
    manifest's. The runs a load would read with ``O_DIRECT`` (``io.direct_reads``; by default those of
    large blocks that nothing of is cached) are read so, into bounce buffers of 8 MiB (one per
    ``io.direct_thread_count`` reader and two more), and checksummed there. Unlike :func:`load`,
    verification goes on past the first damaged chunk and reports all of them. A collective-free
    checkpoint is verified part by part, each part's copy of a replicated chunk too. As a load does
    (``IOConfig.drop_behind``), it leaves in the page cache only what was cached before it began.

    Args:
        path: A checkpoint directory.
        io: I/O tuning (``threads`` readers, ``direct_reads``, ``drop_behind``, ``checkers``).
        progress: Called on the event loop as ``progress(bytes_done, bytes_total)`` a few times a second
            while data is read, and once at the end; what it returns is ignored.

    Returns:
        A :class:`VerifyReport`; ``report.ok`` is true when nothing is damaged, otherwise
        ``report.problems`` holds one :class:`CorruptionError` per damaged chunk (checksum mismatch, file
        missing, no regular file, truncated or unreadable), per tensor its chunks do not hold all of,
        per data file longer than the manifest records (bytes appended, which no load reads), or for a
        damaged manifest.

    Raises:
        CheckpointNotFoundError: ``path`` is not a committed checkpoint (no manifest, or parts missing),
            or it was deleted while it was verified (by another process's retention: its files went
            missing, which is no damage).
        FormatError: The manifest matches its checksum but holds what no save writes, or has a newer
            format version (a damaged manifest, or a file of another kind in its place, is a problem of
            the report).
        StorageError: The system refused to read the manifest, or a data file exists but cannot be
            opened, looked up or closed.
        CheckpointError: ``path`` is empty, or an ``s3://`` URL, or ``progress`` is not callable.
    """
    check_progress(progress)
    directory = local(path, "verify")
    io = io_config(io)
    with responsive(io):
        # The manifest and the per-block plan (10^4 entries for 10^4 tensors), which ``_verify`` puts in
        # ``kept``, are freed in a worker: freed with its frame, on the event loop's thread, they held it
        # for 25-50 ms.
        kept: list[object] = []
        try:
            report = await _verify(directory, io, progress, kept)
        finally:
            await release(kept)
    if not report.ok and not await exists(directory):
        raise CheckpointNotFoundError(
            f"{directory} was deleted while it was verified (retention by another process?)"
        )
    return report


async def _verify(
    directory: Path, io: IOConfig, progress: Callable[[int, int], object] | None, kept: list[object]
) -> VerifyReport:
    try:
        # Every part's own chunks, also the copies of a chunk that a load reads from another part.
        manifest = await run_sync(lambda: read_manifest(directory, every_copy=True))
    except CorruptionError as exc:
        return VerifyReport(path=str(directory), problems=(exc,), num_tensors=0, num_chunks=0, nbytes=0)

    def plan() -> tuple[list[_Item], dict[str, list[Piece]], list[tuple[int, str]], list[_Ordered]]:
        files = _look_up(directory, manifest)
        with paused():
            items, by_file, unfit = _plan(manifest, files)
            damaged = {items[item].chunk.file for item, _ in unfit}
            return items, by_file, unfit, _whole_damage(directory, manifest, files, damaged)

    items, by_file, unfit, whole = await run_sync(plan)
    problems = _Problems(directory, manifest, items)
    kept.extend((manifest, items, by_file, problems))
    for item, what in unfit:
        problems.add(item, what)
    for order, error in whole:
        problems.add_other(order, error)
    checksums = [i.chunk.checksums for i in items]
    total = sum(i.chunk.nbytes for i in items)
    fds: dict[str, int] = {}
    work: list[tuple[int, deque[tuple[str, Run]]]] = []
    done: list[int] = [0]  # bytes verified: by the direct pipeline, then per lane
    before: dict[str, bytes | None] = {}
    direct_fds: dict[str, int] = {}
    direct_jobs: list[tuple[int, int, Run]] = []  # the runs read with O_DIRECT: (direct fd, fd, run)
    pipeline: DirectReads | None = None

    def open_files() -> None:
        jobs: list[tuple[str, Run]] = []
        for name, pieces in by_file.items():
            try:
                fd = open_readable(directory / name)
            except FileNotFoundError:
                for p in pieces:
                    problems.add(p.item, "data file is missing")
                continue
            except OSError as exc:
                raise StorageError(
                    f"cannot open {directory / name}: {exc.strerror or exc}", path=str(directory / name)
                ) from exc
            fds[name] = fd
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                size = os.fstat(fd).st_size
            except OSError as exc:
                raise StorageError(
                    f"cannot read {directory / name}: {exc.strerror or exc}", path=str(directory / name)
                ) from exc
            # As a load does (IOConfig.drop_behind): what was cached before stays, what is read goes.
            before[name] = resident(fd, size) if io.drops_behind else None
            for p in pieces:
                if p.offset + len(p.view) > size:
                    problems.add(p.item, "data file is truncated")
            jobs.extend((name, run) for run in group([p for p in pieces if p.offset + len(p.view) <= size]))
        wanted = [reads_direct(io.direct_reads, before[name], run) for name, run in jobs]
        direct_runs, rest = split_direct(directory, jobs, wanted, fds, direct_fds)
        direct_jobs.extend(direct_runs)
        work.extend(enumerate(lanes(rest, io.thread_count, lambda job: job[1].end - job[1].offset), 1))
        done.extend(0 for _ in work)

    def damaged(short: list[Piece], bad: list[Piece]) -> None:
        for p in short:
            problems.add(p.item, "data file is truncated")
        for p in bad:
            problems.add(p.item, f"checksum mismatch in block {p.block}")

    def unreadable(run: Run, exc: OSError) -> None:
        for p in run.pieces:
            problems.add(p.item, f"read error ({exc.strerror or exc})")

    def finish_direct(run: Run, buffer: memoryview, start: int, end: int) -> None:
        damaged(*copy_checked(run, buffer, start, end, checksums, copy=False))
        done[0] += sum(len(p.view) for p in run.pieces)

    def unreadable_direct(run: Run, exc: OSError) -> None:
        unreadable(run, exc)
        done[0] += sum(len(p.view) for p in run.pieces)

    def worker(abort: threading.Event) -> None:
        index, lane = work.pop()
        # A run spans at most RUN_BYTES (or one block, if larger) plus an alignment gap.
        buf = memoryview(bytearray(max(run.end - run.offset for _, run in lane)))
        scratch = memoryview(bytearray(MAX_GAP))
        while lane:
            if abort.is_set():
                return
            name, run = lane.popleft()
            for p in run.pieces:
                start = p.offset - run.offset
                p.view = buf[start : start + len(p.view)]
            try:
                damaged(*read_checked(fds[name], run, scratch, checksums))
            except OSError as exc:
                unreadable(run, exc)
            else:
                drop_behind(fds[name], run.offset, run.end, before[name])
            done[index] += sum(len(p.view) for p in run.pieces)

    async def read_all() -> None:
        nonlocal pipeline
        if direct_jobs:
            pipeline = DirectReads(direct_jobs, io.direct_thread_count, finish_direct, unreadable_direct)
            kept.append(pipeline)
            direct_jobs.clear()  # (the pipeline has them)
            await pipeline.run(io.checkers)
        if work:
            await run_workers(worker, len(work))

    closing: StorageError | None = None
    try:
        await run_sync(open_files)
        if progress is None:
            await read_all()
        else:
            await _reporting(read_all, lambda: progress(sum(done), total))
    finally:
        with anyio.CancelScope(shield=True):
            closing = await run_sync(lambda: _close_all(directory, fds, before, direct_fds, pipeline))
    if closing is not None:  # (raised only where the checks ended: it never hides an earlier error)
        raise closing
    return VerifyReport(
        path=str(directory),
        problems=problems.in_file_order(),
        num_tensors=len(manifest.tensors),
        num_chunks=len(items),
        nbytes=total,
    )
