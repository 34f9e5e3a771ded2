"""Loads and verifications through O_DIRECT and bounce buffers (by default of cold data) lose nothing."""

from __future__ import annotations

import errno
import mmap
import os
import threading
import time
from pathlib import Path

import anyio
import pytest
import torch
from conftest import assert_tree_equal, cancelled_once, evict, flip_byte, resident_pages

import aiockpt
from aiockpt import CorruptionError, IOConfig, StorageError, _memory
from aiockpt._load import _direct
from aiockpt._load._manifest import read_manifest
from aiockpt._runs import RUN_BYTES, Run
from aiockpt._tree import render

pytestmark = pytest.mark.timeout(60)

DATA = "data-r00000.bin"
DIRECT = IOConfig(direct_reads=True, threads=3, checksum_block=1 << 16)


@pytest.fixture(autouse=True)
def _needs_o_direct(tmp_path: Path) -> None:
    """These tests are about the O_DIRECT path: skip where the temporary file system refuses it."""
    probe = tmp_path / "probe"
    probe.write_bytes(b"x")
    try:
        os.close(os.open(probe, os.O_RDONLY | getattr(os, "O_DIRECT", 0)))
    except (OSError, AttributeError):
        pytest.skip("O_DIRECT is not supported on the temporary directory's file system")
    if not getattr(os, "O_DIRECT", 0):
        pytest.skip("this platform has no O_DIRECT")


def mixed_state() -> dict[str, object]:
    gen = torch.Generator().manual_seed(3)
    return {
        # Several checksum blocks, spread over runs and reader lanes.
        "big": torch.randn(300_001, generator=gen),
        "bf16": torch.randn(513, 129, generator=gen).to(torch.bfloat16),
        # Small tensors packed at unaligned file offsets, one ending the file at an unaligned size.
        "small": {f"s{i}": torch.randn(i + 1, generator=gen) for i in range(40)},
        "ints": torch.arange(1001, dtype=torch.int64),
        "step": 7,
    }


def zeros_like_tree(tree: dict[str, object]) -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out[key] = zeros_like_tree(value)
        elif isinstance(value, torch.Tensor):
            out[key] = torch.zeros_like(value)
        else:
            out[key] = 0
    return out


async def test_direct_load_and_read_match_the_saved_state(ckpt_path: Path) -> None:
    state = mixed_state()
    await aiockpt.save(state, ckpt_path, io=IOConfig(checksum_block=1 << 16))
    assert (ckpt_path / DATA).stat().st_size % 4096, "the data file should end at an unaligned size"
    target = zeros_like_tree(state)
    await aiockpt.load(target, ckpt_path, io=DIRECT)
    assert_tree_equal(target, state)
    assert_tree_equal(await aiockpt.read(ckpt_path, io=DIRECT), state)


async def test_direct_load_into_non_contiguous_targets(ckpt_path: Path) -> None:
    state = {"m": torch.randn(64, 96), "v": torch.randn(1000)}
    await aiockpt.save(state, ckpt_path)
    transposed = torch.zeros(96, 64).t()
    target: dict[str, object] = {"m": transposed, "v": torch.zeros(2000)[::2]}
    await aiockpt.load(target, ckpt_path, io=DIRECT)
    assert target["m"] is transposed
    assert_tree_equal(target, state)


async def test_a_damaged_block_is_reported_and_never_copied_into_the_target(ckpt_path: Path) -> None:
    state = {"weights": torch.full((4096,), 1.5), "other": torch.full((4096,), 2.5)}
    await aiockpt.save(state, ckpt_path)
    data = ckpt_path / DATA
    needle = state["weights"].numpy().tobytes()
    offset = data.read_bytes().find(needle)
    assert offset >= 0
    flip_byte(data, offset + 100)
    target: dict[str, object] = {"weights": torch.zeros(4096), "other": torch.zeros(4096)}
    with pytest.raises(CorruptionError) as info:
        await aiockpt.load(target, ckpt_path, io=IOConfig(direct_reads=True, threads=1))
    assert info.value.key == "weights"
    assert info.value.file is not None
    assert Path(info.value.file).name == DATA
    # Blocks are verified in the bounce buffer before they are copied: the damaged one never lands.
    assert torch.count_nonzero(torch.as_tensor(target["weights"])) == 0


