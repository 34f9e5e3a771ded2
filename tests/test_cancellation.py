"""Cancelling a save at any point leaves no torn checkpoint, no temp data, no leaked slots or files."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import anyio
import pytest
import torch

import aiockpt


def _state(mib: int = 24) -> dict[str, object]:
    gen = torch.Generator().manual_seed(0)
    return {
        "big": torch.randn(mib * 256 * 1024, generator=gen),
        "small": [torch.randn(64, generator=gen) for _ in range(200)],
        "step": 1,
    }


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith(".tmp"))


async def _assert_all_or_nothing(path: Path, state: dict[str, object]) -> bool:
    """The checkpoint either does not exist or is complete and bit-exact."""
    if not path.exists():
        return False
    tree = await aiockpt.read(path)
    assert torch.equal(tree["big"], state["big"])  # type: ignore[arg-type]
    return True


async def test_cancelling_the_caller_at_random_moments(tmp_path: Path) -> None:
    state = _state()
    rng = random.Random(1234)  # seeded: a failure names a reproducible delay
    fds = _open_fds()
    # Delays up to twice a whole save's time, timed here: on a loaded machine a save takes several times
    # as long, and fixed delays all fell before its commit.
    start = time.monotonic()
    await aiockpt.save(state, tmp_path / "timed")
    took = time.monotonic() - start
    outcomes: set[bool] = set()
    trial = 0
    while trial < 12 or (len(outcomes) < 2 and trial < 40):  # more trials till both sides are hit
        delay = rng.uniform(0, 2 * took)
        path = tmp_path / f"c{trial}"
        with anyio.move_on_after(delay):
            await aiockpt.save(state, path)
        outcomes.add(await _assert_all_or_nothing(path, state))
        assert _leftovers(tmp_path) == [], f"trial {trial}, delay {delay:.4f}s left temp data"
        trial += 1
    assert _open_fds() == fds
    assert outcomes == {True, False}, f"the delays (up to {2 * took:.3f} s) missed a side of the commit"


async def test_handle_cancel_at_random_moments(tmp_path: Path) -> None:
    state = _state()
    rng = random.Random(4321)
    fds = _open_fds()
    for trial in range(12):
        path = tmp_path / f"c{trial}"
        handle = None
        with anyio.move_on_after(rng.uniform(0, 0.02)):  # sometimes while staging
            handle = await aiockpt.save(state, path, async_op=True)
        if handle is not None:
            await anyio.sleep(rng.uniform(0, 0.1))
            handle.cancel()
            try:
                await handle
            except aiockpt.CheckpointCancelledError:
                assert handle.state is aiockpt.SaveState.CANCELLED
            else:
                assert handle.state is aiockpt.SaveState.COMMITTED
        committed = await _assert_all_or_nothing(path, state)
        assert committed == (handle is not None and handle.state is aiockpt.SaveState.COMMITTED)
        assert _leftovers(tmp_path) == [], f"trial {trial} left temp data"
    assert _open_fds() == fds


async def test_handle_cancel_aborts_cleanly_and_frees_the_slot(tmp_path: Path) -> None:
    state = _state(64)
    async with aiockpt.Checkpointer(tmp_path, max_inflight=1, on_busy="error") as ckpt:
        handle = await ckpt.save(state, step=1, async_op=True)
        handle.cancel()
        with pytest.raises(aiockpt.CheckpointCancelledError):
            await handle
        assert handle.state is aiockpt.SaveState.CANCELLED
        assert _leftovers(tmp_path) == []
        assert ckpt.steps() == []
        # The slot came back (on_busy="error" would raise otherwise) and step 1 can be saved again.
        meta = await ckpt.save(state, step=1)
        assert meta.step == 1
        assert ckpt.steps() == [1]


async def test_closing_with_cancel_aborts_saves_in_flight(tmp_path: Path) -> None:
    state = _state(64)
    ckpt = aiockpt.Checkpointer(tmp_path)
    await ckpt.open()
    handle = await ckpt.save(state, step=7, async_op=True)
    await ckpt.aclose(cancel=True)
    assert handle.done()
    assert handle.state in (aiockpt.SaveState.CANCELLED, aiockpt.SaveState.COMMITTED)
    assert _leftovers(tmp_path) == []
    if handle.state is aiockpt.SaveState.COMMITTED:
        assert await _assert_all_or_nothing(tmp_path / "step-00000007", state)


async def test_closing_drains_saves_in_flight(tmp_path: Path) -> None:
    state = _state(8)
    async with aiockpt.Checkpointer(tmp_path, max_inflight=2) as ckpt:
        handles = [await ckpt.save(state, step=s, async_op=True) for s in (1, 2)]
    assert [h.state for h in handles] == [aiockpt.SaveState.COMMITTED] * 2
    async with aiockpt.Checkpointer(tmp_path) as again:
        assert again.steps() == [1, 2]


async def test_failed_save_leaves_nothing_and_the_checkpointer_goes_on(tmp_path: Path) -> None:
    async with aiockpt.Checkpointer(tmp_path) as ckpt:
        with pytest.raises(aiockpt.StateError, match="bad"):
            await ckpt.save({"bad": object()}, step=1)
        assert _leftovers(tmp_path) == []
        await ckpt.save({"good": torch.ones(3)}, step=1)
        assert ckpt.steps() == [1]
