"""Reading into GPU tensors through two small pinned buffers per reader.

A file cannot be read into GPU memory. Each reader thread reads the runs bound for GPU tensors into one
of its own two pinned host buffers (each as long as its longest such run: 8 MiB, or one checksum block),
verifies their blocks there, and enqueues their copies to the device on the caller's current stream
(asynchronous DMA from pinned memory; many small tensors' bytes in one copy, scattered on the device: see
_scatter); before it reads into a buffer again, it waits for the copies out of it, which by then are
long done. So a load into GPU tensors holds two runs of host memory per reader, whatever the tensors'
size, and the copies overlap the reads.

Measured on an H100 machine, against the alternatives: one pinned buffer as large as the GPU tensors
took 1.36 s to allocate for 2 GiB (longer than the whole load; torch caches it afterwards, so only a
process's first load pays); copies from pageable memory run at 7.5 GB/s against 54 GB/s from pinned
memory, blocking the thread, since CUDA stages them through a small pinned buffer of its own.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import crc32c
import torch

from .._cuda import cuda_devices, record
from .._memory import byte_view, filling
from .._runs import Piece, Run
from .._threads import yield_gil


def sink_of(t: torch.Tensor) -> torch.Tensor | None:
    """A flat ``uint8`` view of a GPU tensor's elements, where their bytes can be copied into as stored.

    ``None`` for CPU tensors and for GPU tensors that are not contiguous, or are lazy conjugate or
    negative views: those are read into a host tensor of their shape and copied with ``copy_``.
    """
    if t.is_cuda and t.is_contiguous() and not t.is_conj() and not t.is_neg():
        return t.reshape(-1).view(torch.uint8)
    return None


# Where a piece's bytes go: a flat uint8 tensor (see sink_of) and the byte position in it.
Locate = Callable[[Piece], tuple[torch.Tensor, int]]
# A copy's span: its sink, the position there, the offset in the reader's buffer, and its bytes.
Span = tuple[torch.Tensor, int, int, int]
# Spans shorter than this are not copied one by one: see _scatter.
_SCATTER_BELOW = 64 << 10
# Spans per _foreach_copy_: building their lists of views is Python that holds the GIL (see _scatter).
_SCATTER_BATCH = 128


def _copy_spans(buffer: torch.Tensor, spans: list[Span]) -> None:
    """Copy each span of ``buffer`` (pinned) to its sink by a ``copy_`` of its own, on the current stream."""
    for s, q, a, m in spans:
        s[q : q + m].copy_(buffer[a : a + m], non_blocking=True)


def _scatter(buffer: torch.Tensor, spans: list[Span]) -> None:
    """Copy many small spans of ``buffer`` (pinned) to their sinks: one copy to each device, then a scatter.

    A copy per span costs a launch and a few Python calls each, which for thousands of small tensors
    take far longer than their bytes. Instead the part of the buffer that holds a device's spans goes to
    that device in one copy, and ``torch._foreach_copy_`` calls (a few kernels each) put each span in
    its sink, all on the current stream. Where the device has no memory to spare for that part (at most the
    buffer's size), its spans are copied one by one. On an H100 machine, 20,000 spans of 4 KiB took
    0.17-0.24 s one by one and 0.04-0.05 s so; a cold load of 20,000 such GPU tensors 0.64-0.84 s
    against 1.21-1.28 s, but with one ``_foreach_copy_`` per 8 MiB buffer (2,048 spans) its loop-lag
    p99 was 2.05-3.01 ms against 0.83-1.37 ms: the lists of views are built holding the GIL. So they
    are built and copied ``_SCATTER_BATCH`` spans at a time, offering the GIL after each call
    (``python -m benchmarks.batches``, a proxy on CPU tensors under a load's settings, two runs on the
    2-vCPU host: loop-lag p99 2.50 and 2.13 ms in one call per buffer, 0.97 and 0.95 ms in calls of
    128, as fast).
    """
    by_device: dict[torch.device, list[Span]] = {}
    for span in spans:
        by_device.setdefault(span[0].device, []).append(span)
    for device, group in by_device.items():
        lo = min(a for _, _, a, _ in group)
        hi = max(a + m for _, _, a, m in group)
        try:
            part = buffer[lo:hi].to(device, non_blocking=True)
        except torch.cuda.OutOfMemoryError:
            _copy_spans(buffer, group)
            continue
        for i in range(0, len(group), _SCATTER_BATCH):
            batch = group[i : i + _SCATTER_BATCH]
            sinks = [s[q : q + m] for s, q, _, m in batch]
            torch._foreach_copy_(sinks, [part[a - lo : a - lo + m] for _, _, a, m in batch])
            yield_gil()


def _pread_into(fd: int, view: memoryview, offset: int) -> int:
    """Read into all of ``view`` from ``offset``; return the bytes read (fewer only at end of file)."""
    got = 0
    while got < len(view):
        done = os.preadv(fd, [view[got:]], offset + got)
        if done == 0:
            break
        got += done
    return got


class DeviceReader:
    """One reader thread's two pinned buffers, and the device copies out of each still in flight.

    Args:
        size: Bytes of each buffer: at least the span of every run this reader will read.
    """

    def __init__(self, size: int) -> None:
        pinned = torch.cuda.is_available()
        self._buffers = [torch.empty(size, dtype=torch.uint8, pin_memory=pinned) for _ in range(2)]
        self._views = [byte_view(b) for b in self._buffers]
        self._pending: list[list[torch.cuda.Event]] = [[], []]
        self._next = 0

    def read(
        self, fd: int, run: Run, locate: Locate, checksums: Sequence[tuple[int, ...]] | None
    ) -> tuple[list[Piece], list[Piece]]:
        """Read ``run``, verify each piece against ``checksums[piece.item][piece.block]``, copy it out.

        Only a run whose every piece verified is copied. Call in a thread where the caller's device and
        streams are current (see ``_cuda.current``).

        Returns:
            The pieces the file ended before (truncated), and the pieces whose checksum does not match.
        """
        k, self._next = self._next, self._next ^ 1
        for event in self._pending[k]:
            event.synchronize()
        self._pending[k] = []
        span = run.end - run.offset
        view = self._views[k][:span]
        end = run.offset + _pread_into(fd, view, run.offset)
        short: list[Piece] = []
        bad: list[Piece] = []
        for p in run.pieces:
            at, n = p.offset - run.offset, len(p.view)
            if p.offset + n > end:
                short.append(p)
            elif checksums is not None and crc32c.crc32c(view[at : at + n]) != checksums[p.item][p.block]:
                bad.append(p)
        if not (short or bad):
            with filling():  # (a target may be a parameter, or an inference tensor)
                self._pending[k] = self._copy_out(k, run, locate)
        return short, bad

    def _copy_out(self, k: int, run: Run, locate: Locate) -> list[torch.cuda.Event]:
        """Enqueue the copies of buffer ``k``'s pieces; consecutive pieces of one sink go in one copy."""
        spans: list[Span] = []
        for p in run.pieces:
            n = len(p.view)
            if not n:
                continue
            sink, pos = locate(p)
            at = p.offset - run.offset
            if spans:
                s, q, a, m = spans[-1]
                if s is sink and q + m == pos and a + m == at:
                    spans[-1] = (s, q, a, m + n)
                    continue
            spans.append((sink, pos, at, n))
        buffer = self._buffers[k]
        devices = cuda_devices(s for s, _, _, _ in spans)
        small = [span for span in spans if span[3] < _SCATTER_BELOW]
        if len(small) > 1:
            _scatter(buffer, small)
            spans = [span for span in spans if span[3] >= _SCATTER_BELOW]
        _copy_spans(buffer, spans)
        return [record(d) for d in devices]
