"""Damaged and forged collective-free part sets, and forged checkpoints on object storage.

Found by fuzzing the readers (read, load, verify, a Checkpointer, the command line) with part sets whose
part manifests (forged with valid checksums), part directory names and data files were mutated. Each
case is refused with a CheckpointError naming the part, or read as the parts a save wrote; none reads a
mix of saves, allocates by a forged size or escapes as a raw error.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import shutil
from collections.abc import Iterator
from pathlib import Path

import crc32c
import msgspec
import pytest
import torch
from conftest import assert_tree_equal

import aiockpt
from aiockpt._body import decode_body, encode_body
from aiockpt._cli._app import run as cli
from aiockpt._format import (
    ENVELOPE_DECODER,
    MANIFEST_NAME,
    Chunk,
    DictNode,
    Manifest,
    TensorEntry,
    TensorNode,
)


def _manifest(path: Path) -> Manifest:
    env = ENVELOPE_DECODER.decode((path / MANIFEST_NAME).read_bytes())
    return decode_body(env.body, env.format_version)


def _encode(manifest: Manifest) -> bytes:
    """``manifest`` as a manifest file's bytes, with a checksum that matches."""
    body = encode_body(manifest)
    env = {"magic": "aiockpt", "format_version": 2, "body_crc32c": crc32c.crc32c(body), "body": body}
    return msgspec.msgpack.encode(env)


def _forge(path: Path, **changes: object) -> None:
    """Rewrite ``path``'s manifest with ``changes``, its checksum matching."""
    (path / MANIFEST_NAME).write_bytes(_encode(msgspec.structs.replace(_manifest(path), **changes)))


def _with_entry(path: Path, key: tuple[str, ...], **changes: object) -> None:
    m = _manifest(path)
    _forge(
        path, tensors=tuple(msgspec.structs.replace(t, **changes) if t.path == key else t for t in m.tensors)
    )


def _state(rank: int) -> dict[str, object]:
    return {"w": torch.arange(6.0), "shard": torch.arange(12.0).reshape(4, 3) + 100 * rank, "lr": 0.5}


async def _parts(step: Path, world: int, *, step_no: int | None = 5) -> list[Path]:
    """A part set as a collective-free save writes it: each part's manifest says its rank and world size,
    and ``shard`` is a tensor of ``4 * world`` rows of which rank ``r`` holds rows ``4r..4r+4``."""
    parts = []
    for rank in range(world):
        part = step / f"rank-{rank:05d}-of-{world:05d}"
        await aiockpt.save(_state(rank), part)
        m = _manifest(part)
        tensors = tuple(
            msgspec.structs.replace(
                t, shape=(4 * world, 3), chunks=(msgspec.structs.replace(t.chunks[0], offsets=(4 * rank, 0)),)
            )
            if t.path == ("shard",)
            else t
            for t in m.tensors
        )
        _forge(part, part_rank=rank, world_size=world, step=step_no, tensors=tensors)
        parts.append(part)
    return parts


def _expected(world: int) -> dict[str, object]:
    return {"w": torch.arange(6.0), "shard": torch.cat([_state(r)["shard"] for r in range(world)]), "lr": 0.5}  # type: ignore[misc]


def _cli(*args: str) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli(list(args))
    return rc, err.getvalue()


async def _every_reader_refuses(step: Path, error: type[aiockpt.CheckpointError], *words: str) -> None:
    """read, load, verify and the CLI (inspect, verify) refuse ``step`` with ``error`` (``words`` in it)."""
    target = {"w": torch.zeros(6), "shard": torch.zeros(8, 3), "lr": 0.0}
    runs = (lambda: aiockpt.read(step), lambda: aiockpt.load(target, step), lambda: aiockpt.verify(step))
    for run in runs:
        with pytest.raises(error) as info:
            await run()
        for word in (str(step), *words):
            assert word in str(info.value), str(info.value)
    for command in ("inspect", "verify"):
        rc, err = await asyncio.to_thread(_cli, command, str(step))  # (the CLI runs an event loop of its own)
        assert rc == 2, (command, err)
        assert err.startswith("aiockpt: error:"), err
        assert words[0] in err, err


async def test_the_part_set_as_a_save_writes_it_reads(tmp_path: Path) -> None:
    step = tmp_path / "step-00000005"
    await _parts(step, 2)
    assert_tree_equal(await aiockpt.read(step), _expected(2))
    assert (await aiockpt.verify(step)).ok


@pytest.mark.parametrize(("rank", "world"), [(1, 2), (0, 3), (0, 1)])
async def test_a_part_whose_manifest_says_another_rank_or_world_is_refused(
    tmp_path: Path, rank: int, world: int
) -> None:
    # Was merged as the rank its directory's name says: a part copied or forged under another name read
    # as that rank's shards.
    step = tmp_path / "step-00000005"
    parts = await _parts(step, 2)
    _forge(parts[0], part_rank=rank, world_size=world)
    await _every_reader_refuses(
        step,
        aiockpt.FormatError,
        f"{parts[0] / MANIFEST_NAME} is damaged or forged",
        f"rank {rank} of {world}",
    )


