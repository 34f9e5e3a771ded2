"""Stage 1: copying a state into staging memory (``async_op=True``)."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest
import torch
from conftest import assert_tree_equal, snapshot

import aiockpt
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
