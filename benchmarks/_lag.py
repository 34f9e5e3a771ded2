"""Event-loop lag: how late a sibling task's 1 ms sleeps wake while something else runs in the loop."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from types import TracebackType

INTERVAL = 0.001
# Wakes later than this are kept with their time, to be compared with the machine's own stalls.
LATE_S = 0.010
# The separate process records its own wakes later than this.
_STALL_S = 0.005
# It ends with the suite's process, even one killed before it could stop it: its parent changes then.
_STALL_SCRIPT = f"""
import os, sys, time
parent = os.getppid()
while os.getppid() == parent:
    start = time.monotonic()
    time.sleep({INTERVAL})
    lag = time.monotonic() - start - {INTERVAL}
    if lag > {_STALL_S}:
        sys.stdout.write(f"{{start}} {{lag}}\\n")
        sys.stdout.flush()
"""


@dataclass(frozen=True)
class LagStats:
    """Summary of lag samples (actual sleep minus the requested 1 ms), in milliseconds."""

    samples: int
    duration_s: float
    p50_ms: float
    p99_ms: float
    max_ms: float


@dataclass(frozen=True)
class LateWake:
    """A wake of the monitor later than ``LATE_S``, and where the event loop's thread spent it.

    ``start``: ``time.monotonic()`` when the sleep began (the clock of :class:`MachineStalls`). ``at_s``:
    seconds from entering the monitor (the measured call's start) to the wake. ``span_ms``: the
    time from the wake before to this one. ``ran_ms`` and ``waited_ms``: how much of the span the loop's
    thread ran on a CPU, and waited runnable for one (Linux's ``/proc/thread-self/schedstat``; ``None``
    elsewhere). The rest it was off every CPU: waiting for the GIL, in a blocking call, or asleep past
    its timer. Waiting long means the CPUs were taken; off CPU, that something held the thread. Running
    long means its own steps were slow, or its CPU was kept from them while it was the current task:
    on a kernel without ``CONFIG_IRQ_TIME_ACCOUNTING`` (this VM's) interrupts served meanwhile count as
    its run time, and so does a host's stall of the CPU that the host does not report as stolen.
    """

    start: float
    at_s: float
    lag_ms: float
    span_ms: float
    ran_ms: float | None = None
    waited_ms: float | None = None

    @property
    def off_cpu_ms(self) -> float | None:
        """The span's time off every CPU (``None`` where the split is not known)."""
        if self.ran_ms is None or self.waited_ms is None:
            return None
        return max(self.span_ms - self.ran_ms - self.waited_ms, 0.0)


class _SchedStat:
    """The calling thread's run and runqueue-wait nanoseconds, read again and again (Linux)."""

    def __init__(self) -> None:
        self._fd: int | None = None
        try:
            self._fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        except (OSError, AttributeError):  # not Linux (or no /proc)
            self._fd = None

    def read(self) -> tuple[int, int] | None:
        """``(ns run, ns waited for a CPU)`` of the thread that made this object, or ``None``."""
        if self._fd is None:
            return None
        run, wait = os.pread(self._fd, 128, 0).split()[:2]
        return int(run), int(wait)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def late_wake(
    start: float,
    at_s: float,
    lag_s: float,
    span_s: float,
    before: tuple[int, int] | None,
    after: tuple[int, int] | None,
) -> LateWake:
    """A :class:`LateWake` from the thread's schedstat readings ``before`` and ``after`` its span."""
    if before is None or after is None:
        return LateWake(start=start, at_s=at_s, lag_ms=lag_s * 1e3, span_ms=span_s * 1e3)
    return LateWake(
        start=start,
        at_s=at_s,
        lag_ms=lag_s * 1e3,
        span_ms=span_s * 1e3,
        ran_ms=(after[0] - before[0]) / 1e6,
        waited_ms=(after[1] - before[1]) / 1e6,
    )


def _percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list (``q`` in [0, 100])."""
    if not sorted_values:
        return float("nan")
    rank = max(1, -(-len(sorted_values) * q // 100))
    return sorted_values[int(rank) - 1]


def summarize(lags_s: list[float], duration_s: float) -> LagStats:
    """Summarize lag samples given in seconds.

    Args:
        lags_s: One sample per sleep, in seconds.
        duration_s: Wall time the samples cover.

    Returns:
        The count, duration, p50, p99 and max (milliseconds).
    """
    ms = sorted(x * 1000.0 for x in lags_s)
    return LagStats(
        samples=len(ms),
        duration_s=duration_s,
        p50_ms=_percentile(ms, 50),
        p99_ms=_percentile(ms, 99),
        max_ms=ms[-1] if ms else float("nan"),
    )


class LagMonitor:
    """Async context manager running a task that sleeps 1 ms in a loop and records each sleep's lag.

    Samples accumulate into :attr:`lags` (seconds) and :attr:`duration_s`; entering the same monitor
    again (once per repeat) pools them. On exit the monitor lets its current sleep finish, so a stall
    that is still in progress when the measured operation returns is recorded too. Each wake over
    ``LATE_S`` late is also kept in :attr:`wakes`, with where the loop's thread spent it.
    """

    def __init__(self) -> None:
        self.lags: list[float] = []
        self.wakes: list[LateWake] = []
        self.duration_s = 0.0
        self._stop = False
        self._task: asyncio.Task[None] | None = None
        self._started = 0.0

    async def _run(self) -> None:
        sched = _SchedStat()  # made here: the loop's thread is the one it reads
        try:
            read_at, before = time.monotonic(), sched.read()
            while not self._stop:
                start = time.monotonic()
                await asyncio.sleep(INTERVAL)
                now, after = time.monotonic(), sched.read()
                lag = max(now - start - INTERVAL, 0.0)
                self.lags.append(lag)
                if lag > LATE_S:
                    at_s = now - self._started
                    self.wakes.append(late_wake(start, at_s, lag, now - read_at, before, after))
                read_at, before = now, after
        finally:
            sched.close()

    async def __aenter__(self) -> LagMonitor:
        self._stop = False
        self._started = time.monotonic()
        self._task = asyncio.create_task(self._run())
        # Let the task reach its first sleep, so an operation that blocks the loop right away is measured.
        await asyncio.sleep(0)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop = True
        if self._task is not None:
            await self._task
        self.duration_s += time.monotonic() - self._started

    @property
    def late(self) -> list[tuple[float, float]]:
        """Wakes over ``LATE_S`` late: (``time.monotonic()`` when the sleep began, lag in seconds)."""
        return [(w.start, w.lag_ms / 1e3) for w in self.wakes]

    def stats(self) -> LagStats:
        """Summary of the samples recorded so far."""
        return summarize(self.lags, self.duration_s)


async def idle_lag(duration_s: float) -> LagStats:
    """Lag of the monitor alone in an otherwise idle loop for ``duration_s`` seconds (the baseline)."""
    async with LagMonitor() as mon:
        await asyncio.sleep(duration_s)
    return mon.stats()


class MachineStalls:
    """A separate process that sleeps 1 ms in a loop and records its own late wakes: the machine's stalls.

    A wake of the event loop that is late while this process's wake is late too was a stall of the whole
    machine (a VM's CPUs held by its host, say), not of the loop alone. The process shares no GIL, no
    threads and no memory with the suite. Times are ``time.monotonic()``, the same clock in every process.
    """

    def __init__(self) -> None:
        # The process writes its late wakes to a file, read only when asked for (:attr:`stalls`): a thread
        # of the suite's reading them as they came took the GIL from the measured loop at exactly those
        # moments (seen in a sched_switch trace of a fresh read's 32.6 ms wake, the loop handing the GIL
        # to that thread and back 15 times in 8 ms).
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 (open as long as the process runs: see close)
        self._proc = subprocess.Popen([sys.executable, "-c", _STALL_SCRIPT], stdout=self._log)

    @property
    def stalls(self) -> list[tuple[float, float]]:
        """The late wakes recorded so far: (when the sleep began, lag in seconds)."""
        # pread: the process writes through the same open file, at its offset, which must not move.
        fd = self._log.fileno()
        lines = os.pread(fd, os.fstat(fd).st_size, 0).decode().split("\n")
        # The last item is "" or a line the process is writing right now.
        return [(float(a), float(b)) for a, b in (line.split() for line in lines[:-1])]

    def close(self) -> None:
        """Stop the process."""
        self._proc.terminate()
        self._proc.wait()
        self._log.close()

    def shared(self, late: list[tuple[float, float]]) -> int:
        """How many of ``late`` (from :class:`LagMonitor`) overlap a stall of this process by half or more.

        A wake's late part runs from the end of its 1 ms sleep to its actual end; the same for the stalls.
        """
        stalls = sorted((start + INTERVAL, start + INTERVAL + lag) for start, lag in self.stalls)
        count = 0
        for start, lag in late:
            lo, hi = start + INTERVAL, start + INTERVAL + lag
            overlap = sum(max(0.0, min(hi, b) - max(lo, a)) for a, b in stalls if a < hi and b > lo)
            count += overlap >= lag / 2
        return count
