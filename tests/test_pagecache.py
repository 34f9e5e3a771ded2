"""``IOConfig.drop_behind``: a load evicts from the page cache what it read, and only that."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import assert_tree_equal, evict

import aiockpt
from aiockpt import IOConfig, _pagecache
from aiockpt._pagecache import PAGE, drop_behind, kept, resident, sweep

pytestmark = pytest.mark.timeout(60)

DATA = "data-r00000.bin"
# Several runs (8 MiB each at most) over two reader lanes, checksummed in 1 MiB blocks.
IO = IOConfig(threads=2, checksum_block=1 << 20)
# Fresh reads into memory of their own: those evict what they read (mapped tensors' pages are their memory).
UNMAPPED = IOConfig(threads=2, checksum_block=1 << 20, map_reads=False)


@contextlib.contextmanager
def _opened(path: Path) -> Iterator[int]:
    """``path`` opened for reading, closed when the block ends."""
    fd = os.open(path, os.O_RDONLY)
    try:
        yield fd
    finally:
        os.close(fd)


def _resident(path: Path) -> bytes:
    with _opened(path) as fd:
        pages = resident(fd, os.fstat(fd).st_size)
    assert pages is not None
    return pages


def _count(pages: bytes) -> int:
    return len(pages) - pages.count(0)


def _read_pages(path: Path, first: int, stop: int) -> None:
    """Read pages ``[first, stop)`` of ``path`` with readahead off, so that exactly they get cached."""
    with _opened(path) as fd:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        for page in range(first, stop):
            os.pread(fd, PAGE, page * PAGE)


@pytest.fixture(autouse=True)
def _evictable(tmp_path: Path) -> None:
    """Skip where the temporary directory's pages cannot be told apart or evicted (tmpfs, not Linux).

    Probed page by page (``mincore`` only), so that a fault in ``resident``'s use of ``cachestat`` fails
    the tests below instead of skipping them.
    """
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_pagecache, "_SYSCALL", None)
        _probe(tmp_path)


def _probe(tmp_path: Path) -> None:
    probe = tmp_path / "probe"
    probe.write_bytes(b"x" * 4 * PAGE)
    if not hasattr(os, "posix_fadvise"):
        pytest.skip("this platform has no posix_fadvise")
    with _opened(probe) as fd:
        if resident(fd, 4 * PAGE) is None:
            pytest.skip("mincore cannot tell which pages are cached here")
    evict(probe)
    if _count(_resident(probe)):
        pytest.skip("the temporary directory's file system keeps its pages cached (tmpfs)")
    _read_pages(probe, 1, 2)
    if _resident(probe) != b"\0\1\0\0":
        pytest.skip("pages read here are not cached one by one")


def state() -> dict[str, object]:
    gen = torch.Generator().manual_seed(5)
    return {
        "big": torch.randn(5_000_001, generator=gen),  # 20 MB: three runs
        "bf16": torch.randn(513, 129, generator=gen).to(torch.bfloat16),
        "small": {f"s{i}": torch.randn(i + 1, generator=gen) for i in range(40)},
        "step": 3,
    }


def test_resident_tells_which_pages_are_cached(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(os.urandom(8 * PAGE + 100))
    evict(path)
    assert _resident(path) == bytes(9)
    _read_pages(path, 2, 5)
    assert _resident(path) == b"\0\0\1\1\1\0\0\0\0"
    with _opened(path) as fd:
        assert resident(fd, 0) == b""
        assert resident(fd, 3 * PAGE + 1) == b"\0\0\1\1"  # only the pages asked about


@pytest.mark.parametrize("cachestat", [True, False], ids=["cachestat", "mincore-only"])
def test_resident_counts_stretches_then_looks_up_mixed_ones(
    cachestat: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_pagecache, "_SCAN_PAGES", 4)  # stretches of 4 pages: 13 pages make 4 of them
    if not cachestat:
        monkeypatch.setattr(_pagecache, "_SYSCALL", None)  # a kernel without cachestat
    path = tmp_path / "f"
    path.write_bytes(os.urandom(12 * PAGE + 100))
    evict(path)
    _read_pages(path, 0, 4)  # a whole stretch
    _read_pages(path, 9, 11)  # part of one
    _read_pages(path, 12, 13)  # the last, short one
    assert _resident(path) == b"\1\1\1\1\0\0\0\0\0\1\1\0\1"
    with _opened(path) as fd:
        assert resident(fd, 10 * PAGE) == b"\1\1\1\1\0\0\0\0\0\1"


def test_resident_of_a_cold_or_wholly_cached_file_looks_up_no_page(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _cached_file(tmp_path, 9)
    with _opened(path) as fd:
        if _pagecache._cached_count(fd, 0, 9 * PAGE) is None:
            pytest.skip("this kernel has no cachestat (Linux 6.5)")
        assert _pagecache._cached_count(fd, PAGE, 3 * PAGE) == 3

        def refuse(*_: object) -> None:
            raise AssertionError("mapped the file to look up its pages one by one")

        assert _pagecache._CALLS is not None
        monkeypatch.setattr(_pagecache, "_CALLS", (refuse, *_pagecache._CALLS[1:]))
        assert resident(fd, 9 * PAGE) == b"\1" * 9
        evict(path)
        assert resident(fd, 9 * PAGE) == bytes(9)


def _cached_file(tmp_path: Path, pages: int) -> Path:
    """A file of ``pages`` pages, all of them cached (read back after they were evicted)."""
    path = tmp_path / "f"
    path.write_bytes(os.urandom(pages * PAGE))
    evict(path)
    _read_pages(path, 0, pages)
    return path


def test_drop_behind_evicts_whole_pages_of_a_range_nothing_cached_before(tmp_path: Path) -> None:
    path = _cached_file(tmp_path, 8)
    nothing = bytes(8)
    with _opened(path) as fd:
        # Unknown state before: nothing goes.
        drop_behind(fd, 0, 8 * PAGE, None)
        assert _count(_resident(path)) == 8
        # A range with a page cached before the read began: nothing goes either.
        drop_behind(fd, 0, 8 * PAGE, b"\0\0\0\1\0\0\0\0")
        assert _count(_resident(path)) == 8
        # Pages straddling either end stay (a neighbouring run may still be reading them).
        drop_behind(fd, PAGE + 1, 5 * PAGE - 1, nothing)
        assert _resident(path) == b"\1\1\0\0\1\1\1\1"
        drop_behind(fd, 5 * PAGE, 8 * PAGE, nothing)
        assert _resident(path) == b"\1\1\0\0\1\0\0\0"


def test_sweep_evicts_every_page_not_cached_before(tmp_path: Path) -> None:
    path = _cached_file(tmp_path, 8)
    with _opened(path) as fd:
        sweep(fd, None)
        assert _count(_resident(path)) == 8
        sweep(fd, b"\1\0\0\1\1\0\0\0")
        assert _resident(path) == b"\1\0\0\1\1\0\0\0"


def test_sweep_evicts_again_what_in_flight_reads_bring_in_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _cached_file(tmp_path, 8)
    before = b"\1\0\0\0\0\0\0\0"
    # Readahead still in flight at the first pass: its pages land after it, then the second pass gets them.
    counts = iter([3, 1])
    passes: list[int] = []
    real = _pagecache._cached_count

    def counted(fd: int, start: int, length: int) -> int | None:
        passes.append(start)
        return next(counts)

    monkeypatch.setattr(_pagecache, "_cached_count", counted)
    with _opened(path) as fd:
        sweep(fd, before)
        assert passes == [0, 0]  # counted after each of two eviction passes
        # A file another reader keeps cached: the passes end at the deadline.
        monkeypatch.setattr(_pagecache, "_cached_count", lambda fd, start, length: 5)
        monkeypatch.setattr(_pagecache, "_SETTLE", 0.01)
        sweep(fd, before)
        # Without cachestat: one pass.
        monkeypatch.setattr(_pagecache, "_cached_count", lambda fd, start, length: None)
        sweep(fd, before)
    monkeypatch.setattr(_pagecache, "_cached_count", real)
    assert _resident(path) == before


def test_drop_behind_is_on_by_default_unless_one_of_several_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    assert IOConfig().drops_behind
    assert not IOConfig(drop_behind=False).drops_behind
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    assert not IOConfig().drops_behind
    assert IOConfig(drop_behind=True).drops_behind
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    assert IOConfig().drops_behind


@pytest.mark.parametrize("fresh", [False, True], ids=["load", "read"])
async def test_a_cold_load_leaves_none_of_the_data_in_the_page_cache(fresh: bool, ckpt_path: Path) -> None:
    saved = state()
    await aiockpt.save(saved, ckpt_path, io=IO)
    data = ckpt_path / DATA
    evict(data)
    if fresh:
        assert_tree_equal(await aiockpt.read(ckpt_path, io=UNMAPPED), saved)
    else:
        target = state()
        big = target["big"]
        assert isinstance(big, torch.Tensor)
        big.zero_()
        await aiockpt.load(target, ckpt_path, io=IO)
        assert_tree_equal(target, saved)
    pages = _resident(data)
    # At most the pages straddling the ends of the runs remain.
    assert _count(pages) <= 8, f"{_count(pages)} of {len(pages)} pages still cached"


@pytest.mark.parametrize("drop", [True, False])
async def test_verify_reads_everything_and_keeps_only_what_was_cached(drop: bool, ckpt_path: Path) -> None:
    await aiockpt.save(state(), ckpt_path, io=IO)
    data = ckpt_path / DATA
    evict(data)
    report = await aiockpt.verify(ckpt_path, io=IOConfig(threads=2, drop_behind=drop))
    assert report.ok
    pages = _resident(data)
    if drop:
        assert _count(pages) <= 8, f"{_count(pages)} of {len(pages)} pages still cached"
    else:
        assert _count(pages) == len(pages)


async def test_without_drop_behind_a_load_leaves_its_data_cached(ckpt_path: Path) -> None:
    saved = state()
    await aiockpt.save(saved, ckpt_path, io=IO)
    data = ckpt_path / DATA
    evict(data)
    assert_tree_equal(await aiockpt.read(ckpt_path, io=IOConfig(threads=2, drop_behind=False)), saved)
    pages = _resident(data)
    assert _count(pages) == len(pages)


async def test_a_load_keeps_what_was_cached_before_it(ckpt_path: Path) -> None:
    saved = state()
    await aiockpt.save(saved, ckpt_path, io=IOConfig(threads=2, checksum_block=1 << 20, direct_writes=False))
    data = ckpt_path / DATA
    # Just saved through the page cache: cached, and a load (an actor following its learner) leaves it so
    # for the next reader.
    assert_tree_equal(await aiockpt.read(ckpt_path, io=UNMAPPED), saved)
    pages = _resident(data)
    assert _count(pages) == len(pages)
    # Half cached (another reader got that far): that half stays, the rest goes.
    evict(data)
    half = len(pages) // 2
    _read_pages(data, 0, half)
    assert_tree_equal(await aiockpt.read(ckpt_path, io=UNMAPPED), saved)
    pages = _resident(data)
    assert pages[:half] == b"\1" * half
    assert _count(pages[half:]) <= 2


async def test_a_mapped_read_keeps_the_pages_of_its_mapped_tensors_only(ckpt_path: Path) -> None:
    """The pages of mapped tensors are the result's memory: they stay; small tensors' pages go."""
    saved = state()
    await aiockpt.save(saved, ckpt_path, io=IO)
    data = ckpt_path / DATA
    evict(data)
    tree = await aiockpt.read(ckpt_path, io=IO)
    assert_tree_equal(tree, saved)
    pages = _resident(data)
    kept = 0
    for key in ("big", "bf16"):
        t = tree[key]
        assert isinstance(t, torch.Tensor)
        assert t.untyped_storage().nbytes() == data.stat().st_size  # a view of the file
        first = t.storage_offset() * t.element_size() // PAGE
        stop = -(-(t.storage_offset() * t.element_size() + t.nbytes) // PAGE)
        assert pages[first:stop] == b"\1" * (stop - first), key
        kept += stop - first
    # The small tensors' pages (read into slabs) are evicted, bar pages shared with a mapped tensor.
    assert _count(pages) - kept <= 4, f"{_count(pages) - kept} more pages cached"


def test_kept_marks_every_page_a_span_touches() -> None:
    before = bytes(8)
    assert kept(before, [(PAGE + 1, 3 * PAGE)]) == b"\0\1\1\0\0\0\0\0"
    assert kept(before, [(0, 1), (7 * PAGE, 9 * PAGE)]) == b"\1\0\0\0\0\0\0\1"  # clipped to the file
    assert kept(b"\1" + bytes(3), []) == b"\1" + bytes(3)
