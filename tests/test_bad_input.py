"""Bad input and damaged checkpoints: every failure is a CheckpointError that names what is wrong."""

from __future__ import annotations

import collections
import enum
import errno
import os
import pickle
import re
import threading
from functools import partial
from pathlib import Path
from typing import Any, cast

import anyio
import pytest
import torch
from conftest import (
    assert_tree_equal,
    at,
    dir_tree,
    exists,
    fifo_in_place_of,
    file_size,
    flip_byte,
    listdir,
    snapshot,
    tensor_at,
    tensors_in,
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
    StorageError,
)
from aiockpt._fs import collect_garbage
from aiockpt._load import read_manifest
from aiockpt._load._match import plain_unpickle
from aiockpt._save import _read_summary, open_tmp
from aiockpt._tree import MAX_DEPTH, is_stateful

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


async def save_either(
    state: dict[str, object],
    path: Path,
    *,
    async_op: bool,
    metadata: dict[str, str | int | float | bool | None] | None = None,
) -> None:
    if async_op:
        handle = await aiockpt.save(state, path, async_op=True, metadata=metadata)
        await handle
    else:
        await aiockpt.save(state, path, metadata=metadata)


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


@pytest.mark.parametrize("op", ["read", "load", "verify"])
async def test_a_fifo_for_a_data_file_is_an_error_naming_it_not_a_hang(op: str, ckpt_path: Path) -> None:
    await saved(ckpt_path)
    fifo_in_place_of(ckpt_path / DATA)
    with anyio.fail_after(30):  # (a hang would outlast it: the thread in ``open`` cannot be cancelled)
        if op == "verify":
            report = await aiockpt.verify(ckpt_path)
            assert not report.ok
            assert {p.file for p in report.problems} == {str(ckpt_path / DATA)}
            assert all("not a regular file" in str(p) for p in report.problems)
            return
        with pytest.raises(CorruptionError) as info:
            await read_or_load(op, ckpt_path, {"weights": torch.zeros(4096), "step": 0})
    assert "not a regular file" in str(info.value)
    assert info.value.file == str(ckpt_path / DATA)


async def test_a_fifo_for_a_manifest_is_a_format_error_not_a_hang(ckpt_path: Path) -> None:
    await saved(ckpt_path)
    fifo_in_place_of(ckpt_path / MANIFEST)
    with anyio.fail_after(30):
        for call in (aiockpt.read, aiockpt.read_metadata, aiockpt.verify):
            with pytest.raises(FormatError, match="not a regular file") as info:
                await call(ckpt_path)
            assert info.value.file == str(ckpt_path / MANIFEST)


async def test_a_fifo_for_latest_neither_hangs_nor_stops_saves_and_loads(root: Path) -> None:
    """``latest`` is a hint: a FIFO in its place names no step, and a writer replaces it as a missing one."""
    async with aiockpt.Checkpointer(root) as ckpt:
        await ckpt.save({"w": torch.ones(3)}, step=1)
    fifo_in_place_of(root / "latest")
    with anyio.fail_after(30):
        async with aiockpt.Checkpointer(root) as ckpt:
            assert ckpt.latest_step() == 1
            await ckpt.save({"w": torch.full((3,), 2.0)}, step=2)
            target: dict[str, object] = {"w": torch.zeros(3)}
            await ckpt.load(target)
            assert_tree_equal(target, {"w": torch.full((3,), 2.0)})
    assert (root / "latest").is_file()


