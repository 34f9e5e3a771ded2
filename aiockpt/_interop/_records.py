"""Checking bytes read from ``torch.save`` zip records against the records' CRC-32.

:func:`check_crcs` checks the records it is given (a ``torch.save`` file's: see ``_torchfile``), and
:func:`check_records` those of DCP chunks read in place. A DCP chunk stored as a plain record is read by
the native reader straight into destination memory (see ``_dcp``). That reader verifies aiockpt's own
block checksums only; a record's CRC-32 (zlib's, from the archive's central directory, see
``_torchblob``) covers the whole record. So once the reads are done, every record a destination was
filled from is checked whole, as the reader always reads whole records (a chunk of another box than the
destination's goes through a host buffer, then its overlap is copied):

- in destination memory, where it holds the record's bytes as read: the chunk is the destination's box,
  or a run of its leading-dimension rows, of a plain CPU tensor whose memory no other target shares;
- otherwise (a GPU target, a chunk resharded through a buffer that is gone by now, tied targets, whose
  memory holds the later key's values) by reading the record again from its file.

Records longer than ``_BLOCK`` are checked in blocks on several threads, their CRCs combined. A record
whose CRC is 0 (saved under ``torch.serialization.set_crc32_options(False)``) has nothing to check
against, and is neither in ``crcs`` nor checked.
"""

from __future__ import annotations

import os
import threading
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import anyio

from .._errors import CorruptionError, StorageError
from .._format import KeyPath, Manifest
from .._fs import open_regular
from .._gc import paused
from .._load._aliasing import memory_of
from .._load._match import Destination
from .._load._read import _overlap
from .._memory import byte_view, plain_cpu, plain_view, view_at
from .._threads import Aborted, run_sync, run_workers
from .._tree import render

# Records are checked in blocks of this many bytes (one thread each), their CRCs then combined.
_BLOCK = 8 << 20
# Below this many bytes to check in all, one thread checks them (a thread costs more than it saves).
_ONE_THREAD = 16 << 20
# Records of at most this many bytes checked in memory are checked while planning, in its thread.
_INLINE = 64 << 10

_POLY = 0xEDB88320  # CRC-32's polynomial, bit-reversed as zlib uses it


def _multmodp(a: int, b: int) -> int:
    """``a * b`` modulo the CRC-32 polynomial, in zlib's reflected bit order (zlib's ``multmodp``)."""
    m, p = 1 << 31, 0
    while m:
        if a & m:
            p ^= b
            if not a & (m - 1):
                break
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return p


