"""Checkpointer: numbered steps, retention, `latest`, resume, garbage collection, in-flight limits."""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import signal
import threading
import traceback
from collections.abc import Callable, Sequence
from fractions import Fraction
from pathlib import Path

import anyio
import pytest
import torch
from conftest import (
    assert_tree_equal,
    at,
    dir_tree,
    exists,
    listdir,
    make_model,
    make_optimizer,
    read_text,
    snapshot,
    tensor_at,
    tmp_entries,
    train_step,
)

import aiockpt
from aiockpt import (
    BusyError,
    Checkpointer,
    CheckpointExistsError,
    CheckpointNotFoundError,
    SaveState,
    StateError,
    StorageError,
)

pytestmark = pytest.mark.timeout(60)


def step_dir(step: int) -> str:
    return f"step-{step:08d}"


def make_dir(path: Path) -> None:
    os.makedirs(path)


def write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def state_for(step: int) -> dict[str, object]:
    return {"w": torch.full((64,), float(step)), "step": step}


async def wait_until(condition: Callable[[], bool]) -> None:
    """Yield to the event loop until ``condition()`` holds (20 s at most)."""
    with anyio.fail_after(20):
        while not condition():  # noqa: ASYNC110 (a state inside the Checkpointer: no event tells it)
            await anyio.sleep(0.001)


def big_state(step: int) -> dict[str, object]:
    """4 MiB: its save usually takes longer than staging the next one (see ``held_commits``)."""
    return {"w": torch.full((1 << 20,), float(step))}


@pytest.fixture
async def held_commits(monkeypatch: pytest.MonkeyPatch) -> anyio.Event:
    """Saves stay in flight, before their commit, until the returned event is set.

    A save's being in flight right after the next one is staged was left to timing: a 4 MiB save
    sometimes committed first on a CI machine, and a test of a full in-flight limit saw no BusyError.
    """
    release = anyio.Event()
    commit = aiockpt._save._finish.commit

    async def held(
        tmpdir: Path, final: Path, manifest: Sequence[bytes], limiter: anyio.CapacityLimiter | None = None
    ) -> None:
        await release.wait()
        await commit(tmpdir, final, manifest, limiter)

    monkeypatch.setattr(aiockpt._save, "commit", held)
    return release


async def test_keep_last_retention_and_latest(root: Path) -> None:
    async with Checkpointer(root, keep_last=2) as ckpt:
        for step in range(1, 6):
            meta = await ckpt.save(state_for(step), step=step)
            assert meta.step == step
            assert meta.path == str(root / step_dir(step))
            assert read_text(root / "latest").strip() == step_dir(step)
        assert ckpt.steps() == [4, 5]
        assert ckpt.latest_step() == 5
        assert read_text(root / "latest").strip() == step_dir(5)
    assert [n for n in listdir(root) if not n.startswith(".")] == ["latest", step_dir(4), step_dir(5)]
    assert tmp_entries(root) == []


async def test_only_the_names_a_save_gives_are_steps(root: Path) -> None:
    # `step-5` beside `step-00000005` (a copy made by hand) listed step 5 twice, and `step-` with an
    # Arabic-Indic seven listed a step 7 that was never saved, which a save of step 7 then found existing.
    async with Checkpointer(root, keep_last=2) as ckpt:
        await ckpt.save(state_for(5), step=5)
    shutil.copytree(root / step_dir(5), root / "step-5")
    shutil.copytree(root / step_dir(5), root / "step-\u0667")
    async with Checkpointer(root, keep_last=2) as ckpt:
        assert ckpt.steps() == [5]
        await ckpt.save(state_for(7), step=7)
        assert ckpt.steps() == [5, 7]
        assert_tree_equal(await ckpt.read(7), state_for(7))
    assert sorted(n for n in listdir(root) if n.startswith("step-")) == sorted(
        ["step-5", "step-\u0667", step_dir(5), step_dir(7)]
    )


async def test_load_latest_and_a_given_step(root: Path) -> None:
    async with Checkpointer(root, keep_last=2) as ckpt:
        for step in range(1, 6):
            await ckpt.save(state_for(step), step=step)
        target: dict[str, object] = {"w": torch.zeros(64), "step": 0}
        w = target["w"]
        assert await ckpt.load(target) == 5
        assert target["w"] is w
        assert_tree_equal(target, state_for(5))
        assert await ckpt.load(target, step=4) is not None
        assert_tree_equal(target, state_for(4))
        with pytest.raises(CheckpointNotFoundError, match="3"):
            await ckpt.load(target, step=3)  # removed by retention
        with pytest.raises(CheckpointNotFoundError):
            await ckpt.load(target, step=99)
        assert_tree_equal(target, state_for(4))
        assert_tree_equal(await ckpt.read(), state_for(5))
        assert_tree_equal(await ckpt.read(4), state_for(4))


