"""The benchmark's loop-lag monitor: where the event loop's thread spent a late wake (``benchmarks._lag``)."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from benchmarks import _lag, _report, _suite
from benchmarks._lag import LagMonitor, LagStats, LateWake, late_wake
from benchmarks._results import LagRow, Measurement, Results

linux = pytest.mark.skipif(sys.platform != "linux", reason="the split comes from /proc/thread-self/schedstat")


def test_a_late_wake_splits_its_span_into_running_waiting_and_off_cpu() -> None:
    wake = late_wake(100.0, 1.5, 0.030, 0.031, (1_000_000, 0), (6_000_000, 2_000_000))
    assert (wake.start, wake.at_s, wake.lag_ms, wake.span_ms) == (100.0, 1.5, 30.0, 31.0)
    assert (wake.ran_ms, wake.waited_ms, wake.off_cpu_ms) == (5.0, 2.0, 24.0)
    unknown = late_wake(100.0, 1.5, 0.030, 0.031, None, None)
    assert unknown.ran_ms is None
    assert unknown.off_cpu_ms is None


def _row(*wakes: LateWake) -> LagRow:
    stats = LagStats(samples=10, duration_s=1.0, p50_ms=0.1, p99_ms=1.0, max_ms=30.0)
    return LagRow("A", "aiockpt.save", stats, late=len(wakes), shared=0, wakes=list(wakes))


def test_the_report_shows_a_rows_longest_wake_and_where_the_loop_spent_it() -> None:
    res = Results(machine={}, config={})
    early, longest = LateWake(9.0, 0.2, 12.0, 13.0, 1.0, 0.5), LateWake(10.0, 1.25, 30.0, 31.0, 5.0, 2.0)
    res.lags.append(_row(early, longest))
    res.lags.append(_row(LateWake(9.5, 0.5, 11.0, 12.0)))
    res.lags.append(_row())
    table = _report._lag_table(res)
    assert "30.0 at 1.25 s: ran 5.0, waited 2.0, off CPU 24.0" in table
    assert "11.0 at 0.50 s |" in table  # no split where it is unknown
    assert table.splitlines()[-1].endswith("| 0 (0) |  |")  # no late wake: an empty cell
    assert _report.to_json(res)["lags"][0]["wakes"][1]["ran_ms"] == 5.0  # type: ignore[index]


async def _monitored(block: float, *, busy: bool) -> LateWake:
    async with LagMonitor() as monitor:
        await asyncio.sleep(0.005)
        if busy:
            end = time.thread_time() + block
            while time.thread_time() < end:  # the loop's own work: its thread runs for ``block`` of CPU time
                pass
        else:
            time.sleep(block)  # noqa: ASYNC251 - the blocking call under test: the loop's thread is off every CPU
    assert monitor.wakes, monitor.lags
    return max(monitor.wakes, key=lambda w: w.lag_ms)


@linux
def test_the_monitor_tells_a_loop_that_ran_from_one_that_was_held() -> None:
    ran = asyncio.run(_monitored(0.05, busy=True))
    held = asyncio.run(_monitored(0.05, busy=False))
    for wake in (ran, held):
        assert wake.lag_ms > _lag.LATE_S * 1e3
        assert 0.0 < wake.at_s < 1.0
    assert ran.ran_ms is not None
    assert ran.ran_ms >= 45.0  # the spin's 50 ms of CPU time (the same clock as schedstat's)
    assert held.ran_ms is not None
    assert held.off_cpu_ms is not None
    assert held.off_cpu_ms > held.ran_ms  # sleeping, it was on none


def test_every_case_runs_with_the_suites_own_heap_frozen(tmp_path: Path) -> None:
    # A full collection of the suite's heap inside the thread-write baseline made its max (the bar a
    # call's max is held to) a stall of the suite's own: every case, sync or in the loop, runs with the
    # heap of before it frozen, and the collector otherwise as it was.
    before = (gc.get_freeze_count(), gc.get_threshold(), gc.isenabled())
    seen: dict[str, int] = {}

    def sync() -> _suite.Outcome:
        seen["sync"] = gc.get_freeze_count()
        return _suite.Outcome(0.001)

    async def coro() -> _suite.Outcome:
        seen["coro"] = gc.get_freeze_count()
        await asyncio.sleep(0.002)
        return _suite.Outcome(0.002)

    suite = _suite.Suite(tmp_path, 1, _suite.parse_only("small"), None, Results(machine={}, config={}))
    try:
        for name, kind in (("sync", {"sync": sync}), ("coro", {"coro": coro})):
            m = Measurement(state="B", group="limit", case=name, nbytes=1)
            suite.results.measurements.append(m)
            suite.run_rounds([_suite.Case(m, lambda: None, **kind)])
            assert (gc.get_freeze_count(), gc.get_threshold(), gc.isenabled()) == before  # given back
    finally:
        suite.close()
    # Everything alive before the case was frozen (this process's modules, at least thousands of objects).
    assert seen["sync"] > before[0] + 1000
    assert seen["coro"] > before[0] + 1000
    assert [m.seconds for m in suite.results.measurements] == [[0.001], [0.002]]


@pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="stops the process with SIGSTOP")
def test_the_stall_process_records_a_stall_without_a_thread_in_the_measured_process() -> None:
    # A thread of the suite's reading the stalls as they came took the GIL from the measured loop at
    # exactly those moments: they are read from a file when asked for.
    threads = threading.active_count()
    stalls = _lag.MachineStalls()
    try:
        assert threading.active_count() == threads

        def held() -> list[tuple[float, float]]:  # (the machine's own stalls are shorter, if any)
            return [(start, lag) for start, lag in stalls.stalls if lag >= 0.04]

        deadline = time.monotonic() + 10
        while not held() and time.monotonic() < deadline:
            os.kill(stalls._proc.pid, signal.SIGSTOP)  # held as a host holds a VM's CPU
            time.sleep(0.05)
            os.kill(stalls._proc.pid, signal.SIGCONT)
            time.sleep(0.05)
        (start, lag), *_ = held()
        # A loop's late wake over the same span is the machine's; one a second later is not.
        assert stalls.shared([(start, lag), (start + 1.0, lag)]) == 1
    finally:
        stalls.close()
