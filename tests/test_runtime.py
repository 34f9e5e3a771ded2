"""Runtime guarantees: staging budget, retention, watch(), loads racing retention, preemption."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import signal
import sys
import threading
from collections.abc import AsyncGenerator, Callable, Mapping
from pathlib import Path

import anyio
import anyio.abc
import anyio.streams.buffered
import anyio.to_thread
import pytest
import torch
from conftest import assert_tree_equal, child_env, listdir, read_text, tmp_entries

import aiockpt
import aiockpt._checkpointer
import aiockpt._fs
from aiockpt import BusyError, Checkpointer, CheckpointNotFoundError, SaveState, _runner
from aiockpt._fs import LOCK_SUFFIX, OwnerLock, collect_garbage, owner_alive, write_durable

pytestmark = pytest.mark.timeout(120)

MiB = 1024 * 1024


def step_dir(step: int) -> str:
    return f"step-{step:08d}"


def filled(step: int, nbytes: int = 64 * 1024) -> dict[str, object]:
    """A state whose every value derives from ``step``: a mix-up between steps shows in the bytes."""
    return {
        "w": torch.full((nbytes // 4,), float(step), dtype=torch.float32),
        "s": torch.full((4,), step, dtype=torch.int64),
    }


def plain(step: int, nbytes: int) -> dict[str, object]:
    """One float32 tensor of ``nbytes``: a save of it stages exactly ``nbytes``."""
    return {"w": torch.full((nbytes // 4,), float(step), dtype=torch.float32)}


def blank(nbytes: int = 64 * 1024) -> dict[str, object]:
    """A load target shaped like :func:`filled`, holding values no step has."""
    return filled(-1, nbytes)


def on_disk(root: Path) -> list[str]:
    return [name for name in listdir(root) if name.startswith("step-")]


class HeldBytes:
    """Samples ``ckpt._pool.held_bytes`` in the background; :attr:`peak` is the most seen."""

    def __init__(self, ckpt: Checkpointer) -> None:
        self.ckpt = ckpt
        self.peak = 0

    def sample(self) -> None:
        self.peak = max(self.peak, self.ckpt._pool.held_bytes)

    async def run(self) -> None:
        while True:
            self.sample()
            await anyio.sleep(0.001)


async def until(condition: Callable[[], bool]) -> None:
    """Wait until ``condition()`` holds (polled), failing after 30 seconds."""
    deadline = anyio.current_time() + 30
    while not condition():
        assert anyio.current_time() < deadline, "timed out after 30 s"
        await anyio.sleep(0.005)


# --- Subprocesses ---------------------------------------------------------------------------------------


async def spawn(script: Path, *args: str) -> anyio.abc.Process:
    return await anyio.open_process(
        [sys.executable, str(script), *args], stdout=-1, stderr=-1, env=child_env()
    )


async def read_line(proc: anyio.abc.Process, stream: anyio.streams.buffered.BufferedByteReceiveStream) -> str:
    """The next line the child prints; on EOF, fail with what it wrote to stderr."""
    try:
        with anyio.fail_after(60):
            return (await stream.receive_until(b"\n", 4096)).decode()
    except anyio.IncompleteRead:
        assert proc.stderr is not None
        err = b""
        with contextlib.suppress(anyio.EndOfStream, anyio.ClosedResourceError):
            while True:
                err += await proc.stderr.receive()
        pytest.fail(f"the child exited ({await proc.wait()}) before printing a line:\n{err.decode()}")


# --- Staging budget -------------------------------------------------------------------------------------


async def test_a_save_larger_than_the_whole_budget_raises_busy_with_the_byte_counts(root: Path) -> None:
    async with Checkpointer(root, staging_budget=1 * MiB) as ckpt:  # on_busy="wait": must not wait forever
        state = plain(1, 2 * MiB)
        with anyio.fail_after(10), pytest.raises(BusyError) as info:
            await ckpt.save(state, step=1, async_op=True)
        assert "2,097,152" in str(info.value), info.value
        assert "1,048,576" in str(info.value), info.value
        assert ckpt.steps() == []
        assert tmp_entries(root) == []
        assert ckpt._pool.held_bytes == 0
        # A synchronous save writes contiguous tensors from their own memory: no staging, no budget.
        await ckpt.save(state, step=1)
        assert_tree_equal(await ckpt.read(1), plain(1, 2 * MiB))


async def test_on_busy_error_refuses_a_save_while_the_budget_is_in_use(root: Path) -> None:
    async with Checkpointer(root, max_inflight=2, on_busy="error", staging_budget=40 * MiB) as ckpt:
        first = await ckpt.save(plain(1, 32 * MiB), step=1, async_op=True)
        # The first save holds 32 MiB of staging memory until it has written them: 16 MiB more do not fit.
        with pytest.raises(BusyError) as info:
            await ckpt.save(plain(2, 16 * MiB), step=2, async_op=True)
        message = str(info.value)
        for count in (40 * MiB, 32 * MiB, 16 * MiB):
            assert f"{count:,}" in message, message
        await first
        assert ckpt.steps() == [1]
        assert tmp_entries(root) == []
        assert ckpt._pool.held_bytes <= 40 * MiB
        # With the budget free again the refused save goes through.
        await (await ckpt.save(plain(2, 16 * MiB), step=2, async_op=True))
        assert ckpt.steps() == [1, 2]
        assert_tree_equal(await ckpt.read(2), plain(2, 16 * MiB))


async def test_on_busy_wait_waits_for_the_budget_and_both_commit(root: Path) -> None:
    budget = 40 * MiB
    async with Checkpointer(root, max_inflight=2, staging_budget=budget) as ckpt:
        held = HeldBytes(ckpt)
        async with anyio.create_task_group() as tg:
            tg.start_soon(held.run)
            first = await ckpt.save(plain(1, 32 * MiB), step=1, async_op=True)
            with anyio.fail_after(30):
                second = await ckpt.save(plain(2, 16 * MiB), step=2, async_op=True)
                await first
                await second
            tg.cancel_scope.cancel()
        held.sample()
        assert first.state is second.state is SaveState.COMMITTED
        assert ckpt.steps() == [1, 2]
        assert held.peak <= budget, f"kept {held.peak:,} bytes with a budget of {budget:,}"
        for step, nbytes in ((1, 32 * MiB), (2, 16 * MiB)):
            assert_tree_equal(await ckpt.read(step), plain(step, nbytes))
    assert ckpt._pool.held_bytes == 0


async def test_kept_staging_buffers_of_different_sizes_are_reused(root: Path) -> None:
    async with Checkpointer(root, max_inflight=2) as ckpt:
        # Two saves in flight at once leave two kept buffers of different sizes.
        one = await ckpt.save(plain(1, 1 * MiB), step=1, async_op=True)
        two = await ckpt.save(plain(2, 256 * 1024), step=2, async_op=True)
        await one
        await two
        # Later saves take the smallest kept buffer that fits, wherever it is in the pool.
        for step in (3, 4, 5):
            await (await ckpt.save(plain(step, 256 * 1024), step=step, async_op=True))
        await (await ckpt.save(plain(6, 1 * MiB), step=6, async_op=True))
        assert ckpt.steps() == [1, 2, 3, 4, 5, 6]
        for step in (3, 6):
            assert_tree_equal(await ckpt.read(step), plain(step, 1 * MiB if step == 6 else 256 * 1024))


async def test_a_reused_larger_buffer_counts_against_the_budget(root: Path) -> None:
    budget = 64 * MiB
    async with Checkpointer(root, max_inflight=2, staging_budget=budget) as ckpt:
        held = HeldBytes(ckpt)
        async with anyio.create_task_group() as tg:
            tg.start_soon(held.run)
            await (await ckpt.save(plain(1, 48 * MiB), step=1, async_op=True))  # keeps a 48 MiB buffer
            # A 16 MiB save reuses the 48 MiB buffer; while it writes, a 40 MiB save (16 + 40 <= 64 MiB
            # reserved) must not bring the buffers in use or kept past the budget.
            small = await ckpt.save(plain(2, 16 * MiB), step=2, async_op=True)
            large = await ckpt.save(plain(3, 40 * MiB), step=3, async_op=True)
            await small
            await large
            tg.cancel_scope.cancel()
        held.sample()
        assert held.peak <= budget, f"the pool kept {held.peak:,} bytes with a budget of {budget:,}"
        assert ckpt.steps() == [1, 2, 3]


# --- Retention ------------------------------------------------------------------------------------------


async def test_keep_every_steps_are_kept_forever_and_the_newest_is_never_deleted(root: Path) -> None:
    async with Checkpointer(root, keep_last=2, keep_every=3) as ckpt:
        for step in range(1, 11):
            await ckpt.save(filled(step), step=step)
            assert ckpt.latest_step() == step
            assert read_text(root / "latest") == step_dir(step) + "\n"
        assert ckpt.steps() == [3, 6, 9, 10]
        assert on_disk(root) == [step_dir(s) for s in (3, 6, 9, 10)]
        # An older step saved late is pruned at once; the newest one stays and `latest` keeps naming it.
        with pytest.warns(RuntimeWarning, match="step 8 was deleted .* at once"):
            await ckpt.save(filled(8), step=8)
        assert ckpt.steps() == [3, 6, 9, 10]
        assert read_text(root / "latest") == step_dir(10) + "\n"
        await ckpt.wait()  # the pruned steps' trees are removed in the background
        assert tmp_entries(root) == []
    async with Checkpointer(root, keep_last=1) as again:
        assert again.steps() == [3, 6, 9, 10]  # opening prunes nothing
        await again.save(filled(11), step=11)
        assert again.steps() == [11]
        assert_tree_equal(await again.read(), filled(11))


class Gate:
    """A Stateful whose ``load_state_dict`` (run by aiockpt in a worker thread) waits for the test."""

    def __init__(self, value: float) -> None:
        self.x = torch.full((4,), value)
        self.entered = threading.Event()
        self.release = threading.Event()
        self.loaded: dict[str, object] | None = None

    def state_dict(self) -> dict[str, object]:
        return {"x": self.x}

    def load_state_dict(self, state_dict: Mapping[str, object], /) -> None:
        self.entered.set()
        assert self.release.wait(60), "the test never released the load"
        self.loaded = dict(state_dict)


async def test_a_step_being_loaded_is_not_pruned_until_the_load_ends(root: Path) -> None:
    async with Checkpointer(root, keep_last=1) as ckpt:
        await ckpt.save({**filled(1, 16 * MiB), "gate": Gate(1.0)}, step=1)
        gate = Gate(-1.0)
        target: dict[str, object] = {**blank(16 * MiB), "gate": gate}
        loaded: list[int | None] = []

        async def load() -> None:
            loaded.append(await ckpt.load(target, step=1))

        async with anyio.create_task_group() as tg:
            tg.start_soon(load)
            assert await anyio.to_thread.run_sync(gate.entered.wait, 30), "the load never handed over"
            # Step 1 is being loaded: retention of later commits must spare it.
            await ckpt.save(filled(2), step=2)
            await ckpt.save(filled(3), step=3)
            assert ckpt.steps() == [1, 3]
            assert on_disk(root) == [step_dir(1), step_dir(3)]
            gate.release.set()
        assert loaded == [1]
        assert_tree_equal({k: target[k] for k in ("w", "s")}, filled(1, 16 * MiB))
        assert gate.loaded is not None
        assert_tree_equal(gate.loaded["x"], torch.full((4,), 1.0))
        # The load is over: the next commit prunes step 1.
        await ckpt.save(filled(4), step=4)
        assert ckpt.steps() == [4]
        assert on_disk(root) == [step_dir(4)]
        await ckpt.wait()
        assert tmp_entries(root) == []


async def test_retention_removes_old_steps_after_the_save_returns_and_before_the_next_one_writes(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Unlinking a large file can take long (2 GiB: ~0.26 s on ext4 mounted with `discard`): a save is
    # durable, and returns, without waiting for it; the next save waits before writing (for the space).
    entered, release = threading.Event(), threading.Event()
    removed: list[str] = []
    remove_trees = aiockpt._checkpointer._remove_trees

    def held(trees: list[Path]) -> None:
        entered.set()
        assert release.wait(60), "the test never released the removal"
        remove_trees(trees)
        removed.extend(t.name for t in trees)

    monkeypatch.setattr(aiockpt._checkpointer, "_remove_trees", held)
    async with Checkpointer(root, keep_last=1) as ckpt:
        await ckpt.save(filled(1), step=1)
        with anyio.fail_after(30):
            await ckpt.save(filled(2), step=2)  # step 1's removal is held: the save must not wait for it
        assert await anyio.to_thread.run_sync(entered.wait, 30), "step 1 was never removed"
        # Step 1 is gone for every reader already: renamed away, out of the index, `latest` on step 2.
        assert ckpt.steps() == [2]
        assert on_disk(root) == [step_dir(2)]
        assert read_text(root / "latest") == step_dir(2) + "\n"
        trash = [n for n in tmp_entries(root) if n.startswith(".tmp-del-step-00000001-")]
        assert len(trash) == 1, tmp_entries(root)
        handle = await ckpt.save(filled(3), step=3, async_op=True)
        closed = anyio.Event()

        async def drain() -> None:
            await ckpt.wait()
            closed.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(drain)
            await anyio.sleep(0.3)
            # Staged, but not writing until the removal ends; and wait() waits for the removal too.
            assert handle.state is SaveState.STAGED
            assert not closed.is_set()
            release.set()
        assert (await handle).step == 3
        await ckpt.wait()  # step 3's commit took out step 2: its removal too
        assert removed[:1] == trash
        assert [n[: len(".tmp-del-step-00000002-")] for n in removed[1:]] == [".tmp-del-step-00000002-"]
        assert ckpt.steps() == [3]
        assert on_disk(root) == [step_dir(3)]
        assert tmp_entries(root) == []
        assert_tree_equal(await ckpt.read(), filled(3))


async def test_a_failed_removal_warns_and_the_next_open_collects_it(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing(trees: list[Path]) -> None:
        raise PermissionError(13, "Permission denied", str(next(iter(trees))))

    monkeypatch.setattr(aiockpt._checkpointer, "_remove_trees", failing)
    async with Checkpointer(root, keep_last=1) as ckpt:
        await ckpt.save(filled(1), step=1)

        async def save_and_wait() -> None:
            await ckpt.save(filled(2), step=2)
            await ckpt.wait()  # the removal runs in the background: its warning comes by now

        with pytest.warns(RuntimeWarning, match="removing steps that retention deleted"):
            await save_and_wait()
        assert ckpt.steps() == [2]
        assert [n for n in tmp_entries(root) if n.startswith(".tmp-del-")] != []
        await ckpt.save(filled(3), step=3)  # the failure does not hold up later saves
        await ckpt.wait()
    monkeypatch.undo()
    async with Checkpointer(root) as again:
        assert tmp_entries(root) == []
        assert again.steps() == [3]
        assert_tree_equal(await again.read(), filled(3))


async def test_an_interrupted_deletion_is_finished_by_the_next_open(root: Path) -> None:
    async with Checkpointer(root) as ckpt:
        for step in (1, 2):
            await ckpt.save(filled(step), step=step)
    # A crash during retention: step 1 renamed to its trash name and half deleted.
    trash = root / ".tmp-del-step-00000001-0badf00d"
    os.rename(root / step_dir(1), trash)
    os.unlink(trash / "manifest.msgpack")
    # And one made by hand, with nested content.
    made = root / ".tmp-del-step-00000007-12345678"
    (made / "sub").mkdir(parents=True)
    (made / "sub" / "data-r00000.bin").write_bytes(b"x" * 100)
    (made / "manifest.msgpack").write_bytes(b"junk")
    async with Checkpointer(root) as ckpt:
        assert tmp_entries(root) == []
        assert ckpt.steps() == [2]
        assert_tree_equal(await ckpt.read(), filled(2))


async def test_temp_data_of_a_live_writer_survives_an_open(root: Path) -> None:
    root.mkdir()
    tmp = root / ".tmp-step-00000005-0123456789ab"
    tmp.mkdir()
    (tmp / "data-r00000.bin").write_bytes(b"\0" * 4096)
    lock = root / (tmp.name + ".lock")
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a writer in another process holds it
        async with Checkpointer(root) as ckpt:
            assert ckpt.steps() == []
        assert tmp_entries(root) == [tmp.name, lock.name]
    finally:
        os.close(fd)  # the writer dies
    async with Checkpointer(root):
        pass
    assert tmp_entries(root) == []


def test_a_background_save_the_loop_ends_with_warns_and_leaves_nothing(tmp_path: Path) -> None:
    """asyncio.run cancels what is left when its coroutine returns: such a save used to vanish silently."""

    async def forgets(how: str) -> SaveState:
        state = {"w": torch.ones(4 << 20)}
        if how == "one-shot":
            handle = await aiockpt.save(state, tmp_path / "one-shot", async_op=True)
        else:
            handle = await Checkpointer(tmp_path / "root").save(state, step=1, async_op=True)
        return handle.state

    for how in ("one-shot", "checkpointer"):
        with pytest.warns(RuntimeWarning, match="aiockpt's task for background saves was cancelled"):
            assert asyncio.run(forgets(how)) is SaveState.STAGED
    assert listdir(tmp_path) == ["root"]
    assert listdir(tmp_path / "root") == []

    async def cancels() -> None:  # a save cancelled by its handle: asked for, no warning
        handle = await aiockpt.save({"w": torch.ones(4 << 20)}, tmp_path / "cancelled", async_op=True)
        handle.cancel()

    asyncio.run(cancels())
    assert listdir(tmp_path) == ["root"]


@pytest.mark.parametrize("settle", [False, True])
def test_a_save_started_after_every_other_task_was_cancelled_commits(tmp_path: Path, settle: bool) -> None:
    """An application that cancels every other task (a shutdown helper) and goes on saving.

    The save in flight then is cancelled with aiockpt's background task, and warns; a save started
    afterwards went into that ending task group and was cancelled too, after its handle said "staged".
    It now gets a runner of its own: whether the cancellation is still pending (``settle=False``) or the
    old group is winding down. (In a loop of its own: every other task is cancelled.)
    """

    async def main() -> None:
        async with Checkpointer(tmp_path / "root", max_inflight=2) as ckpt:
            first = await ckpt.save({"w": torch.ones(1 << 20)}, step=1, async_op=True)
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()
            if settle:
                await asyncio.sleep(0)
            second = await ckpt.save({"w": torch.full((1 << 20,), 2.0)}, step=2, async_op=True)
            with pytest.raises(aiockpt.CheckpointCancelledError):
                await first
            await second
            assert ckpt.steps() == [2]
            assert ckpt.latest_step() == 2

    with pytest.warns(RuntimeWarning, match="step-00000001 was cancelled before it committed") as seen:
        asyncio.run(main())
    assert len(seen) == 1, [str(w.message) for w in seen]
    assert tmp_entries(tmp_path / "root") == []


@pytest.mark.skipif(sys.version_info < (3, 11), reason="Task.cancelling() is Python 3.11+")
async def test_an_ending_background_task_takes_saves_only_from_callers_being_cancelled() -> None:
    """Which saves a cancelled background task still takes (see ``_runner._usable``).

    One from a caller that goes on after the cancellation starts a new background task. One from a caller
    that is being cancelled too (a task saving on its way out as ``asyncio.run`` cancels every task) goes
    into the ending one, with which it is cancelled, and says so: a new background task would be left
    pending as the loop closes.
    """
    runner = await _runner._runner()
    assert runner.task is not None
    assert _runner._usable(runner)
    seen: list[bool] = []

    async def on_its_way_out() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            seen.append(_runner._usable(runner))
            raise

    caller = asyncio.get_running_loop().create_task(on_its_way_out())
    await asyncio.sleep(0)
    runner.task.cancel()
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert seen == [True]
    assert not _runner._usable(runner)  # this task is not being cancelled
    assert await _runner._runner() is not runner


def test_write_durable_writes_pieces_back_to_back_through_short_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # More pieces than one writev takes, empty ones among them, and a kernel that writes at most 1000
    # bytes per call (cutting pieces anywhere): the file is still the pieces joined.
    pieces = [bytes([i % 251]) * (i % 7 * 300) for i in range(1500)]
    real = os.writev

    def short(fd: int, buffers: list[memoryview]) -> int:
        assert len(buffers) <= 1024
        left, take = 1000, []
        for b in buffers:
            take.append(b[:left])
            left -= len(take[-1])
        return real(fd, take)

    monkeypatch.setattr(os, "writev", short)
    write_durable(tmp_path / "f", pieces)
    assert (tmp_path / "f").read_bytes() == b"".join(pieces)
    write_durable(tmp_path / "g", b"one buffer")
    assert (tmp_path / "g").read_bytes() == b"one buffer"


def test_owner_lock_never_bears_its_name_unlocked(tmp_path: Path) -> None:
    path = tmp_path / ".tmp-step-00000001-0123456789ab.lock"
    lock = OwnerLock(path)
    if not lock.atomic:
        lock.release()
        pytest.skip("no O_TMPFILE + linkat here: the lock is made under a private name and renamed")
    # Made unnamed, locked, then linked: no private name ever existed, and the name is locked.
    assert listdir(tmp_path) == [path.name]
    assert owner_alive(path)
    lock.release()
    assert listdir(tmp_path) == []


def test_owner_lock_falls_back_to_a_private_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(aiockpt._fs, "_name_unnamed", lambda fd, path: False)
    path = tmp_path / ".tmp-step-00000001-0123456789ab.lock"
    lock = OwnerLock(path)
    assert not lock.atomic
    assert listdir(tmp_path) == [path.name]
    assert owner_alive(path)
    with pytest.raises(FileExistsError):  # never replaces a lock, whichever way it is made
        OwnerLock(path)
    monkeypatch.undo()
    with pytest.raises(FileExistsError):
        OwnerLock(path)
    lock.release()
    assert listdir(tmp_path) == []


async def test_free_lock_files_go_at_once_other_loose_files_once_stale(root: Path) -> None:
    root.mkdir()
    orphan = root / ".tmp-step-00000005-0123456789ab.lock"  # its writer died before its mkdir
    orphan.write_bytes(b"")
    held = OwnerLock(root / ".tmp-step-00000006-0123456789ab.lock")  # a live writer's, about to mkdir
    private = root / (orphan.name + "." + "0" * 32)  # a lock under its private name, maybe not yet locked
    private.write_bytes(b"")
    latest = root / (".tmp-latest-" + "1" * 32)  # a `latest` being written
    latest.write_bytes(b"step-00000004\n")
    try:
        async with Checkpointer(root):
            pass
        assert tmp_entries(root) == sorted([held.path.name, private.name, latest.name])
        for p in (private, latest):
            then = os.stat(p).st_mtime - 3600
            os.utime(p, (then, then))
        async with Checkpointer(root):
            pass
        assert tmp_entries(root) == [held.path.name]
    finally:
        held.release()


def test_a_temp_dir_and_its_lock_are_one_entry_removed_whatever_the_listing_order(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Met before its directory, a free lock used to be removed (and listed) as an entry of its own, so
    ``aiockpt prune`` said more than its ``--dry-run`` had."""
    root.mkdir()
    crashed = [root / f".tmp-step-0000000{i}-0123456789ab" for i in (1, 2)]
    for d in crashed:
        d.mkdir()
        (d.parent / (d.name + LOCK_SUFFIX)).write_bytes(b"")  # free: its writer is gone
    listing = Path.iterdir
    monkeypatch.setattr(Path, "iterdir", lambda p: iter(sorted(listing(p), reverse=True)))  # locks first
    would = collect_garbage(root, dry_run=True)
    assert sorted(would) == crashed
    assert collect_garbage(root) == would
    assert list(root.iterdir()) == []


