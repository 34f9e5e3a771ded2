"""Random cancellation stress: many saves to one Checkpointer (``max_inflight=2``), cancelled at random.

Saves mix ``async_op=True`` and ``False``; some are awaited, some left in the background, some cancelled
by ``handle.cancel()`` or by a cancel scope around the caller, all at seeded random moments (the seed is in
every assertion message). Afterwards every committed step must read back bit-exactly, nothing temporary
may remain, file descriptors and threads must be back to where they were, the staging pool must have
stayed within its budget, and the Checkpointer must still save.
"""

from __future__ import annotations

import contextlib
import os
import random
import threading
from dataclasses import dataclass
from pathlib import Path

import anyio
import anyio.to_thread
import pytest
import torch
from conftest import assert_tree_equal, read_text, tmp_entries

from aiockpt import CheckpointCancelledError, Checkpointer, SaveHandle, SaveState

pytestmark = pytest.mark.timeout(240)

MAX_INFLIGHT = 2
# Elements of the float32 tensor of a step: 64 KiB .. 1 MiB, so buffers of different sizes are reused.
SIZES = (16 * 1024, 64 * 1024, 128 * 1024, 256 * 1024)
SMALL = 16
# Bytes a save stages at most (the big tensor, the small one packed before it, the big one page-aligned).
MAX_STAGED = 4 * max(SIZES) + 4096
# Room for one largest save and half of another: buffers of different sizes must be juggled.
BUDGET = MAX_STAGED * 3 // 2
ANYIO_WORKER = "AnyIO worker thread"
KINDS = ("async_awaited", "async_background", "async_handle_cancel", "async_move_on", "sync", "sync_move_on")


def make_state(step: int, numel: int) -> dict[str, object]:
    """Step ``step``'s state: every value derives from the step, so a mix-up between steps shows."""
    return {
        "w": torch.full((numel,), float(step), dtype=torch.float32),
        "b": torch.full((SMALL,), step, dtype=torch.int64),
        "meta": {"step": step, "numel": numel},
    }


def scribble(state: dict[str, object]) -> None:
    """Overwrite the state's tensors, as training would once the save is staged."""
    for key in ("w", "b"):
        t = state[key]
        assert isinstance(t, torch.Tensor)
        t.fill_(-1)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def non_worker_threads() -> set[threading.Thread]:
    """Live threads other than anyio's pooled workers (which idle for ~10 s before they exit)."""
    return {t for t in threading.enumerate() if t.name != ANYIO_WORKER}


@dataclass
class Attempt:
    step: int
    numel: int
    kind: str
    committed: bool | None = None  # None: the caller was cancelled, so only the disk can tell
    handle: SaveHandle | None = None


@dataclass
class Peaks:
    held_bytes: int = 0
    inflight: int = 0


async def _monitor(ckpt: Checkpointer, peaks: Peaks) -> None:
    assert ckpt._slots is not None
    while True:
        peaks.held_bytes = max(peaks.held_bytes, ckpt._pool.held_bytes)
        # Saves holding a slot (``_inflight`` also lists a save whose caller waits for one).
        peaks.inflight = max(peaks.inflight, MAX_INFLIGHT - ckpt._slots.value)
        await anyio.sleep(0.002)


async def _one(ckpt: Checkpointer, attempt: Attempt, rng: random.Random, pending: list[Attempt]) -> None:
    step, kind = attempt.step, attempt.kind
    state = make_state(step, attempt.numel)
    if kind == "sync":
        meta = await ckpt.save(state, step=step)
        assert meta.step == step
        attempt.committed = True
    elif kind == "sync_move_on":
        with anyio.move_on_after(rng.uniform(0, 0.015)):
            await ckpt.save(state, step=step)
            attempt.committed = True
    elif kind == "async_move_on":
        # The cancel scope may hit while staging (the save aborts), or while awaiting the handle (which
        # must not cancel the save: only handle.cancel() does).
        with anyio.move_on_after(rng.uniform(0, 0.015)):
            attempt.handle = await ckpt.save(state, step=step, async_op=True)
            scribble(state)
            await attempt.handle
        pending.append(attempt)
    else:
        attempt.handle = await ckpt.save(state, step=step, async_op=True)
        scribble(state)  # staged: mutating the state must not reach the checkpoint
        if kind == "async_awaited":
            meta = await attempt.handle
            assert meta.step == step
            attempt.committed = True
        elif kind == "async_handle_cancel":
            await anyio.sleep(rng.uniform(0, 0.01))
            attempt.handle.cancel()
            pending.append(attempt)
        else:
            pending.append(attempt)


