"""No blocking call runs on the event loop thread during save, load or read.

Every file-system and copy primitive the pipeline uses is wrapped so that a call from aiockpt code on the
thread running the event loop fails the test; the pipeline must reach them only through worker threads.
(Calls from elsewhere, e.g. the import system loading a module lazily, are not aiockpt's.)
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import aiockpt

BLOCKING = ["open", "close", "fsync", "pwritev", "preadv", "rename", "replace", "mkdir", "unlink",
            "scandir", "listdir", "posix_fallocate", "fstat", "stat", "write", "read"]  # fmt: skip


@pytest.fixture
def guard(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    loop_thread = threading.get_ident()
    offenders: list[str] = []

    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def guarded(*args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if threading.get_ident() == loop_thread and caller.startswith("aiockpt"):
                offenders.append(f"{name} from {caller}")
            return fn(*args, **kwargs)

        return guarded

    for name in BLOCKING:
        monkeypatch.setattr(os, name, wrap(name, getattr(os, name)))
    monkeypatch.setattr(torch.Tensor, "copy_", wrap("Tensor.copy_", torch.Tensor.copy_))
    return offenders


async def test_no_blocking_call_on_the_event_loop(tmp_path: Path, guard: list[str]) -> None:
    model = torch.nn.Linear(64, 64)
    state = {"model": model, "x": torch.randn(1000).t(), "nc": torch.randn(8, 8).t(), "n": 1}
    await aiockpt.save(state, tmp_path / "a")
    handle = await aiockpt.save(state, tmp_path / "b", async_op=True)
    await handle
    await aiockpt.load(state, tmp_path / "a")
    await aiockpt.read(tmp_path / "b")
    assert (await aiockpt.verify(tmp_path / "b", progress=lambda done, total: None)).ok
    async with aiockpt.Checkpointer(tmp_path / "root", keep_last=1) as ckpt:
        for step in range(3):
            await ckpt.save(state, step=step)
        await ckpt.load(state)
    assert guard == []


async def test_foreign_sources_and_convert_stay_off_the_event_loop(tmp_path: Path, guard: list[str]) -> None:
    from safetensors.torch import save_file

    state = {"w": torch.randn(64, 8), "b": torch.arange(5)}
    save_file(state, tmp_path / "m.safetensors")
    torch.save(state, tmp_path / "m.pt")
    await aiockpt.convert(tmp_path / "m.pt", tmp_path / "d", to="dcp")
    await aiockpt.convert(tmp_path / "d", tmp_path / "hf", to="safetensors", max_shard_size=256)
    await aiockpt.convert(tmp_path / "hf", tmp_path / "t.pt", to="torch")
    await aiockpt.convert(tmp_path / "t.pt", tmp_path / "a", to="aiockpt")
    for source in ("m.safetensors", "m.pt", "d", "hf"):
        await aiockpt.read(tmp_path / source)
        await aiockpt.load({k: torch.empty_like(v) for k, v in state.items()}, tmp_path / source)
    assert guard == []


_FIRST_CALLS = """
import asyncio, pathlib, sys, threading
import torch, aiockpt

loop_thread, active, imported = threading.get_ident(), [False], []

def hook(event, args):
    if event == "import" and active[0] and threading.get_ident() == loop_thread:
        imported.append(args[0])

sys.addaudithook(hook)

async def main(root):
    state = {"m": torch.nn.Linear(4, 4), "x": torch.randn(3)}
    active[0] = True
    await aiockpt.save(state, root / "a")
    await (await aiockpt.save(state, root / "b", async_op=True))
    await aiockpt.load(state, root / "a")
    await aiockpt.read(root / "b")
    async with aiockpt.Checkpointer(root / "r", keep_last=1) as ckpt:
        await ckpt.save(state, step=1)
        await ckpt.load(state)
    active[0] = False
    print(imported)

