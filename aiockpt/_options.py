"""Tuning knobs, in one frozen keyword-only object (no environment variables)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from ._errors import CheckpointError

# Past a few threads a local disk gains nothing; network file systems may want more, set explicitly.
_MAX_AUTO_THREADS = 4
_MAX_BLOCK = 1 << 40


def auto_threads() -> int:
    """The default I/O thread count: one fewer than the CPUs this process may use, between 1 and 4.

    Buffered reads and writes make the kernel copy every byte between the page cache and user memory on
    the calling thread's CPU, in stretches the scheduler does not interrupt. With as many such threads
    as CPUs, the event loop's thread waits for a CPU after each wake-up: on a 2-CPU machine, 2 reader
    threads stalled the loop 15 ms at p99 where 1 thread stalled it under 2 ms, at about the same
    bandwidth when run alone (see docs/benchmarks.md for the trade-off). So one CPU is left to the loop.
    """
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(_MAX_AUTO_THREADS, cpus - 1))


def check_flags(**flags: object) -> None:
    """Refuse a flag that is not a bool: the str ``"false"`` of a config file would turn it on.

    Raises:
        CheckpointError: A flag is not a bool; the message names it.
    """
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise CheckpointError(f"{name} must be a bool, not {value!r}")


def check_timeout(collective_timeout: object) -> None:
    """Refuse a ``collective_timeout`` that is not a positive, finite number of seconds (nan included).

    Raises:
        CheckpointError: It is not; the message names it.
    """
    if not (
        isinstance(collective_timeout, int | float)
        and not isinstance(collective_timeout, bool)
        and 0 < collective_timeout < math.inf
    ):
        raise CheckpointError(
            f"collective_timeout must be a positive, finite number of seconds, not {collective_timeout!r}"
        )


def _is_int(value: object) -> bool:
    """Whether ``value`` is an int (a bool is not one here)."""
    return isinstance(value, int) and not isinstance(value, bool)


def io_config(io: object) -> IOConfig:
    """``io`` as given to a public call: an :class:`IOConfig`, or the default one for ``None``.

    Raises:
        CheckpointError: ``io`` is neither (a dict of settings, say).
    """
    if io is None:
        return IOConfig()
    if not isinstance(io, IOConfig):
        raise CheckpointError(f"io must be an aiockpt.IOConfig or None, not {type(io).__name__} {io!r}")
    return io


@dataclass(frozen=True, kw_only=True)
class IOConfig:
    """How checkpoint I/O is carried out.

    Attributes:
        threads: Worker threads that write or read one rank's data at once, each computing or verifying
            the checksums of what it moves. ``None`` (the default) picks one fewer than the CPUs this
            process may run on, at least 1 and at most 4: one thread already saturates most local disks,
            and a CPU left free keeps the event loop responsive while the kernel copies pages. More
            help on network file systems.
        checksum_block: Bytes covered by each CRC32C. Large chunks are split into blocks of this size so
            their writing and verification spread over threads. Recorded in the manifest.
        pause_gc: Hold off collections of the older generations of Python's cyclic garbage collector
            while a save or load runs (the youngest generation is still collected, and reference
            counting goes on). A save of many tensors allocates enough bookkeeping objects to set off
            full collections that hold the GIL for 100 ms and more, stalling the event loop. Older
            cyclic garbage made meanwhile by other code is collected once the last save or load in
            flight ends.
        switch_interval: While a save or load runs, CPython hands the GIL to a waiting thread after this
            many seconds instead of its default 5 ms (the previous value is restored when the last save
            or load in flight ends). A save or load of 10^4 tensors runs Python code in worker threads
            for tens of milliseconds, and without this the event loop's thread waits up to 5 ms for the
            GIL each time it wakes (twice per wake, in asyncio). The default, 0.2 ms, gave a 2-vCPU VM
            a lower loop lag than 0.5 ms, and 0.1 ms no clear further gain; each hand-over costs the
            workers some speed. ``None`` leaves the interpreter's setting alone.
        direct_reads: Read local checkpoint files with ``O_DIRECT``, bypassing the page cache: reader
            threads (:attr:`direct_thread_count`) read runs of the file into bounce buffers (8 MiB, on
            transparent huge pages where the kernel gives them, shared with direct writes and kept), and
            a finisher thread verifies each block there and copies it into place, so the device is kept
            busy while earlier runs are verified and copied. The kernel does almost no work per byte: no
            page-cache pages to allocate (on a VM that hands idle memory back to its host, each new one is
            first-touched again), fill and later evict. ``None`` (the default) reads so the runs that a
            buffered load would evict again (see ``drop_behind``): those of large blocks (64 KiB or more on
            average) none of whose pages is cached, of files that accept ``O_DIRECT``; the rest, and every
            run where ``drop_behind`` is off (several ranks on one machine may share pages), goes through
            the page cache. On a 2-vCPU VM, cold in-place 2 GiB loads took 0.60-0.64 s at best this way
            against 0.70-0.82 s buffered (old and new code alternating), where a plain ``O_DIRECT`` read
            took 0.56-0.62 s. ``True`` reads every run so (a checkpoint still in the page cache is read
            from the device again; files or platforms that refuse ``O_DIRECT`` are read through the page
            cache); ``False``, none. Runs bound for GPU tensors, and tensors ``aiockpt.read`` maps (see
            ``map_reads``), go through the page cache in any case. ``aiockpt.verify`` reads the same runs
            so, checksumming them in the bounce buffers.
        drop_behind: Evict the data a load or verification reads through the page cache from it as soon
            as each run of it is verified, except pages that were cached when it began (a checkpoint saved
            on this machine, or already read by another process, stays cached). The load then holds a few
            runs of pages at a time instead of the whole checkpoint: it does not push out what the
            machine caches for other work, and the kernel reuses the same pages instead of allocating a
            new one for every page read (on a VM that hands idle memory back to its host, each new page
            is touched for the first time again: cold 2 GiB loads after 5 idle seconds took 1.35 s with
            it against 2.15 s without, medians, see docs/benchmarks.md). The price: a process reading
            the same uncached data at the same time as this one, but behind it, reads it from the device
            again. ``None`` (the default) turns it on unless this process is one of several ranks of an
            initialized ``torch.distributed`` job, whose ranks on one machine often read the same bytes
            (replicated tensors) at the same time; ``True`` or ``False`` decide for every load. Linux only
            (elsewhere nothing is evicted); ``direct_reads`` bypass the page cache anyway.
        checkers: Verify a load's blocks of 64 KiB or more on a checker thread beside each reader, so that the
            checksums of one run are computed while the next is read. Where the machine has few CPUs (under
            two per reader besides the event loop's), each reader and its checker are pinned to one CPU that
            is not the loop's for the reads. Linux only: elsewhere, and where no such CPU is free, readers
            check their own runs. On a 2-vCPU VM, cold in-place 2 GiB loads took 0.636 / 0.657 s (best /
            median) with checkers against 0.690 / 0.708 s without, and the loop-lag p99 was 0.45 against 0.63
            ms. The price: with every CPU kept busy by other work, a checker is one more thread wanting a CPU
            (beside a process running matrix products on both vCPUs: p99 5.0 against 3.9 ms, 11 wakes over 10
            ms late against 3 in 14 loads, loads 2-11% faster). ``False``: every reader checks its own runs,
            as ``verify`` always does.
        map_reads: ``aiockpt.read`` of an aiockpt checkpoint returns each tensor of 64 KiB or more that one
            chunk holds whole as a view of a private (copy-on-write) mapping of its data file, populated and
            verified in place, instead of new memory the file is read into: the machine then provides each
            byte once (a page of the page cache) instead of twice (that page and the tensor's). On a 2-vCPU VM
            cold fresh reads of 2 GiB took 0.58-0.61 s at best (0.65-1.36 s median) this way against 1.02-1.07
            s (1.08-1.20 s) into new memory. Writing to such a tensor copies the pages written, never the
            file. The price: its pages are the page cache's, which the kernel may evict under memory pressure
            and read again from the file when they are next touched (a committed checkpoint's files never
            change; a deleted one's stay readable while mapped); its storage, the whole file, cannot be
            resized, and ``torch.save`` of the tensor writes all of it (clone it first); and the file must not
            be truncated while it is mapped (touching bytes past the end of a file kills the process with
            ``SIGBUS``; aiockpt never truncates a committed file). Not used with ``direct_reads=True``, for
            object storage or foreign formats, by ``aiockpt.load``, which fills the target's own tensors, or
            by ``convert`` to torch.save or DCP, whose writers save or clone a tensor's whole storage.
        direct_writes: Write a save's checksum blocks of 64 KiB or more at page-aligned file offsets (every
            tensor of 64 KiB or more starts at one) with ``O_DIRECT``, straight to the device: from a staging
            buffer (``async_op=True``, and tensors that need a copy), which lays large tensors out at page
            boundaries, as they are; from a tensor's own memory, which is not page-aligned, through bounce
            buffers (8 MiB each, one per writer thread and one more, on transparent huge pages where the
            kernel gives them; up to four are kept for the next save). A thread of its own checksums (and
            copies) the blocks ahead of the writers. The kernel then copies nothing into the page cache, so
            the write costs little CPU time and neither fills nor evicts the page cache; a file written so
            gets two writer threads where ``threads`` is ``None`` (:attr:`direct_thread_count`). On a 2-vCPU
            VM, 2 GiB: write phases of 0.50-0.53 s from a staging buffer and 0.49-0.51 s (best of 4) from
            tensor memory, against 0.48-0.53 s for a plain ``O_DIRECT`` write from 4 KiB pages (0.45-0.47 s
            from huge pages) and 0.5-5.5 s for a buffered one, which took as much CPU time as that; in the
            benchmark suite, durable saves' slowest rounds 0.71-1.0 s against 5.4-5.7 s, and the loop-lag max
            of reused-buffer ``async_op=True`` saves 2.0-3.9 ms in four runs of five (55.0 ms in one) against
            82.5 and 964.3 ms in the two runs of the code before. The price: a checkpoint just saved is not in
            the page cache, so loading it right away reads the device. Where the file system or the memory
            refuses ``O_DIRECT``, on open or on a write, the rest of the file is written through the page
            cache. ``False`` writes everything through the page cache. Local files only: saves to object
            storage upload as before.
        worker_nice: How much lower than the caller's the scheduling priority of the threads that
            copy (``async_op=True`` staging), checksum and write a save's bytes is (a ``nice``
            increment; Linux only, where each thread has its own; 0 leaves it). They run at full speed
            on an otherwise idle CPU, but when every CPU is busy the kernel runs the event loop's
            thread first as soon as it wakes, instead of making it wait for a time slice behind a
            thread that is copying pages. Writers of a save whose blocks average under 64 KiB keep the
            caller's priority: their time goes to calls that hold the GIL, and lowered, they kept the
            event loop waiting for it. Loads keep their readers at the caller's priority (lowered,
            they made fresh reads slower). The price: while other threads or processes of the
            caller's priority keep every CPU busy (CPU-bound training), a save's staging copy and
            writes get a smaller share of the CPU, so ``async_op=True`` returns later and the save
            takes longer to become durable; 0 gives them the caller's priority. Each such worker is a
            thread of its own, started per save and gone after it, because an unprivileged process
            cannot raise a thread's priority back.
    """

    threads: int | None = None
    checksum_block: int = 4 << 20
    pause_gc: bool = True
    switch_interval: float | None = 0.0002
    direct_reads: bool | None = None
    direct_writes: bool = True
    drop_behind: bool | None = None
    checkers: bool = True
    map_reads: bool = True
    worker_nice: int = 10

    def __post_init__(self) -> None:
        # Types are checked too: values often come from a config file, where "false" is a truthy str and
        # 10.0 a float that a worker thread's os.nice() refuses.
        for name in ("pause_gc", "direct_writes", "checkers", "map_reads"):
            if not isinstance(getattr(self, name), bool):
                raise CheckpointError(f"IOConfig.{name} must be a bool, not {getattr(self, name)!r}")
        for name in ("direct_reads", "drop_behind"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise CheckpointError(f"IOConfig.{name} must be a bool or None, not {getattr(self, name)!r}")
        threads = self.threads
        if threads is not None and not (_is_int(threads) and threads >= 1):
            raise CheckpointError(f"IOConfig.threads must be an int of at least 1 or None, not {threads!r}")
        interval = self.switch_interval
        if interval is not None and not (
            isinstance(interval, int | float) and not isinstance(interval, bool) and 0 < interval < math.inf
        ):
            raise CheckpointError(
                f"IOConfig.switch_interval must be a positive number of seconds or None, not {interval!r}"
            )
        nice = self.worker_nice
        if not (_is_int(nice) and 0 <= nice <= 19):
            raise CheckpointError(f"IOConfig.worker_nice must be an int from 0 to 19, not {nice!r}")
        block = self.checksum_block
        # (Bounded above so the manifest can record it: its ints are at most 64 bits.)
        if not (_is_int(block) and 4096 <= block <= _MAX_BLOCK and not block % 4096):
            raise CheckpointError(
                f"IOConfig.checksum_block must be a multiple of 4096 from 4096 to 2**40, not {block!r}"
            )

    @property
    def thread_count(self) -> int:
        """``threads``, or where it is ``None`` the default for this process (:func:`auto_threads`)."""
        return auto_threads() if self.threads is None else self.threads

    @property
    def direct_thread_count(self) -> int:
        """Writers (readers) of a data file written (read) with ``O_DIRECT``: ``threads``, or at least 2.

        At least 2 where ``threads`` is ``None``. Such a thread only waits for the device (a preparer
        thread checksums, and copies where needed, ahead of the writers; a finisher verifies and copies
        into place behind the readers), so two keep two requests in flight and the CPU that
        :func:`auto_threads` leaves to the event loop stays free.
        """
        return max(2, auto_threads()) if self.threads is None else self.threads

    @property
    def drops_behind(self) -> bool:
        """``drop_behind``, or where it is ``None`` whether this process is not one of several ranks."""
        if self.drop_behind is not None:
            return self.drop_behind
        import torch.distributed as dist

        return not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)
