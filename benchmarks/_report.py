"""Markdown tables, ratios, target checks and the JSON dump of a run."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

from benchmarks import _suite as s
from benchmarks._lag import LagStats, LateWake
from benchmarks._results import Measurement, Results

LAG_P99_MS = 2.0
LAG_MAX_MS = 25.0


METHOD = " ".join(
    [
        "Method: GB/s = tensor bytes / seconds (10^9 B/s). Every saver is durable when timed: its files",
        "and directories are fsynced (aiockpt does it itself; DCP fsyncs its files and the suite the",
        "directories; torch.save and safetensors get both). Before every load the suite runs os.sync()",
        "and evicts each file of that checkpoint with posix_fadvise(DONTNEED). In-place loaders fill a",
        "preallocated, already touched template; fresh loaders return new tensors, and their time",
        "includes reading one byte per 4 KiB page of the result, so lazily mmap'd tensors count their",
        "I/O. Savers (with the fsync'd-write limit) run round-robin, then loaders (with the cold read),",
        "each round starting one case later and every other round backwards (so that no case always runs",
        "after the same one); the best repeat is reported. An async save's time until it returned is",
        "compared with a memcpy of the state timed just before each of its saves. Loop lag: a task",
        "in the same event loop sleeps 1 ms in a loop while the operation runs; lag = actual sleep - 1 ms.",
        "For a call's longest late wake (over 10 ms): when it came (seconds into the call), and how much",
        "of it the loop's thread ran on a CPU, waited runnable for one, and spent off every CPU (the GIL, a",
        "blocking call, a late timer), from the thread's schedstat. Before every case the suite's own heap",
        "is collected and frozen (gc.freeze): the collections during a case walk only what it allocated.",
    ]
)


@dataclass(frozen=True)
class Check:
    """One target: what is compared, the measured value, the goal, and whether it is met (None: not run)."""

    name: str
    value: str
    goal: str
    met: bool | None


def _fmt(x: float, digits: int = 2) -> str:
    return "n/a" if math.isnan(x) else f"{x:.{digits}f}"


def _ratio(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:.2f}x"


def table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """Render a markdown table (first column left-aligned, the rest right-aligned)."""
    align = [":--"] + ["--:"] * (len(header) - 1)
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _time(res: Results, state: str, case: str) -> float:
    m = res.find(state, case)
    return m.best if m else float("nan")


def _best_time(res: Results, state: str, cases: Iterable[str]) -> float:
    times = [t for t in (_time(res, state, c) for c in cases) if not math.isnan(t)]
    return min(times) if times else float("nan")


def _speedup(other_s: float, ours_s: float) -> float:
    """How many times faster ``ours`` is than ``other`` (equivalently, throughput ratio ours/other)."""
    return other_s / ours_s if ours_s > 0 else float("nan")


def _best_of(res: Results, state: str, template: str, counts: Sequence[int]) -> float:
    return _best_time(res, state, [template.format(n) for n in counts])


def _check(name: str, value: float, goal: str, ok: bool) -> Check:
    return Check(name, _ratio(value), goal, None if math.isnan(value) else ok)


def checks(res: Results) -> list[Check]:
    """Evaluate the project's performance targets against a run."""
    out: list[Check] = []
    a_save, a_load = _time(res, "A", s.AIO_SAVE), _time(res, "A", s.AIO_LOAD)
    ways = [w.format(n) for w in (s.WRITE, s.WRITE_EARLY, s.WRITE_DIRECT) for n in s.IO_THREADS]
    ways = [w for w in ways if not math.isnan(_time(res, "A", w))]  # O_DIRECT ones where refused: absent
    write = _best_time(res, "A", ways)
    reads = [w.format(n) for w in (s.READ, s.READ_DIRECT) for n in s.IO_THREADS]
    reads = [w for w in reads if not math.isnan(_time(res, "A", w))]
    read = _best_time(res, "A", reads)
    dcp_save = _best_of(res, "A", s.DCP_SAVE, s.DCP_THREADS)
    dcp_load = _best_of(res, "A", s.DCP_LOAD, s.DCP_THREADS)
    r = _speedup(write, a_save)
    name = f"A: aiockpt.save throughput / fsync'd write (best of {len(ways)} ways)"
    out.append(_check(name, r, "≥ 0.90x", r >= 0.9))
    for other in (s.TORCH_SAVE, s.ST_SAVE):
        r = _speedup(_time(res, "A", other), a_save)
        out.append(_check(f"A: aiockpt.save vs {other} (speedup)", r, "> 1x", r > 1.0))
    r = _speedup(dcp_save, a_save)
    out.append(_check("A: aiockpt.save vs DCP save, best thread count (speedup)", r, "> 1x", r > 1.0))
    r = _speedup(read, a_load)
    name = f"A: aiockpt.load throughput / cold read (best of {len(reads)} ways)"
    out.append(_check(name, r, "≥ 0.90x", r >= 0.9))
    r = _speedup(dcp_load, a_load)
    out.append(_check("A: aiockpt.load vs DCP load (speedup)", r, "≥ 2x", r >= 2.0))
    out += _staging_checks(res)

    b_save, b_load, b_read = (
        _time(res, "B", s.AIO_SAVE),
        _time(res, "B", s.AIO_LOAD),
        _time(res, "B", s.AIO_READ),
    )
    r = _speedup(_best_of(res, "B", s.DCP_SAVE, s.DCP_THREADS), b_save)
    out.append(_check("B: aiockpt.save vs DCP save (speedup)", r, "≥ 10x", r >= 10.0))
    r = _speedup(_best_of(res, "B", s.DCP_LOAD, s.DCP_THREADS), b_load)
    out.append(_check("B: aiockpt.load vs DCP load (speedup)", r, "≥ 10x", r >= 10.0))
    r = _speedup(_time(res, "B", s.ST_SAVE), b_save)
    out.append(_check("B: aiockpt.save vs safetensors save_file (speedup)", r, "> 1x", r > 1.0))
    r = _speedup(_time(res, "B", s.ST_LOAD), b_read)
    out.append(_check("B: aiockpt.read vs safetensors load_file, both fresh (speedup)", r, "> 1x", r > 1.0))
    r = _speedup(_time(res, "B", s.ST_LOAD), b_load)
    out.append(_check("B: aiockpt.load (in place) vs safetensors load_file (speedup)", r, "> 1x", r > 1.0))
    out += _lag_checks(res)
    return out


