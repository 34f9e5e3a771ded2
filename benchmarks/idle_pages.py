"""What touching memory costs again once it sat untouched for a while: a limit of the machine, not aiockpt.

    python -m benchmarks.idle_pages [--mib 256] [--idle 0,0.1,0.3,1,3] [--repeat 3]

On some VMs the host keeps track of the guest's memory in a way that makes the first touch of a page
that has not been touched for a while slow again, with no page fault the guest could see: the time is
spent outside the guest and shows inside it as user time of the thread that touched the page. Such a
machine runs any Python code that has not run for a second (its code objects, dicts and frames are
spread over many pages) many times slower than it runs warm, and an event loop's thread shows that as
lag however little work it does. This module measures it, so that loop-lag results can be read against
it. Three kinds of memory, each ``--mib`` large and filled once, then per ``--idle`` seconds: touched
whole, left alone for that long (the process sleeps), and touched again in one of two ways:

- a sweep: one byte of every 4 KiB page read in order (µs per page);
- scattered reads: one byte in each of :data:`SCATTERED` pages spread evenly over the memory, each read
  timed alone, as Python code touches its objects (the median and mean µs per read, and the share of
  reads over :data:`SLOW_US`).

The kinds:

- ``4 KiB pages``: an anonymous mapping advised ``MADV_NOHUGEPAGE``;
- ``huge pages``: a 2 MiB-aligned mapping advised ``MADV_HUGEPAGE`` (as aiockpt's staging and bounce
  buffers are); the report says whether the kernel gave huge pages;
- ``Python objects``: a list of small ``str`` objects of about that size, walked in order (about 50 per
  page: the sweep's time includes the interpreter's own per object, so compare it with the first idle
  time's); the scattered reads take the length of one object per page.

Each figure is the median over ``--repeat`` tries; the sweep's row also gives the minor page faults and
system time the guest saw (none and about none where the cost is the host's).
"""

from __future__ import annotations

import argparse
import mmap
import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

PAGE = 4096
_HUGE = 2 << 20
# Pages read one at a time per try, and the time over which such a read counts as slow.
SCATTERED = 256
SLOW_US = 20.0


@dataclass(frozen=True)
class Sample:
    """One try: the sweep's µs per page, faults and system ms; the scattered reads' µs each."""

    sweep_us: float
    faults: int
    sys_ms: float
    reads_us: tuple[float, ...]


@dataclass(frozen=True)
class Memory:
    """One kind of memory, made and filled: its sweep, and its scattered reads (each timed by the caller)."""

    sweep: Callable[[], object]
    reads: tuple[Callable[[], object], ...]
    keep: object  # what must stay alive while the two are used
    huge_given: bool


def _anon_huge_kib() -> int:
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    return 0


