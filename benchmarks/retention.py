"""Retention's cost to a save: Checkpointer saves with ``keep_last=1`` against saves that delete nothing.

    python -m benchmarks.retention [--saves 6] [--size-gib 2] [--gap 1.0] [--dir ./bench-out]

Two Checkpointers on roots of their own save the transformer-like state of the suite (state A) in turns,
one ``async_op=True`` save every ``--gap`` seconds (the training between two checkpoints), each awaited
until durable. One has ``keep_last=1``: each of its commits gives up the step before. The other keeps
every step, and the suite deletes its previous step itself during the gap, untimed, so that both roots
hold as much and the disk does the same work; its saves show what a save costs with nothing to delete.
The machine's own cost of deleting such a checkpoint is measured too: unlinking a file of the same size,
written and fsynced just before (``discard`` mounts wait for the device in the unlink).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from pathlib import Path

import aiockpt
from aiockpt._checkpointer import delete_steps

from ._fs import fsync_path, scratch_dir
from ._state import build_transformer_state, state_nbytes

_CHUNK = 16 << 20


def unlink_seconds(path: Path, nbytes: int) -> float:
    """Write ``nbytes`` into a new file at ``path``, fsync it, and time its unlink (and the dir's fsync)."""
    block = bytes(_CHUNK)
    with open(path, "wb") as f:
        for at in range(0, nbytes, _CHUNK):
            f.write(block[: min(_CHUNK, nbytes - at)])
        f.flush()
        os.fsync(f.fileno())
    start = time.perf_counter()
    path.unlink()
    fsync_path(path.parent)
    return time.perf_counter() - start


def _cell(values: list[float]) -> str:
    return f"{min(values):.3f} / {statistics.median(values):.3f}"


async def run(saves: int, size_gib: float, gap: float, scratch: Path) -> None:
    """Run the saves and print the report."""
    state = build_transformer_state(int(size_gib * 2**30))
    nbytes = state_nbytes(state)
    pruned, kept = scratch / "keep-last-1", scratch / "keep-all"
    staged: dict[str, list[float]] = {"pruned": [], "kept": []}
    durable: dict[str, list[float]] = {"pruned": [], "kept": []}
    unlinks = [unlink_seconds(scratch / "unlink.bin", nbytes) for _ in range(3)]
    async with (
        aiockpt.Checkpointer(pruned, keep_last=1) as a,
        aiockpt.Checkpointer(kept) as b,
    ):
        await a.reserve(state)
        await b.reserve(state)
        for step in range(saves + 1):  # a first save each, untimed: the roots then hold one step each
            for name, ckpt in (("pruned", a), ("kept", b)) if step % 2 else (("kept", b), ("pruned", a)):
                if name == "kept" and step:
                    await asyncio.to_thread(delete_steps, kept, [step - 1])  # as retention would
                await asyncio.sleep(gap)
                start = time.perf_counter()
                handle = await ckpt.save(state, step=step, async_op=True)
                returned = time.perf_counter() - start
                await handle
                if step:
                    staged[name].append(returned)
                    durable[name].append(time.perf_counter() - start)
        await a.wait()
    print(f"## Retention: {saves} async saves of {nbytes / 2**30:.2f} GiB per root, one every {gap:g} s\n")
    print(f"Command: python -m benchmarks.retention --saves {saves} --size-gib {size_gib} --gap {gap}\n")
    print("| root | returned after s (best / median) | durable after s (best / median) |")
    print("| :-- | --: | --: |")
    print(f"| keep_last=1 | {_cell(staged['pruned'])} | {_cell(durable['pruned'])} |")
    print(f"| keeps all (deleted in the gap) | {_cell(staged['kept'])} | {_cell(durable['kept'])} |")
    print(f"\nUnlinking a fsynced file of {nbytes / 2**30:.2f} GiB: {_cell(unlinks)} s (3 times).")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--saves", type=int, default=6)
    parser.add_argument("--size-gib", type=float, default=2.0)
    parser.add_argument("--gap", type=float, default=1.0)
    parser.add_argument("--dir", default="bench-out")
    args = parser.parse_args()
    with scratch_dir(args.dir, "retention") as scratch:
        asyncio.run(run(args.saves, args.size_gib, args.gap, scratch))


if __name__ == "__main__":
    main()
