"""Cold loads: buffered with and without ``drop_behind``, and direct, beside cold reads; idle or busy memory.

    python -m benchmarks.drop_behind [--size-gib 2] [--repeat 6] [--gap 5] [--fill-gib 0] [--dir ./bench-out]

State A (transformer-like, ``--size-gib``) is saved once with aiockpt, and its bytes are written once more
to a plain file for the machine's cold read. Then, ``--repeat`` rounds, each case once per round in an
order rotated each round: the 1-thread cold reads of the plain file (the suite's limits: buffered into
the template, and ``O_DIRECT`` into a copy of the state on huge pages), and the in-place ``aiockpt.load``
through the page cache (``direct_reads=False``) with ``drop_behind=False`` and ``True``, and by default
(the runs that ``drop_behind`` would evict read with ``O_DIRECT``). Before each case both files are
evicted from the page cache and the process sleeps ``--gap`` seconds, as a job does between loads: on
a VM that reports free memory to its host, the pages a read then allocates for the page cache are
touched for the first time again. ``--fill-gib`` first fills the page cache with that many GiB of other
files (the full suite's condition, where reads recycle pages the kernel reclaims from other files).
Reported per case: best and median seconds, GB/s of the best, median CPU seconds of this process
(user + system, all threads) and the loop lag of a task sleeping 1 ms beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiockpt

from . import _limits
from ._fs import drop_cache, scratch_dir
from ._lag import LagMonitor
from ._state import build_transformer_state, byte_views, make_template, state_nbytes, touch_pages

COLD = "cold read, 1 thread (limit)"
COLD_DIRECT = "cold read, O_DIRECT into huge-page memory, 1 thread (limit)"
KEEP = "aiockpt.load, direct_reads=False, drop_behind=False"
DROP = "aiockpt.load, direct_reads=False, drop_behind=True"
DIRECT = "aiockpt.load (default: direct reads of cold runs)"
_FILL_FILE = 1 << 30


def fill_cache(scratch: Path, gib: int) -> None:
    """Write ``gib`` files of 1 GiB under ``scratch`` and read them, so that the page cache holds them."""
    block = memoryview(bytearray(64 << 20))
    for i in range(gib):
        path = scratch / f"fill-{i}"
        with open(path, "wb") as f:
            for _ in range(_FILL_FILE // len(block)):
                f.write(block)
        with open(path, "rb") as f:
            while f.readinto(block):
                pass


async def run(size_gib: float, repeat: int, gap: float, fill_gib: int, scratch: Path) -> None:
    """Run the rounds and print the report."""
    state = build_transformer_state(int(size_gib * 2**30))
    ckpt, plain = scratch / "ckpt", scratch / "plain.bin"
    await aiockpt.save(state, ckpt)
    _limits.fsync_write(plain, byte_views(state), 1)
    nbytes = state_nbytes(state)
    template = make_template(state)
    aligned = _limits.Aligned(byte_views(state)) if _limits.direct_supported(scratch) else None
    del state
    touch_pages(template)
    if fill_gib:
        fill_cache(scratch, fill_gib)
    views = byte_views(template)
    target: dict[str, object] = dict(template)  # the same tensors, typed as load takes them

    def cold() -> Awaitable[object]:
        return asyncio.to_thread(_limits.cold_read, plain, views, 1)

    def cold_direct(into: _limits.Aligned) -> Callable[[], Awaitable[object]]:
        return lambda: asyncio.to_thread(_limits.direct_read, plain, into, 1)

    def load(io: aiockpt.IOConfig) -> Callable[[], Awaitable[object]]:
        return lambda: aiockpt.load(target, ckpt, io=io)

    Case = tuple[str, Callable[[], Awaitable[object]]]
    cases: list[Case] = [
        (COLD, cold),
        (KEEP, load(aiockpt.IOConfig(direct_reads=False, drop_behind=False))),
        (DROP, load(aiockpt.IOConfig(direct_reads=False, drop_behind=True))),
        (DIRECT, load(aiockpt.IOConfig())),
    ]
    if aligned is not None:  # where the file system refuses O_DIRECT, the default load is buffered too
        cases.insert(1, (COLD_DIRECT, cold_direct(aligned)))
    rows: dict[str, list[tuple[float, float, float, float]]] = {name: [] for name, _ in cases}
    for r in range(repeat):
        for name, fn in cases[r % len(cases) :] + cases[: r % len(cases)]:
            drop_cache(ckpt)
            drop_cache(plain)
            await asyncio.sleep(gap)
            before, start = os.times(), time.perf_counter()
            async with LagMonitor() as lag:
                await fn()
            seconds = time.perf_counter() - start
            after = os.times()
            cpu = after.user + after.system - before.user - before.system
            stats = lag.stats()
            rows[name].append((seconds, cpu, stats.p99_ms, stats.max_ms))
            print(f"[round {r + 1}] {name}: {seconds:.3f} s, CPU {cpu:.2f} s", flush=True)
    print(f"\n## Cold loads of {nbytes / 2**30:.2f} GiB, {repeat} rounds, {gap:g} s idle before each\n")
    command = f"python -m benchmarks.drop_behind --size-gib {size_gib:g} --repeat {repeat} --gap {gap:g}"
    print(f"Command: {command}{f' --fill-gib {fill_gib}' if fill_gib else ''}\n")
    print("| case | best s | median s | GB/s (best) | CPU s (median) | loop lag p99 (median) / max ms |")
    print("| :-- | --: | --: | --: | --: | --: |")
    for name, samples in rows.items():
        secs = sorted(s[0] for s in samples)
        cpus = sorted(s[1] for s in samples)
        p99 = sorted(s[2] for s in samples)
        mid = len(samples) // 2
        print(
            f"| {name} | {secs[0]:.3f} | {secs[mid]:.3f} | {nbytes / secs[0] / 1e9:.2f} | {cpus[mid]:.2f} | "
            f"{p99[mid]:.2f} / {max(s[3] for s in samples):.1f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gib", type=float, default=2.0)
    parser.add_argument("--repeat", type=int, default=6)
    parser.add_argument("--gap", type=float, default=5.0, help="idle seconds before each case (default: 5)")
    parser.add_argument("--fill-gib", type=int, default=0, help="GiB of other files to cache first")
    parser.add_argument("--dir", default="bench-out")
    args = parser.parse_args()
    if args.size_gib <= 0 or args.repeat < 1 or args.gap < 0 or args.fill_gib < 0:
        parser.error("--size-gib must be > 0, --repeat >= 1, --gap and --fill-gib >= 0")
    with scratch_dir(args.dir, "drop-behind") as scratch:
        asyncio.run(run(args.size_gib, args.repeat, args.gap, args.fill_gib, scratch))


if __name__ == "__main__":
    main()
