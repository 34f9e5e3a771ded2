"""Integrity of foreign sources: safetensors offsets must tile the data, zip records must match their CRC-32.

safetensors headers are checked as the reference reader checks them (each case is also refused, or
accepted, by ``safetensors`` itself). DCP checkpoints are written by ``dcp.save`` and damaged by hand: a
flipped byte in a tensor's record, read in place, resharded or decoded, or in a value's pickle, is
reported naming the key and the ``.distcp`` file (neither ``torch.load`` nor ``dcp.load`` notices it).
``torch.save`` files are damaged the same way: in a tensor's record or in ``data.pkl``.
"""

from __future__ import annotations

import concurrent.futures
import io
import json
import os
import pickle
import random
import struct
import warnings
import zipfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from conftest import assert_tree_equal, fifo_in_place_of, random_tensor
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

import aiockpt
from aiockpt._interop import _records
from aiockpt._interop._dcp import DcpSource
from aiockpt._interop._dcp import read_metadata as read_dcp_metadata
from aiockpt._interop._safetensors import SafetensorsSource
from aiockpt._interop._torchblob import stored_records
from aiockpt._interop._torchfile import TorchFileSource, is_torch_file
from aiockpt._load._match import Destination

# --- safetensors: the tensors must tile the data section ----------------------------------------------------


def _entry(start: int, end: int, shape: list[int] | None = None) -> dict[str, object]:
    return {"dtype": "U8", "shape": [end - start] if shape is None else shape, "data_offsets": [start, end]}


def _write_safetensors(file: Path, header: dict[str, object], data: bytes) -> None:
    raw = json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


@pytest.mark.parametrize(
    ("header", "size", "message", "key"),
    [
        pytest.param(
            {"a": _entry(0, 4), "b": _entry(2, 6)},
            6,
            r"'b' \(bytes 2\.\.6\) starts inside 'a'",
            "b",
            id="overlap",
        ),
        pytest.param(
            {"a": _entry(0, 4), "b": _entry(0, 4)},
            4,
            r"'b' \(bytes 0\.\.4\) starts inside 'a'",
            "b",
            id="same",
        ),
        pytest.param(
            {"a": _entry(0, 4), "b": _entry(6, 8)},
            8,
            r"bytes 4\.\.6, between 'a' and 'b', belong to no tensor",
            "b",
            id="gap",
        ),
        pytest.param(
            {"a": _entry(2, 4)},
            4,
            r"bytes 0\.\.2, before the first tensor 'a', belong to no tensor",
            "a",
            id="first",
        ),
        pytest.param(
            {"a": _entry(0, 4)},
            6,
            r"bytes 4\.\.6, after the last tensor 'a', belong to no tensor",
            "a",
            id="after",
        ),
        pytest.param({}, 2, r"bytes 0\.\.2 belong to no tensor", None, id="no-tensor"),
        pytest.param(
            {"a": _entry(0, 4), "z": _entry(2, 2, [0, 3]), "b": _entry(4, 8)},
            8,
            r"'z' \(bytes 2\.\.2\) starts inside 'a'",
            "z",
            id="empty-inside",
        ),
    ],
)
async def test_safetensors_offsets_that_do_not_tile_the_data_are_refused(
    tmp_path: Path, header: dict[str, object], size: int, message: str, key: str | None
) -> None:
    # Accepted as they said: two names could be views of the same bytes, or bytes of none.
    file = tmp_path / "m.safetensors"
    _write_safetensors(file, header, bytes(range(size)))
    with pytest.raises(SafetensorError):  # the reference reader refuses each of them
        load_file(file)
    with pytest.raises(aiockpt.CorruptionError, match=message) as info:
        await aiockpt.read(file)
    assert info.value.file == str(file)
    assert info.value.key == key
    with pytest.raises(aiockpt.CorruptionError, match=message):
        await aiockpt.load({name: torch.zeros(1) for name in header}, file, strict=False)


