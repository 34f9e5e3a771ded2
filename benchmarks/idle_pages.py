"""What touching memory costs again once it sat untouched for a while: a limit of the machine, not aiockpt.

    python -m benchmarks.idle_pages [--mib 256] [--idle 0,0.1,0.3,1,3] [--repeat 3]

On some VMs the host keeps track of the guest's memory in a way that makes the first touch of a page
that has not been touched for a while slow again, with no page fault the guest could see: the time is
spent outside the guest and shows inside it as user time of the thread that touched the page. Such a
machine runs any Python code that has not run for a second (its code objects, dicts and frames are
spread over many pages) many times slower than it runs warm, and an event loop's thread shows that as
lag however little work it does. This module measures it, so that loop-lag results can be read against
it. Three kinds of memory, each ``--mib`` large and filled once, then per ``--idle`` seconds: touched
whole, left alone for that long (the process sleeps), and timed while one byte of every 4 KiB page is
read again:

- ``4 KiB pages``: an anonymous mapping advised ``MADV_NOHUGEPAGE``;
- ``huge pages``: a 2 MiB-aligned mapping advised ``MADV_HUGEPAGE`` (as aiockpt's staging and bounce
  buffers are); the report says whether the kernel gave huge pages;
- ``Python objects``: a list of small ``str`` objects of about that size, walked in order.

Reported per kind and idle time: the median over ``--repeat`` tries of microseconds per 4 KiB page (for
Python objects that includes the interpreter's own time per object, so compare it with the first idle
time's), and the minor page faults and system time the guest saw during that touch (none and about none
where the cost is the host's).
"""

from __future__ import annotations

import argparse
import mmap
import resource
import statistics
import time
from collections.abc import Callable

import torch

PAGE = 4096
_HUGE = 2 << 20


class Sample:
    """One timed touch: microseconds per 4 KiB page; minor faults and system milliseconds the guest saw."""

    def __init__(self, us_per_page: float, faults: int, sys_ms: float) -> None:
        self.us_per_page = us_per_page
        self.faults = faults
        self.sys_ms = sys_ms


def _timed(touch: Callable[[], None], pages: int) -> Sample:
    before = resource.getrusage(resource.RUSAGE_THREAD)
    start = time.perf_counter()
    touch()
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_THREAD)
    return Sample(
        seconds / pages * 1e6, after.ru_minflt - before.ru_minflt, (after.ru_stime - before.ru_stime) * 1e3
    )


def _anon_huge_kib() -> int:
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    return 0


def mapped(nbytes: int, *, huge: bool) -> tuple[mmap.mmap, torch.Tensor]:
    """An anonymous mapping of ``nbytes`` (2 MiB-aligned), advised as asked, filled; and a view of it.

    Raises:
        OSError: The mapping cannot be made.
    """
    raw = mmap.mmap(-1, nbytes + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(raw, dtype=torch.uint8)
    skip = -whole.data_ptr() % _HUGE
    advice = getattr(mmap, "MADV_HUGEPAGE" if huge else "MADV_NOHUGEPAGE", None)
    if advice is not None:
        raw.madvise(advice, skip, nbytes)
    view = whole[skip : skip + nbytes]
    view.fill_(1)
    return raw, view


Samples = dict[float, list[Sample]]


def measure(kind: str, nbytes: int, idles: list[float], repeat: int) -> tuple[Samples, bool]:
    """Per idle time, ``repeat`` timed touches of ``kind`` memory that sat untouched that long.

    Returns:
        The samples, and whether the kernel backed the memory with huge pages.
    """
    pages = nbytes // PAGE
    keep: object
    huge_before = _anon_huge_kib()
    if kind == "Python objects":
        # About 80 bytes each: some 50 objects per page, read in the order they were made.
        objects = [str(i) * 4 for i in range(nbytes // 80)]
        keep = objects

        def touch() -> None:
            for obj in objects:
                len(obj)

    else:
        keep, view = mapped(nbytes, huge=kind == "huge pages")
        strided = view[::PAGE]

        def touch() -> None:
            strided.sum()

    huge_given = _anon_huge_kib() > huge_before
    out: Samples = {idle: [] for idle in idles}
    for _ in range(repeat):
        for idle in idles:
            touch()  # warm
            time.sleep(idle)
            out[idle].append(_timed(touch, pages))
    del keep
    return out, huge_given


def summary(mib: int = 64, idle: float = 1.0, repeat: int = 2) -> str:
    """One line for a report's machine table: a 4 KiB page's touch after ``idle`` seconds, and warm."""
    samples, _ = measure("4 KiB pages", mib << 20, [0.0, idle], repeat)
    warm, cold = (statistics.median(s.us_per_page for s in samples[x]) for x in (0.0, idle))
    return f"{cold:.2f} µs per 4 KiB page after {idle:g} s untouched, {warm:.2f} µs warm ({mib} MiB)"


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
        huge_given |= given and kind == "huge pages"
    print(f"\n## Touching {args.mib} MiB again after it sat untouched (median of {args.repeat})\n")
    command = f"python -m benchmarks.idle_pages --mib {args.mib} --idle {args.idle} --repeat {args.repeat}"
    print(f"Command: {command}\n")
    print(f"Huge pages given by the kernel: {'yes' if huge_given else 'no'}\n")
    print("| memory | idle s | µs per 4 KiB page | x the first idle time's | minor faults | system ms |")
    print("| :-- | --: | --: | --: | --: | --: |")
    for kind, by_idle in rows.items():
        first = statistics.median(s.us_per_page for s in by_idle[idles[0]])
        for idle, samples in by_idle.items():
            us = statistics.median(s.us_per_page for s in samples)
            faults = statistics.median(s.faults for s in samples)
            sys_ms = statistics.median(s.sys_ms for s in samples)
            print(f"| {kind} | {idle:g} | {us:.3f} | {us / first:.1f} | {faults:g} | {sys_ms:.1f} |")


if __name__ == "__main__":
    main()
