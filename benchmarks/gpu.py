"""GPU benchmark: saving a state that lives on a CUDA device, and loading a checkpoint back into one.

    python -m benchmarks.gpu [--size-gib 2] [--repeat 3] [--dir ./bench-out]
                             [--only limits,aiockpt,fresh,torch,dcp] [--small COUNT]

State A of the main suite (bf16 matrices and fp32 vectors) on ``cuda:0``; with ``--small COUNT``, state
B instead: COUNT fp32 tensors of 4 KiB each. In the same run, on the same state, each case timed
``--repeat`` times while a sibling task measures the event loop's lag:

- the machine's limits: device-to-host copy into reused pinned memory, host-to-device copy from pinned
  and from pageable memory, allocating pinned memory, fsync'd sequential write (1 and 2 threads) and
  cold sequential read (1 thread) of the same bytes;
- aiockpt: ``save`` (durable), a Checkpointer's ``save(async_op=True)`` (the time until the state may be
  mutated, first and with reused staging, and until durable; for each save, the share of the bytes it
  wrote that went with ``O_DIRECT``), ``load`` in place into the GPU tensors with a cold page cache;
  ``fresh``: the first and the second such load of a new process (the first allocates what later loads
  of the process reuse; the loop lag is not measured there);
- ``torch.save`` (+ fsync) and ``torch.load(mmap=True)`` copied into the GPU tensors;
- DCP ``save`` (4 writer threads) and ``load`` into the GPU tensors.

Loads are checked against the saved values once per case. ``--only aiockpt`` runs aiockpt's cases alone,
for a comparison of two versions of aiockpt on the same machine (``PYTHONPATH`` picks which).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch

import aiockpt

from ._baselines import TORCH_FILE, dcp_load_into, dcp_save, torch_load_mmap_into, torch_save
from ._fs import drop_cache, remove, scratch_dir
from ._lag import LagMonitor
from ._limits import cold_read, fsync_write
from ._state import State, build_small_state, build_transformer_state, byte_views, state_nbytes

_GROUPS = ("limits", "aiockpt", "fresh", "torch", "dcp")


@dataclass
class Case:
    """One measured case: seconds per repeat and the loop lag over all of them."""

    seconds: list[float] = field(default_factory=list)
    lag: LagMonitor = field(default_factory=LagMonitor)
    # aiockpt saves: per repeat, the share of the bytes written that went with O_DIRECT.
    direct: list[float] = field(default_factory=list)


Cases = dict[str, Case]


def _sync() -> None:
    torch.cuda.synchronize()


def _thread(fn: Callable[[], object]) -> Callable[[], Awaitable[None]]:
    """``fn`` run in a worker thread, timed whole."""

    async def run() -> None:
        await asyncio.to_thread(fn)

    return run


def _timed_by(fn: Callable[[], float]) -> Callable[[], Awaitable[float]]:
    """``fn`` run in a worker thread, which measures its own seconds (leaving out what it prepares)."""

    async def run() -> float:
        return await asyncio.to_thread(fn)

    return run


def _awaited(fn: Callable[[], Awaitable[object]]) -> Callable[[], Awaitable[None]]:
    async def run() -> None:
        await fn()

    return run


def _check(template: State, expected: State, what: str) -> None:
    bad = [k for k, t in template.items() if not torch.equal(t.cpu(), expected[k])]
    if bad:
        raise AssertionError(f"{what} loaded wrong values for {len(bad)} tensors, e.g. {bad[0]}")


def _zero(template: State) -> None:
    for t in template.values():
        t.zero_()
    _sync()


@dataclass
class Bench:
    """What every case works on: the GPU state, a GPU template to load into, the expected values."""

    state: State
    template: State
    expected: State
    scratch: Path
    repeat: int
    cases: Cases = field(default_factory=dict)

    async def measure(self, name: str, fn: Callable[[], Awaitable[float | None]]) -> None:
        """Time ``fn`` once under the case's lag monitor (``fn`` may return its own measured seconds)."""
        case = self.cases.setdefault(name, Case())
        async with case.lag:
            start = time.perf_counter()
            own = await fn()
            elapsed = time.perf_counter() - start
        case.seconds.append(elapsed if own is None else own)
        print(f"  {name}: {case.seconds[-1]:.3f} s", flush=True)

    async def loads(self, name: str, path: Path, fn: Callable[[], Awaitable[object]]) -> None:
        """Time ``fn`` (a load of ``path`` into the template) ``repeat`` times, each from a cold cache."""
        for i in range(self.repeat):
            _zero(self.template)
            drop_cache(path)
            await self.measure(name, _awaited(fn))
            if i == 0:
                _check(self.template, self.expected, name)


