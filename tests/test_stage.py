"""Stage 1: copying a state into staging memory (``async_op=True``)."""

from __future__ import annotations

import gc
import os
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import cast

import pytest
import torch
from conftest import assert_tree_equal, snapshot

import aiockpt
import aiockpt.sync
from aiockpt._memory import StagingPool
from aiockpt._options import IOConfig
from aiockpt._save import _stage
from aiockpt._threads import each_in_thread, responsive

pytestmark = pytest.mark.timeout(60)


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_large_copies_are_cut_into_pieces_over_threads(monkeypatch: pytest.MonkeyPatch, threads: int) -> None:
    # Pieces of 4 KiB, tensors of sizes that are not multiples of it: every byte lands once, in place.
    monkeypatch.setattr(_stage, "_PIECE", 4096)
    gen = torch.Generator().manual_seed(threads)
    sources = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen) for n in (1, 4095, 4097, 40_000)]
    buffer = torch.zeros(sum(len(s) for s in sources) + 64, dtype=torch.uint8)
    jobs, at = [], 7  # an unaligned start, as no real layout has, to catch an offset error
    for s in sources:
        jobs.append((buffer.data_ptr() + at, s.data_ptr(), len(s)))
        at += len(s)
    _stage._copy_large(jobs, threads)
    assert torch.equal(buffer[7:at], torch.cat(sources))
    assert not buffer[:7].any()
    assert not buffer[at:].any()


def test_pieces_are_split_over_threads_in_lanes_of_equal_bytes_not_equal_counts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # One long piece, then eight short ones: two lanes of five and four pieces would hold 12 and 4 bytes.
    lanes: list[list[int]] = []

    def record(works: Sequence[Callable[[], None]]) -> None:
        for work in works:
            lanes.append([n for _, n in cast("partial[None]", work).args[0]])
            work()

    monkeypatch.setattr(_stage, "each_in_thread", record)
    done: list[int] = []
    pieces = [(partial(done.append, i), n) for i, n in enumerate([8] + [1] * 8)]
    _stage._over_threads(pieces, 2)
    assert [sum(lane) for lane in lanes] == [8, 8]
    assert done == list(range(9))  # every piece once, in order


def test_work_split_over_threads_runs_at_the_saves_priority_and_reports_failures() -> None:
    seen: list[tuple[int, int]] = []

    def work() -> None:
        seen.append((threading.get_native_id(), _nice()))

    caller = _nice()
    with responsive(IOConfig(worker_nice=5), lowered=True):  # as during a save
        each_in_thread([work, work])
    each_in_thread([work])  # outside a save: in the calling thread
    if sys.platform == "linux":
        assert [n for _, n in seen] == [min(caller + 5, 19)] * 2 + [caller]
        assert len({tid for tid, _ in seen[:2]}) == 2
    assert seen[2][0] == threading.get_native_id()

    def failing() -> None:
        raise ValueError("piece 3")

    with pytest.raises(ValueError, match="piece 3"):
        each_in_thread([work, failing, work])


async def test_every_save_copies_large_tensors_over_as_many_threads_as_torch_uses_up_to_four(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The first save copies into its new staging buffer, the next one into the same buffer reused: both
    # over the same threads (first-touch faults did not make one thread the better choice, see _copy_threads).
    calls: list[int] = []
    real = _stage._copy_large

    def spy(jobs: list[tuple[int, int, int]], threads: int) -> None:
        calls.append(threads)
        real(jobs, threads)

    monkeypatch.setattr(_stage, "_copy_large", spy)
    state: dict[str, object] = {"w": torch.randn(1 << 20), "b": torch.randn(10)}  # 4 MiB: copied in pieces
    expected = snapshot(state)
    async with aiockpt.Checkpointer(root) as ckpt:
        for step in (1, 2):
            handle = await ckpt.save(state, step=step, async_op=True)
            with torch.no_grad():
                state["w"].add_(1)  # type: ignore[attr-defined]
            await handle
        assert_tree_equal(await ckpt.read(1), expected)
    assert calls == [max(1, min(4, torch.get_num_threads()))] * 2


def _small_tensors(gen: torch.Generator) -> list[torch.Tensor]:
    """Small tensors of several dtypes and layouts (0-d, non-contiguous, lazy conjugate) on the CPU."""
    return [
        torch.randn(3, 5, generator=gen),
        torch.randint(0, 2, (7,), generator=gen).bool(),
        torch.tensor(2.5, dtype=torch.bfloat16),
        torch.randn(6, 4, generator=gen, dtype=torch.float64).t(),
        torch.randn(4, generator=gen, dtype=torch.complex64).conj(),
        torch.randint(-100, 100, (9, 3), generator=gen, dtype=torch.int16)[::2],
    ]


def _packed(tensors: list[torch.Tensor], at: int) -> tuple[list[int], dict[int, int], torch.Tensor]:
    """Indices, back-to-back offsets from ``at`` (odd sizes included) and a zeroed buffer for ``tensors``."""
    offsets, pos = {}, at
    for i, t in enumerate(tensors):
        offsets[i] = pos
        pos += t.nbytes
    return list(range(len(tensors))), offsets, torch.zeros(pos + 16, dtype=torch.uint8)


def _expected_bytes(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.resolve_conj().contiguous().reshape(-1).view(torch.uint8) for t in tensors])


