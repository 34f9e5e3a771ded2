"""Writes the golden checkpoint of format version 3 (per-rank state), once; it is never rewritten.

    python tests/golden/make_golden_v3.py

A single-process save holds no per-rank state, so it writes version 2 (``make_golden.py``). This runs
the real writer on two ``torch.distributed`` ranks (gloo on 127.0.0.1, spawned processes): rank 0 saves
:func:`golden_state` itself, so ``tests/test_format.py`` reads it like every other golden; rank 1's
state differs at ``scalar`` (a tensor, in rank 1's own data file), ``step`` (a value) and
``optim/param_groups/0/betas/1`` (an item of a tuple), and holds a key rank 0 lacks, ``loader``.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import shutil
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

HERE = Path(__file__).resolve().parent


def rank_state(rank: int) -> dict[str, object]:
    """The state rank ``rank`` saves."""
    import torch

    from golden_state import golden_state

    state = golden_state()
    if rank == 1:
        state |= {"scalar": torch.tensor(8), "step": 43, "loader": {"position": 7}}
        state["optim"]["param_groups"][0]["betas"] = (0.9, 0.99)  # type: ignore[index]
    return state


def _rank(rank: int, store: str, work: str) -> None:
    sys.path.insert(0, str(HERE))
    import torch.distributed as dist

    import aiockpt

    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    try:
        asyncio.run(aiockpt.save(rank_state(rank), work, metadata={"purpose": "golden"}))
    finally:
        dist.destroy_process_group()


def main() -> None:
    from aiockpt._load import read_manifest

    target = HERE / "v3"
    assert not target.exists(), f"{target} exists: goldens are never rewritten"
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / "v3"
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_rank, args=(r, f"{tmp}/store", str(work))) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
            assert p.exitcode == 0, f"a rank failed (exit code {p.exitcode})"
        assert read_manifest(work).format_version == 3
        shutil.copytree(work, target)
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