@pytest.mark.parametrize(
    "header",
    [
        pytest.param({"z": _entry(0, 0, [0]), "a": _entry(0, 4)}, id="first"),
        pytest.param({"a": _entry(0, 4), "z": _entry(4, 4, [0])}, id="last"),
        pytest.param(
            {"a": _entry(0, 4), "z": _entry(4, 4, [0, 3]), "y": _entry(4, 4, [0]), "b": _entry(4, 8)},
            id="between",
        ),
        pytest.param({"z": _entry(0, 0, [0])}, id="alone"),
    ],
)
async def test_safetensors_zero_size_tensors_at_a_boundary_are_read_as_the_library_reads_them(
    tmp_path: Path, header: dict[str, object]
) -> None:
    file = tmp_path / "m.safetensors"
    size = max(e["data_offsets"][1] for e in header.values())  # type: ignore[index]
    _write_safetensors(file, header, bytes(range(size)))
    ours, theirs = await aiockpt.read(file), load_file(file)
    # (The library orders tensors at the same offset as its hash map iterates them: compared sorted.)
    assert_tree_equal(dict(sorted(ours.items())), dict(sorted(theirs.items())))


async def test_safetensors_shard_with_a_gap_names_the_shard(tmp_path: Path) -> None:
    directory = tmp_path / "hf"
    directory.mkdir()
    save_file({"a": torch.ones(4)}, directory / "model-00001-of-00002.safetensors")
    _write_safetensors(directory / "model-00002-of-00002.safetensors", {"b": _entry(0, 4)}, b"\0" * 12)
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(aiockpt.CorruptionError, match="after the last tensor 'b'") as info:
        await aiockpt.read(directory)
    assert info.value.file == str(directory / "model-00002-of-00002.safetensors")


# --- DCP: every record read matches its CRC-32 -----------------------------------------------------------


def _dcp_save(state: dict[str, Any], path: Path) -> None:
    from torch.distributed.checkpoint import state_dict_saver as dcp

    with warnings.catch_warnings():  # "saving in a single process": exactly what these tests want
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=path)


def _record(
    directory: Path, fqn: str, suffix: str, offsets: tuple[int, ...] | None = None
) -> tuple[Path, int, int]:
    """The ``.distcp`` file of ``fqn``'s blob, and the file offset and length of its record ``*suffix``."""
    md = pickle.loads((directory / ".metadata").read_bytes())
    (info,) = [
        v for k, v in md.storage_data.items() if k.fqn == fqn and (offsets is None or k.offset == offsets)
    ]
    file = directory / info.relative_path
    start, length = _in_archive(file.read_bytes()[info.offset : info.offset + info.length], suffix)
    return file, info.offset + start, length


def _in_archive(blob: bytes, suffix: str) -> tuple[int, int]:
    """The offset and length of the bytes of the record ``*suffix`` of the zip archive ``blob``."""
    with zipfile.ZipFile(io.BytesIO(blob)) as zf:
        (record,) = [i for i in zf.infolist() if i.filename.endswith(suffix)]
    name_len, extra_len = struct.unpack_from("<HH", blob, record.header_offset + 26)
    return record.header_offset + 30 + name_len + extra_len, record.file_size


def _flip(file: Path, at: int) -> None:
    data = bytearray(file.read_bytes())
    data[at] ^= 0x01
    file.write_bytes(bytes(data))


def _state(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "w": random_tensor(torch.float32, (16, 8), gen),
        "b": random_tensor(torch.bfloat16, (8,), gen),
        "i": random_tensor(torch.int64, (3, 3), gen),
    }