@pytest.mark.parametrize("limit", [512 << 10, 64, 1])
def test_small_device_tensors_are_gathered_in_groups_and_copied_out_once_per_group(
    monkeypatch: pytest.MonkeyPatch, limit: int
) -> None:
    # Device-agnostic code, run on CPU tensors: each group is one torch.cat and one copy into the buffer;
    # a group closes before the tensor that would take it past _GATHER bytes (but always takes one).
    monkeypatch.setattr(_stage, "_GATHER", limit)
    tensors = _small_tensors(torch.Generator().manual_seed(3))
    cats: list[int] = []
    real_cat = torch.cat

    def counting_cat(group: list[torch.Tensor]) -> torch.Tensor:
        cats.append(sum(t.numel() for t in group))
        return real_cat(group)

    monkeypatch.setattr(torch, "cat", counting_cat)
    gathered, offsets, buffer = _packed(tensors, at=3)
    _stage._copy_gathered(tensors, gathered, offsets, buffer)
    monkeypatch.setattr(torch, "cat", real_cat)
    end = 3 + sum(t.nbytes for t in tensors)
    assert torch.equal(buffer[3:end], _expected_bytes(tensors))
    assert not buffer[:3].any()
    assert not buffer[end:].any()
    sizes = [t.nbytes for t in tensors]
    assert sizes == [60, 7, 2, 192, 32, 30]
    assert cats == {512 << 10: [sum(sizes)], 64: [60, 7 + 2, 192, 32 + 30], 1: sizes}[limit]


def test_gathering_falls_back_to_one_copy_per_tensor_when_the_device_is_out_of_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def out_of_memory(group: list[torch.Tensor]) -> torch.Tensor:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 MiB")

    monkeypatch.setattr(torch, "cat", out_of_memory)
    tensors = _small_tensors(torch.Generator().manual_seed(4))
    gathered, offsets, buffer = _packed(tensors, at=1)
    _stage._copy_gathered(tensors, gathered, offsets, buffer)
    monkeypatch.undo()
    assert torch.equal(buffer[1 : 1 + sum(t.nbytes for t in tensors)], _expected_bytes(tensors))