async def test_a_part_without_a_part_rank_is_merged_as_its_directory_says(tmp_path: Path) -> None:
    # A single-process save put in a part's place by hand (as tests and tools do) stays readable.
    step = tmp_path / "step-00000005"
    parts = await _parts(step, 2)
    _forge(parts[1], part_rank=None, world_size=1)
    assert_tree_equal(await aiockpt.read(step), _expected(2))


@pytest.mark.parametrize("change", [{"step": 6}, {"step": None}, {"checksum_block": 4096}])
async def test_parts_of_different_saves_never_merge(tmp_path: Path, change: dict[str, object]) -> None:
    # Parts of two steps were merged as one; parts of two checksum blocks were checked by rank 0's block
    # (a false mismatch, or an IndexError where the other part's chunk has fewer checksums than blocks).
    step = tmp_path / "step-00000005"
    parts = await _parts(step, 2)
    _forge(parts[1], **change)
    await _every_reader_refuses(step, aiockpt.FormatError, "cannot merge the parts", str(parts[1]))


async def test_a_part_saved_with_a_smaller_checksum_block_is_refused_not_an_index_error(
    tmp_path: Path,
) -> None:
    step = tmp_path / "step-00000005"
    await aiockpt.save(
        {"x": torch.ones(20_000)}, step / "rank-00000-of-00002", io=aiockpt.IOConfig(checksum_block=4096)
    )
    await aiockpt.save(
        {"x": torch.ones(20_000)}, step / "rank-00001-of-00002"
    )  # (4 MiB blocks: one checksum)
    with pytest.raises(aiockpt.FormatError, match="with 4096-byte blocks"):
        await aiockpt.verify(step)


def _elsewhere(entry: TensorEntry) -> TensorEntry:
    """``entry`` with its chunks moved past its file's end: the copy of an entry over the same bytes is
    refused before the merge sees it (see ``_load._manifest._shared_bytes``)."""
    chunks = tuple(msgspec.structs.replace(c, offset=c.offset + (1 << 20)) for c in entry.chunks)
    return msgspec.structs.replace(entry, chunks=chunks)


async def test_a_part_entry_listed_twice_is_refused_not_an_index_error(tmp_path: Path) -> None:
    # Rank 0's first entry listed again at index 1 (the tree's indices past it shifted): the merge, by key
    # path, folded the two into one, and rank 0's tree then indexed past the merged tensors (IndexError).
    step = tmp_path / "step-00000005"
    parts = await _parts(step, 2)
    m = _manifest(parts[0])
    tensors = (_elsewhere(m.tensors[0]), *m.tensors)
    values = tuple(TensorNode(index=v.index + 1) if isinstance(v, TensorNode) else v for v in m.tree.values)
    _forge(parts[0], tensors=tensors, tree=msgspec.structs.replace(m.tree, values=values))
    await _every_reader_refuses(
        step, aiockpt.FormatError, "its tensor entry 0 says key 'w', where its tree holds entry 1"
    )


async def test_a_part_entry_under_another_key_is_refused(tmp_path: Path) -> None:
    # Rank 1's entry of 'extra' claims the key 'w' (same dtype and shape): its bytes were merged into 'w'.
    step = tmp_path / "step-00000005"
    parts = await _parts(step, 2)
    m = _manifest(parts[1])
    (w,) = [t for t in m.tensors if t.path == ("w",)]
    extra = _elsewhere(msgspec.structs.replace(w, path=("extra",)))
    tree = DictNode(keys=(*m.tree.keys, "extra"), values=(*m.tree.values, TensorNode(index=len(m.tensors))))
    # 'w' and 'extra' swap entries: each is at the other's key path.
    tensors = (*(extra if t.path == ("w",) else t for t in m.tensors), w)
    _forge(parts[1], tensors=tensors, tree=tree)
    await _every_reader_refuses(
        step, aiockpt.FormatError, "damaged or forged: its tensor entry", "key 'extra'"
    )


@pytest.mark.parametrize("rows", [2, 1])
async def test_overlapping_boxes_of_two_parts_are_refused(tmp_path: Path, rows: int) -> None:
    # Rank 1's rows overlap rank 0's, leaving the last ones in no chunk: the elements the chunks hold added
    # up to the tensor's, so the load took it as covered and left those rows as they were (uninitialized
    # memory in a read).
    step = tmp_path / "step-00000005"
    parts = await _parts(step, 2)
    m = _manifest(parts[1])
    (shard,) = [t for t in m.tensors if t.path == ("shard",)]
    _with_entry(parts[1], ("shard",), chunks=(msgspec.structs.replace(shard.chunks[0], offsets=(rows, 0)),))
    await _every_reader_refuses(step, aiockpt.FormatError, "the chunks of key 'shard' overlap", str(parts[1]))


