"""Memory over many saves: resident set size across consecutive ``async_op=True`` saves.

    python -m benchmarks.rss [--saves 50] [--size-gib 0.5] [--dir ./bench-out]

One long-lived Checkpointer (``keep_last=2``) saves the same state ``--saves`` times, each awaited before
the next, while an asyncio task measures event-loop lag. Staging buffers are reused, so after the first
save the resident set must stay flat: the report gives RSS after the first save, the peak, the last, and
the growth from the first to the last.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

import torch

import aiockpt

from ._fs import scratch_dir
from ._lag import LagMonitor


def rss_bytes() -> int:
    """Resident set size of this process (Linux ``/proc/self/status``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


async def run(saves: int, size_gib: float, scratch: Path) -> None:
    """Run the saves and print the report."""
    count = max(1, round(size_gib * 2**30 / (4096 * 4096 * 2)))
    state = {f"w{i}": torch.randn(4096, 4096).to(torch.bfloat16) for i in range(count)}
    state.update({f"b{i}": torch.randn(4096) for i in range(100)})
    samples: list[int] = []
    staging: list[float] = []
    async with LagMonitor() as lag, aiockpt.Checkpointer(scratch, keep_last=2) as ckpt:
        for step in range(1, saves + 1):
            start = time.perf_counter()
            handle = await ckpt.save(state, step=step, async_op=True)
            staging.append(time.perf_counter() - start)
            await handle
            samples.append(rss_bytes())
    stats = lag.stats()
    mib = 2**20
    print(f"## RSS over {saves} async saves of {sum(t.nbytes for t in state.values()) / 2**30:.2f} GiB\n")
    print(f"Command: python -m benchmarks.rss --saves {saves} --size-gib {size_gib}\n")
    print("| RSS after save 1 | peak | after the last | growth 1 -> last | staging (first / median) | "
          "loop lag p99 / max |")  # fmt: skip
    print("| --: | --: | --: | --: | --: | --: |")
    print(
        f"| {samples[0] / mib:,.0f} MiB | {max(samples) / mib:,.0f} MiB | {samples[-1] / mib:,.0f} MiB | "
        f"{(samples[-1] - samples[0]) / mib:+,.0f} MiB | {staging[0]:.3f} s / "
        f"{sorted(staging)[len(staging) // 2]:.3f} s | {stats.p99_ms:.1f} / {stats.max_ms:.1f} ms |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--saves", type=int, default=50)
    parser.add_argument("--size-gib", type=float, default=0.5)
    parser.add_argument("--dir", default="bench-out")
    args = parser.parse_args()
    with scratch_dir(args.dir, "rss") as scratch:
        asyncio.run(run(args.saves, args.size_gib, scratch))


if __name__ == "__main__":
    main()