def test_small_gpu_tensors_are_laid_out_packed_each_devices_together_and_large_ones_aligned(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # plan_stage only reads devices and sizes: CPU tensors stand in for GPU ones by their is_cuda/device.
    class FakeGpu(torch.Tensor):
        fake_index = 0

        @property
        def is_cuda(self) -> bool:  # type: ignore[override]
            return True

        @property
        def is_cpu(self) -> bool:  # type: ignore[override]
            return False

        @property
        def device(self) -> torch.device:  # type: ignore[override]
            return torch.device("cuda", self.fake_index)

    def gpu(n: int, index: int) -> torch.Tensor:
        t = torch.zeros(n, dtype=torch.uint8).as_subclass(FakeGpu)
        t.fake_index = index
        return t

    monkeypatch.setattr(_stage, "cuda_devices", lambda ts: {t.device for t in ts})
    cpu = torch.zeros(3, dtype=torch.uint8)
    state = {"a": gpu(5, 1), "b": cpu, "c": gpu(7, 0), "d": gpu(70_000, 0), "e": gpu(9, 1)}
    layout = _stage.plan_stage(state, copy=True, allow_pickle=False)
    key = {id(t): k for k, t in state.items()}

    def names(indices: list[int]) -> list[str]:
        return [key[id(layout.flat.tensors[i])] for i in indices]

    assert names(layout.small) == ["b"]
    assert names(layout.gathered) == ["c", "a", "e"]  # device 0 first, then device 1 in state order
    assert names(layout.large) == ["d"]
    at = {key[id(layout.flat.tensors[i])]: off for i, off in layout.offsets.items()}
    assert at == {"b": 0, "c": 3, "a": 10, "e": 15, "d": 4096}  # large ones page-aligned (O_DIRECT)
    assert layout.total == 4096 + 70_000
    assert layout.devices == {torch.device("cuda", 0), torch.device("cuda", 1)}


@pytest.mark.parametrize(("key", "size"), [("small", 2000), ("small", 10), ("large", 100_000), ("large", 10)])
async def test_a_tensor_resized_while_its_save_waits_for_staging_memory_is_refused_by_key(
    key: str, size: int
) -> None:
    """Between laying out the buffer and copying, a save may wait for staging memory while other tasks
    run: the copy took the tensor's size then, and a grown one was copied past its place in the buffer."""
    state = {"small": torch.ones(1000), "large": torch.ones(50_000)}
    layout = _stage.plan_stage(state, copy=True, allow_pickle=False)
    state[key].resize_(size)
    pool = StagingPool(budget=None)
    claim = await pool.claim(layout.total, pinned=False)
    with pytest.raises(aiockpt.StateError, match=f"'{key}' changed from") as caught:
        _stage.copy_stage(layout, pool, claim)
    assert caught.value.key == key
    assert pool.forget(claim) == []  # refused before the buffer was taken
    assert pool.in_use_bytes == 0


def _freed_in(buffers: list[torch.Tensor]) -> list[int]:
    """Filled with the thread id that drops each of ``buffers`` last."""
    seen: list[int] = []
    for b in buffers:
        weakref.finalize(b, lambda: seen.append(threading.get_ident()))
    return seen


async def test_a_claim_given_up_before_its_copy_keeps_its_buffer_and_frees_the_evicted_off_the_loop() -> None:
    pool = StagingPool(budget=100)
    kept = [await pool.claim(60, pinned=False), await pool.claim(30, pinned=False)]
    for claim in kept:
        pool.release(pool.take(claim))
    assert pool.held_bytes == 90

    reusing = await pool.claim(25, pinned=False)  # reuses the 30-byte buffer
    assert pool.forget(reusing) == []
    assert pool.held_bytes == 90, "the buffer it would have reused is kept again"
    assert pool.in_use_bytes == 0

    evicting = await pool.claim(70, pinned=False)  # drops both kept buffers: neither can hold 70 bytes
    assert sorted(b.numel() for b in evicting.evicted) == [30, 60]
    freed = _freed_in(evicting.evicted)
    dropped = pool.forget(evicting)
    assert sorted(b.numel() for b in dropped) == [30, 60], "not kept again: the budget no longer counts them"
    assert pool.held_bytes == 0
    assert pool.in_use_bytes == 0
    assert pool.forget(evicting) == [], "forgetting twice gives nothing back twice"
    del dropped
    gc.collect()
    assert freed == [threading.get_ident()] * 2  # here: the test dropped them itself

    pool.release(pool.take(await pool.claim(30, pinned=False)))
    closing = await pool.claim(30, pinned=False)  # reuses it
    pool.close()
    assert [b.numel() for b in pool.forget(closing)] == [30], "a closed pool keeps nothing"
    assert pool.in_use_bytes == 0


@pytest.mark.parametrize("budget", [None, 4 << 20])
async def test_a_state_that_grows_every_save_keeps_one_staging_buffer_not_one_per_save(
    root: Path, budget: int | None
) -> None:
    """A kept buffer too small for the next save was kept beside the new one: without a budget, a state
    growing by 4 KiB per save kept one more buffer each time (20 saves of 1 MiB kept 20.8 MiB)."""
    async with aiockpt.Checkpointer(root, staging_budget=budget, keep_last=2) as ckpt:
        for step in range(1, 11):
            state = {"w": torch.ones((1 << 18) + 1024 * step)}  # 1 MiB + 4 KiB per step
            await (await ckpt.save(state, step=step, async_op=True))
            assert len(ckpt._pool._free) == 1, step
            assert ckpt._pool.held_bytes == state["w"].nbytes
        await (await ckpt.save({"w": torch.ones(1000)}, step=11, async_op=True))  # a smaller one reuses it
        assert ckpt._pool.held_bytes == state["w"].nbytes


async def test_a_save_given_up_before_its_copy_frees_what_its_claim_evicted_in_a_worker_thread(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with aiockpt.Checkpointer(root, staging_budget=1 << 20) as ckpt:
        small = {"w": torch.randn(1 << 16)}  # 256 KiB, kept after its save
        await (await ckpt.save(small, step=1, async_op=True))
        (kept,) = ckpt._pool._free
        freed = _freed_in([kept])
        del kept

        async def fail_before_copying(fn: object, limiter: object = None) -> object:
            raise RuntimeError("given up before the copy")

        monkeypatch.setattr(_stage, "acquire_sync", fail_before_copying)
        with pytest.raises(RuntimeError, match="given up before the copy"):
            await ckpt.save({"w": torch.randn(200_000)}, step=2, async_op=True)  # 800 KB: evicts it
        gc.collect()
        assert len(freed) == 1
        assert freed[0] != threading.get_ident(), "freed off the event loop's thread"
        assert ckpt._pool.in_use_bytes == 0


@pytest.mark.parametrize("threads", [1, 3])
def test_touching_a_buffer_writes_every_byte_of_it(monkeypatch: pytest.MonkeyPatch, threads: int) -> None:
    monkeypatch.setattr(_stage, "_PIECE", 4096)
    buffer = torch.randint(1, 256, (3 * 4096 + 5,), dtype=torch.uint8)
    _stage._touch(buffer, threads)
    assert not buffer.any()


async def test_reserve_allocates_and_keeps_the_buffer_the_next_async_save_copies_into(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    touched: list[int] = []
    real_touch = _stage._touch

    def spy(buffer: torch.Tensor, threads: int) -> None:
        touched.append(buffer.numel())
        real_touch(buffer, threads)

    monkeypatch.setattr(_stage, "_touch", spy)
    state: dict[str, object] = {"w": torch.randn(1 << 18), "b": torch.randn(7), "step": 3}
    expected = snapshot(state)
    total = _stage.plan_stage(state, copy=True, allow_pickle=False).total
    async with aiockpt.Checkpointer(root) as ckpt:
        assert await ckpt.reserve(state) == total
        (buffer,) = ckpt._pool._free
        assert buffer.numel() == total
        assert touched == [total], "a new buffer's pages are written once, ahead"
        assert await ckpt.reserve(state) == total
        assert ckpt._pool._free == [buffer], "a kept buffer that fits is not allocated again"
        assert touched == [total]

        handle = await ckpt.save(state, step=1, async_op=True)
        with torch.no_grad():
            state["w"].add_(1)  # type: ignore[attr-defined]
        await handle
        assert ckpt._pool._free == [buffer], "the save copied into the reserved buffer"
        assert_tree_equal(await ckpt.read(1), expected)
        assert await ckpt.reserve({"n": 1, "empty": torch.empty(0)}) == 0, "nothing to stage"
    with pytest.raises(aiockpt.CheckpointError, match="closed"):
        await ckpt.reserve(state)


async def test_reserve_refuses_what_the_budget_cannot_hold_and_what_cannot_be_saved(root: Path) -> None:
    async with aiockpt.Checkpointer(root, staging_budget=1 << 20) as ckpt:
        with pytest.raises(aiockpt.BusyError, match="staging budget"):
            await ckpt.reserve({"w": torch.randn(1 << 19)})  # 2 MiB
        with pytest.raises(aiockpt.StateError, match="opaque"):
            await ckpt.reserve({"opaque": object()})
        assert ckpt._pool.held_bytes == 0
        assert ckpt._pool.in_use_bytes == 0


def test_the_blocking_facade_reserves_too(root: Path) -> None:
    state = {"w": torch.randn(1000)}
    with aiockpt.sync.Checkpointer(root) as ckpt:
        assert ckpt.reserve(state) == 4000
        ckpt.save(state, step=1, async_op=True).result()
        assert ckpt.steps() == [1]
