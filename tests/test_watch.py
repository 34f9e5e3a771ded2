"""watch(), reads racing another process's retention, Preemption's edges, and the RL example's actor."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import shutil
import signal
from collections.abc import AsyncGenerator
from pathlib import Path
from types import ModuleType

import anyio
import pytest
import torch
from conftest import Listings, assert_tree_equal

import aiockpt
import aiockpt._load
import aiockpt._load._match
from aiockpt import Checkpointer
from aiockpt._checkpointer import delete_steps

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[1]


def filled(step: int, numel: int = 1 << 14) -> dict[str, object]:
    return {"w": torch.full((numel,), float(step))}


async def started(steps: AsyncGenerator[int, None], watcher: Checkpointer) -> asyncio.Task[int]:
    """A task taking the next step of ``steps``, once ``watcher``'s watch listed the root since the call
    (its baseline, or a poll): a step committed after this is new to it. (A fixed sleep, where a loaded
    machine delayed that listing, let the step into the baseline, and the test waited for it in vain.)"""
    listings = Listings.of(watcher)
    seen = listings.count
    task = asyncio.ensure_future(anext(steps))
    await listings.past(seen)
    assert not task.done()
    return task


async def next_step(steps: AsyncGenerator[int, None]) -> int:
    with anyio.fail_after(10):
        return await anext(steps)


# --- watch() --------------------------------------------------------------------------------------------


async def test_watch_yields_a_step_committed_after_a_newer_one(root: Path) -> None:
    """Two saves in flight (or two writers) may commit out of order: the late, older step used to be
    dropped, as it was compared with the newest step yielded."""
    async with (
        Checkpointer(root) as writer,
        Checkpointer(root) as watcher,
        contextlib.aclosing(watcher.watch(poll_interval=0.02, coalesce=False)) as steps,
    ):
        first = await started(steps, watcher)
        await writer.save(filled(20), step=20)
        with anyio.fail_after(10):
            assert await first == 20
        await writer.save(filled(10), step=10)
        assert await next_step(steps) == 10
        await writer.save(filled(30), step=30)
        assert await next_step(steps) == 30  # once each: 10 and 20 are not yielded again


async def test_a_coalescing_watch_yields_only_a_new_newest_step(root: Path) -> None:
    async with (
        Checkpointer(root) as writer,
        Checkpointer(root) as watcher,
        contextlib.aclosing(watcher.watch(poll_interval=0.02)) as steps,
    ):
        first = await started(steps, watcher)
        await writer.save(filled(20), step=20)
        with anyio.fail_after(10):
            assert await first == 20
        pending = await started(steps, watcher)
        await writer.save(filled(10), step=10)  # not the newest: an actor loads 20 anyway
        await anyio.sleep(0.3)
        assert not pending.done(), pending.result()
        await writer.save(filled(30), step=30)
        with anyio.fail_after(10):
            assert await pending == 30


async def test_watch_outlives_its_root_being_removed_and_made_again(root: Path) -> None:
    """A run started afresh in the same root used to end every watch with ``StorageError`` (the root was
    missing at a poll), or, had no poll seen it missing, never yield its steps (numbered from 1 again)."""
    async with (
        Checkpointer(root) as watcher,
        contextlib.aclosing(watcher.watch(poll_interval=0.02)) as steps,
    ):
        first = await started(steps, watcher)
        async with Checkpointer(root) as writer:
            await writer.save(filled(50), step=50)
        with anyio.fail_after(10):
            assert await first == 50
        pending = await started(steps, watcher)
        shutil.rmtree(root)
        await anyio.sleep(0.2)  # polls that find no root
        assert not pending.done()
        async with Checkpointer(root) as writer:
            await writer.save(filled(1), step=1)
        with anyio.fail_after(10):
            assert await pending == 1
        target = filled(-1)
        assert await watcher.load(target) == 1
        assert_tree_equal(target, filled(1))


async def test_watch_yields_the_steps_of_a_root_made_afresh_under_the_old_numbers(
    root: Path, tmp_path: Path
) -> None:
    """A root swapped for a new run's between two polls (no poll saw it missing), with the step numbers
    the old run had: the watch kept the old numbers as known, and never yielded the new checkpoints."""
    async with Checkpointer(root) as writer:
        for step in (10, 20):
            await writer.save(filled(step), step=step)
    fresh = tmp_path / "fresh"
    async with Checkpointer(fresh) as writer:
        for step in (10, 20):
            await writer.save(filled(-step), step=step)
    async with (
        Checkpointer(root) as watcher,
        contextlib.aclosing(watcher.watch(poll_interval=0.02)) as steps,
    ):
        pending = await started(steps, watcher)
        root.rename(tmp_path / "old")
        fresh.rename(root)
        with anyio.fail_after(10):
            assert await pending == 20
        target = filled(0)
        assert await watcher.load(target) == 20
        assert_tree_equal(target, filled(-20))


async def test_watch_yields_the_steps_of_a_run_begun_afresh_in_the_same_directory(root: Path) -> None:
    """The root emptied and a new run's lower steps saved into it, between two polls: as a root removed
    and made again whose directory got the old one's inode number (ext4 hands a freed number to the next
    directory made), its identity is the old one's. Its steps were taken as known, and never yielded."""
    async with Checkpointer(root) as writer:
        for step in (1, 2, 3, 4):
            await writer.save(filled(step), step=step)
    async with (
        Checkpointer(root) as watcher,
        contextlib.aclosing(watcher.watch(poll_interval=1.0, coalesce=False)) as steps,
    ):
        pending = await started(steps, watcher)  # right after a listing: the swap is done by the next
        listings = Listings.of(watcher)
        seen = listings.count
        for entry in list(root.iterdir()):
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        async with Checkpointer(root) as writer:
            for step in (1, 2):
                await writer.save(filled(-step), step=step)
        with anyio.fail_after(10):
            assert await pending == 1
            assert await anext(steps) == 2
        assert listings.count > seen
        target = filled(0)
        assert await watcher.load(target) == 2
        assert_tree_equal(target, filled(-2))