async def test_load_given_step_returns_it(root: Path) -> None:
    async with Checkpointer(root) as ckpt:
        await ckpt.save(state_for(1), step=1)
        await ckpt.save(state_for(2), step=2)
        target: dict[str, object] = {"w": torch.zeros(64), "step": 0}
        assert await ckpt.load(target, step=1) == 1
        assert_tree_equal(target, state_for(1))


async def test_load_on_an_empty_root_returns_none(root: Path) -> None:
    target: dict[str, object] = {"w": torch.ones(64), "step": -1}
    async with Checkpointer(root) as ckpt:
        assert ckpt.steps() == []
        assert ckpt.latest_step() is None
        assert await ckpt.load(target) is None
    assert torch.equal(tensor_at(target, "w"), torch.ones(64))
    assert target["step"] == -1
    assert exists(root)


async def test_a_new_checkpointer_sees_committed_steps(root: Path) -> None:
    async with Checkpointer(root) as ckpt:
        for step in (10, 20, 30):
            await ckpt.save(state_for(step), step=step)
    async with Checkpointer(root) as again:
        assert again.steps() == [10, 20, 30]
        assert again.latest_step() == 30
        target: dict[str, object] = {"w": torch.zeros(64), "step": 0}
        assert await again.load(target) == 30
        assert_tree_equal(target, state_for(30))
        # Steps need not be saved in order, and retention is by step number.
        await again.save(state_for(25), step=25)
        assert again.steps() == [10, 20, 25, 30]
        assert again.latest_step() == 30


async def test_keep_every_keeps_milestones(root: Path) -> None:
    async with Checkpointer(root, keep_last=1, keep_every=3) as ckpt:
        for step in range(1, 8):
            await ckpt.save(state_for(step), step=step)
        assert ckpt.steps() == [3, 6, 7]


async def test_latest_never_moves_back_to_an_older_step_of_another_writer(root: Path) -> None:
    """Two writers of one root (two processes, say): one whose index is stale used to point ``latest``
    back at its own older step, though the other had committed a newer one."""
    async with Checkpointer(root) as a, Checkpointer(root) as b:
        await a.save(state_for(1), step=1)
        await b.save(state_for(10), step=10)
        await a.save(state_for(2), step=2)  # a's index: [1, 2]
        assert read_text(root / "latest").strip() == step_dir(10)
        shutil.rmtree(root / step_dir(10))  # removed by hand: `latest` names no checkpoint now
        await a.save(state_for(3), step=3)
        assert read_text(root / "latest").strip() == step_dir(3)
    assert listdir(root) == ["latest", step_dir(1), step_dir(2), step_dir(3)]  # (no lock file)


async def test_leftover_temp_dir_is_collected_on_open(root: Path) -> None:
    async with Checkpointer(root) as ckpt:
        await ckpt.save(state_for(1), step=1)
    leftover = root / ".tmp-step-00000002-deadbeef0000"
    make_dir(leftover)
    write_file(leftover / "data-r00000.bin", b"\x00" * 100)
    make_dir(root / ".tmp-step-00000003-0123456789ab")
    async with Checkpointer(root) as ckpt:
        assert not exists(leftover)
        assert tmp_entries(root) == []
        assert ckpt.steps() == [1]
    assert listdir(root) == ["latest", step_dir(1)]


async def test_a_missing_or_dangling_latest_is_mended_on_open(root: Path) -> None:
    """A writer killed between its commit and its update of ``latest`` left committed steps that no
    ``latest`` named, until its next commit (the crash trials met it under load)."""
    async with Checkpointer(root) as ckpt:
        await ckpt.save(state_for(1), step=1)
        await ckpt.save(state_for(2), step=2)
    (root / "latest").unlink()
    async with Checkpointer(root):
        assert read_text(root / "latest") == step_dir(2) + "\n"
    write_file(root / "latest", (step_dir(7) + "\n").encode())  # a step that is gone
    async with Checkpointer(root):
        assert read_text(root / "latest") == step_dir(2) + "\n"
    # An older committed step is left alone: a writer in another process may be moving it forward.
    write_file(root / "latest", (step_dir(1) + "\n").encode())
    async with Checkpointer(root):
        assert read_text(root / "latest") == step_dir(1) + "\n"
    assert tmp_entries(root) == []


async def test_incomplete_step_dirs_are_not_steps(root: Path) -> None:
    async with Checkpointer(root) as ckpt:
        await ckpt.save(state_for(1), step=1)
    make_dir(root / step_dir(2))  # no manifest: never committed
    write_file(root / step_dir(2) / "data-r00000.bin", b"junk")
    make_dir(root / "unrelated")
    async with Checkpointer(root) as ckpt:
        assert ckpt.steps() == [1]
        assert ckpt.latest_step() == 1
        target: dict[str, object] = {"w": torch.zeros(64), "step": 0}
        assert await ckpt.load(target) == 1


