"""Pinned staging memory: aiockpt's against registering untouched memory, as the event loop sees it.

    python -m benchmarks.pinned [--size-gib 2.1] [--rounds 3]

A Checkpointer's pinned staging buffer is made by ``_cuda.pinned_empty``: a private mapping on huge
pages where the kernel gives them, touched, then registered with ``cudaHostRegister``. The plain way
registers a fresh mapping of untouched 4 KiB pages, and the driver faults them in while it holds the
process's ``mmap_lock``. Each is made ``--rounds`` times (in the order A B B A ..., a new buffer each
time) in a worker thread, while the event loop's thread maps and unmaps 64 KiB every millisecond (what
starting a worker thread does) and times each such call; then a device-to-host copy into the buffer is
timed, and freeing it. Last, once, the same for torch's caching pinned allocator (what a one-shot
``aiockpt.save`` stages into): its first block of the size, since later ones come from its cache.
Needs a CUDA device.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import mmap
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from aiockpt import _cuda


def _untouched_registered(nbytes: int) -> torch.Tensor:
    """``nbytes`` of fresh private 4 KiB pages, registered untouched (freed with the tensor)."""
    locked = _cuda._Locked(-1, nbytes, flags=mmap.MAP_PRIVATE)
    buffer = torch.frombuffer(locked, dtype=torch.uint8)
    address, device = buffer.data_ptr(), torch.cuda.current_device()
    register = torch.cuda.cudart().cudaHostRegister  # type: ignore[no-untyped-call]
    if not _cuda._in_own_thread(device, lambda: register(address, nbytes, _cuda._REGISTER_PORTABLE)):
        raise RuntimeError(f"cudaHostRegister of {nbytes:,} bytes failed")
    locked.address, locked.device = address, device
    return buffer


def _torch_pinned(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


_WAYS: dict[str, Callable[[int], torch.Tensor]] = {
    "aiockpt (`_cuda.pinned_empty`)": _cuda.pinned_empty,
    "untouched 4 KiB pages, registered": _untouched_registered,
}


@dataclass
class _Way:
    make: list[float] = field(default_factory=list)
    mmap_ms: list[float] = field(default_factory=list)  # the loop thread's longest mmap, per round
    late_ms: list[float] = field(default_factory=list)  # the loop's latest wake, per round
    d2h: list[float] = field(default_factory=list)  # GB/s
    free: list[float] = field(default_factory=list)


async def _made(make: Callable[[int], torch.Tensor], nbytes: int, way: _Way) -> torch.Tensor:
    """``make(nbytes)`` in a worker thread, the loop thread mapping memory meanwhile."""
    done = False
    mapped: list[float] = []
    late: list[float] = []

    async def tick() -> None:
        while not done:
            start = time.perf_counter()
            mmap.mmap(-1, 1 << 16).close()
            mapped.append(time.perf_counter() - start)
            before = time.perf_counter()
            await asyncio.sleep(0.001)
            late.append(time.perf_counter() - before - 0.001)

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0.01)
    start = time.perf_counter()
    buffer = await asyncio.to_thread(make, nbytes)
    way.make.append(time.perf_counter() - start)
    done = True
    await ticker
    way.mmap_ms.append(max(mapped) * 1e3)
    way.late_ms.append(max(late) * 1e3)
    return buffer


def _copied_and_freed(buffer: torch.Tensor, source: torch.Tensor, way: _Way) -> None:
    if not buffer.is_pinned():
        raise AssertionError("the buffer is not pinned")
    start = time.perf_counter()
    buffer.copy_(source, non_blocking=True)
    torch.cuda.synchronize()
    way.d2h.append(buffer.numel() / (time.perf_counter() - start) / 1e9)
    if not torch.equal(buffer[-4096:].cuda(), source[-4096:]):
        raise AssertionError("the copy into the buffer differs")
    start = time.perf_counter()
    del buffer
    gc.collect()
    way.free.append(time.perf_counter() - start)


def _span(values: list[float], fmt: str) -> str:
    return f"{format(min(values), fmt)}-{format(max(values), fmt)} ({format(statistics.median(values), fmt)})"


async def _main(args: argparse.Namespace) -> None:
    nbytes = int(args.size_gib * 2**30) // mmap.PAGESIZE * mmap.PAGESIZE
    source = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    names = list(_WAYS)
    ways = {name: _Way() for name in names}
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            buffer = await _made(_WAYS[name], nbytes, ways[name])
            _copied_and_freed(buffer, source, ways[name])
            del buffer
    torchs = "torch's caching allocator (first block; 1 round)"
    ways[torchs] = _Way()
    buffer = await _made(_torch_pinned, nbytes, ways[torchs])
    _copied_and_freed(buffer, source, ways[torchs])
    del buffer
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    print(
        f"| {nbytes / 2**30:.2f} GiB, {args.rounds} rounds: min-max (median) | made and registered, s "
        "| loop thread's longest mmap, ms | loop's latest wake, ms | device-to-host, GB/s | freed, s |"
    )
    print("| :-- | --: | --: | --: | --: | --: |")
    for name, way in ways.items():
        print(
            f"| {name} | {_span(way.make, '.3f')} | {_span(way.mmap_ms, '.1f')} "
            f"| {_span(way.late_ms, '.1f')} | {_span(way.d2h, '.1f')} | {_span(way.free, '.3f')} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--size-gib", type=float, default=2.1)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if not torch.cuda.is_available() or not hasattr(mmap, "MAP_PRIVATE"):
        sys.exit("benchmarks.pinned needs a CUDA device (and private anonymous mappings)")
    asyncio.run(_main(args))


if __name__ == "__main__":
    main()
