"""``aiockpt.verify``: every block read back and checked, every damaged chunk reported, bounded memory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import crc32c
import msgspec
import pytest
import torch
from conftest import file_size, flip_byte, make_model

import aiockpt
import aiockpt._verify
from aiockpt._checkpointer import doomed_steps
from aiockpt._format import ENCODER, ENVELOPE_DECODER, MANIFEST_NAME, Manifest
from aiockpt._load import read_manifest


def _state() -> dict[str, object]:
    g = torch.Generator().manual_seed(0)
    return {
        "model": make_model(0),
        "a": torch.randn(64, 64, generator=g),  # 16 KiB: four 4 KiB checksum blocks below
        "b": torch.randint(0, 100, (1000,), generator=g),
        "h": torch.randn(10, generator=g).to(torch.bfloat16),
        "empty": torch.empty(0),
        "n": 7,
    }


def _chunk(manifest: Manifest, key: str) -> tuple[str, int, int]:
    """``(file, offset, nbytes)`` of the single chunk of tensor ``key``."""
    (entry,) = [t for t in manifest.tensors if t.path == (key,)]
    (chunk,) = entry.chunks
    return chunk.file, chunk.offset, chunk.nbytes


async def test_an_intact_checkpoint_verifies(ckpt_path: Path) -> None:
    await aiockpt.save(_state(), ckpt_path)
    manifest = read_manifest(ckpt_path)
    seen: list[tuple[int, int]] = []
    report = await aiockpt.verify(ckpt_path, progress=lambda done, total: seen.append((done, total)))
    assert report.ok
    assert report.problems == ()
    assert report.path == str(ckpt_path)
    assert report.num_tensors == len(manifest.tensors)
    assert report.num_chunks == sum(len(t.chunks) for t in manifest.tensors)
    assert report.nbytes == sum(c.nbytes for t in manifest.tensors for c in t.chunks)
    total = report.nbytes
    assert seen[-1] == (total, total)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)


async def test_a_checkpoint_saved_with_a_huge_checksum_block_verifies_and_finds_damage(
    ckpt_path: Path,
) -> None:
    """Any multiple of 4096 is a valid block; verify made a zero placeholder of a block's size (1 TiB
    here: a MemoryError) where no piece is longer than its chunk."""
    await aiockpt.save(_state(), ckpt_path, io=aiockpt.IOConfig(checksum_block=1 << 40))
    assert (await aiockpt.verify(ckpt_path)).ok
    flip_byte(ckpt_path / "data-r00000.bin", 5)
    assert not (await aiockpt.verify(ckpt_path)).ok


async def test_a_progress_that_is_not_callable_is_refused_naming_it(ckpt_path: Path) -> None:
    """``progress=3`` failed with a bare TypeError once data was read."""
    await aiockpt.save(_state(), ckpt_path)
    with pytest.raises(aiockpt.CheckpointError, match=r"progress must be a callable .*, not 3"):
        await aiockpt.verify(ckpt_path, progress=3)  # type: ignore[arg-type]


async def test_an_error_in_the_progress_callback_is_raised_as_it_is(ckpt_path: Path) -> None:
    await aiockpt.save(_state(), ckpt_path)

    def progress(done: int, total: int) -> None:
        raise KeyError("from the callback")

    with pytest.raises(KeyError, match="from the callback"):
        await aiockpt.verify(ckpt_path, progress=progress)


async def test_a_cancelled_verification_stops_and_closes_its_files(ckpt_path: Path) -> None:
    await aiockpt.save({"x": torch.ones(16 << 20)}, ckpt_path)
    open_before = set(os.listdir("/proc/self/fd"))
    calls = 0
    with anyio.CancelScope() as scope:

        def progress(done: int, total: int) -> None:
            nonlocal calls
            calls += 1
            scope.cancel()

        await aiockpt.verify(ckpt_path, progress=progress)
    assert scope.cancelled_caught
    assert calls == 1
    assert set(os.listdir("/proc/self/fd")) == open_before


async def test_a_checkpoint_deleted_while_it_is_verified_is_not_found_not_damaged(
    ckpt_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Retention by another process took the step away after its manifest was read: files missing."""
    await aiockpt.save({"w": torch.ones(1 << 16)}, ckpt_path)
    real = aiockpt._verify.read_manifest  # type: ignore[attr-defined]

    def then_deleted(directory: Path, **kwargs: Any) -> Manifest:
        manifest = real(directory, **kwargs)
        directory.rename(directory.with_name("deleted"))  # as retention does, before it removes the tree
        return manifest

    monkeypatch.setattr(aiockpt._verify, "read_manifest", then_deleted)
    with pytest.raises(aiockpt.CheckpointNotFoundError, match="was deleted while it was verified"):
        await aiockpt.verify(ckpt_path)