# x^(2^k) modulo the polynomial, for k = 0..31 (zlib's ``x2n_table``).
_X2N = [1 << 30]
for _ in range(31):
    _X2N.append(_multmodp(_X2N[-1], _X2N[-1]))


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of ``a + b`` from ``crc1`` of ``a``, ``crc2`` of ``b`` and ``len2 = len(b)`` (as zlib's)."""
    p, k = 1 << 31, 3  # x^0; the shift is by 8 * len2 bits: x^(2^3) per byte
    while len2:
        if len2 & 1:
            p = _multmodp(_X2N[k & 31], p)
        len2 >>= 1
        k += 1
    return _multmodp(p, crc1) ^ crc2


@dataclass(slots=True)
class Check:
    """A zip record: bytes ``[offset, offset + nbytes)`` of ``file``, to match the CRC-32 ``expected``.

    Its bytes are ``view`` (memory that holds them as read), or (``None``) read from the file. Messages
    name ``key``, the key path of the tensor read from the record, or (``None``: no tensor aiockpt
    knows of) the record, by its ``name`` in the archive.
    """

    key: KeyPath | None
    file: str  # relative to the directory the checks are made in
    offset: int
    nbytes: int
    expected: int
    view: memoryview | None
    name: str = ""
    crcs: list[int] | None = None  # per block of ``_BLOCK`` bytes, in order (of worker checks)


def _shared(spans: list[tuple[int, int, int]], destinations: Mapping[int, Destination]) -> set[int]:
    """The destinations whose memory (``spans``, see ``memory_of``) overlaps another's: all of them.

    (``aliased`` leaves out the first of each overlapping run, which the reader reads in place.)
    """
    spans.sort()
    orders: set[int] = set()
    run: list[int] = []
    reach = 0
    for start, stop, order in spans:
        if start >= reach:
            if len(run) > 1:
                orders.update(run)
            run, reach = [], stop
        run.append(order)
        reach = max(reach, stop)
    if len(run) > 1:
        orders.update(run)
    if not orders:
        return set()
    keys = list(destinations)
    return {keys[o] for o in orders}


def _plan(
    manifest: Manifest, destinations: Mapping[int, Destination], crcs: Mapping[tuple[int, int], int]
) -> list[Check]:
    """One check per record read into ``destinations`` (each box once per destination, as the reader)."""
    memory, spans = memory_of(destinations)
    shared = _shared(spans, destinations)
    checks: list[Check] = []
    tensors = manifest.tensors
    for (index, top), mem in zip(destinations.items(), memory, strict=True):
        entry = tensors[index]
        chunks, key = entry.chunks, entry.path
        # Targets that also receive copies of this key's values are checked from the file: their memory
        # holds the bytes read only as long as nothing else is copied there.
        alone = index not in shared and not top.also and not top.shards
        if alone and len(chunks) == 1 and top.offsets is None:
            # The common case, kept to a few operations per tensor as the reader's ``_whole_view``: one
            # chunk, the whole tensor (the matcher checked the target's shape), read into its memory.
            expected = crcs.get((index, 0))
            if expected is not None:
                if top.view is not None:
                    view: memoryview | None = top.view
                elif mem is not None:
                    view = view_at(mem[0], mem[1]) if mem[2] else None
                else:
                    view = plain_view(top.tensor)
                chunk = chunks[0]
                checks.append(Check(key, chunk.file, chunk.offset, chunk.nbytes, expected, view))
            continue
        for dest in (top, *top.shards):
            t = dest.tensor
            d_size = tuple(t.shape)
            d_off = dest.offsets if dest.offsets is not None else (0,) * len(d_size)
            in_memory = alone and plain_cpu(t)
            boxes: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
            for number, chunk in enumerate(chunks):
                exact = chunk.offsets == d_off and chunk.sizes == d_size
                inter = None if exact else _overlap(chunk.offsets, chunk.sizes, d_off, d_size)
                if inter is None and not exact:
                    continue
                box = (chunk.offsets, chunk.sizes)
                if box in boxes:  # (read once, from its first chunk)
                    continue
                boxes.add(box)
                expected = crcs.get((index, number))
                if expected is None:
                    continue
                view = None
                if in_memory and exact:
                    view = dest.view if dest.view is not None else byte_view(t)
                elif (
                    in_memory
                    and inter is not None
                    and d_size
                    and chunk.offsets[1:] == d_off[1:]
                    and chunk.sizes[1:] == d_size[1:]
                    and inter[0] == (chunk.offsets[0], chunk.offsets[0] + chunk.sizes[0])
                ):  # whole rows of the destination, read into place (see ``_read._plan_chunks``)
                    row = t.nbytes // d_size[0]
                    start = (chunk.offsets[0] - d_off[0]) * row
                    view = byte_view(t)[start : start + chunk.sizes[0] * row]
                checks.append(Check(key, chunk.file, chunk.offset, chunk.nbytes, expected, view))
    return checks


def _lanes(jobs: list[tuple[Check, int, int]], count: int) -> list[list[tuple[Check, int, int]]]:
    """``jobs`` (check, start, stop) cut into at most ``count`` runs of about equal bytes, in order."""
    total = sum(stop - start for _, start, stop in jobs)
    lanes: list[list[tuple[Check, int, int]]] = [[]]
    done = 0
    for job in jobs:
        if done >= total * len(lanes) / count and len(lanes) < count:
            lanes.append([])
        lanes[-1].append(job)
        done += job[2] - job[1]
    return lanes


async def check_records(
    directory: Path,
    manifest: Manifest,
    destinations: Mapping[int, Destination],
    crcs: Mapping[tuple[int, int], int],
    *,
    threads: int,
    limiter: anyio.CapacityLimiter | None,
) -> None:
    """Check the CRC-32 of every record the native reader filled ``destinations`` from (see above).

    ``crcs`` holds the expected CRC of each checkable chunk, by (tensor index, chunk number).

    Raises:
        CorruptionError: A record's bytes do not match its CRC-32, or its file is now shorter; names the
            key and the file.
        StorageError: A data file cannot be read.
    """
    await check_crcs(directory, lambda: _plan(manifest, destinations, crcs), threads=threads, limiter=limiter)


async def check_crcs(
    directory: Path,
    plan: Callable[[], Iterable[Check]],
    *,
    threads: int,
    limiter: anyio.CapacityLimiter | None,
) -> None:
    """Check every record ``plan()`` (called in a worker thread) lists, in files under ``directory``.

    Records of up to ``_INLINE`` bytes in memory are checked in that thread; the others in blocks of
    ``_BLOCK`` bytes, on up to ``threads`` threads.

    Raises:
        CorruptionError: A record's bytes do not match its CRC-32, or its file is now shorter; names the
            key (or the record) and the file.
        StorageError: A file cannot be read.
    """
    fds: dict[str, int] = {}
    checks: list[Check] = []  # those left to the workers
    jobs: list[tuple[Check, int, int]] = []  # (check, start, stop): a block of its record

    def planned() -> None:
        with paused():  # (10^4 checks: see ``_gc``)
            for check in plan():
                view, nbytes = check.view, check.nbytes
                if view is not None and nbytes <= _INLINE:  # (its CRC holds the GIL: no gain in a worker)
                    crc = zlib.crc32(view)
                    if crc != check.expected:
                        raise _mismatch(directory, check, crc)
                    continue
                if view is None and check.file not in fds:
                    fds[check.file] = _open(directory, check)
                blocks = range(0, nbytes, _BLOCK)
                check.crcs = [0] * len(blocks)
                jobs.extend((check, lo, min(lo + _BLOCK, nbytes)) for lo in blocks)
                checks.append(check)

    def worker(lanes: list[list[tuple[Check, int, int]]], abort: threading.Event) -> None:
        lane = lanes.pop()
        scratch: memoryview | None = None  # where records are read from their files, made on first use
        for check, start, stop in lane:
            if abort.is_set():
                raise Aborted
            if check.view is not None:
                crc = zlib.crc32(check.view[start:stop])
            else:
                if scratch is None:
                    scratch = memoryview(bytearray(max(stop - start for _, start, stop in lane)))
                crc = _file_crc(directory, check, fds[check.file], start, stop, scratch)
            assert check.crcs is not None  # (made by ``planned`` for every check left to the workers)
            check.crcs[start // _BLOCK] = crc  # (the blocks of a record may be in several lanes)

    def conclude() -> None:
        for check in checks:
            assert check.crcs is not None
            crc = _combined(check.crcs, check.nbytes)
            if crc != check.expected:
                raise _mismatch(directory, check, crc)

    try:
        await run_sync(planned, limiter)
        if jobs:
            total = sum(stop - start for _, start, stop in jobs)
            count = min(threads, len(jobs), total // _BLOCK + 1) if total > _ONE_THREAD else 1
            lanes = _lanes(jobs, max(1, count))
            if len(lanes) == 1:
                await run_sync(lambda: worker(lanes, threading.Event()), limiter)
            else:
                await run_workers(lambda abort: worker(lanes, abort), len(lanes), limiter)
            await run_sync(conclude, limiter)
    finally:
        with anyio.CancelScope(shield=True):
            await run_sync(lambda: _close(fds), limiter)


def _combined(crcs: list[int], nbytes: int) -> int:
    """The CRC-32 of ``nbytes`` from the CRCs of its blocks of ``_BLOCK`` bytes."""
    crc = crcs[0] if crcs else 0
    for i, part in enumerate(crcs[1:], 1):
        crc = crc32_combine(crc, part, min(_BLOCK, nbytes - i * _BLOCK))
    return crc


def _error(directory: Path, check: Check, what: str) -> CorruptionError:
    """A :class:`CorruptionError` saying ``what`` is wrong with ``check``'s record (as ``chunk_error``)."""
    file = str(directory / check.file)
    key = None if check.key is None else render(check.key)
    subject = f"for key {key!r}" if key is not None else f"for its zip record {check.name!r}"
    return CorruptionError(
        f"{what} in {file} {subject} (bytes {check.offset}..{check.offset + check.nbytes})",
        file=file,
        key=key,
    )


def _open(directory: Path, check: Check) -> int:
    """The file of ``check``'s record, opened to read. Blocking."""
    try:
        return open_regular(directory / check.file)  # (a FIFO would block a plain open)
    except FileNotFoundError:
        raise _error(directory, check, "data file is missing") from None
    except OSError as exc:
        path = directory / check.file
        raise StorageError(f"cannot read {path}: {exc.strerror or exc}", path=str(path)) from exc


def _close(fds: dict[str, int]) -> None:
    for fd in fds.values():
        os.close(fd)
    fds.clear()


def _file_crc(directory: Path, check: Check, fd: int, start: int, stop: int, scratch: memoryview) -> int:
    """The CRC-32 of bytes ``[start, stop)`` of ``check``'s record, read from its file. Blocking.

    Raises:
        CorruptionError: The file now ends before ``stop``.
        StorageError: The file cannot be read.
    """
    part = scratch[: stop - start]
    try:
        n = os.preadv(fd, [part], check.offset + start)
    except OSError as exc:
        path = directory / check.file
        raise StorageError(f"cannot read {path}: {exc.strerror or exc}", path=str(path)) from exc
    if n != len(part):
        raise _error(directory, check, "data file is truncated")
    return zlib.crc32(part)


def _mismatch(directory: Path, check: Check, crc: int) -> CorruptionError:
    """The error for ``check``, whose bytes have CRC-32 ``crc``, not its record's. Blocking.

    A check made in memory is made again from the file, to say which of the two differs.
    """
    where = "the bytes read" if check.view is not None else "the file's bytes"
    error = _error(directory, check, "checksum mismatch")
    what = f"{error}: its zip record's CRC-32 is {check.expected:08x}, {where} have {crc:08x}"
    if check.view is not None:
        fd = _open(directory, check)
        try:
            scratch = memoryview(bytearray(min(_BLOCK, check.nbytes)))
            parts = [
                _file_crc(directory, check, fd, lo, min(lo + _BLOCK, check.nbytes), scratch)
                for lo in range(0, check.nbytes, _BLOCK)
            ]
        finally:
            os.close(fd)
        if _combined(parts, check.nbytes) == check.expected:
            what += "; the file's bytes match it: they changed on their way into memory"
    return CorruptionError(what, file=error.file, key=error.key)