async def test_a_box_holding_the_whole_tensor_makes_the_others_redundant(tmp_path: Path) -> None:
    # One part's whole tensor, another's shard of it: the merge reads the whole one.
    step = tmp_path / "step-00000005"
    parts = await _parts(step, 2)
    whole = torch.cat([_state(0)["shard"], _state(1)["shard"]])  # type: ignore[list-item]
    shutil.rmtree(parts[0])
    await aiockpt.save({**_state(0), "shard": whole}, parts[0])
    _forge(parts[0], part_rank=0, world_size=2, step=5)
    assert_tree_equal(await aiockpt.read(step), _expected(2))


@pytest.mark.parametrize(
    "other", ["rank-000001-of-00002", "rank-00001-of-000002", "rank-\u0660\u0660\u0660\u0660\u0661-of-00002"]
)
async def test_only_the_name_a_save_gives_a_part_counts(tmp_path: Path, other: str) -> None:
    # Two directories for one rank: the first in name order was read (rank-000001 sorts before rank-00001),
    # here one holding other bytes; digits other than ASCII ones named a rank too.
    step = tmp_path / "step-00000005"
    parts = await _parts(step, 2)
    shutil.copytree(parts[1], step / other)
    forged = step / other
    (forged / "data-r00000.bin").write_bytes(bytes((forged / "data-r00000.bin").stat().st_size))
    assert_tree_equal(await aiockpt.read(step), _expected(2))
    # Such a name alone is no part: the rank's part is missing.
    shutil.rmtree(parts[1])
    with pytest.raises(aiockpt.CheckpointNotFoundError, match=r"ranks \[1\] \(of 2\)"):
        await aiockpt.read(step)


async def test_a_part_name_of_a_huge_world_allocates_nothing(tmp_path: Path) -> None:
    # The missing ranks were listed as a set of every rank of the world the name says: a MemoryError (or
    # minutes and gigabytes) in read, load, verify, inspect and ls.
    root = tmp_path / "root"
    step = root / "step-00000005"
    parts = await _parts(step, 2)
    shutil.rmtree(parts[1])
    parts[0].rename(step / "rank-00000-of-999999999999")
    message = (
        "ranks [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, and 999999999982 more] "
        "(of 999999999999)"
    )
    for run in (aiockpt.read, aiockpt.verify):
        with pytest.raises(aiockpt.CheckpointNotFoundError) as info:
            await run(step)
        assert message in str(info.value)
    rc, err = await asyncio.to_thread(_cli, "inspect", str(step))
    assert rc == 2, err
    assert message in err, err
    rc, err = await asyncio.to_thread(_cli, "ls", "--json", str(root))
    assert rc == 0, err


# --- Object storage --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3_bucket() -> Iterator[str]:
    pytest.importorskip("moto")
    from s3_util import s3_server

    with s3_server() as server:
        name = server.bucket()
        with server.env():
            yield name


@pytest.mark.timeout(60)
async def test_a_huge_fresh_tensor_on_object_storage_is_refused_before_it_is_allocated(
    s3_bucket: str,
) -> None:
    # A consistent entry of 1 TiB in a data object of a few bytes: the matcher, which makes fresh tensors,
    # sized only local data files, so a read from a store tried to allocate the tensor first.
    import obstore

    from aiockpt._storage import S3Path, resolve
    from aiockpt._storage._s3 import read_manifest, store

    url = f"s3://{s3_bucket}/huge"
    await aiockpt.save({"w": torch.ones(4)}, url)
    location = resolve(url)
    assert isinstance(location, S3Path)
    m = await read_manifest(location)
    n = 1 << 40
    name = m.tensors[0].chunks[0].file  # (on a store, named with the save's token)
    chunk = Chunk(offsets=(0,), sizes=(n,), file=name, offset=1 << 20, nbytes=n, checksums=(0,))
    entry = TensorEntry(path=("huge",), dtype="uint8", shape=(n,), chunks=(chunk,))
    tree = DictNode(keys=(*m.tree.keys, "huge"), values=(*m.tree.values, TensorNode(index=len(m.tensors))))
    forged = msgspec.structs.replace(m, tensors=(*m.tensors, entry), tree=tree, checksum_block=n)
    await obstore.put_async(store(location), f"huge/{MANIFEST_NAME}", _encode(forged))
    with pytest.raises(aiockpt.CorruptionError, match="data file is truncated") as info:
        await aiockpt.read(url)
    assert info.value.key == "huge"
    assert info.value.file == f"{url}/{name}"
    await obstore.delete_async(store(location), f"huge/{name}")
    with pytest.raises(aiockpt.CorruptionError, match="data file is missing"):
        await aiockpt.read(url)
