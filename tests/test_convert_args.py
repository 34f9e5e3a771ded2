"""convert refuses a bad ``max_shard_size`` or ``progress`` before it reads anything, naming it."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import aiockpt
import aiockpt.sync


@pytest.fixture
def src(tmp_path: Path) -> Path:
    aiockpt.sync.save({"a": torch.ones(1000), "b": torch.ones(1000), "c": torch.ones(1000)}, tmp_path / "src")
    return tmp_path / "src"


@pytest.mark.parametrize("size", ["5GB", math.nan, math.inf, True, 1.5, 0, -1, None])
async def test_a_bad_max_shard_size_is_refused_naming_it(src: Path, size: object) -> None:
    """``"5GB"`` raised a bare TypeError; nan, inf, True and 1.5 were taken (True made a shard per tensor)."""
    dst = src.parent / "hf"
    with pytest.raises(aiockpt.CheckpointError, match=rf"max_shard_size must be an int .*, not {size!r}"):
        await aiockpt.convert(src, dst, to="safetensors", max_shard_size=size)  # type: ignore[arg-type]
    assert not dst.exists()


async def test_the_smallest_max_shard_size_gives_a_shard_per_tensor(src: Path) -> None:
    out = await aiockpt.convert(src, src.parent / "hf", to="safetensors", max_shard_size=1)
    assert len(list(out.glob("model-*.safetensors"))) == 3


@pytest.mark.parametrize("progress", [3, "bar"])
async def test_a_progress_that_is_not_callable_is_refused_naming_it(src: Path, progress: object) -> None:
    """``progress=3`` failed with a bare TypeError once the source had been read."""
    dst = src.parent / "out.pt"
    with pytest.raises(aiockpt.CheckpointError, match=rf"progress must be a callable .*, not {progress!r}"):
        await aiockpt.convert(src, dst, to="torch", progress=progress)  # type: ignore[arg-type]
    assert not dst.exists()


def test_sync_convert_and_verify_refuse_them_too(src: Path) -> None:
    with pytest.raises(aiockpt.CheckpointError, match="max_shard_size must be an int"):
        aiockpt.sync.convert(src, src.parent / "hf", to="safetensors", max_shard_size="5GB")  # type: ignore[arg-type]
    with pytest.raises(aiockpt.CheckpointError, match="progress must be a callable"):
        aiockpt.sync.convert(src, src.parent / "out.pt", to="torch", progress=3)  # type: ignore[arg-type]
    with pytest.raises(aiockpt.CheckpointError, match="progress must be a callable"):
        aiockpt.sync.verify(src, progress=3)  # type: ignore[arg-type]
