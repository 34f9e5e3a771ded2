"""What errors and verification say: paths in the way, data files that are not files, sizes, coverage."""

from __future__ import annotations

import asyncio
import contextlib
import io
from collections.abc import Awaitable, Callable
from pathlib import Path

import crc32c
import msgspec
import pytest
import torch

import aiockpt
from aiockpt._cli._app import run as cli
from aiockpt._format import MANIFEST_NAME
from aiockpt._load import read_manifest
from aiockpt._load._manifest import decode_manifest
from aiockpt._save._finish import encode_manifest
from aiockpt._tree import a_or_an


def _run_cli(*args: str | Path) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli([str(a) for a in args])
    return rc, out.getvalue(), err.getvalue()


def _data_file(path: Path) -> Path:
    (info,) = read_manifest(path).files
    return path / info.name


def _rewrite_entry(path: Path, key: str, **changes: object) -> None:
    """Replace fields of tensor ``key``'s entry in the manifest at ``path``, its checksum kept valid."""
    file = path / MANIFEST_NAME
    manifest = decode_manifest(file.read_bytes(), str(file))
    tensors = tuple(
        msgspec.structs.replace(t, **changes) if t.path == (key,) else t for t in manifest.tensors
    )
    forged = msgspec.structs.replace(manifest, tensors=tensors)
    file.write_bytes(b"".join(encode_manifest(forged)[0]))


# --- a file where a directory should be ----------------------------------------------------------------