@pytest.mark.parametrize("keep", [0.0, 0.5, 0.999])
async def test_a_truncated_data_file_is_a_corruption_error(keep: float, ckpt_path: Path) -> None:
    await aiockpt.save(mixed_state(), ckpt_path, io=IOConfig(checksum_block=1 << 16))
    data = ckpt_path / DATA
    os.truncate(data, int(data.stat().st_size * keep))
    with pytest.raises(CorruptionError, match=DATA):
        await aiockpt.read(ckpt_path, io=DIRECT)


async def test_unflushed_writes_are_seen_by_direct_reads(ckpt_path: Path) -> None:
    state = {"t": torch.arange(5000, dtype=torch.float32)}
    await aiockpt.save(state, ckpt_path)
    # Rewrite the data through the page cache without fsync: O_DIRECT must not read stale disk blocks.
    data = ckpt_path / DATA
    raw = data.read_bytes()
    flip_byte(data, raw.find(state["t"].numpy().tobytes()) + 8)
    with pytest.raises(CorruptionError):
        await aiockpt.read(ckpt_path, io=DIRECT)


# -- The default (direct_reads=None): runs of large blocks that nothing of is cached go direct -----------


def _cold(ckpt: Path) -> None:
    """Evict the checkpoint's data file; skip where its pages cannot be evicted (tmpfs)."""
    data = ckpt / DATA
    if not hasattr(os, "posix_fadvise"):
        pytest.skip("this platform has no posix_fadvise")
    evict(data)
    if any(resident_pages(data)):
        pytest.skip("the temporary directory's file system keeps its pages cached (tmpfs)")


def large_state() -> dict[str, object]:
    """Two tensors of 8 MiB (a run each: 8 blocks of 1 MiB, see BLOCKS), then small tensors (one run)."""
    gen = torch.Generator().manual_seed(4)
    return {
        "big": torch.randn(2 << 20, generator=gen),
        "big2": torch.randn(2 << 20, generator=gen),
        "small": {f"s{i}": torch.randn(i + 1, generator=gen) for i in range(40)},
        "step": 7,
    }


BLOCKS = IOConfig(checksum_block=1 << 20)


def _range_of(ckpt: Path, key: str) -> tuple[int, int]:
    """The byte range of ``key``'s only chunk in the data file."""
    manifest = read_manifest(ckpt)
    (entry,) = [e for e in manifest.tensors if render(e.path) == key]
    (chunk,) = entry.chunks
    return chunk.offset, chunk.offset + chunk.nbytes


