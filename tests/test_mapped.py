"""``aiockpt.read`` with ``IOConfig.map_reads``: large tensors are views of private mappings of data files."""

from __future__ import annotations

import contextlib
import gc
import os
import random
import shutil
import sys
from pathlib import Path

import anyio
import msgspec
import pytest
import torch
from conftest import assert_tree_equal, flip_byte

import aiockpt
from aiockpt import CorruptionError, IOConfig
from aiockpt._format import Manifest, TensorEntry
from aiockpt._load import _mapped, read_manifest
from aiockpt._load._mapped import MIN_BYTES, Mapper

DATA = "data-r00000.bin"
IO = IOConfig(threads=2, checksum_block=1 << 20)
linux_only = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self")


def _state() -> dict[str, object]:
    g = torch.Generator().manual_seed(3)
    return {
        "big": torch.randn(1024, 1024, generator=g),  # 4 MiB: four checksum blocks
        "half": torch.randn(300, 700, generator=g).to(torch.bfloat16),  # 410 KiB: not a block multiple
        "bytes": torch.randint(0, 255, (MIN_BYTES,), dtype=torch.uint8, generator=g),  # just large enough
        "small": torch.randn(100, generator=g),  # into a slab
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 3),
        "nested": {"w": torch.randn(256, 128, generator=g), "step": 4},
    }


def _mapped_file(t: torch.Tensor, data: Path) -> bool:
    """Whether ``t``'s storage is a mapping of the whole of ``data`` (not memory of its own)."""
    return t.untyped_storage().nbytes() == data.stat().st_size


def _mappings_of(path: Path) -> list[tuple[int, int]]:
    """The address ranges of this process's mappings of ``path``."""
    out = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            if line.rstrip().endswith(str(path)):
                lo, hi = line.split()[0].split("-")
                out.append((int(lo, 16), int(hi, 16)))
    return out


def _open_files() -> set[str]:
    """What this process's file descriptors refer to."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(FileNotFoundError):  # the descriptor listdir itself used
            out.add(os.readlink(f"/proc/self/fd/{fd}"))
    return out


def _chunk(manifest: Manifest, key: str) -> tuple[int, int]:
    """``(offset, nbytes)`` in the data file of tensor ``key``'s single chunk."""
    (entry,) = [t for t in manifest.tensors if t.path == (key,)]
    (chunk,) = entry.chunks
    return chunk.offset, chunk.nbytes


async def test_large_whole_tensors_are_views_of_the_data_file(ckpt_path: Path) -> None:
    saved = _state()
    await aiockpt.save(saved, ckpt_path, io=IO)
    data = ckpt_path / DATA
    tree = await aiockpt.read(ckpt_path, io=IO)
    assert_tree_equal(tree, saved)
    nested = tree["nested"]
    assert isinstance(nested, dict)
    large = [tree["big"], tree["half"], tree["bytes"], nested["w"]]
    small = [tree["small"], tree["scalar"], tree["empty"]]
    assert all(isinstance(t, torch.Tensor) and _mapped_file(t, data) for t in large)
    assert not any(isinstance(t, torch.Tensor) and _mapped_file(t, data) for t in small)
    for t in large:
        assert isinstance(t, torch.Tensor)
        assert t.is_contiguous()
    if sys.platform == "linux":
        spans = _mappings_of(data.resolve())
        big = tree["big"]
        assert isinstance(big, torch.Tensor)
        assert any(lo <= big.data_ptr() < hi for lo, hi in spans)


@pytest.mark.parametrize(
    "io",
    [
        IOConfig(threads=2, checksum_block=1 << 20, map_reads=False),
        IOConfig(threads=2, direct_reads=True),  # past the page cache: nothing to map
    ],
    ids=["map_reads=False", "direct_reads"],
)
async def test_without_mapping_every_tensor_gets_memory_of_its_own(io: IOConfig, ckpt_path: Path) -> None:
    saved = _state()
    await aiockpt.save(saved, ckpt_path, io=IO)
    tree = await aiockpt.read(ckpt_path, io=io)
    assert_tree_equal(tree, saved)
    big = tree["big"]
    assert isinstance(big, torch.Tensor)
    assert not _mapped_file(big, ckpt_path / DATA)