async def test_a_checkpointer_root_that_is_a_file_is_said_to_be_no_directory(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.write_text("x")
    with pytest.raises(aiockpt.StorageError) as info:
        await aiockpt.Checkpointer(root).open()
    assert str(info.value) == f"cannot open checkpoint root {root}: it is not a directory"
    assert info.value.path == str(root)


async def test_a_checkpointer_root_under_a_file_names_the_file(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    root = blocker / "a" / "root"
    with pytest.raises(aiockpt.StorageError) as info:
        await aiockpt.Checkpointer(root).open()
    assert str(info.value) == f"cannot open checkpoint root {root}: {blocker} is not a directory"
    assert info.value.path == str(blocker)


@pytest.mark.parametrize("below", [("sub",), ("sub", "deeper")])
async def test_a_save_under_a_file_names_the_file(tmp_path: Path, below: tuple[str, ...]) -> None:
    # Directly under the file ``mkdir`` says "File exists", deeper "Not a directory": of another path.
    blocker = tmp_path / "file"
    blocker.write_text("x")
    path = blocker.joinpath(*below)
    with pytest.raises(aiockpt.StorageError) as info:
        await aiockpt.save({"a": 1}, path)
    assert f"{blocker} is not a directory" in str(info.value)
    assert "File exists" not in str(info.value)
    assert info.value.path == str(blocker)
    assert blocker.read_text() == "x"


# --- a data file that is a directory -------------------------------------------------------------------


@pytest.mark.parametrize("n", [10, 100_000])  # read into memory of its own, and checked before allocating
async def test_a_data_file_that_is_a_directory_is_said_to_be_one(ckpt_path: Path, n: int) -> None:
    # It was "truncated" for a large tensor, and a StorageError "Is a directory" for a small one.
    await aiockpt.save({"t": torch.arange(n, dtype=torch.float32)}, ckpt_path)
    data = _data_file(ckpt_path)
    data.unlink()
    data.mkdir()
    runs: dict[str, Callable[[], Awaitable[object]]] = {
        "read": lambda: aiockpt.read(ckpt_path),
        "read, not mapped": lambda: aiockpt.read(ckpt_path, io=aiockpt.IOConfig(map_reads=False)),
        "read, direct": lambda: aiockpt.read(ckpt_path, io=aiockpt.IOConfig(direct_reads=True)),
        "load": lambda: aiockpt.load({"t": torch.zeros(n)}, ckpt_path),
    }
    for name, run in runs.items():
        with pytest.raises(aiockpt.CorruptionError) as info:
            await run()
        assert str(info.value).startswith(f"data file is a directory in {data} for key 't'"), name
        assert (info.value.key, info.value.file) == ("t", str(data)), name
    report = await aiockpt.verify(ckpt_path)
    (problem,) = report.problems
    assert str(problem).startswith(f"data file is a directory in {data} for key 't'")
    assert (problem.key, problem.file) == ("t", str(data))


# --- articles ------------------------------------------------------------------------------------------


def test_the_article_fits_the_word() -> None:
    assert [a_or_an(w) for w in ("int", "OrderedDict", "dict", "uint8", "UserDict", "NoneType")] == [
        "an int",
        "an OrderedDict",
        "a dict",
        "a uint8",
        "a UserDict",
        "a NoneType",
    ]


async def test_messages_say_an_int(ckpt_path: Path) -> None:
    with pytest.raises(aiockpt.StateError, match=r"key 1 under '<root>' is an int; keys here must be str"):
        await aiockpt.save({1: 0}, ckpt_path)  # type: ignore[dict-item]
    await aiockpt.save({"x": 3}, ckpt_path)
    with pytest.raises(aiockpt.StateMismatchError) as info:
        await aiockpt.load({"x": torch.zeros(1)}, ckpt_path)
    assert "x: the target holds a tensor float32[1], the checkpoint an int" in str(info.value)


# --- verify: a data file longer than the manifest says -------------------------------------------------


async def test_verify_reports_bytes_appended_to_a_data_file(ckpt_path: Path) -> None:
    state = {"big": torch.arange(100_000, dtype=torch.float32), "small": torch.arange(10.0)}
    await aiockpt.save(state, ckpt_path)
    data = _data_file(ckpt_path)
    (info,) = read_manifest(ckpt_path).files
    assert data.stat().st_size == info.nbytes
    with data.open("ab") as f:
        f.write(bytes(100))
    report = await aiockpt.verify(ckpt_path)
    (problem,) = report.problems
    assert isinstance(problem, aiockpt.CorruptionError)
    assert (problem.key, problem.file) == (None, str(data))
    assert str(problem) == (
        f"data file {data} is {info.nbytes + 100} bytes long: 100 past the {info.nbytes} the manifest records"
    )
    rc, out, _ = await asyncio.to_thread(_run_cli, "verify", ckpt_path)  # (the CLI runs its own loop)
    assert rc == 1
    assert f"CORRUPT data file {data}" in out
    # No tensor's bytes are touched: a read and a load take what they read, as before.
    back = await aiockpt.read(ckpt_path)
    assert all(torch.equal(back[k], v) for k, v in state.items())  # type: ignore[arg-type]
    target: dict[str, object] = {k: torch.zeros_like(v) for k, v in state.items()}
    await aiockpt.load(target, ckpt_path)
    assert all(torch.equal(target[k], v) for k, v in state.items())  # type: ignore[arg-type]


async def test_verify_reports_a_truncated_file_once_per_chunk_not_again_for_the_file(ckpt_path: Path) -> None:
    await aiockpt.save({"a": torch.arange(10.0)}, ckpt_path)
    data = _data_file(ckpt_path)
    data.write_bytes(data.read_bytes()[:-4])
    (problem,) = (await aiockpt.verify(ckpt_path)).problems
    assert problem.key == "a"
    assert "data file is truncated" in str(problem)


# --- verify: chunks that do not cover their tensor -----------------------------------------------------


async def test_verify_reports_a_tensor_its_chunks_do_not_cover(ckpt_path: Path) -> None:
    # The manifest's checksum is valid; "w" claims 2^60 elements, its chunk holds 32: read() refused it,
    # verify() said OK.
    await aiockpt.save({"w": torch.randn(4, 8), "b": torch.ones(3)}, ckpt_path)
    _rewrite_entry(ckpt_path, "w", shape=(2**40, 2**20))
    with pytest.raises(aiockpt.CorruptionError, match="does not hold all of key 'w'"):
        await aiockpt.read(ckpt_path)
    report = await aiockpt.verify(ckpt_path)
    (problem,) = report.problems
    assert (problem.key, problem.file) == ("w", str(ckpt_path))
    assert "does not hold all of key 'w'" in str(problem)
    assert "no stored chunk has its elements [0:4, 8:1048576]" in str(problem)
    rc, out, _ = await asyncio.to_thread(_run_cli, "verify", ckpt_path)  # (the CLI runs its own loop)
    assert rc == 1
    assert "CORRUPT" in out


async def test_verify_passes_chunks_that_cover_a_tensor_together(ckpt_path: Path) -> None:
    await aiockpt.save({"w": torch.arange(8.0)}, ckpt_path)
    (whole,) = read_manifest(ckpt_path).tensors[0].chunks
    halves = tuple(
        msgspec.structs.replace(whole, offsets=(lo,), sizes=(4,), offset=whole.offset + 16 * i, nbytes=16)
        for i, lo in enumerate((0, 4))
    )
    data = _data_file(ckpt_path).read_bytes()
    halves = tuple(
        msgspec.structs.replace(c, checksums=(crc32c.crc32c(data[c.offset : c.offset + 16]),)) for c in halves
    )
    _rewrite_entry(ckpt_path, "w", chunks=(halves[1], halves[0], halves[1]))  # out of order, one twice
    assert (await aiockpt.verify(ckpt_path)).ok
    back = await aiockpt.read(ckpt_path)
    assert torch.equal(back["w"], torch.arange(8.0))  # type: ignore[arg-type]


# --- an empty path -------------------------------------------------------------------------------------


async def test_convert_refuses_an_empty_destination(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # "" was taken for the working directory ("... already exists").
    await aiockpt.save({"w": torch.ones(2)}, tmp_path / "src")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        aiockpt.CheckpointError, match=r"^dst is an empty path: name the checkpoint to create$"
    ):
        await aiockpt.convert(tmp_path / "src", "", to="torch")
    rc, _, err = await asyncio.to_thread(_run_cli, "convert", tmp_path / "src", "", "--to", "torch")
    assert rc == 2
    assert err == "aiockpt: error: dst is an empty path: name the checkpoint to create\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


async def test_an_empty_path_is_refused_everywhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    runs: dict[str, Callable[[], Awaitable[object]]] = {
        "save": lambda: aiockpt.save({"a": 1}, ""),
        "read": lambda: aiockpt.read(""),
        "verify": lambda: aiockpt.verify(""),
        "convert src": lambda: aiockpt.convert("", tmp_path / "out.pt", to="torch"),
    }
    for name, run in runs.items():
        with pytest.raises(aiockpt.CheckpointError, match=r"empty path|path is empty") as info:
            await run()
        assert type(info.value) is aiockpt.CheckpointError, name
    with pytest.raises(aiockpt.CheckpointError, match="path is empty"):
        aiockpt.Checkpointer("")
    assert list(tmp_path.iterdir()) == []