async def test_existing_step_is_refused_and_untouched(root: Path) -> None:
    async with Checkpointer(root) as ckpt:
        await ckpt.save(state_for(1), step=1)
        before = dir_tree(root / step_dir(1))
        with pytest.raises(CheckpointExistsError, match="1"):
            await ckpt.save(state_for(99), step=1)
        with pytest.raises(CheckpointExistsError):
            await ckpt.save(state_for(99), step=1, async_op=True)
        assert dir_tree(root / step_dir(1)) == before
        assert ckpt.steps() == [1]
        assert_tree_equal(await ckpt.read(1), state_for(1))
    async with Checkpointer(root) as other:  # another instance knows too
        with pytest.raises(CheckpointExistsError):
            await other.save(state_for(99), step=1)
        assert_tree_equal(await other.read(1), state_for(1))
    assert tmp_entries(root) == []


async def test_a_step_directory_without_a_checkpoint_is_refused_as_such(root: Path) -> None:
    """A torn step directory (no manifest) was refused as if it held a checkpoint, with nothing said of
    what to do; a file under a step's name likewise."""
    async with Checkpointer(root) as ckpt:
        await ckpt.save(state_for(1), step=1)
        make_dir(root / step_dir(2))
        write_file(root / step_dir(2) / "data-r00000.bin", b"x")
        write_file(root / step_dir(3), b"x")
        await ckpt.refresh()
        assert ckpt.steps() == [1]
        with pytest.raises(CheckpointExistsError, match=r"step-00000002 already exists, and holds no "):
            await ckpt.save(state_for(2), step=2)
        with pytest.raises(CheckpointExistsError, match=r"step-00000003 already exists, and is no dir"):
            await ckpt.save(state_for(3), step=3)
        with pytest.raises(CheckpointExistsError, match=r"step 1 already exists"):
            await ckpt.save(state_for(1), step=1)
        assert (root / step_dir(2) / "data-r00000.bin").read_bytes() == b"x"  # untouched


async def test_retention_goes_on_where_latest_cannot_be_replaced(root: Path) -> None:
    """A failure to replace ``latest`` (a full disk; here a directory in its place) skipped retention
    too: on a full disk no later save could ever succeed, and keep_last stopped holding."""
    make_dir(root / "latest")
    async with Checkpointer(root, keep_last=2) as ckpt:
        for step in range(1, 5):
            with pytest.warns(RuntimeWarning, match=f"step {step} is committed .* updating `latest`"):
                await ckpt.save(state_for(step), step=step)
        await ckpt.wait()
        assert ckpt.steps() == [3, 4]
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == [step_dir(3), step_dir(4)]


def test_an_unreadable_step_directory_is_left_out_by_name(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step directory that could not be read (no permission) made the whole root unopenable, and
    the error named the root, not the entry."""

    async def save_three() -> None:
        async with Checkpointer(root) as ckpt:
            for step in (1, 2, 3):
                await ckpt.save(state_for(step), step=step)

    anyio.run(save_three)

    def is_checkpoint(path: Path) -> bool:
        if path.name == step_dir(3):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return aiockpt._load.is_checkpoint(path)

    monkeypatch.setattr("aiockpt._checkpointer.is_checkpoint", is_checkpoint)

    async def resume() -> int | None:
        async with Checkpointer(root) as ckpt:
            target = state_for(0)
            step = await ckpt.load(target)
            assert_tree_equal(target, state_for(2))
            return step

    with pytest.warns(RuntimeWarning, match=r"step 3 in .* is left out: cannot read .*step-00000003: Perm"):
        assert anyio.run(resume) == 2


def test_a_reader_that_may_not_write_the_root_opens_it(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader of a learner's root on a read-only mount (or of another user) could not open it while
    a save was in flight: the collector opened the save's owner lock for writing, and removing temp data
    it may not remove failed the open."""
    from aiockpt import _checkpointer, _fs

    async def save_one() -> None:
        async with Checkpointer(root) as ckpt:
            await ckpt.save(state_for(1), step=1)

    anyio.run(save_one)
    lock = _fs.OwnerLock(root / ".tmp-step-00000002-0123456789ab.lock")  # a save in flight
    (root / ".tmp-step-00000002-0123456789ab").mkdir()
    real_open = os.open
    modes: list[int] = []

    def read_only_open(path: object, flags: int, *args: object) -> int:
        if str(path).endswith(".lock"):
            modes.append(flags & os.O_ACCMODE)
            if flags & os.O_ACCMODE != os.O_RDONLY:
                raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, flags, *args)  # type: ignore[arg-type]

    def read_only_collect(path: Path, *, dry_run: bool = False) -> list[Path]:
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    try:
        with monkeypatch.context() as patched:
            patched.setattr(os, "open", read_only_open)
            assert _fs.owner_alive(lock.path)
        assert modes == [os.O_RDONLY]
        monkeypatch.setattr(_checkpointer, "collect_temp", read_only_collect)

        async def read() -> None:
            async with Checkpointer(root) as ckpt:
                assert_tree_equal(await ckpt.read(), state_for(1))

        anyio.run(read)
    finally:
        lock.release()