async def test_data_file_that_cannot_be_opened_is_a_storage_error_naming_it(
    ckpt_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # (The suite may run as root, whom chmod does not stop: the refusal is made here.)
    await aiockpt.save({"w": torch.randn(512, 512), "b": torch.randn(10)}, ckpt_path)
    real_open = os.open

    def refusing(path: str | os.PathLike[str], flags: int, *args: int, **kwargs: int) -> int:
        if os.fspath(path).endswith(DATA):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing)
    target: dict[str, object] = {"w": torch.zeros(512, 512), "b": torch.zeros(10)}
    for call in (partial(aiockpt.read, ckpt_path), partial(aiockpt.load, target, ckpt_path)):
        with pytest.raises(aiockpt.StorageError) as info:
            await call()
        assert info.value.path == str(ckpt_path / DATA)
        assert str(info.value) == f"cannot read {ckpt_path / DATA}: Permission denied"


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
async def test_data_file_that_fails_a_read_is_a_storage_error_naming_it(
    direct: bool, ckpt_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    await aiockpt.save({"w": torch.randn(512, 512), "b": torch.randn(10)}, ckpt_path)

    def failing(*args: object) -> int:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "preadv", failing)
    target: dict[str, object] = {"w": torch.zeros(512, 512), "b": torch.zeros(10)}
    with pytest.raises(aiockpt.StorageError) as info:
        await aiockpt.load(target, ckpt_path, io=aiockpt.IOConfig(direct_reads=direct))
    assert info.value.path == str(ckpt_path / DATA)
    assert str(info.value) == f"cannot read {ckpt_path / DATA}: {os.strerror(errno.EIO)}"
    assert isinstance(info.value.__cause__, OSError)


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


