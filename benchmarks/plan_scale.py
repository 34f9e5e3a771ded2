"""Global-plan scale: time the pure planner on synthetic plans of many ranks and items.

    python -m benchmarks.plan_scale [--ranks 64] [--items 10000]

Each rank holds ``--items`` tensors: 90 % of them sharded (each rank its own row block of a tensor whose
global shape every rank shares) and 10 % replicated (held by every rank, written once). The planner
must dedup the replicated chunks, balance their bytes and lay out every rank's file.
"""

from __future__ import annotations

import argparse
import time

import msgspec

from aiockpt._format import ENCODER
from aiockpt._gc import paused
from aiockpt._save._global_plan import global_plan
from aiockpt._save._local_plan import LocalPlan, WriteItem


def synthetic(ranks: int, items: int) -> list[LocalPlan]:
    """Local plans of ``ranks`` ranks with ``items`` chunks each."""
    plans = []
    for r in range(ranks):
        chunks = []
        for i in range(items):
            if i % 10 == 0:
                chunks.append(
                    WriteItem(path=("model", f"norm{i}"), dtype="float32", shape=(4096,), offsets=(0,),
                              sizes=(4096,), nbytes=16384, replicated=True)
                )  # fmt: skip
            else:
                rows = 64
                chunks.append(
                    WriteItem(path=("model", f"w{i}"), dtype="bfloat16", shape=(rows * ranks, 1024),
                              offsets=(rows * r, 0), sizes=(rows, 1024), nbytes=rows * 1024 * 2,
                              replicated=False)
                )  # fmt: skip
        plans.append(LocalPlan(rank=r, items=tuple(chunks)))
    return plans


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--items", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    # What crosses the wire: each rank's encoded local plan; every rank decodes all of them and plans.
    wire = [ENCODER.encode(p) for p in synthetic(args.ranks, args.items)]
    decoder = msgspec.msgpack.Decoder(LocalPlan)
    times, plan_only = [], []
    for _ in range(args.repeat):
        start = time.perf_counter()
        with paused():
            decoded = [decoder.decode(b) for b in wire]
            middle = time.perf_counter()
            plan = global_plan(decoded)
        end = time.perf_counter()
        times.append(end - start)
        plan_only.append(end - middle)
    writes = [sum(1 for _ in r.writes) for r in plan.ranks]
    chunks = args.ranks * args.items
    best, median = min(times), sorted(times)[len(times) // 2]
    print(
        f"decode + global_plan: {args.ranks} ranks x {args.items} items = {chunks:,} chunks -> "
        f"{len(plan.tensors):,} tensors; best {best:.3f} s, median {median:.3f} s; "
        f"writes per rank {min(writes)}..{max(writes)}"
    )
    print(f"global_plan alone (the pure planner): best {min(plan_only):.3f} s")


if __name__ == "__main__":
    main()
