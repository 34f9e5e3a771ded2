"""Collective-free mode (``use_collectives=False``): temp parts of crashed ranks, and ``latest``.

The ranks of a job are played by Checkpointers of this process given their part by hand, as
``torch.distributed`` would give it, and a rank that dies or is still writing by a child process that
saves its part of a step and stops between writing its data and committing it (killed there, or
left running while the test looks).
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import anyio.abc
import anyio.streams.buffered
import pytest
import torch
from conftest import child_env, listdir, read_text, stderr_of, tmp_entries

import aiockpt
from aiockpt import Checkpointer

pytestmark = pytest.mark.timeout(180)

PART1 = "rank-00001-of-00002"

# Rank 1 of a job of 2 saves its part of step argv[2]; once the part's data is written (its temp dir and
# owner lock made, the bytes fsynced) it says so and waits there, before the commit, until killed.
CHILD = """
import asyncio, sys
import torch
import aiockpt, aiockpt._checkpointer, aiockpt._save

real_write = aiockpt._save.write

async def write(*args, **kwargs):
    result = await real_write(*args, **kwargs)
    print("written", flush=True)
    await asyncio.Event().wait()
    return result

aiockpt._save.write = write
aiockpt._checkpointer.part_of = lambda group: (1, 2)

async def main(root, step):
    async with aiockpt.Checkpointer(root, use_collectives=False) as ckpt:
        await ckpt.save({"w": torch.ones(1 << 10), "step": step}, step=step)

asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""


def step_dir(step: int) -> str:
    return f"step-{step:08d}"


def state_for(rank: int, step: int) -> dict[str, object]:
    return {"w": torch.full((1 << 10,), float(rank)), "step": step}


@contextlib.asynccontextmanager
async def rank(
    root: Path, r: int, world: int = 2, *, keep_last: int | None = None, max_inflight: int = 1
) -> AsyncIterator[Checkpointer]:
    """A collective-free Checkpointer on ``root`` saving the parts of rank ``r`` of ``world``."""
    async with Checkpointer(
        root, use_collectives=False, keep_last=keep_last, max_inflight=max_inflight
    ) as ckpt:
        ckpt._part = (r, world)  # (what part_of says in a job)
        yield ckpt


@contextlib.asynccontextmanager
async def rank_1_writing(tmp_path: Path, root: Path, step: int) -> AsyncIterator[anyio.abc.Process]:
    """Rank 1 in another process, stopped with its part of ``step`` written but not committed."""
    script = tmp_path / "rank1.py"
    script.write_text(CHILD)
    async with await anyio.open_process(
        [sys.executable, str(script), str(root), str(step)], stdout=-1, stderr=-1, env=child_env()
    ) as proc:
        assert proc.stdout is not None
        try:
            with anyio.fail_after(120):
                line = await anyio.streams.buffered.BufferedByteReceiveStream(proc.stdout).receive_until(
                    b"\n", 4096
                )
        except anyio.IncompleteRead:
            pytest.fail(f"the child exited ({await proc.wait()}):\n{await stderr_of(proc)}")
        assert line == b"written"
        try:
            yield proc
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


async def kill(proc: anyio.abc.Process) -> None:
    proc.kill()
    assert await proc.wait() == -signal.SIGKILL


def temp_parts(step: Path) -> list[str]:
    """The temp dirs of the parts being written in (or abandoned in) step directory ``step``."""
    return [n for n in tmp_entries(step) if (step / n).is_dir()]