async def test_writing_a_mapped_tensor_never_changes_the_checkpoint(ckpt_path: Path) -> None:
    saved = _state()
    await aiockpt.save(saved, ckpt_path, io=IO)
    data = ckpt_path / DATA
    before = data.read_bytes()
    tree = await aiockpt.read(ckpt_path, io=IO)
    big = tree["big"]
    assert isinstance(big, torch.Tensor)
    big.fill_(7.0)  # copy-on-write: the pages written become this process's own
    assert bool((big == 7.0).all())
    assert data.read_bytes() == before
    assert (await aiockpt.verify(ckpt_path)).ok
    assert_tree_equal(await aiockpt.read(ckpt_path, io=IO), saved)


async def test_a_deleted_checkpoint_stays_readable_through_its_tensors(ckpt_path: Path) -> None:
    """Retention may delete a checkpoint an actor has just read: its mapped tensors keep their bytes."""
    saved = _state()
    await aiockpt.save(saved, ckpt_path, io=IO)
    tree = await aiockpt.read(ckpt_path, io=IO)
    shutil.rmtree(ckpt_path)
    assert_tree_equal(tree, saved)


@linux_only
async def test_a_read_holds_no_file_descriptor(ckpt_path: Path) -> None:
    await aiockpt.save(_state(), ckpt_path, io=IO)
    data = (ckpt_path / DATA).resolve()
    tree = await aiockpt.read(ckpt_path, io=IO)
    assert str(data) not in _open_files()
    assert _mappings_of(data)  # mapped, through the tensors alone
    del tree
    assert _mappings_of(data) == []


@pytest.mark.parametrize("key", ["big", "half", "bytes"])
async def test_damage_in_a_mapped_tensor_names_its_key_and_file(key: str, ckpt_path: Path) -> None:
    await aiockpt.save(_state(), ckpt_path, io=IO)
    offset, nbytes = _chunk(read_manifest(ckpt_path), key)
    flip_byte(ckpt_path / DATA, offset + nbytes - 1)  # in the last block
    with pytest.raises(CorruptionError) as info:
        await aiockpt.read(ckpt_path, io=IO)
    assert info.value.key == key
    assert info.value.file is not None
    assert Path(info.value.file).name == DATA
    assert "checksum mismatch" in str(info.value)


@pytest.mark.parametrize("cut", [1, 4096, 1 << 20])
async def test_a_truncated_file_is_reported_not_mapped_past_its_end(cut: int, ckpt_path: Path) -> None:
    """Bytes past the end of a file are never mapped (touching them would be ``SIGBUS``): the read says so."""
    await aiockpt.save(_state(), ckpt_path, io=IO)
    data = ckpt_path / DATA
    offset, nbytes = _chunk(read_manifest(ckpt_path), "big")
    os.truncate(data, offset + nbytes - cut)
    with pytest.raises(CorruptionError) as info:
        await aiockpt.read(ckpt_path, io=IO)
    assert "truncated" in str(info.value)
    assert info.value.file is not None
    assert Path(info.value.file).name == DATA


