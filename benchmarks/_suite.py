"""Runs the selected cases on both states and records them in a :class:`~benchmarks._results.Results`.

Disk throughput on shared or virtual machines drifts over seconds, so cases are not run one after the
other ``repeat`` times: all savers (with the fsync'd-write limit among them) run once per round, then all
loaders (with the cold-read limit), and each round starts one case later than the previous one. Every
case thus sees the same mix of good and bad moments, and the best of its repeats is reported.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from benchmarks import _aio, _baselines, _limits
from benchmarks._fs import drop_cache, remove
from benchmarks._lag import LagMonitor, MachineStalls, idle_lag
from benchmarks._results import LagRow, Measurement, Results
from benchmarks._state import State, byte_views, same_tensors, state_nbytes, touch_pages, zero_

T = TypeVar("T")

LIMITS = ("memcpy", "write", "read", "lag")
LIBRARIES = ("aiockpt", "torch", "safetensors", "dcp")
STATES = ("large", "small")
DCP_THREADS = (1, 2, 4)
IO_THREADS = (1, 2)
IDLE_LAG_S = 2.0
MEMCPY_REPEAT = 3

# Case names, shared with the report.
MEMCPY = "memcpy (Tensor.copy_)"
MEMCPY_BEFORE_ASYNC = "memcpy (Tensor.copy_), just before each async save"
WRITE = "fsync'd write, {} thread(s)"
WRITE_EARLY = "fsync'd write, writeback started per 16 MiB, {} thread(s)"
WRITE_DIRECT = "fsync'd write, O_DIRECT from huge-page memory, {} thread(s)"
READ = "cold read, {} thread(s)"
READ_DIRECT = "cold read, O_DIRECT into huge-page memory, {} thread(s)"
AIO_SAVE = "aiockpt.save"
AIO_SAVE_ASYNC = "aiockpt Checkpointer.save(async_op=True)"
AIO_SAVE_ASYNC_FIRST = "aiockpt Checkpointer.save(async_op=True), first save (new staging buffers)"
TORCH_SAVE = "torch.save"
ST_SAVE = "safetensors save_file"
DCP_SAVE = "DCP save, {} thread(s)"
AIO_LOAD = "aiockpt.load (in place)"
AIO_READ = "aiockpt.read (fresh)"
TORCH_LOAD_MMAP = "torch.load(mmap=True) + copy_ (in place)"
TORCH_LOAD = "torch.load (fresh)"
ST_LOAD = "safetensors load_file (fresh)"
DCP_LOAD = "DCP load (in place), {}-thread ckpt"
LAG_IDLE = "idle loop (monitor only)"
LAG_THREAD = "fsync'd write in asyncio.to_thread"
LAG_DCP = "DCP save called in the coroutine, {} thread(s)"


@dataclass(frozen=True)
class Selection:
    """Which states, machine-limit cases and libraries a run covers."""

    states: frozenset[str]
    limits: frozenset[str]
    libraries: frozenset[str]


def parse_only(text: str | None) -> Selection:
    """Parse ``--only``: a comma list of states, limit cases and libraries; an omitted kind means all.

    Args:
        text: For example ``"small,aiockpt,dcp"``; ``None`` or empty selects everything.

    Returns:
        The selection. ``read`` implies ``write`` (it reads the file the write produced).

    Raises:
        ValueError: An unknown name.
    """
    names = {n.strip() for n in (text or "").split(",") if n.strip()}
    unknown = names - set(LIMITS + LIBRARIES + STATES)
    if unknown:
        known = ", ".join(STATES + LIMITS + LIBRARIES)
        raise ValueError(f"unknown case(s) {', '.join(sorted(unknown))}; choose from {known}")
    states = names & set(STATES) or set(STATES)
    cases = names & set(LIMITS + LIBRARIES)
    limits = cases & set(LIMITS) if cases else set(LIMITS)
    libraries = cases & set(LIBRARIES) if cases else set(LIBRARIES)
    if "read" in limits:
        limits.add("write")
    return Selection(frozenset(states), frozenset(limits), frozenset(libraries))


def _log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Outcome:
    """One timed run: its seconds, the time an async save took to return, and data to verify."""

    seconds: float
    staged: float | None = None
    tree: Mapping[str, object] | None = None
    phases: Mapping[str, float] | None = None


@dataclass
class Case:
    """A measurement plus how to run it once.

    Exactly one of ``sync`` (called as is) and ``coro`` (run in the suite's loop beside a lag monitor) is
    set. ``prepare`` runs untimed before each repeat. ``requires`` names a case (the saver whose output a
    loader reads) that must have succeeded. ``first_lag_name``: the lag of the first repeat is reported
    apart, under this name (an async save's first repeat allocates its staging buffers, the others
    reuse them), and so is its ``staged`` time. One monitor per stream pools the lag of its repeats.
    ``baseline`` runs after ``prepare``, untimed by the case: its seconds are paired with the ``staged``
    time of the same repeat.
    """

    m: Measurement
    prepare: Callable[[], None]
    sync: Callable[[], Outcome] | None = None
    coro: Callable[[], Coroutine[Any, Any, Outcome]] | None = None
    expected: State | None = None
    requires: Case | None = None
    lag_name: str | None = None
    lag: LagMonitor = field(default_factory=LagMonitor)
    first_lag_name: str | None = None
    first_lag: LagMonitor = field(default_factory=LagMonitor)
    baseline: Callable[[], float] | None = None
    runs: int = 0
    failed: bool = False


async def _call(fn: Callable[[], T]) -> T:
    """Call ``fn`` from a coroutine, blocking the loop, as a synchronous library call in async code does."""
    return fn()


def _nothing() -> None:
    pass


@contextlib.contextmanager
def _suite_heap_frozen() -> Iterator[None]:
    """While the block runs, keep the suite's own heap out of Python's collections.

    The suite holds the states, templates and results of every case: a full collection of that heap
    took 95-225 ms here, on whichever thread allocated, as part of whatever case ran. One inside the
    thread-write baseline made its loop-lag max, the bar a call's max is held to, 89-217 ms (its longest
    wakes had the loop's thread running 50-55 ms), and the other libraries' times included such
    collections of a heap that is the suite's, not their caller's. So before each case the heap is
    collected and then frozen (``gc.freeze``): the collections during the case run as usual, but walk
    only what the case allocated. It is unfrozen after the case.
    """
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _timed(fn: Callable[..., object], *args: object) -> Outcome:
    start = time.perf_counter()
    fn(*args)
    return Outcome(time.perf_counter() - start)


def _timed_fresh(fn: Callable[..., Mapping[str, object]], *args: object) -> Outcome:
    """Time a loader returning fresh tensors, including touching their pages (see ``touch_pages``)."""
    start = time.perf_counter()
    tree = fn(*args)
    touch_pages(tree)
    return Outcome(time.perf_counter() - start, tree=tree)


class Suite:
    """One run: a scratch directory, one event loop, the results being filled."""

    def __init__(
        self,
        scratch: Path,
        repeat: int,
        selection: Selection,
        aio: _aio.Aiockpt | None,
        results: Results,
    ) -> None:
        self.scratch = scratch
        self.repeat = repeat
        self.sel = selection
        self.aio = aio
        self.results = results
        self.loop = asyncio.new_event_loop()
        self.closers: list[Callable[[], Awaitable[None]]] = []
        self.unmaps: list[Callable[[], None]] = []  # per state
        self.stalls = MachineStalls()

    def close(self) -> None:
        """Close what the cases opened, then shut the event loop down."""
        for closer in self.closers:
            self.loop.run_until_complete(closer())
        self.loop.run_until_complete(self.loop.shutdown_default_executor())
        self.loop.close()
        self.stalls.close()

    # -- running -----------------------------------------------------------------------------------------

    def _new(self, label: str, group: str, case: str, state: State) -> Measurement:
        m = Measurement(state=label, group=group, case=case, nbytes=state_nbytes(state))
        self.results.measurements.append(m)
        return m

    def _once(self, case: Case) -> None:
        m = case.m
        case.prepare()
        base = case.baseline() if case.baseline is not None else None
        _log(f"{m.state}: {m.case}")
        first = case.runs == 0 and case.first_lag_name is not None
        case.runs += 1
        try:
            if case.coro is not None:
                make, monitor = case.coro, case.first_lag if first else case.lag

                async def body() -> Outcome:
                    async with monitor:
                        return await make()

                out = self.loop.run_until_complete(body())
            else:
                assert case.sync is not None
                out = case.sync()
        except Exception as exc:
            case.failed = True
            m.note = f"FAILED: {type(exc).__name__}"
            msg = f"{m.case} [state {m.state}]: {type(exc).__name__}: {exc}"
            self.results.failures.append(msg)
            _log(msg)
            return
        if case.expected is not None and out.tree is not None and not m.seconds:
            bad = same_tensors(case.expected, out.tree)
            if bad:
                m.note = f"WRONG DATA in {len(bad)} tensor(s), e.g. {bad[0]}"
                self.results.failures.append(f"{m.case} [state {m.state}]: {m.note}")
                _log(f"{m.case}: {m.note}")
        m.seconds.append(out.seconds)
        if out.staged is not None and first:
            m.first_staged = out.staged
            m.note = m.note or f"first save returned after {out.staged:.3f} s"
        elif out.staged is not None:
            m.staged.append(out.staged)
            if base is not None:
                m.staged_memcpy.append(base)
        if out.phases:
            m.phases.append(dict(out.phases))

    def run_rounds(self, cases: list[Case]) -> None:
        """Run every case ``repeat`` times, round-robin, then record lag.

        Each round starts one case later than the previous one, and every other round runs backwards. On this
        VM a case's time depends on the case run just before it (docs/benchmarks.md: safetensors' fresh load
        was fastest behind torch.load's fresh load, which it followed in every round); rotation alone keeps
        each case behind the same neighbour in every round but the one where the order wraps, backward rounds
        put it behind its other neighbour.
        """
        for r in range(self.repeat):
            k = r % len(cases) if cases else 0
            order = cases[k:] + cases[:k]
            if r % 2:
                order.reverse()
            for case in order:
                req = case.requires
                if case.failed or (req is not None and not req.m.seconds):
                    if req is not None and not req.m.seconds and not case.m.note:
                        case.m.note = f"skipped: {req.m.case} failed"
                    continue
                with _suite_heap_frozen():  # (collects what the case before left first)
                    self._once(case)
        for case in cases:
            if case.coro is None or not case.m.seconds:
                continue
            if case.first_lag_name is not None and case.first_lag.lags:
                self._lag_row(case.m.state, case.first_lag_name, case.first_lag)
            if case.lag.lags:
                case.m.lag = case.lag.stats()
                self._lag_row(case.m.state, case.lag_name or case.m.case, case.lag)

    def _lag_row(self, state: str, name: str, monitor: LagMonitor) -> None:
        late = monitor.late
        row = LagRow(
            state, name, monitor.stats(), late=len(late), shared=self.stalls.shared(late), wakes=monitor.wakes
        )
        self.results.lags.append(row)

    # -- building the cases ------------------------------------------------------------------------------

    def run_state(self, label: str, state: State, template: State, limits: bool) -> None:
        """All selected cases on one state: memcpy and idle lag, then the save round, then the load round.

        Args:
            label: "A" or "B", as shown in the report.
            state: The state to save.
            template: Preallocated tensors of the same shapes, for the in-place loaders.
            limits: Whether to include the machine-limit cases (memcpy, write, read, lag baselines).
        """
        saves: list[Case] = []
        loads: list[Case] = []
        paths: list[Path] = []
        sel_limits = self.sel.limits if limits else frozenset()
        if "memcpy" in sel_limits:
            m = self._new(label, "limit", MEMCPY, state)
            _limits.memcpy(state, template)  # warm-up: first-touch effects, thread pool start
            m.seconds += [_limits.memcpy(state, template) for _ in range(max(self.repeat, MEMCPY_REPEAT))]
        if "lag" in sel_limits:
            _log(f"{label}: {LAG_IDLE}")
            stats = self.loop.run_until_complete(idle_lag(IDLE_LAG_S))
            self.results.lags.append(LagRow(label, LAG_IDLE, stats))
        self._limit_cases(label, state, template, sel_limits, saves, loads, paths)
        libs = self.sel.libraries
        if "aiockpt" in libs and self.aio is not None:
            self._aiockpt_cases(label, state, template, saves, loads, paths, "memcpy" in sel_limits)
        if "torch" in libs:
            self._torch_cases(label, state, template, saves, loads, paths)
        if "safetensors" in libs:
            self._safetensors_cases(label, state, saves, loads, paths)
        if "dcp" in libs:
            self._dcp_cases(label, state, template, saves, loads, paths)
        try:
            self.run_rounds(saves)
            self.run_rounds(loads)
        finally:
            for p in paths:
                remove(p)
            while self.unmaps:
                self.unmaps.pop()()

    @staticmethod
    def _fresh(path: Path) -> Callable[[], None]:
        def prepare() -> None:
            remove(path)
            os.sync()

        return prepare

    @staticmethod
    def _cold(path: Path, template: State | None = None) -> Callable[[], None]:
        def prepare() -> None:
            if template is not None:
                zero_(template)  # so that a loader copying nothing fails verification
            drop_cache(path)

        return prepare

    def _limit_cases(
        self,
        label: str,
        state: State,
        template: State,
        sel: frozenset[str],
        saves: list[Case],
        loads: list[Case],
        paths: list[Path],
    ) -> None:
        src, dst = byte_views(state), byte_views(template)
        data = self.scratch / f"{label}-limits.bin"
        paths.append(data)
        if "write" in sel:
            for n in IO_THREADS:

                def write(n: int = n) -> Outcome:
                    return Outcome(_limits.fsync_write(data, src, n))

                saves.append(Case(self._new(label, "limit", WRITE.format(n), state), os.sync, sync=write))
            writer = saves[-1]
            for n in IO_THREADS:

                def write_early(n: int = n) -> Outcome:
                    return Outcome(_limits.fsync_write(data, src, n, early=True))

                m = self._new(label, "limit", WRITE_EARLY.format(n), state)
                saves.append(Case(m, os.sync, sync=write_early))
            aligned: _limits.Aligned | None = None
            if _limits.direct_supported(self.scratch):
                aligned = _limits.Aligned(src)  # untimed; unmapped when this state's rounds end
                self.unmaps.append(aligned.close)
                for n in IO_THREADS:

                    def write_direct(n: int = n) -> Outcome:
                        return Outcome(_limits.direct_write(data, aligned, n))

                    m = self._new(label, "limit", WRITE_DIRECT.format(n), state)
                    saves.append(Case(m, os.sync, sync=write_direct))
            if "read" in sel:
                for n in IO_THREADS:

                    def read(n: int = n) -> Outcome:
                        return Outcome(_limits.cold_read(data, dst, n))  # evicts the file first

                    m = self._new(label, "limit", READ.format(n), state)
                    loads.append(Case(m, _nothing, sync=read, requires=writer))
                if aligned is not None:
                    for n in IO_THREADS:

                        def read_direct(n: int = n, into: _limits.Aligned = aligned) -> Outcome:
                            return Outcome(_limits.direct_read(data, into, n))

                        m = self._new(label, "limit", READ_DIRECT.format(n), state)
                        loads.append(Case(m, _nothing, sync=read_direct, requires=writer))
        if "lag" in sel:
            lag_file = self.scratch / f"{label}-lag-write.bin"
            paths.append(lag_file)

            async def threaded() -> Outcome:
                return Outcome(await asyncio.to_thread(_limits.fsync_write, lag_file, src, 1))

            saves.append(Case(self._new(label, "limit", LAG_THREAD, state), os.sync, coro=threaded))

    def _aiockpt_cases(
        self,
        label: str,
        state: State,
        template: State,
        saves: list[Case],
        loads: list[Case],
        paths: list[Path],
        memcpy: bool,
    ) -> None:
        aio = self.aio
        assert aio is not None
        path, apath = self.scratch / f"{label}-aiockpt", self.scratch / f"{label}-aiockpt-async"
        paths += [path, apath]

        async def save() -> Outcome:
            secs, phases = await _aio.save(aio, state, path)
            return Outcome(secs, phases=phases)

        saver_async = _aio.AsyncSaver(aio, apath)
        self.closers.append(saver_async.close)

        async def save_async() -> Outcome:
            staged, durable, phases = await saver_async.save(state)
            return Outcome(durable, staged=staged, phases=phases)

        async def load() -> Outcome:
            return Outcome(await _aio.load(aio, template, path), tree=template)

        async def read() -> Outcome:
            secs, tree = await _aio.read(aio, path)
            start = time.perf_counter()
            # Off the loop: touching 20,000 tensors one torch call at a time would otherwise be the
            # suite's own stall, recorded as aiockpt's lag.
            await asyncio.to_thread(touch_pages, tree)
            return Outcome(secs + time.perf_counter() - start, tree=tree)

        saver = Case(self._new(label, "save", AIO_SAVE, state), self._fresh(path), coro=save)
        saves.append(saver)
        m = self._new(label, "save", AIO_SAVE_ASYNC, state)
        saver_case = Case(m, self._fresh(apath), coro=save_async, first_lag_name=AIO_SAVE_ASYNC_FIRST)
        if memcpy:
            saver_case.baseline = self._memcpy_before(label, state, template)
        saves.append(saver_case)
        m = self._new(label, "load", AIO_LOAD, state)
        loads.append(Case(m, self._cold(path, template), coro=load, expected=state, requires=saver))
        m = self._new(label, "load", AIO_READ, state)
        loads.append(Case(m, self._cold(path), coro=read, expected=state, requires=saver))

    def _memcpy_before(self, label: str, state: State, template: State) -> Callable[[], float]:
        """A memcpy of ``state`` to time just before each async save, recorded as a limit of its own.

        What staging can reach depends on the moment: on this VM a memcpy of 2 GiB took 10-25% longer
        right after a 2 GiB write than on a quiet machine (docs/benchmarks.md), and the memcpy measured
        before the rounds sees a quiet one, the async save's staging the case before it.
        """
        m = self._new(label, "limit", MEMCPY_BEFORE_ASYNC, state)

        def timed() -> float:
            seconds = _limits.memcpy(state, template)
            m.seconds.append(seconds)
            return seconds

        return timed

    def _torch_cases(
        self,
        label: str,
        state: State,
        template: State,
        saves: list[Case],
        loads: list[Case],
        paths: list[Path],
    ) -> None:
        path = self.scratch / f"{label}-torch"
        paths.append(path)
        m = self._new(label, "save", TORCH_SAVE, state)
        saver = Case(m, self._fresh(path), sync=lambda: _timed(_baselines.torch_save, state, path))
        saves.append(saver)

        def mmap_load() -> Outcome:
            out = _timed(_baselines.torch_load_mmap_into, template, path)
            return Outcome(out.seconds, tree=template)

        m = self._new(label, "load", TORCH_LOAD_MMAP, state)
        loads.append(Case(m, self._cold(path, template), sync=mmap_load, expected=state, requires=saver))
        m = self._new(label, "load", TORCH_LOAD, state)
        fresh = Case(m, self._cold(path), sync=lambda: _timed_fresh(_baselines.torch_load, path))
        fresh.expected, fresh.requires = state, saver
        loads.append(fresh)

    def _safetensors_cases(
        self, label: str, state: State, saves: list[Case], loads: list[Case], paths: list[Path]
    ) -> None:
        path = self.scratch / f"{label}-safetensors"
        paths.append(path)
        m = self._new(label, "save", ST_SAVE, state)
        saver = Case(m, self._fresh(path), sync=lambda: _timed(_baselines.safetensors_save, state, path))
        saves.append(saver)
        m = self._new(label, "load", ST_LOAD, state)
        fresh = Case(m, self._cold(path), sync=lambda: _timed_fresh(_baselines.safetensors_load, path))
        fresh.expected, fresh.requires = state, saver
        loads.append(fresh)

    def _dcp_cases(
        self,
        label: str,
        state: State,
        template: State,
        saves: list[Case],
        loads: list[Case],
        paths: list[Path],
    ) -> None:
        for n in DCP_THREADS:
            path = self.scratch / f"{label}-dcp-{n}"
            paths.append(path)

            def save(n: int = n, path: Path = path) -> Coroutine[Any, Any, Outcome]:
                # Deliberately blocking: what calling DCP from async training code does to the event loop.
                return _call(lambda: _timed(_baselines.dcp_save, state, path, n))

            m = self._new(label, "save", DCP_SAVE.format(n), state)
            saver = Case(m, self._fresh(path), coro=save, lag_name=LAG_DCP.format(n))
            saves.append(saver)

            def load(path: Path = path) -> Outcome:
                return Outcome(_timed(_baselines.dcp_load_into, template, path).seconds, tree=template)

            m = self._new(label, "load", DCP_LOAD.format(n), state)
            loads.append(Case(m, self._cold(path, template), sync=load, expected=state, requires=saver))