class _Mkdir:
    """Unpickled, it makes the directory ``path``: proof of whether a pickle ran."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.mkdir, (str(self.path),))


@pytest.mark.parametrize("op", ["read", "load"])
async def test_pickles_that_import_nothing_load_without_allow_pickle(op: str, ckpt_path: Path) -> None:
    """Values stored pickled that a pickle builds by itself, calling nothing, need no ``allow_pickle``."""
    values = {"big": 2**70, "negative": -(2**64), "tags": {"a", "b"}, "frozen": frozenset({1, 2})}
    await aiockpt.save({"x": torch.ones(1), "meta": values}, ckpt_path, allow_pickle=True)
    if op == "read":
        assert (await aiockpt.read(ckpt_path))["meta"] == values
    else:
        target: dict[str, object] = {"x": torch.zeros(1), "meta": dict.fromkeys(values)}
        await aiockpt.load(target, ckpt_path)
        assert target["meta"] == values


@pytest.mark.parametrize("op", ["read", "load"])
async def test_pickled_dtypes_sizes_devices_and_complex_numbers_load_without_allow_pickle(
    op: str, ckpt_path: Path
) -> None:
    """What ``torch.load(weights_only=True)`` allows, a plain value's type: a torch.save file's
    ``{"dtype": torch.bfloat16}`` was refused as "a pickled torch.dtype; loading it can run code"."""
    values = {
        "dtype": torch.bfloat16,
        "size": torch.Size([2, 3]),
        "device": torch.device("cpu"),
        "z": complex(1.0, -2.0),
        "ordered": collections.OrderedDict(b=1, a=2),
    }
    await aiockpt.save({"x": torch.ones(1), "meta": values}, ckpt_path, allow_pickle=True)
    if op == "read":
        got = (await aiockpt.read(ckpt_path))["meta"]
    else:
        target: dict[str, object] = {"x": torch.zeros(1), "meta": dict.fromkeys(values)}
        await aiockpt.load(target, ckpt_path)
        got = target["meta"]
    assert got == values
    assert isinstance(got, dict)
    assert type(got["size"]) is torch.Size
    assert list(got["ordered"]) == ["b", "a"]


@pytest.mark.parametrize(
    "name",
    [
        "torch.load",
        "torch.Size.__reduce__",
        "torch._C",
        "torch.ops",
        "builtins.eval",
        "collections.namedtuple",
    ],
)
def test_an_unpickler_without_allow_pickle_gives_no_other_global(name: str) -> None:
    module, _, attr = name.partition(".")
    data = b"\x80\x04" + pickle_global(module, attr) + b"."
    with pytest.raises(pickle.UnpicklingError, match="would be imported"):
        plain_unpickle(data)


def pickle_global(module: str, name: str) -> bytes:
    """The STACK_GLOBAL opcodes that import ``module.name``."""
    return (
        b"\x8c"
        + bytes([len(module)])
        + module.encode()
        + b"\x8c"
        + bytes([len(name)])
        + name.encode()
        + b"\x93"
    )


@pytest.mark.parametrize("op", ["read", "load"])
async def test_a_pickle_that_would_call_something_is_refused_and_runs_nothing(
    op: str, ckpt_path: Path, tmp_path: Path
) -> None:
    made = tmp_path / "made-by-unpickling"
    await aiockpt.save({"x": torch.ones(1), "obj": _Mkdir(made)}, ckpt_path, allow_pickle=True)
    with pytest.raises(StateError, match=r"key 'obj' holds a pickled .*_Mkdir; loading it can run code"):
        await read_or_load(op, ckpt_path, {"x": torch.zeros(1), "obj": None})
    assert not made.exists()
    await aiockpt.read(ckpt_path, allow_pickle=True)
    assert made.is_dir()  # (what it would have done)


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

    top: dict[str, object] = {}
    top["self"] = top
    with pytest.raises(StateError, match="cycle at key 'self'") as info:  # (not self/self)
        await aiockpt.save(top, ckpt_path)
    assert info.value.key == "self"
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


# --- Bad metadata ---------------------------------------------------------------------------------------


class Color(enum.IntEnum):
    RED = 1


BAD_METADATA = [
    pytest.param({"lr_schedule": [0.1, 0.01]}, "lr_schedule", id="list"),
    pytest.param({"ok": 1, "cfg": {"a": 1}}, "cfg", id="dict"),
    pytest.param({"shape": (1, 2)}, "shape", id="tuple"),
    pytest.param({"blob": b"x"}, "blob", id="bytes"),
    pytest.param({"t": torch.ones(1)}, "t", id="tensor"),
    pytest.param({1: "a"}, 1, id="int_key"),
    pytest.param({"seed": 2**64}, "seed", id="uint64_overflow"),
    pytest.param({"low": -(2**63) - 1}, "low", id="int64_underflow"),
    pytest.param({"path": "/data/\udcff"}, "path", id="surrogate_value"),
    pytest.param({"name\udcff": 1}, "name\udcff", id="surrogate_key"),
]


@pytest.mark.parametrize(("metadata", "key"), BAD_METADATA)
@pytest.mark.parametrize("async_op", [False, True], ids=["sync_save", "async_save"])
async def test_metadata_a_manifest_cannot_hold_is_refused_naming_the_key(
    metadata: dict[object, object], key: object, async_op: bool, ckpt_path: Path
) -> None:
    bad = cast("dict[str, str | int | float | bool | None]", metadata)
    with pytest.raises(StateError, match=re.escape(f"metadata key {key!r}")):
        await save_either({"w": torch.ones(4)}, ckpt_path, async_op=async_op, metadata=bad)
    assert not exists(ckpt_path)
    assert tmp_entries(ckpt_path.parent) == []


@pytest.mark.parametrize(("metadata", "key"), BAD_METADATA)
async def test_checkpointer_refuses_bad_metadata_and_keeps_the_older_checkpoint(
    metadata: dict[object, object], key: object, root: Path
) -> None:
    # With keep_last=1 a committed (unreadable) step 2 would have pruned the good step 1.
    async with aiockpt.Checkpointer(root, keep_last=1) as ckpt:
        await ckpt.save({"w": torch.ones(4)}, step=1)
        with pytest.raises(StateError, match=re.escape(f"metadata key {key!r}")):
            await ckpt.save(
                {"w": torch.full((4,), 2.0)},
                step=2,
                metadata=cast("dict[str, str | int | float | bool | None]", metadata),
            )
        assert ckpt.steps() == [1]
        assert ckpt.latest_step() == 1
        target: dict[str, object] = {"w": torch.zeros(4)}
        await ckpt.load(target)
        assert torch.equal(tensor_at(target, "w"), torch.ones(4))
        await ckpt.save({"w": torch.full((4,), 2.0)}, step=2, metadata={"fine": 2})  # the slot is free again
        assert ckpt.steps() == [2]
    assert tmp_entries(root) == []


NOT_A_MAPPING = [
    pytest.param(["a"], "a builtins.list", id="list"),
    pytest.param([("a", 1)], "a builtins.list", id="list_of_pairs"),  # which dict() took as a mapping
    pytest.param(
        torch.tensor([0.1, 0.2]), "a torch.Tensor", id="tensor"
    ),  # `metadata or {}`: a bare RuntimeError
    pytest.param("seed=1", "a builtins.str", id="str"),
]


@pytest.mark.parametrize(("metadata", "named"), NOT_A_MAPPING)
@pytest.mark.parametrize("async_op", [False, True], ids=["sync_save", "async_save"])
async def test_a_checkpointer_refuses_metadata_that_is_not_a_mapping_and_stays_usable(
    metadata: object, named: str, async_op: bool, root: Path
) -> None:
    """It failed with a bare ValueError or RuntimeError after taking its in-flight slot, and kept it:
    every later save and the Checkpointer's close waited for it for ever."""
    async with aiockpt.Checkpointer(root, max_inflight=1) as ckpt:
        with pytest.raises(StateError, match=f"metadata must be a dict of str keys, or None, not {named}"):
            await ckpt.save({"w": torch.ones(4)}, step=1, async_op=async_op, metadata=metadata)  # type: ignore[call-overload]
        with anyio.fail_after(30):
            await ckpt.save({"w": torch.ones(4)}, step=1, metadata={"fine": 1})
        assert ckpt.steps() == [1]
    with pytest.raises(StateError, match=f"not {named}"):
        await aiockpt.save({"w": torch.ones(4)}, root / "one", metadata=metadata)  # type: ignore[call-overload]


