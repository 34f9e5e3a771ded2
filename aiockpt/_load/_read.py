"""Reading chunks straight into destination memory, in parallel, verifying every block's checksum.

Whole-tensor chunks whose destination is a contiguous CPU tensor are read into its memory (no copy).
Others (slices of a resharded tensor, non-contiguous or GPU targets) are read into host buffers and
copied into place afterwards, in a worker thread. Contiguous GPU targets are read through their
reader's two small pinned buffers, and copied from there as each run is verified (see ``_device``). Copies
to GPU targets are enqueued on the caller's current stream of their device (see ``_cuda``): ordered after
the caller's earlier work on them, and done when the load returns. Runs read with ``O_DIRECT`` (by
default those of large blocks that nothing of is cached, see ``IOConfig.direct_reads``) go through
bounce buffers instead: read by readers of their own, verified and copied into place by a finisher
(see ``_direct``); runs bound for GPU targets are read through the page cache. Fresh tensors that are
views of their data file's mapping (``aiockpt.read``, see ``_mapped``) are not read into: their runs are
populated from the file and verified in place, and never evicted (their pages are the tensors' memory).
"""

from __future__ import annotations

import itertools
import math
import os
import threading
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext, suppress
from dataclasses import dataclass
from functools import partial
from operator import attrgetter
from pathlib import Path

import anyio
import crc32c
import torch

from .._cuda import cuda_devices, current, in_use, noted, wait
from .._errors import CorruptionError, StorageError
from .._format import Chunk, Manifest, TensorEntry
from .._fs import irregular, open_readable
from .._gc import paused
from .._memory import byte_view, filling, plain_cpu, plain_view, view_at
from .._pagecache import drop_behind, kept, resident, sweep
from .._runs import MAX_GAP, Piece, Run, group, lanes, read_run, split
from .._threads import Aborted, dismantle, run_sync, run_workers
from .._tree import dtype_from_name, render
from ._aliasing import Aliasing, Memory, aliasing
from ._checker import Checker, checker_cpus, pinned, wants_checker
from ._device import DeviceReader, sink_of
from ._direct import DirectReads, copy_checked, reads_direct, split_direct
from ._mapped import populate
from ._match import Destination

_ByFile = dict[str, list[Piece]]
_OFFSET = attrgetter("offset")


@dataclass(slots=True)
class _Read:
    """Chunk ``chunk`` of tensor ``tensor``, read into ``view``, or into ``sink`` (a GPU tensor's bytes).

    For a ``sink`` read, ``view`` is as long as the chunk but never touched: it only sizes the read.
    ``mapped``: ``view`` is the chunk's own bytes in a mapping of its file, populated and verified there.
    """

    tensor: int
    chunk: Chunk
    view: memoryview
    sink: torch.Tensor | None = None
    mapped: bool = False


def _overlap(
    a_off: tuple[int, ...], a_size: tuple[int, ...], b_off: tuple[int, ...], b_size: tuple[int, ...]
) -> list[tuple[int, int]] | None:
    """The intersection of two boxes as ``(start, stop)`` per dimension, or ``None`` if empty."""
    out = []
    for ao, asz, bo, bsz in zip(a_off, a_size, b_off, b_size, strict=True):
        lo, hi = max(ao, bo), min(ao + asz, bo + bsz)
        if hi <= lo:
            return None
        out.append((lo, hi))
    return out


def _whole_view(entry: TensorEntry, dest: Destination, memory: Memory) -> memoryview | None:
    """The destination's bytes, if one chunk holds the whole tensor and can be read straight into them.

    The common case of a single-process checkpoint, kept to a few operations per tensor: ``memory`` is
    the destination's (see ``_aliasing.Memory``), found already. (Without offsets the target's shape is the
    entry's: the matcher checked it.)
    """
    if len(entry.chunks) != 1 or dest.offsets is not None:
        return None
    chunk = entry.chunks[0]
    if chunk.sizes != entry.shape or any(chunk.offsets):
        return None
    if dest.view is not None:
        return dest.view
    if memory is not None:
        return view_at(memory[0], memory[1]) if memory[2] else None
    return plain_view(dest.tensor)


# Sizes a read into a GPU tensor: an untouched host view of ``n`` bytes (see _Read).
_Hold = Callable[[int], memoryview]