async def test_async_saves(root: Path) -> None:
    async with Checkpointer(root, keep_last=3) as ckpt:
        model = make_model(0)
        opt = make_optimizer(model)
        for step in range(1, 5):
            train_step(model, opt, None, step)
            state: dict[str, object] = {"model": model, "optim": opt, "step": step}
            expected = snapshot(state)
            handle = await ckpt.save(state, step=step, async_op=True)
            assert handle.state is not SaveState.STAGING
            train_step(model, opt, None, 100 + step)  # mutate while it is written
            meta = await handle
            assert handle.state is SaveState.COMMITTED
            assert handle.done()
            assert meta.step == step
            assert_tree_equal(await ckpt.read(step), expected)
        assert ckpt.steps() == [2, 3, 4]
        assert ckpt.latest_step() == 4
        assert read_text(root / "latest").strip() == step_dir(4)


async def test_closing_waits_for_saves_in_flight(root: Path) -> None:
    async with Checkpointer(root) as ckpt:
        handle = await ckpt.save(big_state(7), step=7, async_op=True)
    assert handle.done()
    assert handle.state is SaveState.COMMITTED
    assert exists(root / step_dir(7) / "manifest.msgpack")
    assert read_text(root / "latest").strip() == step_dir(7)


async def test_on_busy_wait_queues_saves(root: Path) -> None:
    async with Checkpointer(root, max_inflight=1, on_busy="wait") as ckpt:
        h1 = await ckpt.save(big_state(1), step=1, async_op=True)
        h2 = await ckpt.save(big_state(2), step=2, async_op=True)
        await h1
        await h2
        assert ckpt.steps() == [1, 2]
        assert_tree_equal(await ckpt.read(2), big_state(2))


async def test_a_wait_for_an_in_flight_slot_is_counted_as_wait_not_as_staging(
    root: Path, held_commits: anyio.Event
) -> None:
    """``stage`` was timed from the call: a save queued behind another counted the whole wait as staging."""
    async with Checkpointer(root, max_inflight=1, on_busy="wait") as ckpt:
        first = await ckpt.save(state_for(1), step=1, async_op=True)
        async with anyio.create_task_group() as tg:
            queued: list[aiockpt.SaveHandle] = []

            async def save_second() -> None:
                queued.append(await ckpt.save(state_for(2), step=2, async_op=True))

            tg.start_soon(save_second)
            await anyio.sleep(0.3)  # the second save waits for the slot all this time
            assert not queued
            held_commits.set()
        await first
        timings = (await queued[0]).timings
    assert timings["wait"] >= 0.25, timings
    assert timings["stage"] < timings["wait"], timings  # (a few milliseconds of a tiny state's staging)
    assert queued[0].metrics.staging_seconds >= timings["wait"]  # the caller was held up all the same


async def test_on_busy_skip(root: Path, held_commits: anyio.Event) -> None:
    async with Checkpointer(root, max_inflight=1, on_busy="skip") as ckpt:
        h1 = await ckpt.save(big_state(1), step=1, async_op=True)
        assert not h1.done()
        h2 = await ckpt.save(big_state(2), step=2, async_op=True)
        assert h2.state is SaveState.SKIPPED
        assert h2.done()
        with pytest.raises(BusyError):  # SaveSkippedError, a BusyError
            await h2
        with pytest.raises(aiockpt.SaveSkippedError):
            await h2
        held_commits.set()
        await h1
        assert h1.state is SaveState.COMMITTED
        assert ckpt.steps() == [1]
        assert not exists(root / step_dir(2))
        # Once the slot is free again, saving works.
        await ckpt.save(big_state(3), step=3)
        assert ckpt.steps() == [1, 3]


async def test_on_busy_skip_blocking_save_raises(root: Path, held_commits: anyio.Event) -> None:
    async with Checkpointer(root, max_inflight=1, on_busy="skip") as ckpt:
        h1 = await ckpt.save(big_state(1), step=1, async_op=True)
        with pytest.raises(aiockpt.SaveSkippedError):
            await ckpt.save(big_state(2), step=2)
        held_commits.set()
        await h1
        assert ckpt.steps() == [1]


async def test_on_busy_error(root: Path, held_commits: anyio.Event) -> None:
    async with Checkpointer(root, max_inflight=1, on_busy="error") as ckpt:
        h1 = await ckpt.save(big_state(1), step=1, async_op=True)
        with pytest.raises(BusyError):
            await ckpt.save(big_state(2), step=2, async_op=True)
        with pytest.raises(BusyError):
            await ckpt.save(big_state(2), step=2)
        held_commits.set()
        await h1
        await ckpt.save(big_state(2), step=2)
        assert ckpt.steps() == [1, 2]


