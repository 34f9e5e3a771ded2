"""Bad input and damaged checkpoints: every failure is a CheckpointError that names what is wrong."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
from conftest import (
    assert_tree_equal,
    dir_tree,
    exists,
    file_size,
    flip_byte,
    listdir,
    snapshot,
    tensor_at,
    tmp_entries,
)

import aiockpt
from aiockpt import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptionError,
    FormatError,
    SaveState,
    StateError,
)
from aiockpt._save import _read_summary

pytestmark = pytest.mark.timeout(60)

DATA = "data-r00000.bin"
MANIFEST = "manifest.msgpack"


class Custom:
    """A user class: only storable with allow_pickle=True. Module level so that pickle finds it."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return type(other) is Custom and other.value == self.value

    def __hash__(self) -> int:
        return hash(self.value)


def truncate(path: Path, size: int) -> None:
    os.truncate(path, size)


def write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def read_bytes(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def mkdir(path: Path) -> None:
    os.makedirs(path)


def append_bytes(path: Path, data: bytes) -> None:
    with open(path, "ab") as f:
        f.write(data)


async def read_or_load(op: str, path: Path, target: dict[str, object]) -> None:
    if op == "read":
        await aiockpt.read(path)
    else:
        await aiockpt.load(target, path)


async def save_either(state: dict[str, object], path: Path, *, async_op: bool) -> None:
    if async_op:
        handle = await aiockpt.save(state, path, async_op=True)
        await handle
    else:
        await aiockpt.save(state, path)


async def saved(path: Path) -> dict[str, object]:
    """Save a small state with one large tensor (the bulk of the data file) and return a copy of it."""
    state: dict[str, object] = {
        "weights": torch.arange(4096, dtype=torch.float32),
        "step": 5,
    }
    await aiockpt.save(state, path)
    result = snapshot(state)
    assert isinstance(result, dict)
    return result


# --- Not a checkpoint -----------------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["read", "load"])
async def test_missing_path(op: str, tmp_path: Path) -> None:
    path = tmp_path / "nope"
    with pytest.raises(CheckpointNotFoundError, match="nope"):
        await read_or_load(op, path, {"x": torch.zeros(1)})
    assert not exists(path)


async def test_empty_directory_is_not_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError, match=re.escape(str(tmp_path))):
        await aiockpt.read(tmp_path)
    with pytest.raises(CheckpointNotFoundError):
        await aiockpt.load({"x": torch.zeros(1)}, tmp_path)
    assert listdir(tmp_path) == []


async def test_directory_of_random_files_is_not_a_checkpoint(tmp_path: Path) -> None:
    write_file(tmp_path / "notes.txt", b"hello")
    write_file(tmp_path / DATA, os.urandom(100))
    with pytest.raises(CheckpointNotFoundError):
        await aiockpt.read(tmp_path)
    assert listdir(tmp_path) == sorted(["notes.txt", DATA])


async def test_regular_file_is_not_a_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "file.bin"
    write_file(path, b"not a checkpoint")
    with pytest.raises(CheckpointNotFoundError):
        await aiockpt.read(path)


@pytest.mark.parametrize(
    "content",
    [b"", b"garbage", b"\x00" * 64, b"\x82\xa5magic\xa3bad"],
    ids=["empty", "text", "zeros", "msgpack"],
)
async def test_foreign_manifest_is_a_format_error(content: bytes, tmp_path: Path) -> None:
    write_file(tmp_path / MANIFEST, content)
    with pytest.raises(FormatError, match=MANIFEST) as info:
        await aiockpt.read(tmp_path)
    assert info.value.file is not None
    assert info.value.file.endswith(MANIFEST)


# --- Never overwrite ------------------------------------------------------------------------------------


@pytest.mark.parametrize("async_op", [False, True], ids=["sync_save", "async_save"])
async def test_save_over_existing_checkpoint_is_refused(async_op: bool, ckpt_path: Path) -> None:
    expected = await saved(ckpt_path)
    tree = dir_tree(ckpt_path)
    manifest = read_bytes(ckpt_path / MANIFEST)
    data = read_bytes(ckpt_path / DATA)
    other: dict[str, object] = {"weights": torch.zeros(3)}
    with pytest.raises(CheckpointExistsError, match=re.escape(str(ckpt_path))):
        await save_either(other, ckpt_path, async_op=async_op)
    assert dir_tree(ckpt_path) == tree
    assert read_bytes(ckpt_path / MANIFEST) == manifest
    assert read_bytes(ckpt_path / DATA) == data
    assert tmp_entries(ckpt_path.parent) == []
    assert_tree_equal(await aiockpt.read(ckpt_path), expected)


