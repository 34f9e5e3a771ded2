"""Crash safety: a saving process killed at random moments, and a file system that fills up.

A child process saves step after step (mostly ``async_op=True``, with retention) into one root; the test
SIGKILLs it at seeded random moments and restarts it, resuming from the latest step, each time. After
every kill a fresh Checkpointer on the root must see only complete checkpoints, each holding exactly what
its step should, a ``latest`` that names one of them, and no temp directory.
"""

from __future__ import annotations

import errno
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import anyio.abc
import anyio.streams.buffered
import pytest
import torch
from conftest import assert_tree_equal, child_env, listdir, read_text, stderr_of, tmp_entries

import aiockpt
from aiockpt import Checkpointer, StorageError

pytestmark = pytest.mark.timeout(300)

MiB = 1024 * 1024
# float32 elements of step s's tensor: SIZES[s % 4] (64 KiB .. 1 MiB).
SIZES = (16 * 1024, 64 * 1024, 128 * 1024, 256 * 1024)
STEP_DIR = re.compile(r"step-(\d{8})")
# What a killed writer may leave that only ageing makes collectable: a half-written `latest`, and where the
# lock file cannot be made unnamed (no O_TMPFILE + linkat), a lock file under its private name (before its
# rename). A free lock file under its own name (its directory not made yet, or already published) goes at
# once.
LOOSE = re.compile(r"\.tmp-(step-\d{8}-[0-9a-f]{12}\.lock\.[0-9a-f]{32}|latest-[0-9a-f]{32})")

CHILD = """
import asyncio, sys
import torch
import aiockpt

SIZES = {sizes!r}

def expected(step):
    return {{
        "w": torch.full((SIZES[step % 4],), float(step)),
        "i": torch.arange(8, dtype=torch.int64) + step,
        "step": step,
    }}

async def main(root):
    async with aiockpt.Checkpointer(root, max_inflight=2, keep_last=2, keep_every=10) as ckpt:
        step = (ckpt.latest_step() or 0) + 1
        print("ready", step, flush=True)
        while True:
            if step % 5 == 0:
                await ckpt.save(expected(step), step=step)
            else:
                await ckpt.save(expected(step), step=step, async_op=True)
            step += 1

asyncio.run(main(sys.argv[1]))
"""


def expected(step: int) -> dict[str, object]:
    """What step ``step`` holds (the child's ``expected``)."""
    return {
        "w": torch.full((SIZES[step % 4],), float(step)),
        "i": torch.arange(8, dtype=torch.int64) + step,
        "step": step,
    }


async def run_and_kill(script: Path, root: Path, delay: float, where: str) -> str:
    """Start the child, let it save for ``delay`` seconds once ready, SIGKILL it; return its first line."""
    async with await anyio.open_process(
        [sys.executable, str(script), str(root)], stdout=-1, stderr=-1, env=child_env()
    ) as proc:
        assert proc.stdout is not None
        try:
            with anyio.fail_after(60):
                line = await anyio.streams.buffered.BufferedByteReceiveStream(proc.stdout).receive_until(
                    b"\n", 4096
                )
        except anyio.IncompleteRead:
            pytest.fail(f"{where}: the child exited ({await proc.wait()}):\n{await stderr_of(proc)}")
        await anyio.sleep(delay)
        assert proc.returncode is None, f"{where}: the child died on its own:\n{await stderr_of(proc)}"
        proc.kill()
        assert await proc.wait() == -signal.SIGKILL, where
    return line.decode()


def age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then), follow_symlinks=False)


async def verify_after_crash(root: Path, where: str) -> list[int]:
    """Open a Checkpointer on a root whose writer was killed; check everything; return the steps."""
    abandoned = [n for n in tmp_entries(root) if (root / n).is_dir()]
    async with Checkpointer(root) as ckpt:
        leftovers = [root / name for name in tmp_entries(root)]
        dirs = [p.name for p in leftovers if p.is_dir()]
        assert dirs == [], f"{where}: temp directories survived the open: {dirs}"
        strange = [p.name for p in leftovers if not LOOSE.fullmatch(p.name)]
        assert strange == [], f"{where}: unexpected temp files: {strange}"
        locks = [n + ".lock" for n in abandoned if (root / (n + ".lock")).exists()]
        assert locks == [], f"{where}: lock files outlived their directories: {locks}"

        steps = ckpt.steps()
        step_dirs = sorted(int(m.group(1)) for n in listdir(root) if (m := STEP_DIR.fullmatch(n)))
        assert step_dirs == steps, f"{where}: step directories {step_dirs} but committed steps {steps}"
        for step in steps:
            assert_tree_equal(await ckpt.read(step), expected(step), f"{where}/step {step}")
        if (root / "latest").exists():
            text = read_text(root / "latest")
            m = STEP_DIR.fullmatch(text.rstrip("\n"))
            assert m is not None, f"{where}: latest is {text!r}"
            assert text.endswith("\n"), f"{where}: latest is {text!r}"
            assert int(m.group(1)) in steps, f"{where}: latest names {text!r}, not one of {steps}"
        else:
            assert steps == [], f"{where}: steps {steps} but no latest"
    # Loose temp files go once they are old enough that no live writer can be about to rename them.
    for p in leftovers:
        age(p, 3600)
    async with Checkpointer(root):
        pass
    assert tmp_entries(root) == [], f"{where}: aged temp files survived an open"
    return steps