def prune(root: Path, *args: str) -> dict[str, object]:
    """``aiockpt prune --json ROOT --keep-last 5 ARGS``'s report."""
    r = subprocess.run(
        [sys.executable, "-m", "aiockpt", "prune", "--json", str(root), "--keep-last", "5", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=child_env(),
        check=False,
    )
    assert r.returncode == 0, r.stderr
    report: dict[str, object] = json.loads(r.stdout)
    return report


# --- Temp parts of ranks killed mid-save ----------------------------------------------------------------


async def test_open_collects_the_temp_part_of_a_killed_rank_but_not_of_a_live_one(tmp_path: Path) -> None:
    # Rank 1 was killed with its part of step 5 written but not committed: its temp dir (and owner lock)
    # stayed inside step-00000005 for good, as opening a Checkpointer only cleaned the root.
    root = tmp_path / "root"
    step = root / step_dir(5)
    async with rank(root, 0) as r0:
        await r0.save(state_for(0, 5), step=5)
    async with rank_1_writing(tmp_path, root, 5) as proc:
        (tmp,) = temp_parts(step)
        assert tmp.startswith(f".tmp-{PART1}-")
        assert (step / f"{tmp}.lock").exists()
        # A live writer's temp part is left alone, by every rank's open (each collects in this mode).
        async with Checkpointer(root), rank(root, 0):
            pass
        assert tmp_entries(step) == [tmp, f"{tmp}.lock"]
        await kill(proc)
    assert tmp_entries(step) == [tmp, f"{tmp}.lock"]  # nothing goes by itself
    async with Checkpointer(root) as ckpt:
        assert tmp_entries(step) == []
        assert listdir(step) == ["rank-00000-of-00002"]  # rank 0's part stays; the step is incomplete
        assert ckpt.steps() == []
    # Rank 1, restarted, saves its part again and completes the step.
    async with rank(root, 1) as r1:
        await r1.save(state_for(1, 5), step=5)
        assert r1.steps() == [5]
        assert (await r1.read())["step"] == 5
    assert read_text(root / "latest").strip() == step_dir(5)


async def test_prune_removes_the_temp_part_of_a_killed_rank_but_not_of_a_live_one(tmp_path: Path) -> None:
    root = tmp_path / "root"
    step = root / step_dir(5)
    async with rank(root, 0) as r0:
        await r0.save(state_for(0, 5), step=5)
    async with rank_1_writing(tmp_path, root, 5) as proc:
        (tmp,) = temp_parts(step)
        report = await anyio.to_thread.run_sync(prune, root)
        assert report["removed_temp"] == []
        assert temp_parts(step) == [tmp]
        await kill(proc)
    dry = await anyio.to_thread.run_sync(prune, root, "--dry-run")
    assert dry["removed_temp"] == [f"{step_dir(5)}/{tmp}"]
    assert temp_parts(step) == [tmp]
    real = await anyio.to_thread.run_sync(prune, root)
    assert real["removed_temp"] == [f"{step_dir(5)}/{tmp}"]
    assert listdir(step) == ["rank-00000-of-00002"]


# --- `latest` ----------------------------------------------------------------------------------------------


async def test_latest_never_moves_back_to_a_step_a_slower_rank_completes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Rank 0 completes step 9, but updates `latest` only after rank 1 completed step 10 and pointed
    # `latest` at it: rank 0, from its own index (where step 10 is not), pointed it back at step 9.
    root = tmp_path / "root"
    async with rank(root, 0, max_inflight=2) as r0, rank(root, 1) as r1:
        reached, go = anyio.Event(), anyio.Event()
        after_commit = r0._after_commit

        async def late(step: int, newest: int | None = None) -> None:
            if step == 9:
                reached.set()
                await go.wait()
            await after_commit(step, newest)

        monkeypatch.setattr(r0, "_after_commit", late)
        await r1.save(state_for(1, 9), step=9)
        handle = await r0.save(state_for(0, 9), step=9, async_op=True)  # completes step 9 ...
        await reached.wait()  # ... and is late to update `latest`
        await r0.save(state_for(0, 10), step=10)
        await r1.save(state_for(1, 10), step=10)  # completes step 10
        assert read_text(root / "latest").strip() == step_dir(10)
        go.set()
        await handle
        assert read_text(root / "latest").strip() == step_dir(10)
        assert r0.steps() == [9]
        await r0.refresh()
        assert r0.latest_step() == 10
    assert read_text(root / "latest").strip() == step_dir(10)


async def test_latest_naming_a_step_that_is_gone_is_replaced(tmp_path: Path) -> None:
    root = tmp_path / "root"
    async with rank(root, 0) as r0, rank(root, 1) as r1:
        for s in (3, 4):
            await r0.save(state_for(0, s), step=s)
            await r1.save(state_for(1, s), step=s)
        assert read_text(root / "latest").strip() == step_dir(4)
        (root / "latest").write_text(step_dir(7) + "\n")  # a step removed by hand
        await r0.save(state_for(0, 5), step=5)
        await r1.save(state_for(1, 5), step=5)
        assert read_text(root / "latest").strip() == step_dir(5)


async def test_ranks_taking_turns_keep_latest_on_the_newest_step_and_the_root_lists_cleanly(
    tmp_path: Path,
) -> None:
    # The ranks take turns completing steps, each updating `latest` and pruning; `latest` always names
    # the newest step, which stays, and `aiockpt ls` finds nothing odd in the root (its lock file aside).
    root = tmp_path / "root"
    async with rank(root, 0, keep_last=1) as r0, rank(root, 1, keep_last=1) as r1:
        for s in range(1, 7):
            first, last = (0, 1) if s % 2 else (1, 0)
            await (r0, r1)[first].save(state_for(first, s), step=s)
            await (r0, r1)[last].save(state_for(last, s), step=s)
            assert read_text(root / "latest").strip() == step_dir(s)
            assert step_dir(s) in listdir(root)
        await r0.wait()
        await r1.wait()
    assert [n for n in listdir(root) if n.startswith(".")] == [".latest.lock"]
    r = await anyio.to_thread.run_sync(
        lambda: subprocess.run(
            [sys.executable, "-m", "aiockpt", "ls", "--json", str(root)],
            capture_output=True,
            text=True,
            timeout=120,
            env=child_env(),
            check=False,
        )
    )
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["other"] == []
    assert all(row["committed"] and row["problem"] is None for row in doc["steps"])
    assert [row["step"] for row in doc["steps"] if row["latest"]] == [6]
    assert doc["latest"] == step_dir(6)


async def test_read_metadata_of_a_part_set_describes_the_merge(tmp_path: Path) -> None:
    root = tmp_path / "root"
    async with rank(root, 0) as r0, rank(root, 1) as r1:
        await r0.save(state_for(0, 2), step=2, metadata={"loss": 0.5})
        with pytest.raises(aiockpt.CheckpointNotFoundError, match="parts"):  # one part of two
            await aiockpt.read_metadata(root / step_dir(2))
        await r1.save(state_for(1, 2), step=2, metadata={"loss": 0.5})
    meta = await aiockpt.read_metadata(root / step_dir(2))
    assert (meta.step, meta.world_size, meta.manifest_crc32c) == (2, 2, 0)
    assert meta.user_metadata == {"loss": 0.5}
    assert meta.num_tensors == 2  # each rank's own "w" (their values differ)