async def test_dcp_flipped_byte_in_a_record_read_in_place_names_key_and_file(tmp_path: Path) -> None:
    # Read straight into the target's memory without a check: the values were silently wrong.
    state = _state(0)
    _dcp_save(state, tmp_path / "d")
    file, start, length = _record(tmp_path / "d", "w", "/data/0")
    _flip(file, start + length // 2)
    target: dict[str, object] = {k: torch.zeros_like(v) for k, v in state.items()}
    with pytest.raises(aiockpt.CorruptionError, match=r"checksum mismatch in .*\.distcp for key 'w'") as info:
        await aiockpt.load(target, tmp_path / "d")
    assert (info.value.key, info.value.file) == ("w", str(file))
    with pytest.raises(aiockpt.CorruptionError, match="its zip record's CRC-32") as info:
        await aiockpt.read(tmp_path / "d")
    assert (info.value.key, info.value.file) == ("w", str(file))
    # Loading only the undamaged keys still works: only the records read are checked.
    rest: dict[str, object] = {k: torch.zeros_like(v) for k, v in state.items() if k != "w"}
    with pytest.warns(aiockpt.StateMismatchWarning):
        await aiockpt.load(rest, tmp_path / "d", strict=False)
    assert_tree_equal(rest, {k: v for k, v in state.items() if k != "w"})


def _two_chunks(path: Path) -> torch.Tensor:
    """A DCP checkpoint whose tensor ``x`` (4 x 4) is stored as two chunks of two rows (as two ranks save)."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    whole = torch.arange(16, dtype=torch.float32).reshape(4, 4)
    _dcp_save({"x": whole[:2].clone(), "y": whole[2:].clone()}, path)
    file = path / ".metadata"
    md = pickle.loads(file.read_bytes())
    del md.state_dict_metadata["y"]
    x = md.state_dict_metadata["x"]
    x.size = torch.Size([4, 4])
    x.chunks = [x.chunks[0], ChunkStorageMetadata(offsets=torch.Size([2, 0]), sizes=torch.Size([2, 4]))]
    md.storage_data[MetadataIndex("x", (2, 0))] = md.storage_data.pop(MetadataIndex("y", (0, 0)))
    md.planner_data = {"x": ("x",)}
    file.write_bytes(pickle.dumps(md))
    return whole


@pytest.mark.parametrize("target", ["rows in place", "non-contiguous", "read"])
async def test_dcp_flipped_byte_in_a_chunk_of_a_sharded_tensor_is_found(tmp_path: Path, target: str) -> None:
    # Rows read into place are checked there; a non-contiguous target is read through a host tensor, so
    # its records are read again from the file.
    whole = _two_chunks(tmp_path / "d")
    assert_tree_equal(await aiockpt.read(tmp_path / "d"), {"x": whole})
    file, start, _ = _record(tmp_path / "d", "x", "/data/0", (2, 0))
    _flip(file, start + 5)
    dest = torch.zeros(4, 4) if target == "rows in place" else torch.zeros(4, 4).t()
    if target == "read":
        with pytest.raises(aiockpt.CorruptionError, match="for key 'x'") as info:
            await aiockpt.read(tmp_path / "d")
    else:
        with pytest.raises(aiockpt.CorruptionError, match="for key 'x'") as info:
            await aiockpt.load({"x": dest}, tmp_path / "d")
    assert info.value.file == str(file)


async def test_dcp_resharded_read_checks_whole_records_even_beyond_the_shard(tmp_path: Path) -> None:
    # A shard of rows 1..3 needs part of each chunk: both are read whole (into host buffers) and both
    # records are checked, so damage to row 0, which the shard does not hold, is found too.
    whole = _two_chunks(tmp_path / "d")
    source = DcpSource(tmp_path / "d", allow_pickle=False)
    try:
        shard = torch.zeros(2, 4)
        await source.fill(
            source.manifest, {0: Destination(0, shard, False, offsets=(1, 0))}, threads=2, limiter=None
        )
        assert torch.equal(shard, whole[1:3])
        file, start, _ = _record(tmp_path / "d", "x", "/data/0", (0, 0))
        _flip(file, start + 2)  # an element of row 0
        with pytest.raises(aiockpt.CorruptionError, match="for key 'x'"):
            await source.fill(
                source.manifest, {0: Destination(0, shard, False, offsets=(1, 0))}, threads=2, limiter=None
            )
    finally:
        source.close()


async def test_dcp_tied_targets_load_without_a_false_alarm_and_damage_is_still_found(tmp_path: Path) -> None:
    # Two keys, one tensor in the target (tied weights): its memory ends with the later key's values, so
    # the earlier key's record is checked from the file, not there.
    a, b = torch.full((8,), 1.0), torch.full((8,), 2.0)
    _dcp_save({"a": a, "b": b}, tmp_path / "d")
    tied = torch.zeros(8)
    await aiockpt.load({"a": tied, "b": tied}, tmp_path / "d")
    assert torch.equal(tied, b)
    file, start, _ = _record(tmp_path / "d", "a", "/data/0")
    _flip(file, start)
    with pytest.raises(aiockpt.CorruptionError, match="for key 'a'"):
        await aiockpt.load({"a": tied, "b": tied}, tmp_path / "d")


async def test_dcp_flipped_byte_in_a_decoded_chunk_names_its_record(tmp_path: Path) -> None:
    # A channels-last tensor is decoded with torch.load, which checks no CRC: silently wrong values.
    gen = torch.Generator().manual_seed(1)
    t = random_tensor(torch.float32, (2, 3, 4, 5), gen).to(memory_format=torch.channels_last)
    _dcp_save({"t": t}, tmp_path / "d")
    file, start, _ = _record(tmp_path / "d", "t", "/data/0")
    _flip(file, start + 7)
    with pytest.raises(aiockpt.CorruptionError, match=r"key 't': its zip record '.*data/0'") as info:
        await aiockpt.load({"t": torch.zeros_like(t)}, tmp_path / "d")
    assert (info.value.key, info.value.file) == ("t", str(file))


async def test_dcp_flipped_byte_in_a_tensor_recipe_is_found(tmp_path: Path) -> None:
    # data.pkl's requires_grad False -> True: torch.load decoded it without a word.
    _dcp_save({"w": torch.ones(3)}, tmp_path / "d")
    file, start, length = _record(tmp_path / "d", "w", "data.pkl")
    recipe = file.read_bytes()[start : start + length]
    assert recipe.count(b"\x89") == 1  # NEWFALSE: the tensor's requires_grad
    _flip(file, start + recipe.index(b"\x89"))
    with pytest.raises(aiockpt.CorruptionError, match=r"key 'w': its zip record '.*data\.pkl'"):
        await aiockpt.read(tmp_path / "d")


async def test_dcp_flipped_byte_in_a_value_names_its_key(tmp_path: Path) -> None:
    # A str value's pickle: "run-a" became "run-`" without a word.
    _dcp_save({"w": torch.ones(2), "name": "run-a"}, tmp_path / "d")
    file, start, length = _record(tmp_path / "d", "name", "data.pkl")
    _flip(file, start + file.read_bytes()[start : start + length].index(b"run-a") + 4)
    with pytest.raises(aiockpt.CorruptionError, match="key 'name'") as info:
        await aiockpt.read(tmp_path / "d")
    assert (info.value.key, info.value.file) == ("name", str(file))


@pytest.fixture
def without_crcs() -> Iterator[None]:
    """``torch.save`` writes no CRC-32 (0) for the duration of the test."""
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(True)


@pytest.mark.usefixtures("without_crcs")
async def test_dcp_saved_without_crcs_loads_in_place_unchecked(tmp_path: Path) -> None:
    # torch.save writes CRC 0 for every record then (zipfile refuses such records): read in place, as
    # others are, with nothing to check them against.
    state = _state(2)
    _dcp_save({**state, "name": "run-a"}, tmp_path / "d")
    source = DcpSource(tmp_path / "d", allow_pickle=False)
    source.close()
    assert source.decoded == set()
    assert source.crcs == {}
    target: dict[str, object] = {**{k: torch.zeros_like(v) for k, v in state.items()}, "name": ""}
    await aiockpt.load(target, tmp_path / "d")
    assert_tree_equal(target, {**state, "name": "run-a"})
    file, start, length = _record(tmp_path / "d", "w", "/data/0")
    _flip(file, start + length // 2)
    await aiockpt.load(target, tmp_path / "d")  # cannot be checked: loaded as it is
    assert not torch.equal(target["w"], state["w"])  # type: ignore[arg-type]


@pytest.fixture
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Records checked in blocks of 4 KiB, all on worker threads (each CRC combined from its blocks')."""
    monkeypatch.setattr(_records, "_BLOCK", 4096)
    monkeypatch.setattr(_records, "_ONE_THREAD", 0)
    monkeypatch.setattr(_records, "_INLINE", 0)


@pytest.mark.usefixtures("small_blocks")
async def test_dcp_large_records_are_checked_in_blocks_on_several_threads(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(3)
    state = {f"t{i}": random_tensor(torch.float32, (1000 + 37 * i,), gen) for i in range(6)}
    _dcp_save(state, tmp_path / "d")
    target: dict[str, object] = {k: torch.zeros_like(v) for k, v in state.items()}
    await aiockpt.load(target, tmp_path / "d", io=aiockpt.IOConfig(threads=3))
    assert_tree_equal(target, state)
    file, start, length = _record(tmp_path / "d", "t5", "/data/0")
    _flip(file, start + length - 1)  # in its last block
    with pytest.raises(aiockpt.CorruptionError, match="for key 't5'"):
        await aiockpt.load(target, tmp_path / "d", io=aiockpt.IOConfig(threads=3))


async def test_dcp_bytes_changed_in_memory_are_told_from_a_damaged_file(tmp_path: Path) -> None:
    # The check made where the bytes were read is made again from the file to say which one differs.
    _dcp_save({"w": torch.ones(4)}, tmp_path / "d")
    source = DcpSource(tmp_path / "d", allow_pickle=False)
    source.close()
    never_read = torch.zeros(4)
    with pytest.raises(aiockpt.CorruptionError, match="the file's bytes match it: they changed on their way"):
        await _records.check_records(
            tmp_path / "d",
            source.manifest,
            {0: Destination(0, never_read, False)},
            source.crcs,
            threads=1,
            limiter=None,
        )


# --- torch.save files: every record a load uses matches its CRC-32 ---------------------------------------


def _pt_save(state: dict[str, Any], file: Path, suffix: str) -> tuple[int, int]:
    """``torch.save`` ``state`` as ``file``; the offset and length of its record ``*suffix``."""
    torch.save(state, file)
    return _in_archive(file.read_bytes(), suffix)


def _zeros(state: dict[str, Any]) -> dict[str, Any]:
    """A target of ``state``'s shape: zero tensors, and the other values as they are."""
    return {
        k: _zeros(v) if isinstance(v, dict) else torch.zeros_like(v) if isinstance(v, torch.Tensor) else v
        for k, v in state.items()
    }


async def test_torch_save_flipped_byte_in_a_tensor_names_key_and_file(tmp_path: Path) -> None:
    # torch.load(mmap=True) maps the record as the tensor's bytes, unchecked: silently wrong values.
    model = _state(4)
    state: dict[str, Any] = {"model": model, "step": 3}
    file = tmp_path / "x.pt"
    start, length = _pt_save(state, file, "/data/0")  # (storages are numbered in pickling order: w's)
    assert file.read_bytes()[start : start + length] == model["w"].numpy().tobytes()
    assert_tree_equal(await aiockpt.read(file), state)  # undamaged: bit-exact
    target = _zeros(state)
    await aiockpt.load(target, file)
    assert_tree_equal(target, state)
    _flip(file, start + length // 2)
    target = _zeros(state)
    with pytest.raises(
        aiockpt.CorruptionError, match=r"checksum mismatch in .*x\.pt for key 'model/w'"
    ) as info:
        await aiockpt.load(target, file)
    assert (info.value.key, info.value.file) == ("model/w", str(file))
    assert_tree_equal(target, _zeros(state))  # checked before anything is copied
    with pytest.raises(aiockpt.CorruptionError, match="its zip record's CRC-32") as info:
        await aiockpt.read(file)
    assert (info.value.key, info.value.file) == ("model/w", str(file))
    # Loading only the undamaged keys still works: only the records copied from are checked.
    rest: dict[str, object] = {"model": {k: torch.zeros_like(v) for k, v in model.items() if k != "w"}}
    with pytest.warns(aiockpt.StateMismatchWarning):
        await aiockpt.load(rest, file, strict=False)
    assert_tree_equal(rest["model"], {k: v for k, v in model.items() if k != "w"})


async def test_torch_save_view_is_checked_over_its_whole_storage(tmp_path: Path) -> None:
    # torch.save writes a view's whole storage as its record: a flip outside the view is damage all the same.
    base = torch.arange(16, dtype=torch.float32)
    file = tmp_path / "x.pt"
    start, _ = _pt_save({"a": torch.ones(2), "v": base[8:]}, file, "/data/1")
    _flip(file, start + 1)  # an element of base[:8], outside the view
    target: dict[str, object] = {"a": torch.zeros(2), "v": torch.zeros(8)}
    with pytest.raises(aiockpt.CorruptionError, match="for key 'v'"):
        await aiockpt.load(target, file)
    a = torch.zeros(2)
    with pytest.warns(aiockpt.StateMismatchWarning):
        await aiockpt.load({"a": a}, file, strict=False)
    assert torch.equal(a, torch.ones(2))


@pytest.mark.parametrize("flip", ["key", "stop"])
async def test_torch_save_flipped_byte_in_the_pickle_names_the_file(tmp_path: Path, flip: str) -> None:
    # The key "w" became "v" without a word; a damaged STOP opcode was refused as an object that
    # torch.load(weights_only=True) does not allow ("pass allow_pickle=True if you trust this file").
    file = tmp_path / "x.pt"
    start, length = _pt_save({"w": torch.ones(3)}, file, "data.pkl")
    pickled = file.read_bytes()[start : start + length]
    assert pickled.count(b"X\x01\x00\x00\x00w") == 1  # BINUNICODE "w"
    assert pickled.endswith(b".")  # STOP
    _flip(file, start + (pickled.index(b"X\x01\x00\x00\x00w") + 5 if flip == "key" else length - 1))
    with pytest.raises(
        aiockpt.CorruptionError, match=r"checksum mismatch in .*x\.pt: its zip record '.*data\.pkl'"
    ) as info:
        await aiockpt.read(file)
    assert (info.value.key, info.value.file) == (None, str(file))
    with pytest.raises(aiockpt.CorruptionError, match=r"'.*data\.pkl'"):
        await aiockpt.load({"w": torch.zeros(3)}, file, allow_pickle=True)


@pytest.mark.usefixtures("without_crcs")
async def test_torch_save_saved_without_crcs_loads_unchecked(tmp_path: Path) -> None:
    state = _state(5)
    file = tmp_path / "x.pt"
    start, length = _pt_save(state, file, "/data/0")
    assert_tree_equal(await aiockpt.read(file), state)
    target = _zeros(state)
    await aiockpt.load(target, file)
    assert_tree_equal(target, state)
    _flip(file, start + length // 2)
    await aiockpt.load(target, file)  # cannot be checked: loaded as it is
    assert not torch.equal(target["w"], state["w"])


@pytest.mark.usefixtures("small_blocks")
async def test_torch_save_large_records_are_checked_in_blocks_on_several_threads(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(6)
    state = {f"t{i}": random_tensor(torch.float32, (1000 + 37 * i,), gen) for i in range(6)}
    file = tmp_path / "x.pt"
    start, length = _pt_save(state, file, "/data/5")
    target = _zeros(state)
    await aiockpt.load(target, file, io=aiockpt.IOConfig(threads=3))
    assert_tree_equal(target, state)
    _flip(file, start + length - 1)  # in its last block
    with pytest.raises(aiockpt.CorruptionError, match="for key 't5'"):
        await aiockpt.load(target, file, io=aiockpt.IOConfig(threads=3))


@dataclass
class Holder:
    """An object holding a tensor: pickled whole into the tree ``read`` returns, its tensor included."""

    t: torch.Tensor


async def test_torch_save_tensor_inside_a_pickled_object_is_checked(tmp_path: Path) -> None:
    file = tmp_path / "x.pt"
    start, length = _pt_save({"w": torch.ones(4), "h": Holder(torch.arange(4.0))}, file, "/data/1")
    holder = (await aiockpt.read(file, allow_pickle=True))["h"]
    assert isinstance(holder, Holder)
    assert torch.equal(holder.t, torch.arange(4.0))
    _flip(file, start + length - 1)
    with pytest.raises(aiockpt.CorruptionError, match=r"for its zip record '.*/data/1'") as info:
        await aiockpt.read(file, allow_pickle=True)
    assert (info.value.key, info.value.file) == (None, str(file))


async def test_torch_save_not_mapped_has_every_record_checked(tmp_path: Path) -> None:
    # A deflated data.pkl: torch.load then reads every storage into memory of its own, where no record
    # can be told from its address. Every (stored) record is checked, named as a record.
    state = _state(7)
    plain = io.BytesIO()
    torch.save(state, plain)
    file = tmp_path / "x.pt"
    with zipfile.ZipFile(plain) as src, zipfile.ZipFile(file, "w") as dst:
        for info in src.infolist():
            kind = zipfile.ZIP_DEFLATED if info.filename.endswith("data.pkl") else zipfile.ZIP_STORED
            dst.writestr(zipfile.ZipInfo(info.filename), src.read(info), compress_type=kind)
    assert_tree_equal(await aiockpt.read(file), state)
    start, _ = _in_archive(file.read_bytes(), "/data/2")
    _flip(file, start)
    with pytest.raises(aiockpt.CorruptionError, match=r"for its zip record '.*/data/2'"):
        await aiockpt.load(_zeros(state), file)
    source = TorchFileSource(file, allow_pickle=False)
    source.close()
    assert source.located == [None] * 3  # (the case this test is about)
    assert len(source.unheld) == 3


@pytest.mark.parametrize("to", ["aiockpt", "torch", "safetensors", "dcp"])
async def test_convert_from_a_damaged_torch_save_file_leaves_nothing(tmp_path: Path, to: str) -> None:
    file = tmp_path / "x.pt"
    start, length = _pt_save(_state(8), file, "/data/1")
    _flip(file, start + length // 2)
    dst = tmp_path / ("out.safetensors" if to == "safetensors" else "out")
    with pytest.raises(aiockpt.CorruptionError, match="for key 'b'"):
        await aiockpt.convert(file, dst, to=to)  # type: ignore[arg-type]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.pt"]


def test_crc32_combine_is_zlibs() -> None:
    rng = random.Random(0)
    data = rng.randbytes(10_000)
    for cut in (0, 1, 7, 4096, 9_999, 10_000):
        a, b = data[:cut], data[cut:]
        assert _records.crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(data)


async def test_a_fifo_for_a_safetensors_shard_is_an_error_naming_it_not_a_hang(tmp_path: Path) -> None:
    directory = tmp_path / "hf"
    directory.mkdir()
    shards = {"model-00001-of-00002.safetensors": "a", "model-00002-of-00002.safetensors": "b"}
    for file, key in shards.items():
        save_file({key: torch.ones(64)}, directory / file)
    index = {"weight_map": {key: file for file, key in shards.items()}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    shard = directory / "model-00002-of-00002.safetensors"
    fifo_in_place_of(shard)
    with anyio.fail_after(30), pytest.raises(aiockpt.StorageError, match="not a regular file") as info:
        await aiockpt.read(directory)
    assert info.value.path == str(shard)


@pytest.mark.parametrize("op", ["read", "load"])
async def test_a_fifo_for_a_dcp_data_file_is_an_error_naming_it_not_a_hang(op: str, tmp_path: Path) -> None:
    state = {"w": torch.randn(64), "b": torch.randn(8)}
    _dcp_save(state, tmp_path / "d")
    (data,) = (tmp_path / "d").glob("*.distcp")
    fifo_in_place_of(data)
    call = (
        partial(aiockpt.read, tmp_path / "d")
        if op == "read"
        else partial(aiockpt.load, _zeros(state), tmp_path / "d")
    )
    with anyio.fail_after(30), pytest.raises(aiockpt.StorageError, match="not a regular file") as info:
        await call()
    assert info.value.path == str(data)


def _not_blocked(call: Callable[[], object], fifo: Path) -> object:
    """``call()``, which must not wait on ``fifo``: one that does is failed (its thread let go), not hung."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(call)
        try:
            return future.result(timeout=15)
        except concurrent.futures.TimeoutError:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # a writer: the blocked open returns
            pytest.fail(f"blocked opening the FIFO {fifo}")


def test_a_fifo_swapped_in_for_a_torch_file_after_detection_is_no_torch_file(tmp_path: Path) -> None:
    file = tmp_path / "x.pt"
    torch.save({"a": torch.ones(4)}, file)
    fifo_in_place_of(file)
    assert _not_blocked(partial(is_torch_file, file), file) is False
    assert _not_blocked(partial(stored_records, file), file) is None


def test_a_fifo_for_dcp_metadata_is_an_error_naming_it_not_a_hang(tmp_path: Path) -> None:
    _dcp_save({"w": torch.randn(8)}, tmp_path / "d")
    metadata = tmp_path / "d" / ".metadata"
    fifo_in_place_of(metadata)
    with pytest.raises(aiockpt.StorageError, match="not a regular file") as info:
        _not_blocked(partial(read_dcp_metadata, tmp_path / "d", allow_pickle=False), metadata)
    assert info.value.path == str(metadata)


def test_a_fifo_swapped_in_for_a_safetensors_index_is_an_error_not_a_hang(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = tmp_path / "hf"
    directory.mkdir()
    save_file({"a": torch.ones(4)}, directory / "model-00001-of-00001.safetensors")
    index = directory / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "model-00001-of-00001.safetensors"}}))
    fifo_in_place_of(index)
    monkeypatch.setattr(Path, "is_file", lambda self: True)  # as if swapped in after the check
    with pytest.raises(aiockpt.FormatError, match="not a regular file"):
        _not_blocked(partial(SafetensorsSource, directory), index)