async def _limits(b: Bench, host: State) -> None:
    """The machine's limits; copies to the device go into the template, never into the saved state."""
    nbytes = state_nbytes(b.state)
    views = byte_views(host)

    def d2h() -> None:
        for k, t in b.state.items():
            host[k].copy_(t, non_blocking=True)
        _sync()

    def h2d(src: State) -> Callable[[], None]:
        def run() -> None:
            for k, t in b.template.items():
                t.copy_(src[k], non_blocking=True)
            _sync()

        return run

    for _ in range(b.repeat):
        await b.measure("limit: device-to-host into pinned", _thread(d2h))
        await b.measure("limit: host-to-device from pinned", _thread(h2d(host)))
        await b.measure("limit: host-to-device from pageable", _thread(h2d(b.expected)))
    for _ in range(b.repeat):
        alloc = partial(torch.empty, nbytes, dtype=torch.uint8, pin_memory=True)
        await b.measure("limit: pinned allocation", _thread(alloc))
    file = b.scratch / "limit.bin"
    for threads in (1, 2):
        for _ in range(b.repeat):
            write = partial(fsync_write, file, views, threads)
            await b.measure(f"limit: fsync'd write, {threads} thr", _timed_by(write))
    for _ in range(b.repeat):
        await b.measure("limit: cold read, 1 thr", _timed_by(partial(cold_read, file, views, 1)))
    remove(file)


def _share(written: int, direct: int) -> float:
    return direct / written if written else 0.0


async def _aiockpt(b: Bench) -> None:
    path = b.scratch / "aiockpt"
    state: dict[str, object] = dict(b.state)
    one_shot = "aiockpt: save (durable)"

    async def save() -> None:
        meta = await aiockpt.save(state, path)
        b.cases[one_shot].direct.append(_share(meta.written_bytes, meta.direct_bytes))

    for _ in range(b.repeat):
        remove(path)
        await b.measure(one_shot, save)
    async with aiockpt.Checkpointer(b.scratch / "aiockpt-root", keep_last=1) as ckpt:
        for step in range(1, b.repeat + 2):
            staging = "first" if step == 1 else "reused"
            durable = Case()  # until durable: measured within the case below, merged into its own after

            async def mutable(step: int = step, durable: Case = durable) -> float:
                start = time.perf_counter()
                handle = await ckpt.save(state, step=step, async_op=True)
                staged = time.perf_counter() - start
                await handle
                durable.seconds.append(time.perf_counter() - start)
                durable.direct.append(_share(handle.metrics.written_bytes, handle.metrics.direct_bytes))
                return staged

            await b.measure(f"aiockpt: async_op=True, mutable after ({staging} staging)", mutable)
            case = b.cases.setdefault(f"aiockpt: async_op=True, durable ({staging} staging)", Case())
            case.seconds += durable.seconds
            case.direct += durable.direct
    template: dict[str, object] = dict(b.template)
    await b.loads("aiockpt: load into GPU (cold)", path, lambda: aiockpt.load(template, path))
    remove(path)
    remove(b.scratch / "aiockpt-root")


def _child_load(path: Path, shapes: Path) -> None:
    """In a new process: make the GPU template, then time two cold loads of ``path`` into it (JSON out)."""
    spec = json.loads(shapes.read_text())
    template: dict[str, object] = {
        k: torch.zeros(shape, dtype=getattr(torch, dtype), device="cuda")
        for k, (shape, dtype) in spec.items()
    }
    _sync()
    seconds = []
    for _ in range(2):
        drop_cache(path)
        start = time.perf_counter()
        asyncio.run(aiockpt.load(template, path))
        seconds.append(time.perf_counter() - start)
    print(json.dumps(seconds))


async def _fresh(b: Bench) -> None:
    """The first load of a new process (which allocates what a load reuses later), and its second."""
    path = b.scratch / "aiockpt-fresh"
    remove(path)
    await aiockpt.save(dict(b.state), path)
    shapes = b.scratch / "shapes.json"
    spec = {k: (list(t.shape), str(t.dtype).removeprefix("torch.")) for k, t in b.state.items()}
    await asyncio.to_thread(shapes.write_text, json.dumps(spec))
    for _ in range(b.repeat):
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "benchmarks.gpu", "--child-load", str(path), str(shapes),
            stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, _ = await proc.communicate()
        first, second = json.loads(out.decode().strip().splitlines()[-1])
        for name, seconds in (("first", first), ("second", second)):
            case = b.cases.setdefault(f"aiockpt: load into GPU, {name} in a new process (cold)", Case())
            case.seconds.append(seconds)
            print(f"  {name} load in a new process: {seconds:.3f} s", flush=True)
    remove(path)