@pytest.mark.parametrize("kind", ["empty_dir", "file"])
async def test_save_over_any_existing_path_is_refused(kind: str, ckpt_path: Path) -> None:
    if kind == "empty_dir":
        mkdir(ckpt_path)
    else:
        write_file(ckpt_path, b"precious")
    with pytest.raises(CheckpointExistsError):
        await aiockpt.save({"x": torch.ones(1)}, ckpt_path)
    if kind == "empty_dir":
        assert listdir(ckpt_path) == []
    else:
        assert read_bytes(ckpt_path) == b"precious"
    assert tmp_entries(ckpt_path.parent) == []


async def test_path_appearing_during_an_async_save_is_not_overwritten(ckpt_path: Path) -> None:
    handle = await aiockpt.save({"x": torch.randn(1 << 18)}, ckpt_path, async_op=True)
    mkdir(ckpt_path)  # someone else takes the name while ours is being written
    write_file(ckpt_path / "theirs", b"theirs")
    with pytest.raises(CheckpointExistsError):
        await handle
    assert handle.done()
    assert handle.state is SaveState.FAILED
    assert listdir(ckpt_path) == ["theirs"]
    assert tmp_entries(ckpt_path.parent) == []


async def test_cancelled_async_save_leaves_nothing(ckpt_path: Path) -> None:
    handle = await aiockpt.save({"x": torch.randn(1 << 20)}, ckpt_path, async_op=True)
    handle.cancel()
    with pytest.raises(aiockpt.CheckpointCancelledError):
        await handle
    assert handle.state is SaveState.CANCELLED
    assert handle.done()
    assert not exists(ckpt_path)
    assert tmp_entries(ckpt_path.parent) == []