async def test_a_watch_begun_while_the_root_is_missing_waits_for_it(root: Path) -> None:
    """A watch (re)started while the learner makes the root afresh used to raise ``StorageError`` at its
    first listing, though a root missing at any later poll is waited out."""
    async with Checkpointer(root) as watcher:
        shutil.rmtree(root)
        async with contextlib.aclosing(watcher.watch(poll_interval=0.02)) as steps:
            pending = await started(steps, watcher)
            await anyio.sleep(0.2)  # polls that find no root
            assert not pending.done()
            async with Checkpointer(root) as writer:
                await writer.save(filled(3), step=3)
            with anyio.fail_after(10):
                assert await pending == 3


async def test_watch_still_fails_on_a_root_that_cannot_be_listed(root: Path) -> None:
    async with (
        Checkpointer(root) as watcher,
        contextlib.aclosing(watcher.watch(poll_interval=0.02)) as steps,
    ):
        first = await started(steps, watcher)
        shutil.rmtree(root)
        root.write_text("not a directory")
        with anyio.fail_after(10), pytest.raises(aiockpt.StorageError):
            await first


# --- read() racing another process's retention ----------------------------------------------------------


async def test_read_of_the_latest_step_retries_when_retention_deletes_it(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``Checkpointer.read()`` used to raise ``CorruptionError`` ("data file is missing") for a step
    that another process's retention deleted under it, where ``load()`` retried the new latest."""
    async with Checkpointer(root) as learner, Checkpointer(root) as actor:
        await learner.save(filled(1), step=1)
        await actor.refresh()
        real = aiockpt._load._match.match
        loop = asyncio.get_running_loop()
        raced: list[int] = []

        def racing(*args: object, **kwargs: object) -> object:
            # Between the manifest and the data files: the learner commits step 2, its keep_last=1
            # retention deletes step 1.
            if not raced:
                raced.append(1)
                asyncio.run_coroutine_threadsafe(learner.save(filled(2), step=2), loop).result(30)
                delete_steps(root, [1])
            return real(*args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(aiockpt._load, "match", racing)
        assert_tree_equal(await actor.read(), filled(2))
        assert raced == [1]


async def test_read_of_a_named_step_deleted_under_it_says_so(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with Checkpointer(root) as learner, Checkpointer(root) as actor:
        await learner.save(filled(1), step=1)
        await learner.save(filled(2), step=2)
        await actor.refresh()
        real = aiockpt._load._match.match

        def racing(*args: object, **kwargs: object) -> object:
            delete_steps(root, [1])
            return real(*args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(aiockpt._load, "match", racing)
        with pytest.raises(aiockpt.CheckpointNotFoundError, match="step 1 was deleted"):
            await actor.read(1)


# --- Preemption -----------------------------------------------------------------------------------------


async def test_final_save_may_return_none(root: Path) -> None:
    """The docstring says ``final_save`` returns ``(state, step)`` "or None"; None raised ``TypeError``."""
    async with Checkpointer(root) as ckpt:
        preemption = aiockpt.Preemption(ckpt, final_save=lambda: None, exit=False)
        with anyio.fail_after(30):
            async with preemption:
                os.kill(os.getpid(), signal.SIGTERM)
                await preemption.wait()
        assert preemption.signal is signal.SIGTERM
        assert ckpt.steps() == []


async def test_a_preemption_entered_again_starts_afresh(root: Path) -> None:
    """The signal handled by its first block used to make the second block act as if signalled again."""
    saved: list[int] = []
    async with Checkpointer(root) as ckpt:

        def final() -> tuple[dict[str, object], int]:
            saved.append(len(saved) + 1)
            return filled(saved[-1]), saved[-1]

        preemption = aiockpt.Preemption(ckpt, final_save=final, exit=False)
        with anyio.fail_after(30):
            async with preemption:
                os.kill(os.getpid(), signal.SIGTERM)
                await preemption.wait()
            assert saved == [1]
            async with preemption:
                assert not preemption.requested
        assert saved == [1]
        assert ckpt.steps() == [1]


async def test_a_refused_signal_leaves_no_handler_behind(root: Path) -> None:
    """A signal that cannot be handled used to leave the ones taken before it with the Preemption."""
    loop = asyncio.get_running_loop()
    async with Checkpointer(root) as ckpt:
        with pytest.raises(aiockpt.CheckpointError, match="Preemption cannot handle SIGKILL"):
            async with aiockpt.Preemption(ckpt, signals=(signal.SIGUSR1, signal.SIGKILL), exit=False):
                pass
    assert signal.SIGUSR1 not in getattr(loop, "_signal_handlers", {})
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL


# --- The RL example ---------------------------------------------------------------------------------------


def rl_example() -> ModuleType:
    path = REPO / "examples" / "rl_learner_actor.py"
    spec = importlib.util.spec_from_file_location("rl_learner_actor", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def test_an_rl_actor_started_after_the_learner_finished_ends_on_its_last_step(tmp_path: Path) -> None:
    """The actor's watch never yields a step committed before it began: an actor that started late (a
    slow spawn) used to wait for a step that never came and fail after 60 s."""
    example = rl_example()
    root = tmp_path / "root"
    root.mkdir()
    await example.learner(root, 20, 10, 0.0)
    with anyio.fail_after(30):
        await example.actor("late-actor", root, 0.0)


@pytest.mark.parametrize("interval", [0, -1.0, float("nan")])
async def test_watch_refuses_a_poll_interval_that_is_not_positive(root: Path, interval: float) -> None:
    # 0 (or nan, which anyio.sleep returns from at once) listed the root in a busy loop.
    async with Checkpointer(root) as ckpt:
        with pytest.raises(aiockpt.CheckpointError, match="poll_interval"):
            await anext(ckpt.watch(poll_interval=interval))