def _staging_checks(res: Results) -> list[Check]:
    """Staging against memcpy: each async save against the memcpy timed just before it.

    The run's best memcpy, measured before the rounds on a quiet machine, is given beside it: a ratio to
    it also counts how much slower the machine was during the rounds.
    """
    saver, memcpy = res.find("A", s.AIO_SAVE_ASYNC), res.find("A", s.MEMCPY)
    if saver is None or not saver.staged:
        return []
    name = "A: async_op=True save returned after (reused staging buffers) / memcpy just before it"
    r = saver.staged_per_memcpy  # NaN where memcpy was not selected
    check = _check(name + " (median of saves)", r, "≤ 1.30x", r <= 1.3)
    if memcpy is not None:
        quiet = saver.best_staged / memcpy.best
        value = f"{check.value} (best against the best memcpy before the rounds: {_ratio(quiet)})"
        check = Check(check.name, value, check.goal, check.met)
    return [check]


def _lag_checks(res: Results) -> list[Check]:
    out: list[Check] = []
    aio_cases = (s.AIO_SAVE, s.AIO_SAVE_ASYNC, s.AIO_SAVE_ASYNC_FIRST, s.AIO_LOAD, s.AIO_READ)
    thread = next((x.stats for x in res.lags if x.state == "A" and x.case == s.LAG_THREAD), None)
    base = f" (thread write: {thread.p99_ms:.2f}, {thread.max_ms:.1f})" if thread else ""
    for row in res.lags:
        if row.case not in aio_cases:
            continue
        st = row.stats
        out.append(
            Check(
                f"{row.state}: loop lag during {row.case}",
                f"p99 {st.p99_ms:.2f} ms, max {st.max_ms:.1f} ms" + base,
                f"p99 ≤ {LAG_P99_MS:g} ms; max ≤ {LAG_MAX_MS:g} ms, or ≤ the thread write's over it",
                st.p99_ms <= LAG_P99_MS and st.max_ms <= max_lag_ms(thread),
            )
        )
    return out