asyncio.run(main(pathlib.Path(sys.argv[1])))
"""


def test_first_calls_import_nothing_on_the_event_loop(tmp_path: Path) -> None:
    # A module imported lazily by the first save or load is a stall of that loop (anyio's backend took
    # 10-90 ms here). Run in a fresh interpreter: this one has imported everything already.
    import subprocess

    out = subprocess.run(
        [sys.executable, "-c", _FIRST_CALLS, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


async def test_a_loads_runs_are_freed_off_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load's per-run bookkeeping (10^4 pieces for 10^4 small tensors) goes with its worker threads.

    Freed with the load's frame instead, on the event loop's thread, it was a 1 ms stall per load of
    20,000 tensors (loop-lag p99 2.2-2.3 ms against 1.2-1.3 ms).
    """
    from conftest import assert_tree_equal, evict

    from aiockpt import _runs
    from aiockpt._load import _read
    from aiockpt._runs import Run

    loop_thread = threading.get_ident()
    freed: list[int] = []

    class Tracked(Run):
        def __del__(self) -> None:
            freed.append(threading.get_ident())

    def tracked(*args: Any, **kwargs: Any) -> list[Run]:
        return [
            Tracked(offset=r.offset, pieces=r.pieces, end=r.end, first=r.first, direct=r.direct)
            for r in _runs.group(*args, **kwargs)
        ]

    monkeypatch.setattr(_read, "group", tracked)
    # Small tensors (read through the page cache) and large ones (with O_DIRECT where the file is cold).
    tensors = {f"s{i}": torch.randn(64) for i in range(600)}
    tensors |= {f"w{i}": torch.randn(1 << 18) for i in range(3)}
    state: dict[str, object] = dict(tensors)
    await aiockpt.save(state, tmp_path / "c")
    for data in (tmp_path / "c").glob("data-*"):
        evict(data)
    target: dict[str, object] = {k: torch.zeros_like(v) for k, v in tensors.items()}
    await aiockpt.load(target, tmp_path / "c")
    assert_tree_equal(target, state)
    assert freed, "the load's runs should have been freed by now"
    assert loop_thread not in freed, f"{freed.count(loop_thread)} of {len(freed)} runs freed on the loop"


async def test_a_saves_pieces_are_freed_off_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save's pieces (one per block: 10^4 for 10^4 small tensors) go with its worker threads.

    The writers' jobs and the direct writer held them past the worker that frees the write's bookkeeping,
    so they were freed with the write's frame, on the event loop's thread.
    """
    from aiockpt._runs import Piece, split
    from aiockpt._save import _write

    loop_thread = threading.get_ident()
    freed: list[int] = []

    class Tracked(Piece):
        def __del__(self) -> None:
            freed.append(threading.get_ident())

    def tracked(*args: Any, **kwargs: Any) -> list[Piece]:
        return [Tracked(p.offset, p.view, p.item, p.block) for p in split(*args, **kwargs)]

    monkeypatch.setattr(_write, "split", tracked)
    # Small tensors (written through the page cache) and large ones (with O_DIRECT where it can).
    state: dict[str, object] = {f"s{i}": torch.randn(64) for i in range(600)}
    state |= {f"w{i}": torch.randn(1 << 18) for i in range(3)}
    await aiockpt.save(state, tmp_path / "sync")
    handle = await aiockpt.save(state, tmp_path / "async", async_op=True)
    await handle
    async with aiockpt.Checkpointer(tmp_path / "root") as ckpt:
        await ckpt.save(state, step=1)
    assert freed, "the saves' pieces should have been freed by now"
    assert loop_thread not in freed, f"{freed.count(loop_thread)} of {len(freed)} pieces freed on the loop"


async def test_a_reads_manifest_is_freed_off_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The manifest of a load or a fresh read (10^4 entries for 10^4 tensors) is freed in a worker.

    A fresh read's planning call held it past the worker that frees the read's bookkeeping, so it was
    freed with the read's frame, on the event loop's thread (6-8 ms per read of 20,000 tensors, in a
    sampled trace).
    """
    import msgspec

    from aiockpt import _load

    loop_thread = threading.get_ident()
    freed: list[str] = []

    class Tracked:
        def __init__(self, where: str) -> None:
            self.where = where

        def __del__(self) -> None:
            freed.append(self.where if threading.get_ident() != loop_thread else f"{self.where} on the loop")

    real = _load._manifest
    calls = 0

    async def tracked(*args: Any, **kwargs: Any) -> Any:
        # A probe only the manifest holds: it is freed when the manifest is.
        nonlocal calls
        manifest, cached, others = await real(*args, **kwargs)
        calls += 1
        probe = {"probe": Tracked(f"manifest {calls}")}
        return msgspec.structs.replace(manifest, user_metadata=probe), cached, others

    monkeypatch.setattr(_load, "_manifest", tracked)
    tensors = {f"s{i}": torch.randn(64) for i in range(600)}
    tensors |= {f"w{i}": torch.randn(1 << 18) for i in range(3)}
    state: dict[str, object] = dict(tensors)
    await aiockpt.save(state, tmp_path / "c")
    await aiockpt.load({k: torch.zeros_like(v) for k, v in tensors.items()}, tmp_path / "c")
    tree = await aiockpt.read(tmp_path / "c")
    assert sorted(tree) == sorted(state)
    assert sorted(freed) == ["manifest 1", "manifest 2"]