@pytest.mark.parametrize("flag", ["no", "false", 1, None])
async def test_a_checkpointer_save_refuses_an_async_op_that_is_not_a_bool(flag: object, root: Path) -> None:
    """``async_op="false"`` started a background save, returning before the checkpoint was durable."""
    async with aiockpt.Checkpointer(root) as ckpt:
        with pytest.raises(CheckpointError, match=f"async_op must be a bool, not {flag!r}"):
            await ckpt.save({"w": torch.ones(4)}, step=1, async_op=flag)  # type: ignore[call-overload]
        assert ckpt.steps() == []
        await ckpt.save({"w": torch.ones(4)}, step=1)
    assert tmp_entries(root) == []


async def test_metadata_at_the_edges_of_what_a_manifest_holds_is_kept(ckpt_path: Path) -> None:
    metadata: dict[str, str | int | float | bool | None] = {
        "max": 2**64 - 1,
        "min": -(2**63),
        "nan": float("nan"),
        "none": None,
        "flag": True,
        "text": "é✓",
        "enum": Color.RED,
    }
    await aiockpt.save({"w": torch.ones(1)}, ckpt_path, metadata=metadata)
    kept = read_manifest(ckpt_path).user_metadata
    assert kept.keys() == metadata.keys()
    assert kept["nan"] != kept["nan"]
    assert {k: v for k, v in kept.items() if k != "nan"} == {k: v for k, v in metadata.items() if k != "nan"}


# --- State keys and values a manifest cannot hold -------------------------------------------------------


@pytest.mark.parametrize(
    ("state", "key", "named"),
    [
        (
            {"w": torch.ones(4), "by_id": {2**64: "x"}},
            "by_id/18446744073709551616",
            "key 18446744073709551616",
        ),
        ({"by_id": {-(2**63) - 1: torch.ones(4)}}, "by_id/-9223372036854775809", "key -9223372036854775809"),
        # (a key not printable as it is is quoted, escaped, in the key path)
        ({"files": {"name\udcff.bin": torch.ones(4)}}, "files/'name\\udcff.bin'", "key 'name\\udcff.bin'"),
        ({"w": torch.ones(4), "cfg": {"path": "/data/\udcff"}}, "cfg/path", "at key 'cfg/path'"),
        ({"w": torch.ones(4), "cfg": ["ok", "\ud800"]}, "cfg/1", "at key 'cfg/1'"),
    ],
    ids=["uint64_overflow_key", "int64_underflow_key", "surrogate_key", "surrogate_value", "surrogate_item"],
)
@pytest.mark.parametrize("allow_pickle", [False, True], ids=["no_pickle", "pickle"])
async def test_unencodable_keys_and_strs_are_refused_naming_the_key(
    state: dict[str, object], key: str, named: str, allow_pickle: bool, ckpt_path: Path
) -> None:
    with pytest.raises(StateError) as info:
        await aiockpt.save(state, ckpt_path, allow_pickle=allow_pickle)
    assert info.value.key == key
    assert named in str(info.value)
    assert not exists(ckpt_path)
    assert tmp_entries(ckpt_path.parent) == []