async def test_max_inflight_two_allows_two(root: Path, held_commits: anyio.Event) -> None:
    async with Checkpointer(root, max_inflight=2, on_busy="error") as ckpt:
        h1 = await ckpt.save(big_state(1), step=1, async_op=True)
        h2 = await ckpt.save(big_state(2), step=2, async_op=True)
        with pytest.raises(BusyError):
            await ckpt.save(big_state(3), step=3, async_op=True)
        held_commits.set()
        await h1
        await h2
        assert listdir(root) == ["latest", step_dir(1), step_dir(2)]
        assert read_text(root / "latest").strip() == step_dir(2)
        assert ckpt.steps() == [1, 2]
        assert ckpt.latest_step() == 2


async def test_same_step_in_flight_is_refused(root: Path) -> None:
    async with Checkpointer(root, max_inflight=2) as ckpt:
        h1 = await ckpt.save(big_state(1), step=1, async_op=True)
        with pytest.raises(CheckpointExistsError):
            await ckpt.save(big_state(1), step=1, async_op=True)
        await h1
        assert ckpt.steps() == [1]


async def test_failed_save_changes_nothing(root: Path) -> None:
    async with Checkpointer(root, keep_last=2) as ckpt:
        await ckpt.save(state_for(1), step=1)
        latest = read_text(root / "latest")
        before = dir_tree(root)
        with pytest.raises(StateError, match="bad/obj"):
            await ckpt.save({"w": torch.ones(1), "bad": {"obj": object()}}, step=2)
        assert ckpt.steps() == [1]
        assert dir_tree(root) == before
        assert read_text(root / "latest") == latest
        assert tmp_entries(root) == []
        # The slot was released: the next save goes through.
        await ckpt.save(state_for(2), step=2)
        assert ckpt.steps() == [1, 2]