def _into(
    index: int, chunk: Chunk, part: torch.Tensor, sink: torch.Tensor | None, hold: _Hold | None
) -> _Read:
    """The read of ``chunk`` into ``part``: its bytes, or ``sink`` (the target's bytes at ``part``)."""
    if sink is None:
        return _Read(index, chunk, byte_view(part))
    assert hold is not None  # sinks are only made where reads can be sized
    return _Read(index, chunk, hold(part.nbytes), sink)


def _plan_chunks(
    index: int,
    entry: TensorEntry,
    dest: Destination,
    reads: list[_Read],
    copies: list[Callable[[], None]],
    keep: list[torch.Tensor],
    hold: _Hold | None,
    where: str | None,
) -> None:
    """Plan the reads of ``dest`` from every chunk of ``entry`` that overlaps it (see :func:`prepare`).

    Raises:
        CorruptionError: The chunks do not cover every element of ``dest`` (see :func:`_uncovered`).
    """
    target = dest.tensor
    d_size = tuple(target.shape)
    d_off = dest.offsets if dest.offsets is not None else (0,) * len(d_size)
    sink = sink_of(target) if hold is not None else None
    if sink is None and not plain_cpu(target):
        staging = torch.empty(d_size, dtype=dtype_from_name(entry.dtype), device="cpu")
        keep.append(staging)
        copies.append(lambda t=target, s=staging: t.copy_(s, non_blocking=t.is_cuda))  # type: ignore[misc]
        target = staging
    # Elements of ``dest`` the chunks hold, counted per chunk. The chunks of one tensor do not overlap (a
    # save writes each box once; a merge of parts keeps one copy of a box, and a box listed twice is read
    # once here), so a count short of the destination's means some of it is in no chunk, and an equal one
    # that all of it is read. Only exact copies are dropped, so an overlap (one part's whole tensor,
    # another's shard of it) counts more, and is checked exactly.
    covered = 0
    boxes: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()  # (of the chunks that overlap ``dest``)
    for chunk in entry.chunks:
        exact = chunk.offsets == d_off and chunk.sizes == d_size
        inter = None if exact else _overlap(chunk.offsets, chunk.sizes, d_off, d_size)
        if inter is None and not exact:
            continue
        box = (chunk.offsets, chunk.sizes)
        if box in boxes:
            continue
        boxes.add(box)
        if inter is None:
            covered += target.numel()
            reads.append(_into(index, chunk, target, sink, hold))
            continue
        covered += math.prod(hi - lo for lo, hi in inter)
        if (
            d_size
            and chunk.offsets[1:] == d_off[1:]
            and chunk.sizes[1:] == d_size[1:]
            and (inter[0] == (chunk.offsets[0], chunk.offsets[0] + chunk.sizes[0]))
        ):
            start = chunk.offsets[0] - d_off[0]
            rows = target[start : start + chunk.sizes[0]]
            at = start * (target.nbytes // d_size[0])
            reads.append(_into(index, chunk, rows, None if sink is None else sink[at:], hold))
            continue
        buf = torch.empty(chunk.sizes, dtype=target.dtype, device="cpu")
        keep.append(buf)
        src = tuple(slice(lo - o, hi - o) for (lo, hi), o in zip(inter, chunk.offsets, strict=True))
        dst = tuple(slice(lo - o, hi - o) for (lo, hi), o in zip(inter, d_off, strict=True))
        copies.insert(0, lambda t=target, b=buf, s=src, d=dst: t[d].copy_(b[s]))  # type: ignore[misc]
        reads.append(_Read(index, chunk, byte_view(buf)))
    if covered != target.numel():
        _check_covered(entry, d_off, d_size, where)


def check_whole(entry: TensorEntry, where: str | None) -> None:
    """Refuse ``entry`` if its chunks do not hold every element of it, as a read of all of it would.

    Counts the elements of its distinct chunk boxes first; only a count short of (or, across parts,
    over) the tensor's is looked into exactly.

    Raises:
        CorruptionError: Names the key, ``where`` (the checkpoint) and a box of it that no chunk holds.
    """
    shape = entry.shape
    chunks = entry.chunks
    if len(chunks) == 1 and chunks[0].sizes == shape and not any(chunks[0].offsets):
        return  # (the whole tensor in one chunk: nearly every entry)
    boxes = {(c.offsets, c.sizes) for c in chunks}
    if sum(math.prod(sizes) for _, sizes in boxes) != math.prod(shape):
        _check_covered(entry, (0,) * len(shape), shape, where)


def _check_covered(
    entry: TensorEntry, d_off: tuple[int, ...], d_size: tuple[int, ...], where: str | None
) -> None:
    """Refuse a destination (the box ``d_off``, ``d_size`` of ``entry``) that its chunks do not cover.

    Raises:
        CorruptionError: Names the key, the checkpoint and a box of the destination that no chunk holds.
    """
    key = render(entry.path)
    try:
        hole = _uncovered(d_off, d_size, [(c.offsets, c.sizes) for c in entry.chunks])
    except ValueError as exc:
        raise CorruptionError(
            f"{where or 'the checkpoint'} cannot be read: the chunks of key {key!r} (global shape "
            f"{list(entry.shape)}) overlap too intricately to check that they hold all of it ({exc})",
            file=where,
            key=key,
        ) from None
    if hole is None:
        return
    whole = d_off == (0,) * len(d_size) and d_size == entry.shape
    dest = _render_box([(o, o + n) for o, n in zip(d_off, d_size, strict=True)])
    raise CorruptionError(
        f"{where or 'the checkpoint'} does not hold all of key {key!r} (global shape {list(entry.shape)}): "
        f"no stored chunk has its elements {_render_box(hole)}, wanted by "
        + ("the target" if whole else f"this rank's shard {dest}")
        + "; no rank of the save held them (such as a save over a sub-group that held part of a DTensor)",
        file=where,
        key=key,
    )


# The most tests of a cell against a box that ``_uncovered`` makes, a few seconds of Python.
_MAX_COVER_CHECKS = 1 << 22


def _uncovered(
    d_off: tuple[int, ...], d_size: tuple[int, ...], boxes: Sequence[tuple[tuple[int, ...], tuple[int, ...]]]
) -> list[tuple[int, int]] | None:
    """A box of the destination ``d_off``, ``d_size`` that none of ``boxes`` covers, or ``None``.

    Exact, overlapping boxes included: the destination is cut at every box's edges, and each cell is
    covered wholly or not at all. Only run where counting elements found a shortfall or an overlap.

    Raises:
        ValueError: The cells and boxes are too many to check (more than ``_MAX_COVER_CHECKS`` tests of a
            cell against a box): a manifest with many small overlapping boxes in several dimensions would
            otherwise hold a load for hours. What a save or a merge of parts writes (one part's whole
            tensor and others' shards of it) is decided before that.
    """
    ends = [o + n for o, n in zip(d_off, d_size, strict=True)]
    if any(
        all(off <= o and e <= off + size for o, e, off, size in zip(d_off, ends, offsets, sizes, strict=True))
        for offsets, sizes in boxes
    ):
        return None  # a box that holds the whole destination (a part's whole tensor): no cell to check
    cuts = []
    for dim, (o, n) in enumerate(zip(d_off, d_size, strict=True)):
        edges = {o, o + n}
        for offsets, sizes in boxes:
            edges.update(e for e in (offsets[dim], offsets[dim] + sizes[dim]) if o < e < o + n)
        ordered = sorted(edges)
        cuts.append(list(itertools.pairwise(ordered)))
    checks = math.prod(map(len, cuts)) * max(len(boxes), 1)
    if checks > _MAX_COVER_CHECKS:
        raise ValueError(f"{checks} tests of a cell against a box, of at most {_MAX_COVER_CHECKS}")
    for cell in itertools.product(*cuts):
        if not any(
            all(
                off <= lo and hi <= off + size
                for (lo, hi), off, size in zip(cell, offsets, sizes, strict=True)
            )
            for offsets, sizes in boxes
        ):
            return list(cell)
    return None


def _render_box(box: Sequence[tuple[int, int]]) -> str:
    return "[" + ", ".join(f"{lo}:{hi}" for lo, hi in box) + "]"


def _staged(
    dest: Destination, entry: TensorEntry, keep: list[torch.Tensor], late: list[Callable[[], None]]
) -> Destination:
    """A host tensor to read ``dest`` into instead of its memory, which an earlier destination shares.

    Its bytes are verified there, untouched by the other key's, and copied into place (then into
    ``dest.also``) by ``late``, which runs after every other copy: the later key's values win (the
    matcher let the two keys through: their values are equal, or not known to differ).
    """
    staging = torch.empty(tuple(dest.tensor.shape), dtype=dtype_from_name(entry.dtype), device="cpu")
    keep.append(staging)
    late.append(lambda t=dest.tensor, s=staging: t.copy_(s, non_blocking=t.is_cuda))  # type: ignore[misc]
    late.extend(_into_also(dest))
    return Destination(dest.index, staging, True, offsets=dest.offsets)


def _into_also(dest: Destination) -> list[Callable[[], None]]:
    """The copies of ``dest.tensor``, once filled, into its further targets of the same box (``also``)."""
    return [lambda o=other, t=dest.tensor: o.copy_(t) for other in dest.also]  # type: ignore[misc]


def prepare(
    manifest: Manifest,
    destinations: dict[int, Destination],
    *,
    sinks: bool = False,
    where: str | None = None,
    shared: Aliasing | None = None,
) -> tuple[list[_Read], list[Callable[[], None]], list[torch.Tensor]]:
    """Plan the reads of every destination; return the reads, the copies to run after them, and buffers.

    A chunk goes straight into destination memory when it is exactly the destination's box, or a run of
    whole leading-dimension rows of it (the layout of ``Shard(0)``); any other overlap is read whole into
    a host buffer, verified, and its intersection copied into place. With ``sinks`` (readers that can
    copy to the device, see ``_device``), the same two cases of a contiguous GPU target are reads into
    the target's bytes; otherwise a GPU target gets a host tensor of its shape, copied after the reads.
    The copies end by waiting for every copy to a GPU. ``where`` names the checkpoint in errors.
    ``shared``: the matcher's :func:`_aliasing.aliasing` of these destinations, if it made it.

    Raises:
        CorruptionError: The chunks of a tensor do not cover all of a destination of it (names the key).
    """
    reads: list[_Read] = []
    copies: list[Callable[[], None]] = []
    keep: list[torch.Tensor] = []
    devices: set[torch.device] = set()
    hold: _Hold | None = None
    if in_use():  # (without CUDA in use no tensor is on a GPU: loads of 10^4 tensors skip these passes)
        every = [s for d in destinations.values() for s in (d, *d.shards)]
        devices = cuda_devices(t for d in every for t in (d.tensor, *d.also))
        longest = max((d.tensor.nbytes for d in every if d.tensor.is_cuda), default=0)
        if sinks and longest:
            # Never written (pages of an untouched allocation cost nothing): it only sizes sink reads.
            sizer = torch.empty(longest, dtype=torch.uint8, device="cpu")
            keep.append(sizer)
            sizes = byte_view(sizer)

            def hold(n: int) -> memoryview:
                return sizes[:n]

    tensors = manifest.tensors
    if shared is None:
        shared = aliasing(destinations)
    memory, tied = shared.memory, shared.tied
    late: list[Callable[[], None]] = []  # copies into the memory of tied destinations, in their order
    for (index, dest), mem in zip(destinations.items(), memory, strict=True):
        entry = tensors[index]
        shards = dest.shards
        if index in tied:
            dest, mem = _staged(dest, entry, keep, late), None
        view = _whole_view(entry, dest, mem)
        if view is not None:
            reads.append(_Read(index, entry.chunks[0], view, None, dest.mapped))
        else:
            _plan_chunks(index, entry, dest, reads, copies, keep, hold, where)
        if dest.also:  # tied in the checkpoint, separate in the target: copied once read
            copies += _into_also(dest)
        for shard in shards:  # tied in the checkpoint, apart in the target, laid out otherwise: read too
            _plan_chunks(index, entry, shard, reads, copies, keep, hold, where)
            copies += _into_also(shard)
    copies.extend(late)
    if devices:
        copies.append(partial(wait, devices))
    return reads, copies, keep


def chunk_error(directory: Path, manifest: Manifest, tensor: int, chunk: Chunk, what: str) -> CorruptionError:
    """A :class:`CorruptionError` saying ``what`` is wrong with ``chunk`` of tensor ``tensor``."""
    key = render(manifest.tensors[tensor].path)
    file = str(directory / chunk.file)
    return CorruptionError(
        f"{what} in {file} for key {key!r} (bytes {chunk.offset}..{chunk.offset + chunk.nbytes})",
        file=file,
        key=key,
    )


def read_checked(
    fd: int, run: Run, scratch: memoryview, checksums: Sequence[tuple[int, ...]] | None
) -> tuple[list[Piece], list[Piece]]:
    """Read ``run`` into its pieces' views and verify each against ``checksums[piece.item][piece.block]``.

    ``checksums`` is ``None`` for sources that carry none (foreign formats): only truncation is checked.

    Returns:
        The pieces the file ended before (truncated), and the pieces whose checksum does not match.
    """
    end = run.offset + read_run(fd, run, scratch)
    whole = [p for p in run.pieces if p.offset + len(p.view) <= end]
    short = [p for p in run.pieces if p.offset + len(p.view) > end]
    return short, [] if checksums is None else mismatched(whole, checksums)


def mismatched(pieces: Iterable[Piece], checksums: Sequence[tuple[int, ...]]) -> list[Piece]:
    """The pieces whose bytes do not match ``checksums[piece.item][piece.block]``."""
    return [p for p in pieces if crc32c.crc32c(p.view) != checksums[p.item][p.block]]


def cached_pages(directory: Path, manifest: Manifest) -> dict[str, bytes | None]:
    """Which pages of each data file the page cache holds now (see :func:`aiockpt._pagecache.resident`).

    Taken before the reads, so that :func:`read_into` evicts what it brought in and nothing else. A file
    that cannot be opened is left out: the read stage reports it. Blocking.

    Raises:
        StorageError: A data file that opened cannot be ``fstat``-ed or closed; names the file (every
            file opened is closed all the same).
    """
    out: dict[str, bytes | None] = {}
    for info in manifest.files:
        path = directory / info.name
        try:
            fd = open_readable(path)
        except OSError:
            continue
        try:
            found = os.fstat(fd)
        except OSError as exc:
            _close_quietly(fd)
            raise _unusable(path, "read", exc) from exc
        try:
            if irregular(found.st_mode) is None:  # (the read stage reports a directory, say)
                # (The file's own size bounds the snapshot: a damaged manifest can say any byte count.)
                out[info.name] = resident(fd, min(info.nbytes, found.st_size))
        finally:
            _close_checked(fd, path)
    return out


def _unusable(path: Path, what: str, exc: OSError) -> StorageError:
    """The error for a data file ``path`` that cannot be ``what`` (read, closed): errno kept, path named."""
    return StorageError(f"cannot {what} {path}: {exc.strerror or exc}", path=str(path))


def _close_quietly(fd: int) -> None:
    """Close ``fd`` where another error is the one to report (the descriptor is freed either way)."""
    with suppress(OSError):
        os.close(fd)


def _close_checked(fd: int, path: Path) -> None:
    """Close ``fd``, the data file ``path``'s descriptor (freed even where the close fails).

    Raises:
        StorageError: The close reported an error; names the file.
    """
    try:
        os.close(fd)
    except OSError as exc:
        raise _unusable(path, "close", exc) from exc


def _release(
    directory: Path,
    fds: dict[str, int],
    before: dict[str, bytes | None],
    direct_fds: dict[str, int],
    pipeline: DirectReads | None,
    copies: list[Callable[[], None]],
    keep: list[torch.Tensor],
    reads: list[_Read],
    by_file: _ByFile,
) -> StorageError | None:
    """Close every data file (all of them, whatever one close does) and free the bookkeeping. Blocking.

    Returns:
        The error of the first close that failed, naming its file; ``None`` where all closed cleanly.
        Returned, not raised: only the caller knows whether the read failed already, with its own error.
    """
    if pipeline is not None:
        pipeline.close()
    unclosed = close_files(directory, fds, before, direct_fds)
    # The containers stay referenced by the caller: their items move into ``box``, freed in slices.
    box: list[object] = [copies[:], keep[:], reads[:], list(by_file.values())]
    copies.clear()
    keep.clear()
    reads.clear()
    by_file.clear()
    dismantle(box)
    return unclosed


def close_files(
    directory: Path, fds: dict[str, int], before: dict[str, bytes | None], direct_fds: dict[str, int]
) -> StorageError | None:
    """Close the data files of ``directory`` a read opened (by name), all of them whatever one close does.

    What readahead brought into the cache of a buffered one (``fds``) past what was cached ``before`` is
    evicted first. Both mappings are emptied: closed, a descriptor is never closed again. Blocking.

    Returns:
        The error of the first close that failed (on NFS, a deferred write error), naming its file;
        ``None`` where all closed cleanly. Returned, not raised: only the caller knows whether the read
        failed already, with its own error.
    """
    unclosed: StorageError | None = None
    for opened in (fds, direct_fds):
        for name, fd in opened.items():
            if opened is fds:
                sweep(fd, before.get(name))
            try:
                os.close(fd)
            except OSError as exc:
                if unclosed is None:
                    unclosed = _unusable(directory / name, "close", exc)
                    unclosed.__cause__ = exc
        opened.clear()
    return unclosed


def run_all(calls: Iterable[Callable[[], object]]) -> None:
    """Run the copies into place (blocking), in the mode :func:`~.._memory.filling` names."""
    with filling():
        for call in calls:
            call()


async def read_into(
    directory: Path,
    manifest: Manifest,
    destinations: dict[int, Destination],
    *,
    threads: int,
    direct: bool | None = False,
    direct_threads: int = 2,
    cached: Mapping[str, bytes | None] | None = None,
    checkers: bool = True,
    limiter: anyio.CapacityLimiter | None = None,
    shared: Aliasing | None = None,
) -> int:
    """Fill every destination from ``directory``'s data files; return the bytes read.

    Given ``cached`` (what :func:`cached_pages` found before the reads began), each run read through the
    page cache is evicted from it once verified, unless some of its pages were cached before (see
    ``IOConfig.drop_behind``); a file it has no snapshot of is not evicted. ``direct=None`` reads the
    runs that would be evicted so, if their blocks are large (see ``_checker.wants_checker``), with
    ``O_DIRECT`` where the file system allows it (see ``_direct``) instead: none of their pages is
    cached before or after. ``direct=True`` reads every run that is not bound for a GPU or mapped so;
    ``False``, none. ``direct_threads`` readers read the direct runs. With ``checkers``, buffered readers
    hand the checks of large blocks to checker threads (see ``_checker`` and ``IOConfig.checkers``), and
    the direct runs' finisher is pinned like a checker. ``shared``: the matcher's
    :func:`_aliasing.aliasing` of ``destinations``, if it made it (see :func:`prepare`).

    Raises:
        CorruptionError: A block's checksum does not match, or a data file is missing, no regular file
            (a directory, say) or too short; the message names the key and the file.
        StorageError: A data file cannot be opened or read; the message and ``path`` name the file.
    """
    block = manifest.checksum_block
    # Foreign sources (safetensors) store no checksums; aiockpt's own manifests always say "crc32c".
    verify = manifest.checksum_algorithm != "none"

    def plan_reads() -> tuple[list[_Read], list[Callable[[], None]], list[torch.Tensor], _ByFile, int]:
        with paused():
            reads, copies, keep = prepare(
                manifest, destinations, sinks=True, where=str(directory), shared=shared
            )
            checksums.extend(r.chunk.checksums for r in reads)
            by_file: dict[str, list[Piece]] = {}
            to_gpu: dict[str, list[Piece]] = {}  # bound for GPU tensors: in runs of their own
            mapped: dict[str, list[Piece]] = {}  # mapped tensors' bytes: in runs of their own
            for i, r in enumerate(reads):
                into = mapped if r.mapped else by_file if r.sink is None else to_gpu
                chunk = r.chunk
                pieces = into.get(chunk.file)
                if pieces is None:
                    pieces = into[chunk.file] = []
                if len(r.view) <= block:  # one block, as is each of 10^4 small tensors: no call
                    pieces.append(Piece(chunk.offset, r.view, i, 0))
                else:
                    pieces += split(chunk.offset, r.view, i, block)
            for pieces_of in (by_file, to_gpu, mapped):
                for name, pieces in pieces_of.items():
                    pieces.sort(key=_OFFSET)
                    jobs.extend((name, run) for run in group(pieces))
            for name, pieces in mapped.items():
                held[name] = [(p.offset, p.offset + len(p.view)) for p in pieces]
            for pieces_of in (to_gpu, mapped):  # every file's pieces together, to open and size it
                for name, pieces in pieces_of.items():
                    by_file.setdefault(name, []).extend(pieces)
        return reads, copies, keep, by_file, sum(len(r.view) for r in reads)

    fds: dict[str, int] = {}
    direct_fds: dict[str, int] = {}
    # Per buffered file, its pages cached before this read (with ``cached`` only); ``None``: evict nothing.
    before: dict[str, bytes | None] = {}
    # Per file, the byte ranges of its mapped tensors: never evicted (counted as cached before).
    held: dict[str, list[tuple[int, int]]] = {}
    jobs: list[tuple[str, Run]] = []  # every run, in file order per file
    direct_jobs: list[tuple[int, int, Run]] = []  # the runs read with O_DIRECT: (direct fd, fd, run)
    work: list[deque[tuple[str, Run]]] = []  # the runs read through the page cache, in readers' lanes
    pipeline: DirectReads | None = None
    # Per lane, the CPU its reader and checker are pinned to (see checker_cpus); ``None``: no checkers.
    cpus: list[int | None] | None = None
    checksums: list[tuple[int, ...]] = []
    caller = noted()
    reads, copies, keep, by_file, total = await run_sync(plan_reads, limiter)

    def corrupt(r: _Read, what: str) -> CorruptionError:
        return chunk_error(directory, manifest, r.tensor, r.chunk, what)

    def unreadable(name: str, exc: OSError) -> StorageError:
        file = directory / name
        return StorageError(f"cannot read {file}: {exc.strerror or exc}", path=str(file))

    def on_gpu(run: Run) -> bool:
        return reads[run.pieces[0].item].sink is not None

    def in_map(run: Run) -> bool:
        return reads[run.pieces[0].item].mapped

    def goes_direct(name: str, run: Run) -> bool:
        """Whether ``run`` is to be read with ``O_DIRECT``, where its file can be opened so."""
        return not on_gpu(run) and not in_map(run) and reads_direct(direct, before.get(name), run)

    def open_files() -> None:
        for name, pieces in by_file.items():
            path = directory / name
            try:
                fd = open_readable(path)
            except FileNotFoundError:
                raise corrupt(reads[pieces[0].item], "data file is missing") from None
            except OSError as exc:
                raise unreadable(name, exc) from exc
            fds[name] = fd
            try:
                found = os.fstat(fd)
            except OSError as exc:
                raise unreadable(name, exc) from exc
            if (kind := irregular(found.st_mode)) is not None:  # (a directory opens, then fails to read)
                raise corrupt(reads[pieces[0].item], f"data file is {kind}")
            size = found.st_size
            end = max(p.offset + len(p.view) for p in pieces)
            if size < end:
                short = next(p for p in pieces if p.offset + len(p.view) > size)
                raise corrupt(reads[short.item], "data file is truncated")
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            if cached is not None:
                snapshot = cached.get(name)
                spans = held.get(name)
                before[name] = kept(snapshot, spans) if snapshot is not None and spans else snapshot
        wanted = [goes_direct(name, run) for name, run in jobs]
        direct_runs, rest = split_direct(directory, jobs, wanted, fds, direct_fds)
        direct_jobs.extend(direct_runs)
        work.extend(lanes(rest, threads, lambda job: job[1].end - job[1].offset))
        # From here the runs live in the lanes and the direct jobs only, and go with the threads that take
        # them. Still listed here, 10^4 pieces would be freed with this frame on the event loop's thread:
        # a 20,000-tensor load's loop-lag p99 was 2.2-2.3 ms so, against 1.2-1.3 ms.
        jobs.clear()

    def failed_direct(run: Run, exc: OSError) -> None:
        raise unreadable(reads[run.pieces[0].item].chunk.file, exc) from exc

    def finish_direct(run: Run, buffer: memoryview, start: int, end: int) -> None:
        short, bad = copy_checked(run, buffer, start, end, checksums if verify else None)
        if short:
            raise corrupt(reads[short[0].item], "data file is truncated")
        if bad:
            raise corrupt(reads[bad[0].item], f"checksum mismatch in block {bad[0].block}")

    def to_sink(p: Piece) -> tuple[torch.Tensor, int]:
        r = reads[p.item]
        assert r.sink is not None
        return r.sink, p.offset - r.chunk.offset

    def to_checker(run: Run) -> bool:
        return verify and not on_gpu(run) and wants_checker(run)

    def worker(abort: threading.Event) -> None:
        lane = work.pop()
        cpu = cpus[len(work)] if cpus else None  # (the list stays whole: its CPUs are released after)
        checker: AbstractContextManager[Checker | None] = nullcontext()
        # A checker overlaps one run's check with the next run's read: a lane of one such run gains nothing.
        if cpus is not None and sum(to_checker(run) for _, run in lane) > 1:
            checker = Checker(cpu, abort)
        else:
            cpu = None  # the reader checks every run itself, wherever the kernel runs it
        # Copies to GPU tensors go on the caller's streams.
        with current(caller), pinned(cpu), checker as check:
            read_lane(abort, lane, check)

    def settle(name: str, run: Run, bad: list[Piece]) -> None:
        """Fail on the first damaged block of ``run``, or evict the verified run (drop-behind)."""
        if bad:
            raise corrupt(reads[bad[0].item], f"checksum mismatch in block {bad[0].block}")
        if name in before and not in_map(run):  # (only files with a snapshot)
            drop_behind(fds[name], run.offset, run.end, before[name])

    def checked(name: str, run: Run) -> None:
        settle(name, run, mismatched(run.pieces, checksums))

    def read_one(
        name: str,
        run: Run,
        sums: Sequence[tuple[int, ...]] | None,
        scratch: memoryview,
        device: DeviceReader | None,
    ) -> tuple[list[Piece], list[Piece]]:
        """Read ``run`` (verified against ``sums`` unless ``None``): its pieces cut short, and damaged."""
        if in_map(run):  # inside the file: checked when it was mapped, and again when opened
            if not populate(run.pieces[0].view, run.end - run.offset):  # cut short since: never touch
                raise corrupt(reads[run.pieces[0].item], "data file is truncated or unreadable")
            return [], [] if sums is None else mismatched(run.pieces, sums)
        if device is not None and on_gpu(run):
            return device.read(fds[name], run, to_sink, sums)
        return read_checked(fds[name], run, scratch, sums)

    def read_lane(abort: threading.Event, lane: deque[tuple[str, Run]], check: Checker | None) -> None:
        scratch = memoryview(bytearray(MAX_GAP))
        longest = max((run.end - run.offset for _, run in lane if on_gpu(run)), default=0)
        device = DeviceReader(longest) if longest else None
        sums = checksums if verify else None
        while lane:
            if abort.is_set():
                raise Aborted
            name, run = lane.popleft()
            handed = check is not None and to_checker(run)  # checked by the checker, not here
            try:
                short, bad = read_one(name, run, None if handed else sums, scratch, device)
            except OSError as exc:
                raise unreadable(name, exc) from exc
            if short:
                raise corrupt(reads[short[0].item], "data file is truncated")
            if check is not None and handed:
                check.put(partial(checked, name, run))
            else:
                settle(name, run, bad)

    unclosed: StorageError | None = None
    failed = True  # until every destination is filled: a close's error is then the read's own
    try:
        await run_sync(open_files, limiter)
        if direct_jobs:
            pipeline = DirectReads(direct_jobs, direct_threads, finish_direct, failed_direct)
            direct_jobs.clear()  # (the pipeline has them: see jobs.clear above)
            await pipeline.run(checkers, limiter)
        if work:
            with checker_cpus(len(work)) if checkers else nullcontext() as cpus:  # on the loop's thread
                await run_workers(worker, len(work), limiter)
        if copies:
            await run_sync(lambda: run_all(copies), limiter)
        failed = False
    except OSError as exc:
        # (Reads and opens name their file above; this is what is left, such as a failed ``fstat``.)
        raise StorageError(
            f"cannot read checkpoint data in {directory}: {exc.strerror or exc}", path=str(directory)
        ) from exc
    finally:
        # Host buffers are freed in the thread too: unmapping large ones would stall the event loop. So
        # are the per-chunk bookkeeping objects, whose deallocation takes milliseconds for 10^4 tensors.
        with anyio.CancelScope(shield=True):
            unclosed = await run_sync(
                lambda: _release(directory, fds, before, direct_fds, pipeline, copies, keep, reads, by_file),
                limiter,
            )
    # A close that fails after a failed read is not raised over the read's own error.
    if unclosed is not None and not failed:
        raise unclosed
    return total