def max_lag_ms(thread: LagStats | None) -> float:
    """The bound on a call's loop-lag max: 25 ms, or a plain fsync'd write's in a thread where it is higher.

    The issue's target: "max ≤ 25 ms at 2 GiB ... where a plain fsync'd write in a worker thread already
    exceeds 25 ms in the same run, be no worse than it". The p99 bound (2 ms) has no such exception.
    """
    return max(LAG_MAX_MS, thread.max_ms) if thread is not None else LAG_MAX_MS


def _seconds_header(res: Results) -> list[str]:
    return ["best s", "median s"] if _multi(res) else ["seconds"]


def _multi(res: Results) -> bool:
    return any(len(m.seconds) > 1 for m in res.measurements if m.group != "limit" or m.case != s.MEMCPY)


def _seconds(res: Results, m: Measurement) -> list[str]:
    return [_fmt(m.best, 3), _fmt(m.median, 3)] if _multi(res) else [_fmt(m.best, 3)]


def _limits_table(res: Results) -> str:
    rows = [
        [m.case, *_seconds(res, m), _fmt(m.gbps), m.note]
        for m in res.measurements
        if m.state == "A" and m.group == "limit"
    ]
    return table(["case", *_seconds_header(res), "GB/s", "note"], rows)


def _savers_table(res: Results, state: str) -> str:
    ours = _time(res, state, s.AIO_SAVE)
    rows = [
        [
            m.case,
            *_seconds(res, m),
            _fmt(m.gbps),
            _fmt(m.best_staged, 3) if m.staged else "",
            _ratio(_speedup(m.best, ours)),
            m.note,
        ]
        for m in res.measurements
        if m.state == state and m.group == "save"
    ]
    header = ["saver (durable)", *_seconds_header(res), "GB/s", "returned after s", "aiockpt.save speedup"]
    return table([*header, "note"], rows)


def _loaders_table(res: Results, state: str) -> str:
    load, read = _time(res, state, s.AIO_LOAD), _time(res, state, s.AIO_READ)
    rows = [
        [
            m.case,
            *_seconds(res, m),
            _fmt(m.gbps),
            _ratio(_speedup(m.best, load)),
            _ratio(_speedup(m.best, read)),
            m.note,
        ]
        for m in res.measurements
        if m.state == state and m.group == "load"
    ]
    header = [
        "loader (cold cache)",
        *_seconds_header(res),
        "GB/s",
        "aiockpt.load speedup",
        "aiockpt.read speedup",
    ]
    return table([*header, "note"], rows)


def _phases_table(res: Results) -> str:
    """Per-phase seconds aiockpt reports (``Metadata.timings``) for each save's fastest repeat."""
    rows = [(f"{m.state}: {m.case}", m.best, m.best_phases) for m in res.measurements if m.best_phases]
    if not rows:
        return ""
    names = list(dict.fromkeys(k for _, _, ph in rows for k in ph))
    body = [
        [label, _fmt(total, 3), *(_fmt(ph.get(k, float("nan")), 3) for k in names)]
        for label, total, ph in rows
    ]
    return table(["aiockpt save", "total s", *(f"{k} s" for k in names)], body)