async def test_awaiting_a_failed_handle_again_raises_the_same_traceback(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each await raised the one stored exception anew, adding its frames to its traceback: three
    awaits gave 10, 13 and 16 frames (and kept every frame's locals alive)."""

    async def failing(*args: object) -> None:
        raise StorageError("the disk went away")

    monkeypatch.setattr(aiockpt._save, "commit", failing)
    async with Checkpointer(root) as ckpt:
        handle = await ckpt.save(state_for(1), step=1, async_op=True)
        depths = []
        for _ in range(3):
            with pytest.raises(StorageError, match="the disk went away") as caught:
                await handle
            depths.append(len(traceback.extract_tb(caught.value.__traceback__)))
        assert depths[0] == depths[1] == depths[2], depths
        assert handle.state is SaveState.FAILED


async def test_allow_pickle_checkpointer(root: Path) -> None:
    async with Checkpointer(root, allow_pickle=True) as ckpt:
        await ckpt.save({"s": {1, 2}, "f": Fraction(1, 3), "t": torch.ones(2)}, step=1)
        got = await ckpt.read()
        assert at(got, "s") == {1, 2}
        assert at(got, "f") == Fraction(1, 3)
    async with Checkpointer(root) as strict:
        with pytest.raises(StateError, match=r"key 'f' holds a pickled fractions\.Fraction"):
            await strict.read()  # (the set's pickle imports nothing: it alone would load)
        with pytest.raises(StateError):
            await strict.save({"s": {1, 2}}, step=2)


@pytest.mark.parametrize(
    "kwargs",
    [{"keep_last": 0}, {"max_inflight": 0}, {"on_busy": "sometimes"}, {"keep_every": 0}],
    ids=["keep_last", "max_inflight", "on_busy", "keep_every"],
)
def test_bad_arguments(kwargs: dict[str, object], root: Path) -> None:
    with pytest.raises(aiockpt.CheckpointError):
        Checkpointer(root, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("step", [-1, 1.5, "3", True, 2**64])
async def test_bad_step(step: object, root: Path) -> None:
    async with Checkpointer(root) as ckpt:
        with pytest.raises(aiockpt.CheckpointError):
            await ckpt.save(state_for(1), step=step)  # type: ignore[call-overload]
        # path_of made "step--0000001" of -1 and raised a bare ValueError for 1.5 and "3".
        with pytest.raises(aiockpt.CheckpointError, match="step must be"):
            ckpt.path_of(step)  # type: ignore[arg-type]
        assert ckpt.steps() == []
        assert tmp_entries(root) == []


@pytest.mark.parametrize(
    ("kwargs", "culprit"),
    [
        ({"signals": ("SIGTERM",)}, "signals"),
        ({"signals": "SIGTERM"}, "signals"),
        ({"signals": None}, "signals"),
        ({"signals": 15.0}, "signals"),
        ({"signals": True}, "signals"),
        ({"signals": (True,)}, "signals"),
        ({"signals": (10**6,)}, "signals"),
        ({"final_save": "save"}, "final_save"),
        ({"cancel": "yes"}, "cancel"),
        ({"exit": None}, "exit"),
    ],
)
async def test_preemption_refuses_bad_arguments_naming_them(
    root: Path, kwargs: dict[str, object], culprit: str
) -> None:
    """A signal name given as a str raised a bare TypeError on entering the block; a final_save that is
    no function failed only once a signal had come."""
    async with Checkpointer(root) as ckpt:
        with pytest.raises(aiockpt.CheckpointError, match=culprit):
            aiockpt.Preemption(ckpt, **kwargs)  # type: ignore[arg-type]


async def test_preemption_takes_one_signal_as_it_takes_a_sequence(root: Path) -> None:
    """``signals=signal.SIGTERM`` (not in a sequence) raised a bare TypeError."""
    async with Checkpointer(root) as ckpt:
        before = signal.getsignal(signal.SIGUSR1)
        preemption = aiockpt.Preemption(ckpt, signals=signal.SIGUSR1, exit=False)
        assert preemption.signals == (signal.SIGUSR1,)
        async with preemption:
            assert signal.getsignal(signal.SIGUSR1) is not before
        assert signal.getsignal(signal.SIGUSR1) is before


def test_preemption_needs_an_async_checkpointer(root: Path) -> None:
    """Preemption(None) was accepted, and failed only once a signal had come."""
    with pytest.raises(aiockpt.CheckpointError, match=r"needs an aiockpt\.Checkpointer, not NoneType"):
        aiockpt.Preemption(None)  # type: ignore[arg-type]
    with (
        aiockpt.sync.Checkpointer(root) as blocking,
        pytest.raises(aiockpt.CheckpointError, match="not Checkpointer"),
    ):
        aiockpt.Preemption(blocking)  # type: ignore[arg-type]


# -- concurrent calls ----------------------------------------------------------------------------------


def test_the_first_two_background_saves_of_an_event_loop_both_run(tmp_path: Path) -> None:
    """The loop's runner of background saves is registered before its task group exists: the second
    save, started meanwhile, must wait for it too (it used to fail an assertion and lose its save)."""

    async def main() -> list[int]:
        async with Checkpointer(tmp_path / "a") as a, Checkpointer(tmp_path / "b") as b:
            handles = await asyncio.gather(
                a.save(state_for(1), step=1, async_op=True), b.save(state_for(1), step=1, async_op=True)
            )
            return [(await h).step or 0 for h in handles]

    assert asyncio.run(main()) == [1, 1]  # a new event loop: its first background saves


def test_a_checkpointer_serves_one_running_event_loop_at_a_time(root: Path) -> None:
    """Used by two event loops at once (two threads), a release of its semaphore in one loop never woke
    the other's waiter: that loop hung in its save. One loop after another is fine."""
    ckpt = Checkpointer(root)
    opened, done = threading.Event(), threading.Event()

    async def first() -> None:
        await ckpt.save(state_for(1), step=1)
        opened.set()
        await anyio.to_thread.run_sync(done.wait)  # this loop still runs

    thread = threading.Thread(target=lambda: asyncio.run(first()))
    thread.start()
    try:
        assert opened.wait(30)

        async def second(step: int) -> None:
            await ckpt.save(state_for(step), step=step)

        with pytest.raises(aiockpt.CheckpointError, match="in use by another event loop, which still runs"):
            asyncio.run(second(2))
    finally:
        done.set()
        thread.join(30)
    asyncio.run(second(3))  # the first loop has ended: this one is served
    asyncio.run(ckpt.aclose())
    assert ckpt.steps() == [1, 3]


async def test_concurrent_first_calls_open_once_and_share_the_in_flight_limit(
    root: Path, held_commits: anyio.Event
) -> None:
    """Three saves gathered on a Checkpointer never entered: each used to open it, with a semaphore of
    its own, and all three ran despite ``max_inflight=1``."""
    ckpt = Checkpointer(root, max_inflight=1, on_busy="error")
    try:
        results = await asyncio.gather(
            *(ckpt.save(big_state(s), step=s, async_op=True) for s in (1, 2, 3)), return_exceptions=True
        )
        handles = [r for r in results if isinstance(r, aiockpt.SaveHandle)]
        assert len(handles) == 1
        assert sum(isinstance(r, BusyError) for r in results) == 2
        held_commits.set()
        await handles[0]
        await ckpt.save(big_state(4), step=4)  # the slot came back: one slot, not three
        assert ckpt._slots is not None
        assert ckpt._slots.value == 1
    finally:
        held_commits.set()
        await ckpt.aclose()


class _Interrupts:
    """A Stateful whose ``state_dict()`` raises ``exc`` (``SystemExit``: a ``sys.exit()`` in user code)."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def state_dict(self) -> dict[str, object]:
        raise self.exc

    def load_state_dict(self, state: dict[str, object]) -> None:
        pass


@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.parametrize("exc", [SystemExit("bye"), KeyboardInterrupt()])
async def test_an_interrupt_raised_by_the_state_reaches_the_caller_and_gives_its_slot_back_once(
    root: Path, held_commits: anyio.Event, async_op: bool, exc: BaseException
) -> None:
    """The slot used to be given back twice (max_inflight stopped holding), and with ``async_op=True``
    the caller got ``CancelledError`` while the interrupt tore down every other background save."""
    async with Checkpointer(root, max_inflight=2, on_busy="error") as ckpt:
        other = await ckpt.save(big_state(1), step=1, async_op=True)  # held before its commit
        bad = {"bad": _Interrupts(exc)}
        call = ckpt.save(bad, step=2, async_op=True) if async_op else ckpt.save(bad, step=2)
        with pytest.raises(type(exc)):
            await call
        assert ckpt._slots is not None
        assert ckpt._slots.value == 1  # the other save's slot is still taken
        await ckpt.save(big_state(3), step=3, async_op=True)  # ... and this one takes the last
        with pytest.raises(BusyError):
            await ckpt.save(big_state(4), step=4, async_op=True)
        held_commits.set()
        assert (await other).step == 1
        await ckpt.wait()
        assert ckpt.steps() == [1, 3]
        assert ckpt._slots.value == 2


async def test_a_step_waiting_for_a_slot_is_in_flight_already(root: Path, held_commits: anyio.Event) -> None:
    """A second save of a step whose first save waits for a free slot is refused at once; both used to
    be accepted, and the Checkpointer then lost track of one of them."""
    async with Checkpointer(root, max_inflight=1, on_busy="wait") as ckpt:
        first = await ckpt.save(big_state(1), step=1, async_op=True)
        async with anyio.create_task_group() as tg:
            waiting: list[aiockpt.SaveHandle] = []

            async def save_two() -> None:
                waiting.append(await ckpt.save(big_state(2), step=2, async_op=True))

            tg.start_soon(save_two)
            await wait_until(lambda: 2 in ckpt._inflight)
            with pytest.raises(CheckpointExistsError):
                await ckpt.save(big_state(2), step=2, async_op=True)
            held_commits.set()
        await first
        await waiting[0]
        assert ckpt.steps() == [1, 2]
        assert_tree_equal(await ckpt.read(2), big_state(2))


async def test_aclose_cancel_also_cancels_saves_waiting_for_a_slot(
    root: Path, held_commits: anyio.Event
) -> None:
    """They used to start once the slot was free, commit, and hold ``aclose`` until they had."""
    ckpt = await Checkpointer(root, max_inflight=1, on_busy="wait").__aenter__()
    first = await ckpt.save(big_state(1), step=1, async_op=True)
    outcome: list[BaseException] = []

    async def save_two() -> None:
        try:
            await ckpt.save(big_state(2), step=2, async_op=True)
        except aiockpt.CheckpointError as exc:
            outcome.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(save_two)
        await wait_until(lambda: 2 in ckpt._inflight)
        with anyio.fail_after(20):
            await ckpt.aclose(cancel=True)
    assert first.state is SaveState.CANCELLED
    assert len(outcome) == 1
    assert isinstance(outcome[0], aiockpt.CheckpointCancelledError)
    assert listdir(root) == []
    with pytest.raises(aiockpt.CheckpointError, match="closed"):
        await ckpt.save(big_state(3), step=3)


async def test_aclose_refuses_a_cancel_that_is_not_a_bool(root: Path, held_commits: anyio.Event) -> None:
    """``aclose(cancel="false")``, a config file's "do not cancel", cancelled the save in flight."""
    ckpt = await Checkpointer(root).__aenter__()
    handle = await ckpt.save(state_for(1), step=1, async_op=True)
    with pytest.raises(aiockpt.CheckpointError, match="cancel must be a bool, not 'false'"):
        await ckpt.aclose(cancel="false")  # type: ignore[arg-type]
    held_commits.set()
    await ckpt.aclose()
    assert handle.state is SaveState.COMMITTED
    assert ckpt.steps() == [1]
    with pytest.raises(aiockpt.CheckpointError, match="cancel must be a bool"):
        await ckpt.aclose(cancel=1)  # type: ignore[arg-type]


async def test_watch_refuses_a_coalesce_that_is_not_a_bool(root: Path) -> None:
    async with Checkpointer(root) as ckpt:
        steps = ckpt.watch(poll_interval=0.01, coalesce="no")  # type: ignore[arg-type]
        with pytest.raises(aiockpt.CheckpointError, match="coalesce must be a bool, not 'no'"):
            await steps.__anext__()


async def test_repr_shortens_a_long_list_of_steps(root: Path) -> None:
    """Every committed step was listed: 29 KB for a run that kept 5000."""
    async with Checkpointer(root, keep_last=None) as ckpt:
        for step in range(3):
            await ckpt.save(state_for(step), step=step)
        assert repr(ckpt) == f"<Checkpointer root={str(root)!r} steps=[0, 1, 2]>"
        for step in range(3, 9):
            await ckpt.save(state_for(step), step=step)
        assert repr(ckpt) == f"<Checkpointer root={str(root)!r} steps=[0, 1, 2, ..., 6, 7, 8] (9 steps)>"


async def test_a_failure_after_the_commit_leaves_the_save_committed(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Updating ``latest`` failed (the disk full, say) after the step was committed: the save used to
    be marked failed with a raw OSError (and ``aclose`` to stop before freeing its buffers)."""

    def full(path: Path, data: bytes) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    async with Checkpointer(root, keep_last=1) as ckpt:
        await ckpt.save(state_for(1), step=1)
        monkeypatch.setattr("aiockpt._checkpointer.replace_durable", full)
        handle = await ckpt.save(state_for(2), step=2, async_op=True)
        with pytest.warns(RuntimeWarning, match="step 2 is committed"):
            meta = await handle
        assert handle.state is SaveState.COMMITTED
        assert meta.step == 2
        # Retention goes on without `latest` (on a full disk it frees the room for the next save), which
        # names the step it took out until the next commit replaces it.
        assert ckpt.steps() == [2]
        assert read_text(root / "latest").strip() == step_dir(1)
        monkeypatch.undo()
        await ckpt.save(state_for(3), step=3)  # the next commit catches up
        assert ckpt.steps() == [3]
        assert read_text(root / "latest").strip() == step_dir(3)
    assert listdir(root) == ["latest", step_dir(3)]


async def test_a_refresh_never_drops_a_step_committed_while_it_listed(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A refresh (``watch`` makes one per poll) lists the root, then a save commits step 2; the stale
    listing used to replace the index between the save's adding its step and its publishing, so
    ``latest`` named step 1. Here the listing is held until the save publishes (or 1 s, for a refresh
    that keeps the save from publishing meanwhile), and released just before it does."""
    real_scan = aiockpt._checkpointer.scan_steps
    real_publish = Checkpointer._publish_and_prune
    listed, publishing, returned = threading.Event(), threading.Event(), threading.Event()

    def held_scan(directory: Path) -> list[int]:
        steps = real_scan(directory)
        listed.set()
        publishing.wait(timeout=1.0)
        returned.set()
        return steps

    async def publish(self: Checkpointer) -> None:
        publishing.set()
        await anyio.to_thread.run_sync(returned.wait)
        await anyio.sleep(0.05)  # the refresh task resumes meanwhile
        await real_publish(self)

    async with Checkpointer(root) as ckpt:
        await ckpt.save(state_for(1), step=1)
        monkeypatch.setattr("aiockpt._checkpointer.scan_steps", held_scan)
        monkeypatch.setattr(Checkpointer, "_publish_and_prune", publish)
        async with anyio.create_task_group() as tg:
            tg.start_soon(ckpt.refresh)
            await anyio.to_thread.run_sync(listed.wait)  # its listing holds step 1 only
            await ckpt.save(state_for(2), step=2)
        assert read_text(root / "latest").strip() == step_dir(2)
        assert ckpt.steps() == [1, 2]


async def test_a_root_that_is_a_file_or_is_gone_is_a_storage_error(root: Path) -> None:
    file = root.parent / "a-file"
    write_file(file, b"x")
    with pytest.raises(aiockpt.StorageError, match="a-file") as info:
        await Checkpointer(file).open()
    assert info.value.path == str(file)
    async with Checkpointer(root) as ckpt:
        await ckpt.save(state_for(1), step=1)
        await anyio.to_thread.run_sync(shutil.rmtree, root)
        with pytest.raises(aiockpt.StorageError, match=str(root)):
            await ckpt.refresh()


async def test_metadata_of_a_step_gives_what_it_was_saved_with(tmp_path: Path) -> None:
    async with aiockpt.Checkpointer(tmp_path) as ckpt:
        with pytest.raises(aiockpt.CheckpointNotFoundError, match="no committed checkpoint"):
            await ckpt.metadata()
        for step, loss in ((1, 0.5), (2, 0.25), (3, 0.4)):
            await ckpt.save({"w": torch.full((4,), float(step))}, step=step, metadata={"loss": loss})
        losses = {s: (await ckpt.metadata(s)).user_metadata["loss"] for s in ckpt.steps()}
        assert losses == {1: 0.5, 2: 0.25, 3: 0.4}
        assert (await ckpt.metadata()).step == 3  # the latest
        with pytest.raises(aiockpt.CheckpointNotFoundError):
            await ckpt.metadata(7)
    with aiockpt.sync.Checkpointer(tmp_path) as blocking:
        assert blocking.metadata(2).user_metadata == {"loss": 0.25}