@pytest.fixture
def direct_spans(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """The file ranges read by the direct pipeline's readers, in the order read."""
    spans: list[tuple[int, int]] = []
    read_span = _direct._read_span

    def spy(direct_fd: int, fd: int, buffer: memoryview, start: int) -> int:
        spans.append((start, start + len(buffer)))
        return read_span(direct_fd, fd, buffer, start)

    monkeypatch.setattr(_direct, "_read_span", spy)
    return spans


def _within(inner: tuple[int, int], spans: list[tuple[int, int]]) -> bool:
    """Whether every byte of ``inner`` lies in one of ``spans`` (which do not overlap)."""
    lo, hi = inner
    covered = sum(max(0, min(hi, b) - max(lo, a)) for a, b in spans)
    return covered == hi - lo


def _touches(inner: tuple[int, int], spans: list[tuple[int, int]]) -> bool:
    return any(min(inner[1], b) > max(inner[0], a) for a, b in spans)


def _assert_read_by_default(ckpt: Path, spans: list[tuple[int, int]], what: str) -> None:
    """``large_state``'s big tensors were read directly, its small ones not, and nothing stays cached."""
    assert _within(_range_of(ckpt, "big"), spans)
    assert _within(_range_of(ckpt, "big2"), spans)
    for i in (0, 20, 39):  # packed small tensors: read through the page cache, then evicted
        assert not _touches(_range_of(ckpt, f"small/s{i}"), spans)
    assert not any(resident_pages(ckpt / DATA)), f"a cold {what} must leave nothing cached"


async def test_a_default_load_reads_cold_large_blocks_directly_and_small_ones_buffered(
    ckpt_path: Path, direct_spans: list[tuple[int, int]]
) -> None:
    state = large_state()
    await aiockpt.save(state, ckpt_path, io=BLOCKS)
    _cold(ckpt_path)
    target = zeros_like_tree(state)
    await aiockpt.load(target, ckpt_path)
    assert_tree_equal(target, state)
    _assert_read_by_default(ckpt_path, direct_spans, "load")


async def test_cached_runs_are_read_through_the_page_cache_and_stay_cached(
    ckpt_path: Path, direct_spans: list[tuple[int, int]]
) -> None:
    state = large_state()
    await aiockpt.save(state, ckpt_path, io=BLOCKS)
    _cold(ckpt_path)
    big = _range_of(ckpt_path, "big")
    fd = os.open(ckpt_path / DATA, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead: exactly these pages get cached
        middle = (big[0] + big[1]) // 2 // 4096 * 4096
        os.pread(fd, 4096, middle)
    finally:
        os.close(fd)
    before = resident_pages(ckpt_path / DATA)
    assert before[middle // 4096]
    assert sum(map(bool, before)) == 1
    target = zeros_like_tree(state)
    await aiockpt.load(target, ckpt_path)
    assert_tree_equal(target, state)
    assert not _touches(big, direct_spans)  # its run was read through the page cache
    assert _within(_range_of(ckpt_path, "big2"), direct_spans)
    assert resident_pages(ckpt_path / DATA)[middle // 4096], "a page cached before the load must stay cached"


@pytest.mark.parametrize(
    "io",
    [IOConfig(direct_reads=False), IOConfig(drop_behind=False)],
    ids=["direct_reads=False", "drop_behind=False"],
)
async def test_loads_that_keep_or_share_pages_read_nothing_directly(
    io: IOConfig, ckpt_path: Path, direct_spans: list[tuple[int, int]]
) -> None:
    """``drop_behind=False`` (several ranks on one machine, by default) may share pages: not direct."""
    state = large_state()
    await aiockpt.save(state, ckpt_path, io=BLOCKS)
    _cold(ckpt_path)
    target = zeros_like_tree(state)
    await aiockpt.load(target, ckpt_path, io=io)
    assert_tree_equal(target, state)
    _cold(ckpt_path)
    assert (await aiockpt.verify(ckpt_path, io=io)).ok
    assert direct_spans == []


def _flags(fd: int) -> int:
    import fcntl

    return fcntl.fcntl(fd, fcntl.F_GETFL)


def _failing_direct_reads(monkeypatch: pytest.MonkeyPatch, code: int, after: int = 0) -> list[int]:
    """Make ``os.preadv`` on ``O_DIRECT`` descriptors fail with ``code`` after ``after`` calls."""
    preadv = os.preadv
    calls: list[int] = []

    def failing(fd: int, buffers: list[memoryview], offset: int) -> int:
        if _flags(fd) & os.O_DIRECT:
            calls.append(offset)
            if len(calls) > after:
                raise OSError(code, os.strerror(code))
        return preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", failing)
    return calls


async def test_a_direct_read_refused_when_reading_is_done_through_the_page_cache(
    ckpt_path: Path, monkeypatch: pytest.MonkeyPatch, direct_spans: list[tuple[int, int]]
) -> None:
    state = large_state()
    await aiockpt.save(state, ckpt_path, io=BLOCKS)
    _cold(ckpt_path)
    refused = _failing_direct_reads(monkeypatch, errno.EINVAL)
    target = zeros_like_tree(state)
    await aiockpt.load(target, ckpt_path)
    assert refused
    assert direct_spans
    assert_tree_equal(target, state)


def _bounce_accounting(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count bounce buffers taken from the shared pool and not given back: ``[outstanding]``."""
    out = [0]
    take, give = _memory.BOUNCE.take, _memory.BOUNCE.give

    def counted_take(nbytes: int) -> tuple[mmap.mmap, memoryview]:
        out[0] += 1
        return take(nbytes)

    def counted_give(buffer: tuple[mmap.mmap, memoryview]) -> None:
        out[0] -= 1
        give(buffer)

    monkeypatch.setattr(_memory.BOUNCE, "take", counted_take)
    monkeypatch.setattr(_memory.BOUNCE, "give", counted_give)
    return out


async def test_a_failing_direct_read_fails_the_load_by_directory_and_stops_every_thread(
    ckpt_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = {f"w{i}": torch.randn(1 << 20) for i in range(6)}  # 24 MiB: several runs per reader
    await aiockpt.save(state, ckpt_path)
    _cold(ckpt_path)
    outstanding = _bounce_accounting(monkeypatch)
    fds = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
    threads = threading.active_count()
    _failing_direct_reads(monkeypatch, errno.EIO, after=2)
    with anyio.fail_after(30), pytest.raises(StorageError, match=str(ckpt_path)) as info:
        await aiockpt.load({k: torch.zeros_like(v) for k, v in state.items()}, ckpt_path)
    assert isinstance(info.value.__cause__, OSError)
    assert outstanding == [0]
    if fds is not None:
        assert len(os.listdir("/proc/self/fd")) == fds
    assert threading.active_count() <= threads + 4  # anyio's pool may have grown; none is stuck
    monkeypatch.undo()
    target: dict[str, object] = {k: torch.zeros_like(v) for k, v in state.items()}
    await aiockpt.load(target, ckpt_path)
    assert_tree_equal(target, state)


@pytest.mark.parametrize("verify", [False, True], ids=["load", "verify"])
async def test_a_load_or_verification_cancelled_during_direct_reads_leaves_nothing_behind(
    verify: bool, ckpt_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = {f"w{i}": torch.randn(1 << 20) for i in range(6)}
    await aiockpt.save(state, ckpt_path)
    _cold(ckpt_path)
    outstanding = _bounce_accounting(monkeypatch)
    fds = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
    preadv = os.preadv
    reading = threading.Event()
    calls = 0

    def slow(fd: int, buffers: list[memoryview], offset: int) -> int:
        nonlocal calls
        if _flags(fd) & os.O_DIRECT:
            calls += 1
            reading.set()
            time.sleep(0.05)
        return preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", slow)
    zeros: dict[str, object] = {k: torch.zeros_like(v) for k, v in state.items()}
    run = (lambda: aiockpt.verify(ckpt_path)) if verify else (lambda: aiockpt.load(zeros, ckpt_path))
    assert await cancelled_once(reading, run)
    assert 0 < calls < 4  # stopped midway (three runs of 8 MiB), not after it
    assert outstanding == [0]
    if fds is not None:
        assert len(os.listdir("/proc/self/fd")) == fds
    monkeypatch.setattr(os, "preadv", preadv)
    target: dict[str, object] = {k: torch.zeros_like(v) for k, v in state.items()}
    await aiockpt.load(target, ckpt_path)
    assert_tree_equal(target, state)


async def test_a_damaged_block_read_directly_by_default_names_key_and_file(ckpt_path: Path) -> None:
    state = {"weights": torch.full((1 << 18,), 1.5), "other": torch.full((1 << 18,), 2.5)}
    await aiockpt.save(state, ckpt_path)
    start, _ = _range_of(ckpt_path, "other")
    flip_byte(ckpt_path / DATA, start + 100)
    _cold(ckpt_path)
    target: dict[str, object] = {"weights": torch.zeros(1 << 18), "other": torch.zeros(1 << 18)}
    with pytest.raises(CorruptionError) as info:
        await aiockpt.load(target, ckpt_path)
    assert info.value.key == "other"
    assert info.value.file is not None
    assert Path(info.value.file).name == DATA


async def test_a_load_reads_into_kept_bounce_buffers(
    ckpt_path: Path, monkeypatch: pytest.MonkeyPatch, direct_spans: list[tuple[int, int]]
) -> None:
    """Direct writes and direct reads share one pool: a run widened to page alignment fits its buffers."""
    state = large_state()
    await aiockpt.save(state, ckpt_path, io=BLOCKS)
    _cold(ckpt_path)
    _memory.BOUNCE.clear()
    kept = [_memory.BOUNCE.take(1) for _ in range(_memory.BOUNCE.keep)]
    for buffer in kept:
        _memory.BOUNCE.give(buffer)  # as a save gives its buffers back
    made: list[int] = []
    real = _memory.direct_buffer

    def spy(nbytes: int) -> tuple[mmap.mmap, memoryview]:
        made.append(nbytes)
        return real(nbytes)

    monkeypatch.setattr(_memory, "direct_buffer", spy)
    target = zeros_like_tree(state)
    await aiockpt.load(target, ckpt_path)
    assert_tree_equal(target, state)
    assert direct_spans, "the load should have read directly"
    assert made == [], "the load should have taken the kept buffers, not made new ones"


@pytest.mark.parametrize("offset", [0, 1, 4095, 4097, 123_457])
def test_the_longest_run_widened_to_page_alignment_fits_a_pooled_bounce_buffer(offset: int) -> None:
    start, stop = _direct.span(Run(offset=offset, end=offset + RUN_BYTES))
    assert start <= offset
    assert stop >= offset + RUN_BYTES
    assert stop - start <= _memory.BOUNCE.size


# -- Verification: the runs a load would read directly, read so and only checksummed ------------------------


async def test_a_default_verification_reads_cold_large_blocks_directly(
    ckpt_path: Path, direct_spans: list[tuple[int, int]]
) -> None:
    state = large_state()
    await aiockpt.save(state, ckpt_path, io=BLOCKS)
    _cold(ckpt_path)
    seen: list[tuple[int, int]] = []
    report = await aiockpt.verify(ckpt_path, progress=lambda done, total: seen.append((done, total)))
    assert report.ok, report.problems
    assert seen[-1] == (report.nbytes, report.nbytes)  # the direct runs count towards progress too
    _assert_read_by_default(ckpt_path, direct_spans, "verification")


async def test_damaged_blocks_read_directly_are_all_reported_by_key_file_and_block(
    ckpt_path: Path, direct_spans: list[tuple[int, int]]
) -> None:
    state = large_state()
    await aiockpt.save(state, ckpt_path, io=BLOCKS)
    for key, at in (("big", 3 << 20), ("big2", 100)):  # block 3 of "big", block 0 of "big2"
        flip_byte(ckpt_path / DATA, _range_of(ckpt_path, key)[0] + at)
    _cold(ckpt_path)
    report = await aiockpt.verify(ckpt_path)
    assert direct_spans
    assert [p.key for p in report.problems] == ["big", "big2"]
    assert "checksum mismatch in block 3" in str(report.problems[0])
    assert "checksum mismatch in block 0" in str(report.problems[1])
    assert all(p.file == str(ckpt_path / DATA) for p in report.problems)


async def test_a_direct_run_that_cannot_be_read_is_reported_and_the_rest_verified(
    ckpt_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = large_state()
    await aiockpt.save(state, ckpt_path, io=BLOCKS)
    _cold(ckpt_path)
    outstanding = _bounce_accounting(monkeypatch)
    fds = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
    calls = _failing_direct_reads(monkeypatch, errno.EIO, after=1)  # the first direct read succeeds
    with anyio.fail_after(30):
        report = await aiockpt.verify(ckpt_path)
    assert len(calls) == 2  # one run of each big tensor
    (problem,) = report.problems
    assert problem.key in ("big", "big2")
    assert f"read error ({os.strerror(errno.EIO)})" in str(problem)
    assert problem.file == str(ckpt_path / DATA)
    assert outstanding == [0]
    if fds is not None:
        assert len(os.listdir("/proc/self/fd")) == fds