def _lag_table(res: Results) -> str:
    rows = [
        [
            f"{row.state}: {row.case}",
            _fmt(row.stats.duration_s, 2),
            str(row.stats.samples),
            _fmt(row.stats.p50_ms, 3),
            _fmt(row.stats.p99_ms, 3),
            _fmt(row.stats.max_ms, 1),
            "" if row.late is None else f"{row.late} ({row.shared})",
            _wake(row.longest),
        ]
        for row in res.lags
    ]
    header = [
        "scenario",
        "seconds",
        "samples",
        "p50 ms",
        "p99 ms",
        "max ms",
        "> 10 ms (machine)",
        "longest wake, ms (when; the loop's thread)",
    ]
    return table(header, rows)


def _wake(wake: LateWake | None) -> str:
    """The longest late wake of a lag row: when in the call, and where the loop's thread spent it."""
    if wake is None:
        return ""
    text = f"{wake.lag_ms:.1f} at {wake.at_s:.2f} s"
    off = wake.off_cpu_ms
    if wake.ran_ms is not None and wake.waited_ms is not None and off is not None:
        text += f": ran {wake.ran_ms:.1f}, waited {wake.waited_ms:.1f}, off CPU {off:.1f}"
    return text


def _checks_table(res: Results) -> str:
    mark = {True: "yes", False: "**no**", None: "not run"}
    rows = [[c.name, c.value, c.goal, mark[c.met]] for c in checks(res)]
    return table(["target", "measured", "goal", "met"], rows)


def _describe_state(res: Results, state: str) -> str:
    info = res.states.get(state, {})
    return str(info.get("description", ""))


def markdown(res: Results) -> str:
    """The whole report as markdown."""
    parts = ["## Machine", table(["", ""], [[k, v] for k, v in res.machine.items()])]
    parts += ["", "Configuration: " + ", ".join(f"{k}={v}" for k, v in res.config.items())]
    parts += ["", METHOD]
    speed = "Speedup columns: the other case's seconds / aiockpt's (> 1 means aiockpt is faster)."
    if "A" in res.states:
        parts += ["", f"## State A: {_describe_state(res, 'A')}", ""]
        if any(m.state == "A" and m.group == "limit" for m in res.measurements):
            parts += ["### Machine limits (same bytes, no serialization)", "", _limits_table(res), ""]
        parts += ["### Savers (each fsyncs its files and directory)", "", _savers_table(res, "A"), ""]
        parts += ["### Loaders (page cache dropped before each)", "", _loaders_table(res, "A"), "", speed]
    if "B" in res.states:
        parts += ["", f"## State B: {_describe_state(res, 'B')}", ""]
        parts += ["### Savers", "", _savers_table(res, "B"), ""]
        parts += ["### Loaders (cold cache)", "", _loaders_table(res, "B"), "", speed]
    phases = _phases_table(res)
    if phases:
        parts += ["", "## aiockpt save phases (its Metadata.timings, fastest repeat)", "", phases]
    if res.lags:
        parts += ["", "## Event-loop lag (a task sleeping 1 ms in a loop; lag = actual sleep - 1 ms)", ""]
        parts += [_lag_table(res)]
    parts += ["", "## Targets", "", _checks_table(res)]
    if res.skipped or res.failures:
        parts += ["", "## Skipped and failed", ""]
        parts += [f"- skipped: {x}" for x in res.skipped] + [f"- FAILED: {x}" for x in res.failures]
    return "\n".join(parts) + "\n"


def to_json(res: Results) -> dict[str, object]:
    """A JSON-ready dict of the run: raw timings per repeat, derived best/GB/s, lag and checks."""
    out = asdict(res)
    for m, d in zip(res.measurements, out["measurements"], strict=True):
        d["best_s"] = None if math.isnan(m.best) else m.best
        d["gbps"] = None if math.isnan(m.gbps) else m.gbps
    out["checks"] = [asdict(c) for c in checks(res)]
    return out
