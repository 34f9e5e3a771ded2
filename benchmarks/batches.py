"""The batch sizes of many small GPU tensors' copies, by their Python's hold on the GIL (runs on a CPU).

    python -m benchmarks.batches [--count 20000] [--rounds 10]

Staging gathers small GPU tensors on their device in groups (``_stage._GATHER`` bytes) and a load
scatters small spans with ``torch._foreach_copy_`` in batches (``_device._SCATTER_BATCH`` spans).
Forming a group or a batch is Python that holds the GIL, so the batch size bounds how long the event
loop's thread may wait for it. Both functions are device-agnostic: here they run on CPU tensors
(``--count`` tensors of 4 KiB; the scatter over reader buffers of 2,048 spans), in a worker thread
beside the loop-lag monitor, under the settings of a save (the gathering) or a load (the scattering),
the batch sizes alternating for ``--rounds`` rounds after one unmeasured. On a GPU the copies
themselves are asynchronous launches, so only the Python part is represented: a proxy, not the GPU's
figures (see ``python -m benchmarks.gpu --small``).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable

import torch

from aiockpt._load import _device
from aiockpt._options import IOConfig
from aiockpt._save import _stage
from aiockpt._threads import responsive

from ._lag import LagMonitor

_BYTES = 4096
_SPANS_PER_BUFFER = 2048  # one reader buffer of 8 MiB of 4 KiB spans, with 64 bytes between spans
_GATHERS = (8 << 20, _stage._GATHER)
_SCATTERS = (_SPANS_PER_BUFFER, _device._SCATTER_BATCH)


def _gather(count: int) -> Callable[[int], None]:
    tensors = [torch.randn(_BYTES // 4) for _ in range(count)]
    offsets = {i: i * _BYTES for i in range(count)}
    buffer = torch.empty(count * _BYTES, dtype=torch.uint8)

    def run(limit: int) -> None:
        _stage._GATHER = limit
        _stage._copy_gathered(tensors, list(range(count)), offsets, buffer)
        if not torch.equal(buffer[-_BYTES:].view(torch.float32), tensors[-1]):
            raise AssertionError("gathered bytes differ")

    return run


def _scatter(count: int) -> Callable[[int], None]:
    step = _BYTES + 64
    buffer = torch.randint(0, 256, (_SPANS_PER_BUFFER * step,), dtype=torch.uint8)
    sinks = [torch.empty(_BYTES, dtype=torch.uint8) for _ in range(count)]

    def run(batch: int) -> None:
        _device._SCATTER_BATCH = batch
        for first in range(0, count, _SPANS_PER_BUFFER):
            part = sinks[first : first + _SPANS_PER_BUFFER]
            _device._scatter(buffer, [(s, 0, i * step, _BYTES) for i, s in enumerate(part)])
        if not torch.equal(sinks[-1], buffer[(count - 1) % _SPANS_PER_BUFFER * step :][:_BYTES]):
            raise AssertionError("scattered bytes differ")

    return run


async def _measure(fn: Callable[[int], None], size: int, monitor: LagMonitor, *, save: bool) -> float:
    """Seconds of ``fn(size)`` in a worker thread; the loop's lag meanwhile pools into ``monitor``.

    Under the settings a save (``save``) or a load runs with: the short GIL switch interval, the older
    GC generations held off, and for a save the lowered priority of its threads.
    """
    with responsive(IOConfig(), lowered=save):
        async with monitor:
            start = time.perf_counter()
            await asyncio.to_thread(fn, size)
            return time.perf_counter() - start


async def _main(args: argparse.Namespace) -> None:
    cases = [
        ("gather", "bytes per group", _gather(args.count), _GATHERS, True),
        ("scatter", "spans per call", _scatter(args.count), _SCATTERS, False),
    ]
    print(f"{args.count} CPU tensors of {_BYTES} B, {args.rounds} rounds, batch sizes alternating")
    print("| case | batch | median s | loop lag p99 / max ms (all rounds' wakes) | wakes |")
    print("| :-- | --: | --: | --: | --: |")
    for name, unit, fn, sizes, save in cases:
        seconds: dict[int, list[float]] = {size: [] for size in sizes}
        monitors = {size: LagMonitor() for size in sizes}
        for size in sizes:  # a round unmeasured: the first touches the destinations' new pages
            await asyncio.to_thread(fn, size)
        for _ in range(args.rounds):
            for size in sizes:
                seconds[size].append(await _measure(fn, size, monitors[size], save=save))
        for size in sizes:
            lag = monitors[size].stats()
            print(
                f"| {name} | {size:,} {unit} | {statistics.median(seconds[size]):.3f} | "
                f"{lag.p99_ms:.2f} / {lag.max_ms:.1f} | {lag.samples} |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--count", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    gather, scatter = _stage._GATHER, _device._SCATTER_BATCH
    try:
        asyncio.run(_main(args))
    finally:
        _stage._GATHER, _device._SCATTER_BATCH = gather, scatter


if __name__ == "__main__":
    main()
