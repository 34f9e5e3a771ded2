"""Distributed benchmark: aiockpt vs DCP with several ranks (spawned processes, gloo on 127.0.0.1).

    python -m benchmarks.dist [--size-gib 2] [--world 2] [--repeat 2] [--dir ./bench-out]

The global state (bf16 matrices, ``--size-gib`` in all) is sharded row-wise (``Shard(0)`` DTensors on a
1-D CPU mesh), so each rank holds and writes ``1/world`` of it. Every case runs on all ranks at once,
between barriers; its time is the slowest rank's. Measured in the same run: aiockpt save (durable) and
load (cold page cache), DCP ``save``/``load``, the time until the state may be mutated with
``async_op=True`` (a long-lived Checkpointer, so staging buffers are reused from the second save on) vs
DCP ``async_save``'s blocking time, and per-rank machine limits: memcpy of the local shard, fsync'd write
and cold read of the same bytes (all ranks at once).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import shutil
import time
from collections.abc import Awaitable, Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ._fs import drop_cache
from ._limits import cold_read, fsync_write
from ._state import byte_views

Results = dict[str, list[float]]


def _state(world: int, rank: int, size_gib: float) -> dict[str, torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    rows, cols = 4096, 4096
    count = max(1, round(size_gib * 2**30 / (rows * cols * 2)))
    gen = torch.Generator().manual_seed(rank)
    state: dict[str, torch.Tensor] = {}
    for i in range(count):
        local = torch.randn(rows // world, cols, generator=gen).to(torch.bfloat16)
        state[f"layer{i}.weight"] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
    return state


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


# The suite's own barriers and reductions use a group of their own: DCP's async_save runs collectives on
# the default group from a background thread, and sharing that group would interleave with them.
_SYNC: list[dist.ProcessGroup] = []


async def _timed(results: Results, name: str, fn: Callable[[], Awaitable[object]]) -> object:
    dist.barrier(group=_SYNC[0])
    start = time.perf_counter()
    out = await fn()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=_SYNC[0])
    results.setdefault(name, []).append(float(elapsed.item()))
    return out


def _drop(path: Path) -> None:
    dist.barrier(group=_SYNC[0])
    if dist.get_rank() == 0 and path.exists():
        drop_cache(path)
    dist.barrier(group=_SYNC[0])


async def _rounds(rank: int, world: int, args: argparse.Namespace) -> Results:
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load_fn
    from torch.distributed.checkpoint.state_dict_saver import async_save, save

    import aiockpt

    scratch = Path(args.dir)
    state = _state(world, rank, args.size_gib)
    template: dict[str, object] = {k: v.clone() for k, v in state.items()}
    views = byte_views({k: _local(v) for k, v in state.items()})
    copies = [torch.empty_like(_local(v)) for v in state.values()]
    for c in copies:
        c.fill_(0)
    results: Results = {}
    ckpt = aiockpt.Checkpointer(scratch / "aiockpt-async-root", keep_last=1)
    await ckpt.open()
    for rnd in range(args.repeat):
        path, dpath = scratch / f"aiockpt-{rnd}", scratch / f"dcp-{rnd}"

        async def memcpy() -> None:
            for c, v in zip(copies, state.values(), strict=True):
                c.copy_(_local(v))

        await _timed(results, "memcpy of the local shard", memcpy)
        limit_file = scratch / f"limit-r{rank}.bin"

        async def write_limit() -> None:
            fsync_write(limit_file, views, 2)

        await _timed(results, "fsync'd write, 2 threads per rank", write_limit)

        async def read_limit() -> None:
            cold_read(limit_file, views, 2)

        await _timed(results, "cold read, 2 threads per rank", read_limit)

        async def aio_save() -> None:
            await aiockpt.save(state, path)

        await _timed(results, "aiockpt.save", aio_save)
        handle_box: list[aiockpt.SaveHandle] = []

        async def aio_stage() -> None:
            handle_box.append(await ckpt.save(state, step=rnd + 1, async_op=True))

        await _timed(results, "aiockpt async_op=True: until the state may change", aio_stage)

        async def aio_durable() -> None:
            await handle_box[0]

        await _timed(results, "aiockpt async_op=True: then until durable", aio_durable)

        async def dcp_save() -> None:
            save(state, checkpoint_id=str(dpath))

        await _timed(results, "DCP save", dcp_save)
        future_box: list[object] = []

        async def dcp_async() -> None:
            future_box.append(async_save(state, checkpoint_id=str(scratch / f"dcp-async-{rnd}")))

        await _timed(results, "DCP async_save: blocking time", dcp_async)

        async def dcp_async_wait() -> None:
            future_box[0].result()  # type: ignore[attr-defined]

        await _timed(results, "DCP async_save: then until done", dcp_async_wait)

        _drop(path)

        async def aio_load() -> None:
            await aiockpt.load(template, path)

        await _timed(results, "aiockpt.load (cold)", aio_load)
        _drop(dpath)

        async def dcp_load() -> None:
            dcp_load_fn(template, checkpoint_id=str(dpath))

        await _timed(results, "DCP load (cold)", dcp_load)
        dist.barrier(group=_SYNC[0])
        if rank == 0:
            for p in (path, dpath, scratch / f"dcp-async-{rnd}"):
                shutil.rmtree(p, ignore_errors=True)
        limit_file.unlink(missing_ok=True)
    await ckpt.aclose()
    return results


def _worker(rank: int, world: int, store: str, args: argparse.Namespace, queue: mp.Queue[Results]) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=timedelta(minutes=10)
    )
    _SYNC.append(dist.new_group(backend="gloo"))
    try:
        results = asyncio.run(_rounds(rank, world, args))
        if rank == 0:
            queue.put(results)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gib", type=float, default=2.0)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--dir", default="bench-out")
    args = parser.parse_args()
    scratch = Path(args.dir).absolute()
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    args.dir = str(scratch)
    ctx = mp.get_context("spawn")
    queue: mp.Queue[Results] = ctx.Queue()
    store = str(scratch / "store")
    procs = [ctx.Process(target=_worker, args=(r, args.world, store, args, queue)) for r in range(args.world)]
    for p in procs:
        p.start()
    results = queue.get()
    for p in procs:
        p.join()
    shutil.rmtree(scratch, ignore_errors=True)
    nbytes = max(1, round(args.size_gib * 2**30 / (4096 * 4096 * 2))) * 4096 * 4096 * 2
    print(f"## Distributed: world size {args.world}, {nbytes / 2**30:.2f} GiB global state (Shard(0) bf16)\n")
    print(f"Command: python -m benchmarks.dist --size-gib {args.size_gib} --world {args.world} "
          f"--repeat {args.repeat}\n")  # fmt: skip
    print("| case (slowest rank) | best s | median s | GB/s (global bytes) |")
    print("| :-- | --: | --: | --: |")
    for name, times in results.items():
        best, median = min(times), sorted(times)[len(times) // 2]
        print(f"| {name} | {best:.3f} | {median:.3f} | {nbytes / best / 1e9:.2f} |")


if __name__ == "__main__":
    main()
