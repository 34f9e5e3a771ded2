"""The benchmark report's loop-lag target, as the issue states it (``benchmarks._report``)."""

from __future__ import annotations

from benchmarks import _report
from benchmarks import _suite as suite
from benchmarks._lag import LagStats
from benchmarks._results import LagRow, Results


def _stats(p99_ms: float, max_ms: float) -> LagStats:
    return LagStats(samples=1000, duration_s=1.0, p50_ms=0.1, p99_ms=p99_ms, max_ms=max_ms)


def _met(p99_ms: float, max_ms: float, thread: LagStats | None) -> bool:
    res = Results(machine={}, config={})
    if thread is not None:
        res.lags.append(LagRow("A", suite.LAG_THREAD, thread))
    res.lags.append(LagRow("A", suite.AIO_READ, _stats(p99_ms, max_ms)))
    (check,) = _report._lag_checks(res)
    assert check.met is not None
    return check.met


def test_the_max_may_reach_a_thread_write_max_over_25_ms_but_the_p99_bound_stays() -> None:
    quiet, noisy = _stats(0.5, 10.0), _stats(3.0, 69.5)
    assert _met(1.9, 24.0, quiet)
    assert not _met(1.9, 26.0, quiet)  # the thread write stayed under 25 ms: so must the call
    assert _met(1.9, 60.0, noisy)  # the machine stalls a plain write this long: no worse than it
    assert not _met(1.9, 70.0, noisy)
    assert not _met(2.1, 10.0, noisy)  # p99 over 2 ms, even where the thread write's is higher
    assert _met(1.9, 24.0, None)
    assert not _met(1.9, 26.0, None)