def test_a_tree_another_process_is_removing_too_is_removed_and_the_root_opens(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step renamed for deletion has no owner lock, so a Checkpointer opening the root (or ``aiockpt
    prune``) may remove it beside the process that renamed it. ``shutil.rmtree`` stopped at the first file
    the other one had removed, and after three tries the FileNotFoundError failed the open ("cannot open
    checkpoint root ...: No such file or directory") or the prune (exit 2, trees left behind)."""
    root.mkdir()
    doomed = root / ".tmp-del-step-00000003-0123456789ab"
    doomed.mkdir()
    files = [doomed / f"data-r{rank:05d}.bin" for rank in range(64)]
    for f in files:
        f.write_bytes(b"x")
    unlink = os.unlink

    def raced(path: str | os.PathLike[str], *, dir_fd: int | None = None) -> None:
        # The other process removes one of the files first, every time ours removes one.
        other = next((f for f in files if f.exists()), None)
        if other is not None and other.name != os.fspath(path):
            unlink(other)
        unlink(path, dir_fd=dir_fd)

    monkeypatch.setattr(os, "unlink", raced)
    aiockpt.sync.Checkpointer(root).close()
    assert list(root.iterdir()) == []


# --- watch() --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("coalesce", [True, False], ids=["coalesce", "each"])
async def test_watch_yields_steps_committed_by_another_checkpointer(root: Path, coalesce: bool) -> None:
    async with Checkpointer(root) as writer, Checkpointer(root) as watcher:
        await writer.save(filled(0), step=0)  # committed before watching: never yielded
        assert watcher.steps() == []
        seen: list[int] = []

        async def verify_newest(expected: int) -> None:
            target = blank()
            assert await watcher.load(target) == expected
            assert_tree_equal(target, filled(expected), f"newest step {expected}")

        watch = watcher.watch(poll_interval=0.05, coalesce=coalesce)
        assert isinstance(watch, AsyncGenerator)
        async with contextlib.aclosing(watch) as steps:

            async def take_first() -> None:
                seen.append(await anext(steps))

            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(take_first)
                    await until(lambda: watcher.steps() == [0])  # watch() has taken its baseline
                    await writer.save(filled(1), step=1)
                await verify_newest(1)
                # While the consumer is busy (the generator is not polling), several steps land.
                for burst in ([2, 3, 4], [5, 6]):
                    for step in burst:
                        await writer.save(filled(step), step=step)
                    seen.extend([await anext(steps) for _ in (burst[-1:] if coalesce else burst)])
                    await verify_newest(burst[-1])
        assert seen == ([1, 4, 6] if coalesce else [1, 2, 3, 4, 5, 6])


# --- Loads racing retention in another process ----------------------------------------------------------

LEARNER = """
import asyncio, sys
import torch
import aiockpt

NUMEL = {numel}

def filled(step):
    return {{"w": torch.full((NUMEL,), float(step)), "s": torch.full((4,), step, dtype=torch.int64)}}

async def main(root, steps):
    async with aiockpt.Checkpointer(root, keep_last=1) as ckpt:
        print("ready", flush=True)
        for step in range(1, steps + 1):
            await ckpt.save(filled(step), step=step)

asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""


async def test_loads_racing_retention_never_return_wrong_data(tmp_path: Path) -> None:
    nbytes = 2 * MiB
    script = tmp_path / "learner.py"
    script.write_text(LEARNER.format(numel=nbytes // 4))
    root = tmp_path / "run"
    loaded: list[int] = []
    async with Checkpointer(root) as actor, await spawn(script, str(root), "80") as proc:
        assert proc.stdout is not None
        out = anyio.streams.buffered.BufferedByteReceiveStream(proc.stdout)
        assert await read_line(proc, out) == "ready"
        await race(actor, proc, nbytes, loaded)
    assert loaded == sorted(loaded), "latest went backwards"
    assert len(set(loaded)) >= 2, f"the actor loaded too few steps: {loaded}"
    assert on_disk(root) == [step_dir(80)]


async def race(actor: Checkpointer, proc: anyio.abc.Process, nbytes: int, loaded: list[int]) -> None:
    """Load the latest step again and again while the learner runs."""
    with anyio.fail_after(120):
        while proc.returncode is None:
            target = blank(nbytes)
            try:
                step = await actor.load(target)
            except CheckpointNotFoundError:
                # The step vanished under the load, and under every retry: the target must be untouched.
                assert_tree_equal(target, blank(nbytes), "target after a failed load")
                continue
            if step is None:
                assert_tree_equal(target, blank(nbytes), "target with nothing to load")
                continue
            assert_tree_equal(target, filled(step, nbytes), f"loaded step {step}")
            loaded.append(step)
        assert await proc.wait() == 0


# --- Preemption -----------------------------------------------------------------------------------------

TRAINER = """
import asyncio, sys
import anyio
import torch
import aiockpt

NUMEL = {numel}

async def main(root):
    async with aiockpt.Checkpointer(root, max_inflight=2) as ckpt:
        state = {{"w": torch.zeros(NUMEL), "s": torch.zeros(4, dtype=torch.int64)}}
        step = 0

        def final_save():
            print("final", step, flush=True)
            return state, step

        async with aiockpt.Preemption(ckpt, final_save=final_save) as preemption:
            print("ready", flush=True)
            while not preemption.requested:
                step += 1
                state["w"].fill_(float(step))
                state["s"].fill_(step)
                if step % 10 == 0:
                    await ckpt.save(state, step=step, async_op=True)
                await anyio.sleep(0.002)
        print("left the block without exiting", flush=True)

asyncio.run(main(sys.argv[1]))
"""


async def test_sigterm_drains_saves_saves_once_more_and_exits_143(tmp_path: Path) -> None:
    nbytes = 4 * MiB
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER.format(numel=nbytes // 4))
    root = tmp_path / "run"
    async with await spawn(script, str(root)) as proc:
        assert proc.stdout is not None
        out = anyio.streams.buffered.BufferedByteReceiveStream(proc.stdout)
        assert await read_line(proc, out) == "ready"
        await anyio.sleep(0.5)  # long enough for a few saves, some of them in flight
        proc.send_signal(signal.SIGTERM)
        final = await read_line(proc, out)
        with anyio.fail_after(60):
            rest = b""
            with contextlib.suppress(anyio.EndOfStream, anyio.IncompleteRead):
                while True:
                    rest += await out.receive()
            code = await proc.wait()
    assert code == 128 + signal.SIGTERM, f"exit status {code}; stdout after the final save: {rest!r}"
    assert final.startswith("final "), final
    assert rest == b"", rest
    last = int(final.split()[1])
    assert last >= 10, f"only {last} steps in 0.5 s"
    async with Checkpointer(root) as ckpt:
        # Every save in flight was drained (committed), then the final step saved.
        assert ckpt.steps() == sorted({*range(10, last + 1, 10), last})
        assert read_text(root / "latest") == step_dir(last) + "\n"
        assert_tree_equal(await ckpt.read(), filled(last, nbytes))
        assert tmp_entries(root) == []


async def test_a_repeated_signal_during_the_final_save_is_ignored(root: Path) -> None:
    """Slurm sends SIGTERM again at the time limit: the handlers used to be gone by then, and the default
    action killed the process before the final save was written."""
    async with Checkpointer(root) as ckpt:

        def final() -> tuple[dict[str, object], int]:
            # The repeat must meet the handler (checked first: the default action would end the tests).
            assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
            os.kill(os.getpid(), signal.SIGTERM)
            return filled(2, MiB), 2

        preemption = aiockpt.Preemption(ckpt, final_save=final, exit=False)
        with anyio.fail_after(30):
            async with preemption:
                os.kill(os.getpid(), signal.SIGTERM)
                await preemption.wait()
        assert ckpt.steps() == [2]
        assert_tree_equal(await ckpt.read(2), filled(2, MiB))


async def test_preemption_is_seen_by_a_loop_of_synchronous_steps(root: Path) -> None:
    """A loop that never awaits between steps used to run to its end: the handler waited for the loop."""
    async with Checkpointer(root) as ckpt:
        step = 0
        preemption = aiockpt.Preemption(ckpt, final_save=lambda: (filled(step, MiB), step), exit=False)
        async with preemption:
            while step < 100 and not preemption.requested:
                step += 1  # a synchronous training step
                if step == 5:
                    os.kill(os.getpid(), signal.SIGTERM)
        assert (step, preemption.signal) == (5, signal.SIGTERM)
        assert ckpt.steps() == [5]
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # given back


async def test_a_signal_just_before_the_block_is_left_still_saves(root: Path) -> None:
    """A signal in the block's last step, after its last check: it was dropped with the handlers."""
    async with Checkpointer(root) as ckpt:
        preemption = aiockpt.Preemption(ckpt, final_save=lambda: (filled(7, MiB), 7), exit=False)
        async with preemption:
            os.kill(os.getpid(), signal.SIGTERM)  # no await after it: the block ends here
        assert preemption.requested
        assert ckpt.steps() == [7]


async def test_preemption_gives_each_signal_back_to_its_handler_before(root: Path) -> None:
    """It used to leave SIGTERM (and any signal it handled) at the default action, even with no signal."""
    got: list[str] = []
    loop = asyncio.get_running_loop()
    before = signal.signal(signal.SIGUSR1, lambda *_: got.append("python"))
    loop.add_signal_handler(signal.SIGUSR2, got.append, "asyncio")
    try:
        async with (
            Checkpointer(root) as ckpt,
            aiockpt.Preemption(ckpt, signals=(signal.SIGUSR1, signal.SIGUSR2), exit=False),
        ):
            pass
        # Checked before each signal is sent: the default action would end the tests.
        assert signal.getsignal(signal.SIGUSR2) is not signal.SIG_DFL
        os.kill(os.getpid(), signal.SIGUSR2)
        with anyio.fail_after(10):
            while not got:  # noqa: ASYNC110 (asyncio runs the handler on the loop: no event to wait on)
                await anyio.sleep(0.01)
        assert signal.getsignal(signal.SIGUSR1) is not signal.SIG_DFL
        signal.raise_signal(signal.SIGUSR1)
        assert got == ["asyncio", "python"]
    finally:
        loop.remove_signal_handler(signal.SIGUSR2)
        signal.signal(signal.SIGUSR1, before)


async def test_preemption_given_a_signal_twice_gives_it_back_to_its_handler_before(root: Path) -> None:
    """The second entry of the signal took Preemption's own handler, just installed, for the one before
    and put it back on leaving: the signal then raised in a handler of a Preemption long gone."""
    got: list[int] = []
    before = signal.signal(signal.SIGUSR1, lambda signum, _: got.append(signum))
    try:
        async with (
            Checkpointer(root) as ckpt,
            aiockpt.Preemption(ckpt, signals=(signal.SIGUSR1,) * 2, exit=False),
        ):
            pass
        signal.raise_signal(signal.SIGUSR1)
        assert got == [signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, before)


async def test_a_handler_the_application_installs_inside_the_block_stays(root: Path) -> None:
    """Leaving the block put back the handler from before it (here the default action, which ends the
    process) over one the application had added inside it: the next signal killed the process."""
    got: list[str] = []
    loop = asyncio.get_running_loop()
    before = signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    try:
        async with (
            Checkpointer(root) as ckpt,
            aiockpt.Preemption(ckpt, signals=(signal.SIGUSR1,), exit=False),
        ):
            loop.add_signal_handler(signal.SIGUSR1, got.append, "server")  # a server started in the block
        assert signal.getsignal(signal.SIGUSR1) is not signal.SIG_DFL  # (checked: it would end the tests)
        os.kill(os.getpid(), signal.SIGUSR1)
        with anyio.fail_after(10):
            while not got:  # noqa: ASYNC110 (asyncio runs the handler on the loop: no event to wait on)
                await anyio.sleep(0.01)
        assert got == ["server"]
    finally:
        loop.remove_signal_handler(signal.SIGUSR1)
        signal.signal(signal.SIGUSR1, before)


def test_a_preemption_can_be_made_before_the_event_loop_runs(root: Path) -> None:
    """Its cancel scope and event were made at once, which anyio refuses outside a running loop
    (NoEventLoopError); a Checkpointer can be made there, and both are then used in the loop."""
    ckpt = Checkpointer(root)
    preemption = aiockpt.Preemption(ckpt, exit=False)

    async def main() -> None:
        async with ckpt, preemption:
            await ckpt.save({"w": torch.ones(4)}, step=1)
            os.kill(os.getpid(), signal.SIGTERM)
            with anyio.fail_after(10):
                assert await preemption.wait() is signal.SIGTERM

    asyncio.run(main())
    assert preemption.requested
    assert ckpt.steps() == [1]


async def test_preemption_with_cancel_cancels_the_block_and_returns(root: Path) -> None:
    async with Checkpointer(root, max_inflight=2) as ckpt:
        state = filled(3, 8 * MiB)
        preemption = aiockpt.Preemption(ckpt, final_save=lambda: (state, 3), cancel=True, exit=False)
        with anyio.fail_after(30):
            async with preemption:
                handle = await ckpt.save(filled(1, 8 * MiB), step=1, async_op=True)
                os.kill(os.getpid(), signal.SIGTERM)
                await anyio.sleep(30)  # cancelled by the signal
                pytest.fail("the signal did not cancel the block")
        assert preemption.requested
        assert preemption.signal is signal.SIGTERM
        assert handle.state is SaveState.COMMITTED
        assert ckpt.steps() == [1, 3]
        assert_tree_equal(await ckpt.read(3), filled(3, 8 * MiB))
        assert tmp_entries(root) == []