# --- Damaged data ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["read", "load"])
async def test_flipped_data_byte_is_a_corruption_error(op: str, ckpt_path: Path) -> None:
    await saved(ckpt_path)
    data = ckpt_path / DATA
    flip_byte(data, file_size(data) // 2)
    with pytest.raises(CorruptionError) as info:
        await read_or_load(op, ckpt_path, {"weights": torch.zeros(4096), "step": 0})
    err = info.value
    assert "weights" in str(err)
    assert DATA in str(err)
    assert err.key == "weights"
    assert err.file is not None
    assert Path(err.file).name == DATA
    assert isinstance(err, FormatError)


async def test_flipped_byte_names_the_damaged_key_among_many(ckpt_path: Path) -> None:
    state: dict[str, object] = {f"t{i}": torch.full((256,), float(i)) for i in range(8)}
    await aiockpt.save(state, ckpt_path)
    good = read_bytes(ckpt_path / DATA)
    needle = torch.full((256,), 5.0).numpy().tobytes()
    offset = good.find(needle)
    assert offset >= 0
    flip_byte(ckpt_path / DATA, offset + 100)
    with pytest.raises(CorruptionError) as info:
        await aiockpt.read(ckpt_path)
    assert info.value.key == "t5"
    assert "t5" in str(info.value)


@pytest.mark.parametrize("keep", [0.0, 0.5, 0.99])
async def test_truncated_data_file_is_a_corruption_error(keep: float, ckpt_path: Path) -> None:
    await saved(ckpt_path)
    data = ckpt_path / DATA
    truncate(data, int(file_size(data) * keep))
    with pytest.raises(CorruptionError, match=DATA) as info:
        await aiockpt.read(ckpt_path)
    assert info.value.file is not None
    assert Path(info.value.file).name == DATA
    assert "weights" in str(info.value)


async def test_missing_data_file_is_a_corruption_error(ckpt_path: Path) -> None:
    await saved(ckpt_path)
    os.unlink(ckpt_path / DATA)
    with pytest.raises(CorruptionError, match=DATA):
        await aiockpt.read(ckpt_path)


async def test_failed_load_leaves_the_checkpoint_readable_after_repair(ckpt_path: Path) -> None:
    expected = await saved(ckpt_path)
    data = ckpt_path / DATA
    original = read_bytes(data)
    flip_byte(data, 10)
    with pytest.raises(CorruptionError):
        await aiockpt.read(ckpt_path)
    write_file(data, original)
    assert_tree_equal(await aiockpt.read(ckpt_path), expected)


# --- Damaged manifest -----------------------------------------------------------------------------------


async def test_every_flipped_manifest_byte_is_detected(ckpt_path: Path) -> None:
    await saved(ckpt_path)
    manifest = ckpt_path / MANIFEST
    original = read_bytes(manifest)
    undetected: list[int] = []
    messages: dict[int, str] = {}
    for offset in range(len(original)):
        flip_byte(manifest, offset)
        try:
            await aiockpt.read(ckpt_path)
        except FormatError as exc:
            messages[offset] = str(exc)
        else:
            undetected.append(offset)
        write_file(manifest, original)
    assert undetected == [], f"flipping these bytes of a {len(original)}-byte manifest went unnoticed"
    unnamed = {k: v for k, v in messages.items() if MANIFEST not in v}
    assert unnamed == {}, "these errors do not name the manifest file"


@pytest.mark.parametrize("cut", ["empty", "one_byte", "half", "last_byte_missing"])
async def test_truncated_manifest_is_a_format_error(cut: str, ckpt_path: Path) -> None:
    await saved(ckpt_path)
    manifest = ckpt_path / MANIFEST
    size = file_size(manifest)
    truncate(manifest, {"empty": 0, "one_byte": 1, "half": size // 2, "last_byte_missing": size - 1}[cut])
    with pytest.raises(FormatError, match=MANIFEST) as info:
        await aiockpt.read(ckpt_path)
    assert info.value.file is not None
    assert Path(info.value.file).name == MANIFEST


async def test_manifest_with_trailing_garbage_is_a_format_error(ckpt_path: Path) -> None:
    await saved(ckpt_path)
    append_bytes(ckpt_path / MANIFEST, b"\x00junk")
    with pytest.raises(FormatError, match=MANIFEST):
        await aiockpt.read(ckpt_path)


async def test_a_rank_reading_back_a_published_manifest_checks_it_as_a_load_does(ckpt_path: Path) -> None:
    # A rank other than 0 learns the committed manifest by reading the file rank 0 published.
    await saved(ckpt_path)
    manifest, _, nbytes = _read_summary(ckpt_path)
    assert nbytes == 4096 * 4
    assert [e.shape for e in manifest.tensors] == [(4096,)]
    raw = read_bytes(ckpt_path / MANIFEST)
    flip_byte(ckpt_path / MANIFEST, len(raw) - 3)  # in the body: only its checksum tells
    with pytest.raises(CorruptionError, match=MANIFEST):
        _read_summary(ckpt_path)


# --- Bad state ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("state", "key"),
    [
        ({1: torch.ones(1)}, "1"),
        ({"ok": 1, 2.5: "x"}, "2.5"),
        ({"ok": 1, None: "x"}, "None"),
        ({("a", "b"): torch.ones(1)}, "('a', 'b')"),
    ],
    ids=["int", "float", "none", "tuple"],
)
async def test_non_str_top_level_key_is_refused(
    state: dict[object, object], key: str, ckpt_path: Path
) -> None:
    with pytest.raises(StateError) as info:
        await aiockpt.save(state, ckpt_path)  # type: ignore[arg-type]
    assert key in str(info.value)
    assert not exists(ckpt_path)
    assert tmp_entries(ckpt_path.parent) == []


async def test_bad_nested_key_type_names_the_path(ckpt_path: Path) -> None:
    state: dict[str, object] = {"outer": {"inner": {(1, 2): torch.ones(1)}}}
    with pytest.raises(StateError, match="outer/inner"):
        await aiockpt.save(state, ckpt_path)
    assert not exists(ckpt_path)


@pytest.mark.parametrize(
    "value",
    [Custom(1), {1, 2, 3}, frozenset({1}), 2**64, -(2**63) - 1, torch.float32, object()],
    ids=["custom", "set", "frozenset", "uint64_overflow", "int64_underflow", "dtype", "object"],
)
@pytest.mark.parametrize("async_op", [False, True], ids=["sync_save", "async_save"])
async def test_unsupported_objects_are_refused_naming_the_key(
    value: object, async_op: bool, ckpt_path: Path
) -> None:
    state: dict[str, object] = {"model": {"layers": [torch.ones(2), {"cfg": value}]}, "w": torch.ones(3)}
    with pytest.raises(StateError, match="model/layers/1/cfg") as info:
        await save_either(state, ckpt_path, async_op=async_op)
    assert "allow_pickle" in str(info.value) or "pickle" in str(info.value)
    assert not exists(ckpt_path)
    assert tmp_entries(ckpt_path.parent) == []


@pytest.mark.parametrize(
    "value",
    [Custom(1), {1, 2, 3}, frozenset({1}), 2**64, torch.float32, torch.Size([2, 3])],
    ids=["custom", "set", "frozenset", "big_int", "dtype", "size"],
)
async def test_allow_pickle_roundtrips_arbitrary_objects(value: object, ckpt_path: Path) -> None:
    state: dict[str, object] = {"a": {"b": [value]}, "t": torch.ones(2)}
    await aiockpt.save(state, ckpt_path, allow_pickle=True)
    got = await aiockpt.read(ckpt_path, allow_pickle=True)
    restored = got["a"]
    assert isinstance(restored, dict)
    assert type(restored["b"][0]) is type(value)
    assert restored["b"][0] == value
    assert torch.equal(tensor_at(got, "t"), torch.ones(2))

    target: dict[str, object] = {"a": {"b": [None]}, "t": torch.zeros(2)}
    await aiockpt.load(target, ckpt_path, allow_pickle=True)
    assert tensor_at(target, "t").sum() == 2
    loaded = target["a"]
    assert isinstance(loaded, dict)
    assert loaded["b"][0] == value


@pytest.mark.parametrize("op", ["read", "load"])
async def test_pickled_object_is_refused_on_read_without_allow_pickle(op: str, ckpt_path: Path) -> None:
    state: dict[str, object] = {"x": torch.ones(1), "meta": {"obj": Custom(3)}}
    await aiockpt.save(state, ckpt_path, allow_pickle=True)
    with pytest.raises(StateError, match="meta/obj") as info:
        await read_or_load(op, ckpt_path, {"x": torch.zeros(1), "meta": {"obj": None}})
    assert isinstance(info.value, CheckpointError)
    assert "allow_pickle" in str(info.value)


async def test_unsupported_tensor_kinds_are_refused(ckpt_path: Path) -> None:
    sparse = torch.eye(3).to_sparse()
    with pytest.raises(StateError, match="sp"):
        await aiockpt.save({"sp": sparse}, ckpt_path)
    with pytest.raises(StateError, match="meta_t"):
        await aiockpt.save({"meta_t": torch.empty(3, device="meta")}, ckpt_path)
    assert not exists(ckpt_path)


async def test_state_must_be_a_mapping(ckpt_path: Path) -> None:
    with pytest.raises(StateError):
        await aiockpt.save([torch.ones(1)], ckpt_path)  # type: ignore[call-overload]
    assert not exists(ckpt_path)


async def test_cyclic_state_is_refused(ckpt_path: Path) -> None:
    inner: dict[str, object] = {}
    inner["self"] = inner
    with pytest.raises(StateError, match="a/self"):
        await aiockpt.save({"a": inner}, ckpt_path)
    assert not exists(ckpt_path)


# --- Keys never become paths ----------------------------------------------------------------------------


async def test_hostile_keys_never_create_files_outside(tmp_path: Path) -> None:
    sandbox = tmp_path / "sandbox"
    mkdir(sandbox)
    outside = listdir(tmp_path)
    hostile = ["../../escape", "/abs", "../sibling", "..", ".", "/", "//", "a/../../b", "\\..\\evil", "~root"]
    state: dict[str, object] = {k: torch.full((4,), float(i)) for i, k in enumerate(hostile)}
    state["nested"] = {k: {k: torch.ones(1)} for k in hostile}
    path = sandbox / "ckpt"
    await aiockpt.save(state, path)
    assert listdir(tmp_path) == outside
    assert dir_tree(sandbox) == {"ckpt", "ckpt/manifest.msgpack", f"ckpt/{DATA}"}
    assert not exists(Path("/abs"))
    assert not exists(tmp_path.parent / "escape")
    assert_tree_equal(await aiockpt.read(path), snapshot(state))