async def test_int_keys_at_the_edges_of_int64_and_uint64_roundtrip(ckpt_path: Path) -> None:
    state: dict[str, object] = {"by_id": {2**64 - 1: torch.ones(2), -(2**63): "low"}}
    await aiockpt.save(state, ckpt_path)
    assert_tree_equal(await aiockpt.read(ckpt_path), snapshot(state))


# --- Objects that look like something else --------------------------------------------------------------


def test_a_class_is_never_a_stateful() -> None:
    # The class has state_dict and load_state_dict (unbound): the runtime protocol check alone says yes.
    cls: object = torch.optim.AdamW
    assert isinstance(cls, aiockpt.Stateful)
    assert not is_stateful(torch.optim.AdamW)
    assert not is_stateful(torch.nn.Linear)
    assert is_stateful(torch.nn.Linear(1, 1))


def test_torchs_modules_optimizers_and_schedulers_are_statefuls_to_a_type_checker() -> None:
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.AdamW(model.parameters())
    # (mypy checks these: a load_state_dict typed to take a Mapping matched no optimizer or scheduler)
    typed: list[aiockpt.Stateful] = [model, opt, torch.optim.lr_scheduler.StepLR(opt, 1)]
    assert all(map(is_stateful, typed))


class _Batches(dict[str, torch.Tensor]):
    """A mapping that is a Stateful too (as a TensorDict is): saved and loaded through its state dict."""

    def __init__(self, size: int) -> None:
        super().__init__(x=torch.zeros(size))
        self.size = size

    def state_dict(self) -> dict[str, object]:
        return {"size": self.size, "data": dict(self)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.size = state["size"]
        self.clear()
        self.update(state["data"])


class _History(list[float]):
    """A list that is a Stateful too."""

    def state_dict(self) -> dict[str, object]:
        return {"values": list(self)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self[:] = state["values"]


async def test_a_mapping_or_list_that_is_a_stateful_is_saved_through_its_state_dict(ckpt_path: Path) -> None:
    """Saved as a container, it was loaded through state_dict() (the keys differed), or refused."""
    batches, history = _Batches(3), _History([0.5, 0.25])
    batches["x"] += 1
    await aiockpt.save({"b": batches, "h": history}, ckpt_path)
    assert_tree_equal(
        await aiockpt.read(ckpt_path),
        {"b": {"size": 3, "data": {"x": torch.ones(3)}}, "h": {"values": [0.5, 0.25]}},
    )
    batches2, history2 = _Batches(2), _History()
    await aiockpt.load({"b": batches2, "h": history2}, ckpt_path)  # strict
    assert batches2.size == 3
    assert torch.equal(batches2["x"], torch.ones(3))  # (a tensor of another size: read fresh)
    assert history2 == [0.5, 0.25]


async def test_a_stateful_class_is_a_plain_object_refused_or_pickled(ckpt_path: Path) -> None:
    state: dict[str, object] = {"cfg": {"opt_cls": torch.optim.AdamW, "layer": torch.nn.Linear}}
    with pytest.raises(StateError, match="cfg/opt_cls") as info:
        await aiockpt.save(state, ckpt_path)
    assert info.value.key == "cfg/opt_cls"
    assert not exists(ckpt_path)

    await aiockpt.save(state, ckpt_path, allow_pickle=True)
    assert at(await aiockpt.read(ckpt_path, allow_pickle=True), "cfg") == state["cfg"]
    target: dict[str, object] = {"cfg": {"opt_cls": torch.optim.SGD, "layer": None}}
    await aiockpt.load(target, ckpt_path, allow_pickle=True)
    assert target == state


@pytest.mark.parametrize(
    ("value", "kind"),
    [(lambda: 1, "builtins.function"), (threading.Lock(), "_thread.lock")],
    ids=["lambda", "lock"],
)
async def test_an_object_that_cannot_be_pickled_names_its_key(
    value: object, kind: str, ckpt_path: Path
) -> None:
    with pytest.raises(StateError, match=f"cannot pickle {kind} at key 'cfg/hook'") as info:
        await aiockpt.save({"cfg": {"hook": value}}, ckpt_path, allow_pickle=True)
    assert info.value.key == "cfg/hook"
    assert not exists(ckpt_path)


# --- Deep nesting ---------------------------------------------------------------------------------------


def nested(depth: int, kind: str) -> dict[str, object]:
    """``{"d": ...}`` with ``depth`` containers (dicts under key "k", or lists), a tensor in the deepest."""
    inner: object = torch.ones(2)
    for _ in range(depth - 1):
        inner = {"k": inner} if kind == "dict" else [inner]
    return {"d": {"k": inner} if kind == "dict" else [inner]}


@pytest.mark.parametrize("kind", ["dict", "list"])
async def test_nesting_deeper_than_the_limit_is_refused_naming_the_key(kind: str, ckpt_path: Path) -> None:
    with pytest.raises(StateError, match=f"more than {MAX_DEPTH} levels") as info:
        await aiockpt.save(nested(MAX_DEPTH, kind), ckpt_path)
    step = "k" if kind == "dict" else "0"
    assert info.value.key == "/".join(["d", *[step] * (MAX_DEPTH - 1)])
    assert not exists(ckpt_path)
    assert tmp_entries(ckpt_path.parent) == []
    with pytest.raises(StateError, match=f"more than {MAX_DEPTH} levels"):  # far deeper: no RecursionError
        await aiockpt.save(nested(5 * MAX_DEPTH, kind), ckpt_path)


@pytest.mark.parametrize("kind", ["dict", "list"])
async def test_nesting_up_to_the_limit_saves_reads_and_loads(kind: str, ckpt_path: Path) -> None:
    state = nested(MAX_DEPTH - 1, kind)
    await aiockpt.save(state, ckpt_path)
    assert_tree_equal(await aiockpt.read(ckpt_path), snapshot(state))
    target = nested(MAX_DEPTH - 1, kind)
    tensors = list(tensors_in(target))
    tensors[0].zero_()
    await aiockpt.load(target, ckpt_path)
    assert torch.equal(tensors[0], torch.ones(2))


# --- Target names ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["c" * 232, "c" * 233, "c" * 255, "é" * 127], ids=["232", "233", "255", "254utf8"]
)
async def test_names_up_to_name_max_can_be_saved_to(name: str, tmp_path: Path) -> None:
    path = tmp_path / name
    await aiockpt.save({"w": torch.arange(4.0)}, path)
    assert torch.equal(tensor_at(await aiockpt.read(path), "w"), torch.arange(4.0))
    assert listdir(tmp_path) == [name]


async def test_a_name_longer_than_name_max_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    path = tmp_path / ("c" * 256)
    with pytest.raises(StorageError, match="256 bytes") as info:
        await aiockpt.save({"w": torch.ones(4)}, path)
    assert info.value.path == str(path)
    assert listdir(tmp_path) == []


@pytest.mark.parametrize("atomic", [True, False], ids=["unnamed_lock", "private_lock_name"])
def test_temp_data_of_a_long_name_is_locked_and_collected_once_its_writer_is_gone(
    atomic: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not atomic:  # the lock is made under a private name 33 bytes longer, then renamed
        monkeypatch.setattr(aiockpt._fs, "_open_unnamed", lambda directory: -1)
    tmp, lock = open_tmp(tmp_path / ("c" * 255))
    assert lock.atomic is atomic
    assert tmp.name.startswith(".tmp-ccc")
    assert len(os.fsencode(lock.path.name)) + 33 <= 255
    assert collect_garbage(tmp_path) == []  # its writer lives
    os.close(lock._fd)  # the writer dies: the kernel drops its lock, the files stay
    removed = {p.name for p in collect_garbage(tmp_path)}  # the lock as an entry of its own, or with its dir
    assert tmp.name in removed
    assert removed <= {tmp.name, lock.path.name}
    assert listdir(tmp_path) == []