async def test_every_damaged_chunk_is_reported_with_key_file_and_block(ckpt_path: Path) -> None:
    await aiockpt.save(_state(), ckpt_path, io=aiockpt.IOConfig(checksum_block=4096))
    manifest = read_manifest(ckpt_path)
    file_a, off_a, _ = _chunk(manifest, "a")
    file_b, off_b, n_b = _chunk(manifest, "b")
    flip_byte(ckpt_path / file_a, off_a + 2 * 4096 + 5)  # block 2 of "a"
    flip_byte(ckpt_path / file_b, off_b + n_b - 1)  # the last byte of "b"

    report = await aiockpt.verify(ckpt_path)
    assert not report.ok
    assert [p.key for p in report.problems] == sorted(["a", "b"], key=lambda k: _chunk(manifest, k)[1])
    by_key = {p.key: p for p in report.problems}
    assert by_key["a"].file == str(ckpt_path / file_a)
    assert "checksum mismatch in block 2" in str(by_key["a"])
    assert str(ckpt_path / file_a) in str(by_key["a"])
    assert "checksum mismatch in block 1" in str(by_key["b"])  # 8000 bytes: blocks 0 and 1
    assert all(isinstance(p, aiockpt.CorruptionError) for p in report.problems)
    # A load stops at the first damage and names it the same way.
    with pytest.raises(aiockpt.CorruptionError, match="checksum mismatch") as info:
        await aiockpt.read(ckpt_path)
    assert info.value.key in by_key


async def test_truncated_and_missing_data_files(ckpt_path: Path, tmp_path: Path) -> None:
    await aiockpt.save(_state(), ckpt_path)
    manifest = read_manifest(ckpt_path)
    ends = [(c.offset + c.nbytes, "/".join(map(str, t.path))) for t in manifest.tensors for c in t.chunks]
    last_end, last_key = max(ends)  # the chunk that ends the file
    (name,) = {f.name for f in manifest.files}
    os.truncate(ckpt_path / name, last_end - 1)

    report = await aiockpt.verify(ckpt_path)
    assert [p.key for p in report.problems] == [last_key]
    assert "data file is truncated" in str(report.problems[0])

    os.unlink(ckpt_path / name)
    report = await aiockpt.verify(ckpt_path)
    stored = {"/".join(map(str, t.path)) for t in manifest.tensors}
    assert {p.key for p in report.problems} == stored
    assert all("data file is missing" in str(p) and p.file == str(ckpt_path / name) for p in report.problems)


async def test_a_damaged_manifest_is_a_problem_and_not_a_checkpoint_raises(ckpt_path: Path) -> None:
    await aiockpt.save(_state(), ckpt_path)
    manifest_file = ckpt_path / MANIFEST_NAME
    flip_byte(manifest_file, file_size(manifest_file) - 3)
    report = await aiockpt.verify(ckpt_path)
    assert len(report.problems) == 1
    assert report.problems[0].file == str(manifest_file)
    assert report.num_tensors == 0

    os.unlink(manifest_file)
    with pytest.raises(aiockpt.CheckpointNotFoundError, match="no manifest"):
        await aiockpt.verify(ckpt_path)
    with pytest.raises(aiockpt.CheckpointNotFoundError, match="does not exist"):
        await aiockpt.verify(ckpt_path / "nope")


async def test_a_newer_format_is_refused(ckpt_path: Path) -> None:
    await aiockpt.save(_state(), ckpt_path)
    manifest_file = ckpt_path / MANIFEST_NAME
    env = ENVELOPE_DECODER.decode(manifest_file.read_bytes())
    # A newer manifest's body says its version too (the envelope alone saying so is damage).
    body = ENCODER.encode({**msgspec.msgpack.decode(env.body), "format_version": aiockpt.FORMAT_VERSION + 1})
    newer = msgspec.structs.replace(
        env, format_version=aiockpt.FORMAT_VERSION + 1, body=body, body_crc32c=crc32c.crc32c(body)
    )
    manifest_file.write_bytes(ENCODER.encode(newer))
    with pytest.raises(aiockpt.FormatError, match="upgrade aiockpt"):
        await aiockpt.verify(ckpt_path)


