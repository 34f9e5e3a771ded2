"""What a run records: one :class:`Measurement` per case, lag rows, skips and failures."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from benchmarks._lag import LagStats, LateWake


@dataclass
class Measurement:
    """One timed case on one state; ``seconds`` holds one entry per repeat, the best one is reported."""

    state: str
    group: str  # "limit", "save" or "load"
    case: str
    nbytes: int
    seconds: list[float] = field(default_factory=list)
    # Async saves: time until the call returned, of the saves that reused their staging buffers, and of
    # the first one (which allocated them).
    staged: list[float] = field(default_factory=list)
    first_staged: float | None = None
    # The same saves: a memcpy of the state timed just before each (same index), under the same
    # conditions (after the same case, in the same round), as the measure of what staging can reach.
    staged_memcpy: list[float] = field(default_factory=list)
    phases: list[dict[str, float]] = field(default_factory=list)  # aiockpt saves: Metadata.timings
    lag: LagStats | None = None
    note: str = ""

    @property
    def best(self) -> float:
        """Fastest repeat, in seconds (NaN when the case recorded nothing)."""
        return min(self.seconds) if self.seconds else float("nan")

    @property
    def best_phases(self) -> dict[str, float]:
        """Per-phase seconds of the fastest repeat (empty when the library reports none)."""
        if len(self.phases) != len(self.seconds) or not self.phases:
            return {}
        return self.phases[self.seconds.index(self.best)]

    @property
    def median(self) -> float:
        """Median of the repeats, in seconds (NaN when the case recorded nothing)."""
        return statistics.median(self.seconds) if self.seconds else float("nan")

    @property
    def gbps(self) -> float:
        """Throughput of the fastest repeat in GB/s (10^9 bytes per second, tensor bytes only)."""
        return self.nbytes / self.best / 1e9 if self.seconds else float("nan")

    @property
    def best_staged(self) -> float:
        """Fastest time until an async save with reused buffers returned, in seconds (NaN if none)."""
        return min(self.staged) if self.staged else float("nan")

    @property
    def staged_per_memcpy(self) -> float:
        """Median over the async saves with reused buffers of (time until returned / the memcpy before it).

        NaN where no memcpy was paired with them.
        """
        if not self.staged_memcpy or len(self.staged_memcpy) != len(self.staged):
            return float("nan")
        return statistics.median(s / m for s, m in zip(self.staged, self.staged_memcpy, strict=True))


@dataclass
class LagRow:
    """Loop-lag statistics of one scenario (idle, a thread doing I/O, a library call).

    ``late``: wakes over 10 ms late; ``shared``: of them, those during which a separate process's wakes
    were late too (stalls of the whole machine). ``None`` where not counted. ``wakes``: those wakes, with
    where the loop's thread spent them.
    """

    state: str
    case: str
    stats: LagStats
    late: int | None = None
    shared: int | None = None
    wakes: list[LateWake] = field(default_factory=list)

    @property
    def longest(self) -> LateWake | None:
        """The latest of :attr:`wakes`, the one of the largest lag (``None`` if there is none)."""
        return max(self.wakes, key=lambda w: w.lag_ms, default=None)


@dataclass
class Results:
    """Everything one run measured, plus the context needed to read it."""

    machine: dict[str, str]
    config: dict[str, object]
    states: dict[str, dict[str, object]] = field(default_factory=dict)
    measurements: list[Measurement] = field(default_factory=list)
    lags: list[LagRow] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def find(self, state: str, case: str) -> Measurement | None:
        """The measurement of ``case`` on ``state`` that has at least one timing, if any."""
        for m in self.measurements:
            if m.state == state and m.case == case and m.seconds:
                return m
        return None
