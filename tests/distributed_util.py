"""Running a test body on N real ``torch.distributed`` ranks (gloo on 127.0.0.1, spawned processes).

``run_world(fn, n, tmp_path, *args)`` spawns ``n`` processes that rendezvous through a file store (or a
TCP store hosted by rank 0, as torchrun's, with ``tcp_store=True``), runs
``asyncio.run(fn(rank, n, *args))`` in each, and fails the calling test with every rank's traceback if
any rank raises, exits abnormally or outlives the timeout. ``fn`` must be a module-level coroutine
function of an importable module, and its arguments picklable. Return values come back in rank order.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import pickle
import signal
import socket
import time
import traceback
from collections.abc import Callable, Coroutine
from datetime import timedelta
from pathlib import Path
from typing import Any

DEFAULT_TIMEOUT = 120.0


def _child(
    fn: Callable[..., Coroutine[Any, Any, Any]],
    rank: int,
    n: int,
    init_method: str,
    out: str,
    args: tuple[Any, ...],
) -> None:
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        dist.init_process_group(
            "gloo", init_method=init_method, rank=rank, world_size=n, timeout=timedelta(seconds=60)
        )
        try:
            result = asyncio.run(fn(rank, n, *args))
        finally:
            dist.destroy_process_group()
        payload: tuple[bool, Any] = (True, result)
    except BaseException:
        payload = (False, traceback.format_exc())
    with open(out, "wb") as f:
        pickle.dump(payload, f)


def run_world(
    fn: Callable[..., Coroutine[Any, Any, Any]],
    n: int,
    tmp_path: Path,
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT,
    expect_failure: set[int] | None = None,
    tcp_store: bool = False,
) -> list[Any]:
    """Run ``fn`` on ``n`` ranks; see the module docstring.

    Args:
        fn: ``async def fn(rank, world_size, *args)``.
        n: World size.
        tmp_path: A scratch directory for the rendezvous store and results.
        args: Extra arguments for ``fn``.
        timeout: Seconds the whole world may take.
        expect_failure: Ranks allowed to fail or die (their results are ``None`` or the traceback text).
        tcp_store: Rendezvous through a TCP store that rank 0 hosts (it dies with rank 0).

    Returns:
        Each rank's return value, in rank order (a traceback string for an expected failure).
    """
    ctx = mp.get_context("spawn")
    run_dir = tmp_path / f"world-{os.getpid()}-{id(fn)}-{n}"
    run_dir.mkdir(parents=True, exist_ok=True)
    store = run_dir / "store"
    store.unlink(missing_ok=True)
    init_method = f"tcp://127.0.0.1:{_free_port()}" if tcp_store else f"file://{store}"
    outs = [run_dir / f"rank{r}.pkl" for r in range(n)]
    procs = [
        ctx.Process(target=_child, args=(fn, r, n, init_method, str(outs[r]), args), daemon=True)
        for r in range(n)
    ]
    for p in procs:
        p.start()
    end = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in hung:
        os.kill(procs[r].pid or 0, signal.SIGKILL)
        procs[r].join(5)
    results: list[Any] = []
    problems: list[str] = []
    allowed = expect_failure or set()
    for r, (p, out) in enumerate(zip(procs, outs, strict=True)):
        if r in hung:
            problems.append(f"rank {r} did not finish within {timeout:g} s")
            results.append(None)
            continue
        if not out.exists():
            results.append(None)
            if r not in allowed:
                problems.append(f"rank {r} died (exit code {p.exitcode}) without a result")
            continue
        ok, value = pickle.loads(out.read_bytes())
        results.append(value)
        if not ok and r not in allowed:
            problems.append(f"rank {r} raised:\n{value}")
    if problems:
        raise AssertionError("\n\n".join(problems))
    return results


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port