async def run_stress(root: Path, *, seed: int, saves: int) -> None:
    rng = random.Random(seed)
    where = f"seed {seed}"
    fds = open_fds()
    threads = non_worker_threads()
    peaks = Peaks()
    attempts: list[Attempt] = []
    pending: list[Attempt] = []

    ckpt = Checkpointer(root, max_inflight=MAX_INFLIGHT, staging_budget=BUDGET)
    await ckpt.open()
    async with anyio.create_task_group() as tg:
        tg.start_soon(_monitor, ckpt, peaks)
        for step in range(1, saves + 1):
            attempt = Attempt(step=step, numel=rng.choice(SIZES), kind=rng.choice(KINDS))
            attempts.append(attempt)
            try:
                await _one(ckpt, attempt, rng, pending)
            except Exception as exc:
                pytest.fail(f"{where}: the save of step {step} ({attempt.kind}) raised {exc!r}")
            assert len(ckpt._inflight) <= MAX_INFLIGHT, f"{where}, step {step}: {ckpt._inflight}"
        await ckpt.wait()
        tg.cancel_scope.cancel()

    for a in pending:
        assert a.handle is None or a.handle.done(), f"{where}: step {a.step} ({a.kind}) still running"
        if a.handle is not None:
            state = a.handle.state
            assert state in (SaveState.COMMITTED, SaveState.CANCELLED), (
                f"{where}: step {a.step} ({a.kind}) ended {state.value}: {a.handle._error!r}"
            )
            a.committed = state is SaveState.COMMITTED

    # Every committed step reads back exactly what was saved for it; cancelled ones left nothing.
    on_disk = set(await ckpt.refresh())
    assert on_disk <= {a.step for a in attempts}, f"{where}: unknown steps {on_disk}"
    for a in attempts:
        if a.committed is True:
            assert a.step in on_disk, f"{where}: step {a.step} ({a.kind}) committed but not on disk"
        elif a.committed is False:
            assert a.step not in on_disk, f"{where}: step {a.step} ({a.kind}) cancelled but on disk"
        if a.step in on_disk:
            tree = await ckpt.read(a.step)
            assert_tree_equal(tree, make_state(a.step, a.numel), f"{where}/step {a.step} ({a.kind})")
    assert 0 < len(on_disk) < saves, f"{where}: cancellations should hit both sides ({len(on_disk)} kept)"
    assert tmp_entries(root) == [], f"{where}: temp data with no save in flight"
    assert ckpt._slots is not None
    assert ckpt._slots.value == MAX_INFLIGHT, f"{where}: in-flight slots leaked or doubled"
    assert peaks.inflight <= MAX_INFLIGHT, f"{where}: {peaks.inflight} saves in flight"

    # Still usable: a final save of each kind commits and reads back.
    final = saves + 1
    await ckpt.save(make_state(final, SIZES[-1]), step=final)
    handle = await ckpt.save(make_state(final + 1, SIZES[0]), step=final + 1, async_op=True)
    await handle
    assert_tree_equal(await ckpt.read(final), make_state(final, SIZES[-1]), f"{where}/final")
    assert_tree_equal(await ckpt.read(), make_state(final + 1, SIZES[0]), f"{where}/final+1")

    await ckpt.aclose()
    assert peaks.held_bytes <= BUDGET, f"{where}: the pool kept {peaks.held_bytes:,} > {BUDGET:,} bytes"
    assert ckpt._pool.held_bytes == 0, f"{where}: {ckpt._pool.held_bytes:,} bytes kept after close"
    assert tmp_entries(root) == [], f"{where}: temp data after close"
    assert open_fds() == fds, f"{where}: file descriptors leaked"

    # Threads: nothing of ours outlives close; anyio's idle workers are bounded by its thread limiter.
    for _ in range(100):  # threads that are ending may take a moment to be gone
        if non_worker_threads() <= threads:
            break
        await anyio.sleep(0.05)
    leaked = non_worker_threads() - threads
    assert not leaked, f"{where}: threads leaked: {sorted(t.name for t in leaked)}"
    assert not [t.name for t in threading.enumerate() if t.name.lower().startswith("aiockpt")], where
    limit = anyio.to_thread.current_default_thread_limiter().total_tokens
    assert threading.active_count() <= len(threads) + limit, f"{where}: {threading.active_count()} threads"

    async with Checkpointer(root) as again:
        assert again.steps() == sorted(on_disk | {final, final + 1}), where


async def test_handle_cancel_around_the_commit_point(tmp_path: Path) -> None:
    """A cancelled handle means nothing was published; a committed one that the bookkeeping followed."""
    root = tmp_path / "run"
    seed = 99
    rng = random.Random(seed)
    outcomes: set[SaveState] = set()
    async with Checkpointer(root) as ckpt:
        durations = []
        for step in range(3):  # how long a save takes from staged to committed, buffers warm
            handle = await ckpt.save(make_state(step, SIZES[-1]), step=step, async_op=True)
            t0 = anyio.current_time()
            await handle
            durations.append(anyio.current_time() - t0)
        duration = sorted(durations)[1]
        for step in range(3, 63):
            where = f"seed {seed}, step {step}"
            handle = await ckpt.save(make_state(step, SIZES[-1]), step=step, async_op=True)
            await anyio.sleep(rng.uniform(0.0, 1.2) * duration)  # up to and around the commit
            handle.cancel()
            with contextlib.suppress(CheckpointCancelledError):
                await handle
            outcomes.add(handle.state)
            path = ckpt.path_of(step)
            assert isinstance(path, Path)
            published = path.exists()
            if handle.state is SaveState.CANCELLED:
                assert not published, f"{where}: cancelled, yet {ckpt.path_of(step)} was published"
            else:
                assert handle.state is SaveState.COMMITTED, f"{where}: {handle.state.value}"
                assert published, where
                assert ckpt.latest_step() == step, f"{where}: committed, but steps() = {ckpt.steps()}"
                assert read_text(root / "latest") == f"step-{step:08d}\n", where
            assert tmp_entries(root) == [], where
    assert outcomes == {SaveState.CANCELLED, SaveState.COMMITTED}, f"seed {seed}: only {outcomes}"


async def test_random_cancellation_bounded(tmp_path: Path) -> None:
    await run_stress(tmp_path / "run", seed=20240611, saves=40)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_random_cancellation_full(tmp_path: Path, seed: int) -> None:
    await run_stress(tmp_path / "run", seed=seed, saves=300)