async def test_a_verifys_manifest_and_plan_are_freed_off_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """verify's manifest and per-block plan were locals of its coroutine, freed with its frame on the
    event loop's thread (25-50 ms for 20,000 tensors)."""
    import msgspec

    from aiockpt import _verify

    loop_thread = threading.get_ident()
    freed: list[str] = []

    class Tracked:
        def __del__(self) -> None:
            freed.append("on the loop" if threading.get_ident() == loop_thread else "in a worker")

    real = _verify.read_manifest  # type: ignore[attr-defined]

    def tracked(*args: Any, **kwargs: Any) -> Any:
        return msgspec.structs.replace(real(*args, **kwargs), user_metadata={"probe": Tracked()})

    await aiockpt.save({f"s{i}": torch.randn(64) for i in range(600)}, tmp_path / "c")
    monkeypatch.setattr(_verify, "read_manifest", tracked)
    assert (await aiockpt.verify(tmp_path / "c")).ok
    assert freed == ["in a worker"]


@pytest.mark.parametrize("to", ["aiockpt", "torch", "safetensors", "dcp"])
async def test_converts_walks_of_the_tree_run_in_a_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, to: str
) -> None:
    """convert walked the whole tree it had read on the event loop's thread (checking DCP's names, listing
    the tensors): a list of 20,000 ints held the loop for 3 s when converted to DCP."""
    from aiockpt._interop import _convert

    loop_thread = threading.get_ident()
    on_the_loop: list[str] = []

    def tracked(name: str) -> Callable[..., Any]:
        real = getattr(_convert, name)

        def walk(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() == loop_thread:
                on_the_loop.append(name)
            return real(*args, **kwargs)

        return walk

    torch.save({"w": torch.randn(16), "n": [1, 2, 3]}, tmp_path / "in.pt")
    await aiockpt.convert(tmp_path / "in.pt", tmp_path / "dcp", to="dcp")  # a DCP source: its ids restored
    for name in ("restore_optimizer_ids", "named_tensors", "check_dcp_names", "_tensors"):
        monkeypatch.setattr(_convert, name, tracked(name))
    out = tmp_path / ("out.safetensors" if to == "safetensors" else "out")
    await aiockpt.convert(tmp_path / "dcp", out, to=to, drop_non_tensors=to == "safetensors")  # type: ignore[arg-type]
    assert on_the_loop == []