def _mapped(nbytes: int, *, huge: bool) -> Memory:
    before = _anon_huge_kib()
    raw = mmap.mmap(-1, nbytes + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(raw, dtype=torch.uint8)
    skip = -whole.data_ptr() % _HUGE
    advice = getattr(mmap, "MADV_HUGEPAGE" if huge else "MADV_NOHUGEPAGE", None)
    if advice is not None:
        raw.madvise(advice, skip, nbytes)
    view = whole[skip : skip + nbytes]
    view.fill_(1)
    strided = view[::PAGE]
    step = nbytes // SCATTERED // PAGE * PAGE
    reads = tuple(_byte_at(raw, skip + i * step) for i in range(SCATTERED))
    return Memory(lambda: strided.sum(), reads, (raw, whole, view, strided), _anon_huge_kib() > before)


def _byte_at(raw: mmap.mmap, offset: int) -> Callable[[], object]:
    return lambda: raw[offset]


def _objects(nbytes: int) -> Memory:
    objects = [str(i) * 4 for i in range(nbytes // 80)]  # about 80 bytes each

    def sweep() -> None:
        for obj in objects:
            len(obj)

    step = max(1, len(objects) // SCATTERED)
    reads = tuple(_length_of(obj) for obj in objects[::step][:SCATTERED])
    return Memory(sweep, reads, objects, False)


def _length_of(obj: str) -> Callable[[], object]:
    return lambda: len(obj)


def _try(memory: Memory, pages: int, idle: float) -> Sample:
    memory.sweep()  # warm
    time.sleep(idle)
    reads = []
    clock = time.perf_counter
    for read in memory.reads:
        start = clock()
        read()
        reads.append((clock() - start) * 1e6)
    memory.sweep()  # warm again: the scattered reads touched only some of the pages
    time.sleep(idle)
    before = resource.getrusage(resource.RUSAGE_THREAD)
    start = clock()
    memory.sweep()
    seconds = clock() - start
    after = resource.getrusage(resource.RUSAGE_THREAD)
    return Sample(
        sweep_us=seconds / pages * 1e6,
        faults=after.ru_minflt - before.ru_minflt,
        sys_ms=(after.ru_stime - before.ru_stime) * 1e3,
        reads_us=tuple(reads),
    )


Samples = dict[float, list[Sample]]


def measure(kind: str, nbytes: int, idles: list[float], repeat: int) -> tuple[Samples, bool]:
    """Per idle time, ``repeat`` tries on ``kind`` memory that sat untouched that long.

    Returns:
        The samples, and whether the kernel backed the memory with huge pages.
    """
    memory = _objects(nbytes) if kind == "Python objects" else _mapped(nbytes, huge=kind == "huge pages")
    out: Samples = {idle: [] for idle in idles}
    for _ in range(repeat):
        for idle in idles:
            out[idle].append(_try(memory, nbytes // PAGE, idle))
    return out, memory.huge_given


@dataclass(frozen=True)
class Row:
    """The medians over a kind's tries at one idle time."""

    sweep_us: float
    read_median_us: float
    read_mean_us: float
    slow_share: float
    faults: float
    sys_ms: float


def row(samples: list[Sample]) -> Row:
    """The medians over ``samples`` of each figure."""
    return Row(
        sweep_us=statistics.median(s.sweep_us for s in samples),
        read_median_us=statistics.median(statistics.median(s.reads_us) for s in samples),
        read_mean_us=statistics.median(statistics.fmean(s.reads_us) for s in samples),
        slow_share=statistics.median(sum(r > SLOW_US for r in s.reads_us) / len(s.reads_us) for s in samples),
        faults=statistics.median(s.faults for s in samples),
        sys_ms=statistics.median(s.sys_ms for s in samples),
    )


def summary(mib: int = 64, idle: float = 1.0, repeat: int = 2) -> str:
    """One line for a report's machine table: 4 KiB pages touched again after ``idle`` seconds, and warm."""
    samples, _ = measure("4 KiB pages", mib << 20, [0.0, idle], repeat)
    warm, cold = row(samples[0.0]), row(samples[idle])
    return (
        f"after {idle:g} s untouched: a scattered read {cold.read_mean_us:.1f} µs on average "
        f"({cold.slow_share:.0%} over {SLOW_US:g} µs), a sweep {cold.sweep_us:.2f} µs per 4 KiB page; "
        f"warm {warm.read_mean_us:.1f} and {warm.sweep_us:.2f} µs ({mib} MiB)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="size of each kind of memory (default: 256)")
    parser.add_argument("--idle", default="0,0.1,0.3,1,3", help="idle seconds, a comma list")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    try:
        idles = [float(x) for x in args.idle.split(",")]
    except ValueError:
        parser.error(f"--idle must be a comma list of seconds, not {args.idle!r}")
    if args.mib < 2 or args.repeat < 1 or any(x < 0 for x in idles):
        parser.error("--mib must be >= 2, --repeat >= 1, and every --idle >= 0")
    torch.set_num_threads(1)
    nbytes = args.mib << 20
    rows: dict[str, Samples] = {}
    huge_given = False
    for kind in ("4 KiB pages", "huge pages", "Python objects"):
        rows[kind], given = measure(kind, nbytes, idles, args.repeat)
        huge_given |= given
    print(f"\n## Touching {args.mib} MiB again after it sat untouched (median of {args.repeat})\n")
    command = f"python -m benchmarks.idle_pages --mib {args.mib} --idle {args.idle} --repeat {args.repeat}"
    print(f"Command: {command}\n")
    print(f"Huge pages given by the kernel: {'yes' if huge_given else 'no'}\n")
    print(
        "| memory | idle s | sweep: µs per 4 KiB page | x the first idle time's | minor faults | system ms "
        f"| {SCATTERED} scattered reads: median µs | mean µs | over {SLOW_US:g} µs |"
    )
    print("| :-- | --: | --: | --: | --: | --: | --: | --: | --: |")
    for kind, by_idle in rows.items():
        first = row(by_idle[idles[0]]).sweep_us
        for idle, samples in by_idle.items():
            r = row(samples)
            print(
                f"| {kind} | {idle:g} | {r.sweep_us:.3f} | {r.sweep_us / first:.1f} | {r.faults:g} | "
                f"{r.sys_ms:.1f} | {r.read_median_us:.2f} | {r.read_mean_us:.1f} | {r.slow_share:.0%} |"
            )


if __name__ == "__main__":
    main()