async def test_collective_free_parts_are_verified_through_the_merged_manifest(ckpt_path: Path) -> None:
    # Two parts as two ranks of a collective-free save publish them (each a complete checkpoint).
    await aiockpt.save({"a": torch.ones(100), "r": torch.zeros(8)}, ckpt_path / "rank-00000-of-00002")
    await aiockpt.save({"b": torch.ones(50), "r": torch.zeros(8)}, ckpt_path / "rank-00001-of-00002")
    report = await aiockpt.verify(ckpt_path)
    assert report.ok
    assert report.num_tensors == 3
    part = ckpt_path / "rank-00001-of-00002"
    part_manifest = read_manifest(part)
    file_b, off_b, _ = _chunk(part_manifest, "b")
    flip_byte(part / file_b, off_b)
    report = await aiockpt.verify(ckpt_path)
    assert [(p.key, p.file) for p in report.problems] == [("b", str(part / file_b))]


@pytest.mark.parametrize("io", [aiockpt.IOConfig(direct_reads=False), aiockpt.IOConfig(direct_reads=True)])
async def test_collective_free_parts_are_verified_with_every_copy_of_a_replicated_chunk(
    ckpt_path: Path, io: aiockpt.IOConfig
) -> None:
    # Both ranks write the replicated "r"; a load of the whole reads rank 0's copy, but a load of part 1 on
    # its own reads rank 1's: verify must check that copy too (it used to plan from the merged manifest).
    r = torch.randn(1000)
    await aiockpt.save({"a": torch.ones(100), "r": r}, ckpt_path / "rank-00000-of-00002")
    await aiockpt.save({"b": torch.ones(50), "r": r}, ckpt_path / "rank-00001-of-00002")
    clean = await aiockpt.verify(ckpt_path, io=io)
    assert clean.ok
    assert (clean.num_tensors, clean.num_chunks) == (3, 4)
    part = ckpt_path / "rank-00001-of-00002"
    file_r, off_r, _ = _chunk(read_manifest(part), "r")
    flip_byte(part / file_r, off_r + 8)
    report = await aiockpt.verify(ckpt_path, io=io)
    assert [(p.key, p.file) for p in report.problems] == [("r", str(part / file_r))]
    assert not (await aiockpt.verify(part, io=io)).ok


async def test_object_storage_urls_are_refused_by_name(tmp_path: Path) -> None:
    # verify and convert read local files only; an s3:// URL must not turn into a local path "s3:/...".
    for call in (
        aiockpt.verify("s3://bucket/run/step-1"),
        aiockpt.convert(tmp_path / "src", "s3://bucket/out", to="aiockpt"),
    ):
        with pytest.raises(aiockpt.CheckpointError, match="local paths only, not on 's3://bucket/"):
            await call
    assert list(tmp_path.iterdir()) == []


def test_memory_stays_bounded_whatever_the_checkpoint_size(tmp_path: Path) -> None:
    """A 256 MiB checkpoint is verified with a few tens of MiB of extra resident memory."""
    path = tmp_path / "big"
    nbytes = 256 << 20
    script = f"""
import resource, anyio, torch, aiockpt
anyio.run(lambda: aiockpt.save({{"x": torch.ones({nbytes // 4})}}, {str(path)!r}))
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    script = f"""
import resource, anyio, aiockpt
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
report = anyio.run(lambda: aiockpt.verify({str(path)!r}))
assert report.ok and report.nbytes == {nbytes}, report
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""
    out = subprocess.run(
        [sys.executable, "-c", script], check=True, timeout=120, capture_output=True, text=True
    )
    grown = int(out.stdout.split()[-1])
    assert grown < 64 << 20, f"verifying {nbytes} bytes grew the resident set by {grown} bytes"


@pytest.mark.parametrize(
    ("steps", "keep_last", "keep_every", "protect", "doomed"),
    [
        ([1, 2, 3], None, None, (), []),
        ([1, 2, 3], 3, None, (), []),
        ([1, 2, 3, 4], 1, None, (), [1, 2, 3]),
        ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 2, 4, (), [1, 2, 3, 5, 6, 7]),
        ([10, 20, 30, 40], 1, None, (20,), [10, 30]),
    ],
)
def test_retention_rules(
    steps: list[int],
    keep_last: int | None,
    keep_every: int | None,
    protect: tuple[int, ...],
    doomed: list[int],
) -> None:
    assert doomed_steps(steps, keep_last=keep_last, keep_every=keep_every, protect=protect) == doomed