def _then_sync(fn: Callable[[], None]) -> Callable[[], Awaitable[None]]:
    """``fn`` in a worker thread, then a wait for the device work it enqueued."""

    def run() -> None:
        fn()
        _sync()

    return _thread(run)


async def _torch(b: Bench) -> None:
    path = b.scratch / "torch"
    for _ in range(b.repeat):
        remove(path)
        await b.measure("torch.save (+fsync)", _thread(lambda: torch_save(b.state, path)))
    load = _then_sync(lambda: torch_load_mmap_into(b.template, path))
    await b.loads("torch.load(mmap) + copy_ into GPU (cold)", path / TORCH_FILE, load)
    remove(path)


async def _dcp(b: Bench) -> None:
    path = b.scratch / "dcp"
    for _ in range(b.repeat):
        remove(path)
        await b.measure("DCP save (4 thr)", _thread(lambda: dcp_save(b.state, path, 4)))
    await b.loads("DCP load into GPU (cold)", path, _then_sync(lambda: dcp_load_into(b.template, path)))
    remove(path)


def _report(cases: Cases, nbytes: int, args: argparse.Namespace) -> str:
    lines = [
        f"Device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, aiockpt from "
        f"{Path(aiockpt.__file__).parent}",
        f"State: {nbytes / 2**30:.2f} GiB on cuda:0; command: python -m benchmarks.gpu "
        + (f"--small {args.small}" if args.small else f"--size-gib {args.size_gib}")
        + f" --repeat {args.repeat} --only {args.only}",
        "",
        "| case | best s | median s | GB/s (best) | loop lag p99 / max ms | written with O_DIRECT |",
        "| --- | --: | --: | --: | --: | --: |",
    ]
    for name, case in cases.items():
        best = min(case.seconds)
        lag = case.lag.stats()
        lag_text = f"{lag.p99_ms:.2f} / {lag.max_ms:.1f}" if lag.samples else "-"
        direct = f"{min(case.direct):.1%} - {max(case.direct):.1%}" if case.direct else ""
        lines.append(
            f"| {name} | {best:.3f} | {statistics.median(case.seconds):.3f} | {nbytes / best / 1e9:.2f} | "
            f"{lag_text} | {direct} |"
        )
    return "\n".join(lines)


async def run(args: argparse.Namespace, scratch: Path) -> Cases:
    """Build the state, run the selected cases and print the report; return the cases."""
    groups = set(args.only.split(","))
    if args.small:
        cpu = build_small_state(args.small, 4096)
    else:
        cpu = build_transformer_state(int(args.size_gib * 2**30))
    state = {k: t.cuda() for k, t in cpu.items()}
    b = Bench(state, {k: torch.zeros_like(t) for k, t in state.items()}, cpu, scratch, args.repeat)
    _sync()
    if "limits" in groups:
        await _limits(b, {k: torch.empty_like(t).pin_memory() for k, t in cpu.items()})
        # torch keeps freed pinned memory for reuse: without this the first staging buffer of a save
        # would come from what the limits allocated, and its allocation would not be measured.
        empty_host_cache = getattr(torch._C, "_host_emptyCache", None)
        if empty_host_cache is not None:
            empty_host_cache()
    if "aiockpt" in groups:
        await _aiockpt(b)
    if "fresh" in groups:
        await _fresh(b)
    if "torch" in groups:
        await _torch(b)
    if "dcp" in groups:
        await _dcp(b)
    print(_report(b.cases, state_nbytes(cpu), args), flush=True)
    return b.cases


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--size-gib", type=float, default=2.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default="bench-out")
    parser.add_argument("--only", default=",".join(_GROUPS), help=f"comma-separated of {', '.join(_GROUPS)}")
    parser.add_argument("--small", type=int, default=0, help="state B: this many 4 KiB tensors")
    parser.add_argument("--json", help="also write the seconds and lag of every case to this file")
    parser.add_argument("--child-load", nargs=2, type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_load:
        _child_load(*args.child_load)
        return
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.gpu needs a CUDA device")
    if unknown := set(args.only.split(",")) - set(_GROUPS):
        raise SystemExit(f"--only: unknown groups {sorted(unknown)}")
    with scratch_dir(args.dir, "gpu") as scratch:
        cases = asyncio.run(run(args, scratch))
    if args.json:
        out = {name: {"seconds": c.seconds, "lag": vars(c.lag.stats())} for name, c in cases.items()}
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