async def test_without_populate_the_checksum_pass_reads_the_pages(
    ckpt_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Kernels before 5.14 lack ``MADV_POPULATE_READ``: the mapped pages are then faulted in as verified."""
    saved = _state()
    await aiockpt.save(saved, ckpt_path, io=IO)
    monkeypatch.setattr(_mapped, "_MADVISE", None)
    assert_tree_equal(await aiockpt.read(ckpt_path, io=IO), saved)
    offset, nbytes = _chunk(read_manifest(ckpt_path), "big")
    flip_byte(ckpt_path / DATA, offset + nbytes // 2)
    with pytest.raises(CorruptionError) as info:
        await aiockpt.read(ckpt_path, io=IO)
    assert info.value.key == "big"


async def test_tensors_that_cannot_be_views_are_read_into_memory(ckpt_path: Path) -> None:
    """Small, misaligned or split entries, and files that are missing or too short, get no mapping."""
    await aiockpt.save(_state(), ckpt_path, io=IO)
    manifest = read_manifest(ckpt_path)
    (big,) = [t for t in manifest.tensors if t.path == ("big",)]
    (small,) = [t for t in manifest.tensors if t.path == ("small",)]
    mapper = Mapper(ckpt_path)
    view = mapper.tensor(big, torch.float32)
    assert view is not None
    assert view.shape == (1024, 1024)
    assert mapper.tensor(small, torch.float32) is None
    chunk = big.chunks[0]
    replace = msgspec.structs.replace

    def moved(**changes: object) -> TensorEntry:
        return replace(big, chunks=(replace(chunk, **changes),))

    assert mapper.tensor(moved(offset=chunk.offset + 2), torch.float32) is None  # misaligned
    assert mapper.tensor(moved(offset=chunk.offset + (1 << 30)), torch.float32) is None  # past the end
    assert mapper.tensor(moved(file="missing.bin"), torch.float32) is None
    half = replace(chunk, sizes=(512, 1024), nbytes=chunk.nbytes // 2)
    split = replace(big, chunks=(half, replace(half, offsets=(512, 0))))
    assert mapper.tensor(split, torch.float32) is None


@linux_only
async def test_reads_cancelled_at_random_moments_leave_nothing_behind(ckpt_path: Path) -> None:
    """Mappings, threads and file descriptors all go when a mapped read is cancelled, wherever it is."""
    seed = 20261126
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(5)
    saved: dict[str, object] = {f"w{i}": torch.randn(1 << 20, generator=g) for i in range(6)}  # 24 MiB
    await aiockpt.save(saved, ckpt_path, io=IO)
    data = (ckpt_path / DATA).resolve()
    fds = len(os.listdir("/proc/self/fd"))
    cancelled = 0
    for _ in range(30):
        with anyio.move_on_after(rng.uniform(0, 0.02)) as scope:
            tree = await aiockpt.read(ckpt_path, io=IO)
            assert_tree_equal(tree, saved)
            del tree
        cancelled += scope.cancelled_caught
    # The cancelled reads' frames, which held their tensors, are garbage once the loop has run their
    # task groups' last callbacks.
    await anyio.sleep(0.05)
    gc.collect()
    assert _mappings_of(data) == [], f"seed {seed}"
    assert len(os.listdir("/proc/self/fd")) == fds, f"seed {seed}"
    assert cancelled > 0, f"seed {seed}: no read was cancelled"
    assert_tree_equal(await aiockpt.read(ckpt_path, io=IO), saved)


_CUT_AFTER_OPEN = """
import asyncio, os, sys
import aiockpt
from aiockpt._load import _read

real = _read.populate
data, keep = sys.argv[1], int(sys.argv[2])

def cut_then_populate(start, nbytes):  # the file is cut short after it was mapped and opened
    os.truncate(data, keep)
    return real(start, nbytes)

_read.populate = cut_then_populate
try:
    asyncio.run(aiockpt.read(sys.argv[3], io=aiockpt.IOConfig(threads=1, checksum_block=1 << 20)))
except aiockpt.CorruptionError as exc:
    print("CorruptionError:", exc)
    sys.exit(3)
"""


@linux_only
def test_a_file_cut_short_after_it_was_mapped_is_an_error_not_sigbus(ckpt_path: Path) -> None:
    """Touching mapped bytes past the end of a file kills the process: the reader asks the kernel first."""
    import subprocess

    release = tuple(int(x) for x in os.uname().release.split(".")[:2] if x.isdigit())
    if release < (5, 14):
        pytest.skip("MADV_POPULATE_READ needs Linux 5.14")
    anyio.run(lambda: aiockpt.save(_state(), ckpt_path, io=IO))
    data = ckpt_path / DATA
    offset, _ = _chunk(read_manifest(ckpt_path), "big")
    proc = subprocess.run(
        [sys.executable, "-c", _CUT_AFTER_OPEN, str(data), str(offset), str(ckpt_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 3, f"rc {proc.returncode}: {proc.stdout} {proc.stderr[-2000:]}"
    assert "truncated or unreadable" in proc.stdout
    assert DATA in proc.stdout
