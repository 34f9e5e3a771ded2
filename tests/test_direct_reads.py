"""``IOConfig(direct_reads=True)``: loads through O_DIRECT and bounce buffers keep every load guarantee."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from conftest import assert_tree_equal, flip_byte

import aiockpt
from aiockpt import CorruptionError, IOConfig

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
