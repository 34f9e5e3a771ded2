"""Per-rank state's cost to a distributed save: the digest every rank computes, and the tree exchange.

    python -m benchmarks.per_rank [--world 2] [--count 20000] [--bytes 4096] [--saves 4] [--rounds 2]
                                  [--dir ./bench-out] [--code DIR]

Every rank saves the suite's state B (``--count`` plain fp32 tensors of ``--bytes`` each, the same on
every rank: the worst case for the digest, which checksums every plain tensor of at most 64 KiB on every
rank) with ``aiockpt.save`` (durable), ``--saves`` times per world, in two variants: ``alike`` (nothing
differs: the digests agree and no tree is exchanged) and ``rng`` (each rank adds its own
``torch.get_rng_state()``: the ranks exchange and merge their trees). Ranks are spawned processes on
gloo, 127.0.0.1, started between barriers; a save's time is rank 0's. ``--code DIR`` imports aiockpt from
``DIR`` instead (a checkout of another commit, to compare with: ``git archive <sha> aiockpt | tar -x -C
DIR``); ``--rounds`` alternates the two variants that many times, each round in new processes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

from ._fs import scratch_dir

VARIANTS = ("alike", "rng")


def _rank(code: str, rank: int, world: int, store: str, root: str, args: dict[str, int | str]) -> None:
    if code:
        sys.path.insert(0, code)
    import torch
    import torch.distributed as dist

    import aiockpt

    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    try:
        gen = torch.Generator().manual_seed(1)
        numel = int(args["bytes"]) // 4
        state: dict[str, object] = {
            f"t{i}": torch.randn(numel, generator=gen) for i in range(int(args["count"]))
        }
        if args["variant"] == "rng":
            torch.manual_seed(rank)
            state["rng"] = torch.get_rng_state()
        rows = []
        for n in range(int(args["saves"])):
            path = Path(root) / f"ckpt-{n}"
            dist.barrier()
            start = time.perf_counter()
            meta = asyncio.run(aiockpt.save(state, path))
            rows.append({"seconds": time.perf_counter() - start, **meta.timings})
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path)
        if rank == 0:
            (Path(root) / "result.json").write_text(json.dumps({"rows": rows, "aiockpt": aiockpt.__file__}))
    finally:
        dist.destroy_process_group()


def run_world(
    code: str, world: int, root: Path, args: dict[str, int | str]
) -> tuple[list[dict[str, float]], str]:
    """Run one world of ``world`` ranks saving ``args["saves"]`` times; rank 0's timings and its aiockpt."""
    root.mkdir(parents=True)
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_rank, args=(code, r, world, str(root / "store"), str(root), args))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(600)
        if p.exitcode != 0:
            raise SystemExit(f"a rank failed (exit code {p.exitcode})")
    result = json.loads((root / "result.json").read_text())
    shutil.rmtree(root)
    return result["rows"], result["aiockpt"]


def _median(rows: list[dict[str, float]], key: str) -> float:
    return statistics.median(r.get(key, float("nan")) for r in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--count", type=int, default=20_000)
    parser.add_argument("--bytes", type=int, default=4096)
    parser.add_argument("--saves", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dir", default="bench-out")
    parser.add_argument("--code", default="", help="import aiockpt from this directory instead")
    opts = parser.parse_args()
    code = str(Path(opts.code).resolve()) if opts.code else ""
    results: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    where = ""
    with scratch_dir(opts.dir, "per-rank") as scratch:
        for n in range(opts.rounds):
            for variant in VARIANTS if n % 2 == 0 else VARIANTS[::-1]:
                args: dict[str, int | str] = {
                    "count": opts.count,
                    "bytes": opts.bytes,
                    "saves": opts.saves,
                    "variant": variant,
                }
                rows, where = run_world(code, opts.world, scratch / f"{variant}-{n}", args)
                results[variant] += rows
    print(f"aiockpt from {where}; world {opts.world}, {opts.count} plain tensors of {opts.bytes} bytes")
    print("| variant | saves | best s | median s | local_plan ms (median) | global_plan ms (median) |")
    print("| :-- | --: | --: | --: | --: | --: |")
    for variant, rows in results.items():
        times = sorted(r["seconds"] for r in rows)
        print(
            f"| {variant} | {len(rows)} | {times[0]:.3f} | {statistics.median(times):.3f} | "
            f"{1e3 * _median(rows, 'local_plan'):.1f} | {1e3 * _median(rows, 'global_plan'):.1f} |"
        )


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