async def crash_trials(tmp_path: Path, *, seed: int, trials: int) -> None:
    rng = random.Random(seed)
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(sizes=SIZES))
    root = tmp_path / "run"
    newest = 0
    for trial in range(trials):
        where = f"seed {seed}, trial {trial}"
        delay = rng.uniform(0.0, 0.4)
        where += f", killed {delay:.3f}s after ready"
        line = await run_and_kill(script, root, delay, where)
        assert line == f"ready {newest + 1}", f"{where}: the child resumed with {line!r}, not {newest + 1}"
        steps = await verify_after_crash(root, where)
        assert not steps or steps[-1] >= newest, f"{where}: steps went backwards: {steps} < {newest}"
        newest = steps[-1] if steps else newest
    # Not vacuous: some kill came after a commit (how many depends on the machine's speed, not checked).
    assert newest > 0, f"seed {seed}: no step committed in {trials} trials"


async def test_killed_writer_bounded(tmp_path: Path) -> None:
    await crash_trials(tmp_path, seed=7, trials=6)


@pytest.mark.slow
async def test_killed_writer_full(tmp_path: Path) -> None:
    await crash_trials(tmp_path, seed=1234, trials=50)


# --- A full disk ----------------------------------------------------------------------------------------


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB tmpfs mounted for the test (needs root; skipped where mounting is not allowed)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a 16 MiB tmpfs needs root")
    if shutil.which("mount") is None or shutil.which("umount") is None:
        pytest.skip("mount/umount are not installed")
    mnt = tmp_path / "small"
    mnt.mkdir()
    cmd = ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs ({' '.join(cmd)}): {done.stderr.strip() or done.returncode}")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], check=False)


def assert_disk_full(exc: StorageError, root: Path) -> None:
    cause = exc.__cause__
    assert isinstance(cause, OSError), f"cause {cause!r}"
    assert cause.errno == errno.ENOSPC, f"cause {cause!r}"
    assert exc.path is not None
    assert exc.path.startswith(str(root)), f"path {exc.path!r}"
    assert exc.path in str(exc), f"the message does not name {exc.path}: {exc}"


async def test_disk_full_fails_cleanly_and_saving_goes_on(small_fs: Path) -> None:
    root = small_fs / "run"
    small = {"w": torch.full((256 * 1024,), 1.0)}  # 1 MiB
    big = {"w": torch.full((6 * MiB,), 2.0)}  # 24 MiB: more than the file system holds
    async with Checkpointer(root, max_inflight=2) as ckpt:
        await ckpt.save(small, step=1)

        with pytest.raises(StorageError) as info:
            await ckpt.save(big, step=2)
        assert_disk_full(info.value, root)
        assert "data-r00000.bin" in str(info.value), info.value
        assert tmp_entries(root) == []
        assert ckpt.steps() == [1]

        handle = await ckpt.save(big, step=3, async_op=True)  # staged in memory; the write fails
        with pytest.raises(StorageError) as info:
            await handle
        assert_disk_full(info.value, root)
        assert handle.state is aiockpt.SaveState.FAILED
        assert tmp_entries(root) == []
        assert ckpt.steps() == [1]

        assert_tree_equal(await ckpt.read(1), small)
        assert read_text(root / "latest") == "step-00000001\n"
        for step in (4, 5):  # the loop goes on
            await ckpt.save({"w": torch.full((256 * 1024,), float(step))}, step=step)
        assert ckpt.steps() == [1, 4, 5]
    async with Checkpointer(root) as again:
        assert again.steps() == [1, 4, 5]
        assert_tree_equal(await again.read(5), {"w": torch.full((256 * 1024,), 5.0)})
    assert tmp_entries(root) == []


async def test_disk_full_at_the_commit_publishes_nothing(small_fs: Path) -> None:
    root = small_fs / "run"
    async with Checkpointer(root) as ckpt:
        await ckpt.save({"w": torch.full((1024,), 1.0)}, step=1)
        # Fill the file system so that the data file of the next save fits exactly, its manifest not.
        stat = os.statvfs(small_fs)
        free = stat.f_bavail * stat.f_frsize
        data = 1 * MiB
        fd = os.open(small_fs / "filler", os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.posix_fallocate(fd, 0, free - data)
        finally:
            os.close(fd)
        with pytest.raises(StorageError) as info:
            await ckpt.save({"w": torch.full((data // 4,), 2.0)}, step=2)
        assert_disk_full(info.value, root)
        assert "cannot publish" in str(info.value), info.value
        assert tmp_entries(root) == []
        assert listdir(root) == ["latest", "step-00000001"]
        assert ckpt.steps() == [1]
        os.unlink(small_fs / "filler")
        await ckpt.save({"w": torch.full((data // 4,), 2.0)}, step=2)
        assert ckpt.steps() == [1, 2]
        assert_tree_equal(await ckpt.read(), {"w": torch.full((data // 4,), 2.0)})


@pytest.mark.parametrize("to", ["torch", "dcp"])
async def test_a_conversion_onto_a_full_disk_is_a_storage_error(
    small_fs: Path, tmp_path: Path, to: str
) -> None:
    """torch.save and dcp.save turn the OSError of a full disk into a RuntimeError ("unexpected pos
    ..."), which convert took for a value the target refuses: a StateError blaming the source."""
    src = tmp_path / "src"
    await aiockpt.save({"w": torch.ones(6 * MiB)}, src)  # 24 MiB: more than the file system holds
    with pytest.raises(StorageError) as info:
        await aiockpt.convert(src, small_fs / "out", to=to)  # type: ignore[arg-type]
    cause = info.value.__cause__
    assert isinstance(cause, OSError), f"cause {cause!r}"
    assert cause.errno == errno.ENOSPC, f"cause {cause!r}"
    assert listdir(small_fs) == []
