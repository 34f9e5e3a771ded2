"""Event-loop lag: how late a sibling task's 1 ms sleeps wake while something else runs in the loop."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from types import TracebackType

INTERVAL = 0.001


@dataclass(frozen=True)
class LagStats:
    """Summary of lag samples (actual sleep minus the requested 1 ms), in milliseconds."""

    samples: int
    duration_s: float
    p50_ms: float
    p99_ms: float
    max_ms: float


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

    Samples accumulate into :attr:`lags` (seconds), which may be shared across several monitors (one per
    repeat) to pool them. On exit the monitor lets its current sleep finish, so a stall that is still in
    progress when the measured operation returns is recorded too.
    """

    def __init__(self, lags: list[float] | None = None) -> None:
        self.lags: list[float] = [] if lags is None else lags
        self.duration_s = 0.0
        self._stop = False
        self._task: asyncio.Task[None] | None = None
        self._started = 0.0

    async def _run(self) -> None:
        while not self._stop:
            start = time.perf_counter()
            await asyncio.sleep(INTERVAL)
            self.lags.append(max(time.perf_counter() - start - INTERVAL, 0.0))

    async def __aenter__(self) -> LagMonitor:
        self._stop = False
        self._started = time.perf_counter()
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
        self.duration_s += time.perf_counter() - self._started

    def stats(self) -> LagStats:
        """Summary of the samples recorded so far."""
        return summarize(self.lags, self.duration_s)


async def idle_lag(duration_s: float) -> LagStats:
    """Lag of the monitor alone in an otherwise idle loop for ``duration_s`` seconds (the baseline)."""
    async with LagMonitor() as mon:
        await asyncio.sleep(duration_s)
    return mon.stats()
