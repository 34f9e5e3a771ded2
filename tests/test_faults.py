"""Operating-system calls that fail where a save or a load least expects it (fault injection).

Each test makes one ``os`` function fail once (the technique of a fault-injection harness: the real call
is made where the kernel would have made it, a close frees its descriptor, then the error is raised) and
checks what the caller sees: past the commit point a ``RuntimeWarning`` and a committed save; before it,
or on a read, a ``StorageError`` naming the file (errno kept in the cause), with every descriptor closed.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import torch
from conftest import assert_tree_equal, listdir, read_text, tmp_entries

import aiockpt
from aiockpt import IOConfig, StorageError
from aiockpt._fs import OwnerLock

pytestmark = pytest.mark.timeout(60)

DATA = "data-r00000.bin"
O_DIRECT: int = getattr(os, "O_DIRECT", 0)


def state(value: float = 1.0) -> dict[str, object]:
    return {"w": torch.full((300_000,), value), "b": torch.arange(5), "step": int(value)}


def target_of(fd: int) -> str:
    """What descriptor ``fd`` is open on (its ``/proc/self/fd`` link), or ``""`` where it is not open."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


def open_on(name: str) -> list[str]:
    """The descriptors of this process open on a file whose path holds ``name``."""
    return [t for fd in os.listdir("/proc/self/fd") if name in (t := target_of(int(fd)))]


def eio() -> OSError:
    return OSError(errno.EIO, os.strerror(errno.EIO))


def failing_close(
    monkeypatch: pytest.MonkeyPatch, on: Callable[[str], bool], times: int = 1
) -> list[tuple[int, str]]:
    """Make the first ``times`` closes of a descriptor whose target satisfies ``on`` report ``EIO``.

    The descriptor is closed first, as Linux does where a close reports an error. Returns every close
    call made meanwhile: (descriptor, its target then).
    """
    real = os.close
    calls: list[tuple[int, str]] = []
    left = [times]

    def close(fd: int) -> None:
        target = target_of(fd)
        calls.append((fd, target))
        real(fd)
        if left[0] and on(target):
            left[0] -= 1
            raise eio()

    monkeypatch.setattr(os, "close", close)
    return calls


def failing_fsync(monkeypatch: pytest.MonkeyPatch, directory: Path) -> list[int]:
    """Make the ``n``-th fsync of ``directory`` report ``EIO`` once the countdown returned is set to ``n``.

    The countdown is at 0 (none fails) until the test sets it, and back at 0 once the fsync failed.
    """
    real = os.fsync
    countdown = [0]

    def fsync(fd: int) -> None:
        if countdown[0] and target_of(fd) == str(directory):
            countdown[0] -= 1
            if not countdown[0]:
                raise eio()
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return countdown


def _nth_close_of(name: str, n: int) -> Callable[[str], bool]:
    """A ``failing_close`` filter: the ``n``-th close of a file whose path holds ``name``."""
    seen = [0]

    def on(target: str) -> bool:
        if name not in target:
            return False
        seen[0] += 1
        return seen[0] == n

    return on


# --- past the commit point: a warning, and a save that committed


@pytest.mark.parametrize(
    ("nth", "warned"),
    [
        (1, r"fsyncing .* after the rename that committed it failed"),  # the commit's own
        # The root's fsyncs: the commit's, `latest`'s, then retention's (the step it renamed away stayed in
        # the index, its tree on disk until the next open).
        (3, "pruning older steps failed"),
    ],
    ids=["commit", "retention"],
)
async def test_a_failed_fsync_of_the_root_past_the_commit_is_a_warning_and_the_step_committed(
    nth: int, warned: str, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    countdown = failing_fsync(monkeypatch, root)
    async with aiockpt.Checkpointer(root, keep_last=2) as ckpt:
        await ckpt.save(state(1), step=1)
        await ckpt.save(state(2), step=2)
        countdown[0] = nth
        with pytest.warns(RuntimeWarning, match=warned) as w:
            meta = await ckpt.save(state(3), step=3)
        assert str(root) in str(w[0].message)
        assert os.strerror(errno.EIO) in str(w[0].message)
        assert countdown[0] == 0
        assert meta.step == 3
        # The Checkpointer's after-commit work ran: index, `latest` and retention.
        assert ckpt.steps() == [2, 3]
        assert read_text(root / "latest").strip() == "step-00000003"
        await ckpt.wait()
        assert listdir(root) == ["latest", "step-00000002", "step-00000003"]  # the trashed tree removed
        assert_tree_equal(await aiockpt.read(root / "step-00000003"), state(3))


async def test_a_failed_fsync_of_the_parent_in_a_one_shot_save_is_a_warning(
    ckpt_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    failing_fsync(monkeypatch, ckpt_path.parent)[0] = 1
    with pytest.warns(RuntimeWarning, match=f"saved {ckpt_path}, but fsyncing {ckpt_path.parent}"):
        await aiockpt.save(state(), ckpt_path)
    monkeypatch.undo()
    assert_tree_equal(await aiockpt.read(ckpt_path), state())


@pytest.mark.parametrize("call", ["unlink", "close"])
async def test_a_failed_release_of_the_owner_lock_after_the_commit_is_a_warning(
    call: str, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lock's descriptor is closed once: a second close could close a file opened meanwhile."""
    closes: list[tuple[int, str]] = []
    async with aiockpt.Checkpointer(root, keep_last=2) as ckpt:
        await ckpt.save(state(1), step=1)
        if call == "close":
            # The lock file is unlinked first, then its descriptor closed: "(deleted)" by then.
            closes = failing_close(monkeypatch, lambda t: f"{root}/" in t and t.endswith("(deleted)"))
        else:
            real_unlink = os.unlink
            fired = [False]

            def unlink(path: str | os.PathLike[str], *args: object, **kwargs: object) -> None:
                if os.fspath(path).endswith(".lock") and not fired[0]:
                    fired[0] = True
                    raise OSError(errno.EIO, os.strerror(errno.EIO), os.fspath(path))
                real_unlink(path, *args, **kwargs)  # type: ignore[arg-type]

            monkeypatch.setattr(os, "unlink", unlink)
        with pytest.warns(RuntimeWarning, match=r"saved .*step-00000002, but releasing its temp dir's lock"):
            meta = await ckpt.save(state(2), step=2)
        monkeypatch.undo()
        assert meta.step == 2
        assert ckpt.steps() == [1, 2]
        assert read_text(root / "latest").strip() == "step-00000002"
    if call == "close":
        assert len([t for _, t in closes if t.endswith("(deleted)")]) == 1
        assert "" not in [t for _, t in closes], closes  # no descriptor closed again once gone
    # A lock file left behind (its unlink failed) has no owner: the next open collects it.
    async with aiockpt.Checkpointer(root) as ckpt:
        assert ckpt.steps() == [1, 2]
    assert tmp_entries(root) == []


def test_owner_lock_release_is_once_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lock = OwnerLock(tmp_path / ".tmp-x-0123456789ab.lock")
    closes = failing_close(monkeypatch, lambda t: True)
    with pytest.raises(OSError, match=os.strerror(errno.EIO)):
        lock.release()
    lock.release()  # the descriptor is gone: its number is not closed again
    assert len(closes) == 1
    assert not (tmp_path / ".tmp-x-0123456789ab.lock").exists()


# --- closes that fail: a StorageError naming the file, and no descriptor left open


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
async def test_a_data_file_whose_close_fails_in_a_save_fails_the_save(
    direct: bool, ckpt_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On NFS a close reports write errors deferred until then: the data may not be durable."""
    if direct and not O_DIRECT:
        pytest.skip("this platform has no O_DIRECT")
    failing_close(monkeypatch, lambda t: DATA in t)
    saved = {"w": torch.randn(1 << 20), "b": torch.arange(5)}
    with pytest.raises(StorageError) as info:
        await aiockpt.save(saved, ckpt_path, io=IOConfig(direct_writes=direct))
    assert info.value.path is not None
    assert info.value.path.endswith(DATA)
    assert str(info.value) == f"cannot close {info.value.path}: {os.strerror(errno.EIO)}"
    assert isinstance(info.value.__cause__, OSError)
    assert info.value.__cause__.errno == errno.EIO
    assert open_on(DATA) == []  # both descriptors of a direct write closed
    assert listdir(ckpt_path.parent) == []  # nothing published, the temp dir removed


async def test_a_close_that_fails_after_a_failed_write_keeps_the_write_error(
    ckpt_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    failing_close(monkeypatch, lambda t: DATA in t)

    def fsync(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(StorageError, match=f"cannot write .*{DATA}: {os.strerror(errno.ENOSPC)}"):
        await aiockpt.save(state(), ckpt_path)
    assert open_on(DATA) == []


@pytest.mark.parametrize(
    ("io", "closes"),
    [
        (IOConfig(direct_reads=False, drop_behind=False), 1),
        (IOConfig(direct_reads=False, drop_behind=True), 1),  # cached_pages' own close
        (IOConfig(direct_reads=False, drop_behind=True), 2),  # the read stage's
        (IOConfig(direct_reads=True), 1),
    ],
    ids=["buffered", "snapshot", "drop-behind", "direct"],
)
async def test_a_data_file_whose_close_fails_in_a_read_is_a_storage_error_and_no_fd_leaks(
    io: IOConfig, closes: int, ckpt_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    saved = {"w": torch.randn(1 << 20), "b": torch.arange(5)}
    await aiockpt.save(saved, ckpt_path)
    for call in (lambda: aiockpt.read(ckpt_path, io=io), lambda: aiockpt.load(dict(saved), ckpt_path, io=io)):
        failing_close(monkeypatch, _nth_close_of(DATA, closes))
        with pytest.raises(StorageError) as info:
            await call()
        monkeypatch.undo()
        assert info.value.path == str(ckpt_path / DATA)
        assert str(info.value) == f"cannot close {ckpt_path / DATA}: {os.strerror(errno.EIO)}"
        assert isinstance(info.value.__cause__, OSError)
        assert info.value.__cause__.errno == errno.EIO
        assert open_on(DATA) == []  # every descriptor closed, the direct one too
    assert_tree_equal(await aiockpt.read(ckpt_path, io=io), saved)


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
async def test_a_data_file_whose_close_fails_in_verify_is_a_storage_error_and_no_fd_leaks(
    direct: bool, ckpt_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    saved = {"w": torch.randn(1 << 20), "b": torch.arange(5)}
    await aiockpt.save(saved, ckpt_path)
    failing_close(monkeypatch, lambda t: DATA in t)
    with pytest.raises(StorageError, match=f"cannot close .*{DATA}: {os.strerror(errno.EIO)}") as info:
        await aiockpt.verify(ckpt_path, io=IOConfig(direct_reads=direct))
    assert isinstance(info.value.__cause__, OSError)
    assert open_on(DATA) == []


async def test_a_close_that_fails_after_a_failed_read_keeps_the_read_error(
    ckpt_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    await aiockpt.save(state(), ckpt_path)
    failing_close(monkeypatch, lambda t: DATA in t, times=2)

    def preadv(*args: object) -> int:
        raise eio()

    monkeypatch.setattr(os, "preadv", preadv)
    with pytest.raises(StorageError, match=f"cannot read {ckpt_path / DATA}: "):
        await aiockpt.read(ckpt_path, io=IOConfig(direct_reads=False, drop_behind=False))
    assert open_on(DATA) == []


async def test_a_data_file_that_cannot_be_fstated_is_a_storage_error_naming_it(
    ckpt_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    await aiockpt.save(state(), ckpt_path)
    real = os.fstat

    def fstat(fd: int) -> os.stat_result:
        if DATA in target_of(fd):
            raise eio()
        return real(fd)

    monkeypatch.setattr(os, "fstat", fstat)
    for drop_behind in (True, False):  # (with drop-behind, cached_pages fstats it first)
        with pytest.raises(StorageError) as info:
            await aiockpt.read(ckpt_path, io=IOConfig(direct_reads=False, drop_behind=drop_behind))
        assert info.value.path == str(ckpt_path / DATA)
        assert str(info.value) == f"cannot read {ckpt_path / DATA}: {os.strerror(errno.EIO)}"
        assert open_on(DATA) == []


# --- paths that cannot be looked up


async def assert_cannot_read(path: Path, calls: list[Callable[[], Awaitable[object]]], error: int) -> None:
    """Each of ``calls`` raises a ``StorageError`` naming ``path`` and the OS error ``error`` (chained)."""
    for call in calls:
        with pytest.raises(StorageError) as info:
            await call()
        assert info.value.path == str(path)
        assert str(info.value) == f"cannot read {path}: {os.strerror(error)}"
        assert isinstance(info.value.__cause__, OSError)
        assert info.value.__cause__.errno == error


async def test_a_path_whose_name_is_too_long_is_a_storage_error_naming_it(tmp_path: Path) -> None:
    path = tmp_path / ("x" * 300)
    calls: list[Callable[[], Awaitable[object]]] = [
        lambda: aiockpt.read(path),
        lambda: aiockpt.load({}, path),
        lambda: aiockpt.read_metadata(path),
        lambda: aiockpt.verify(path),
    ]
    await assert_cannot_read(path, calls, errno.ENAMETOOLONG)


async def test_a_path_that_cannot_be_stated_is_a_storage_error_naming_it(
    ckpt_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # (The suite may run as root, whom a directory without search permission does not stop.)
    await aiockpt.save(state(), ckpt_path)
    real = os.stat

    def refusing(path: str | os.PathLike[str], *args: object, **kwargs: object) -> os.stat_result:
        if os.fspath(path) == str(ckpt_path):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(path))
        return real(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "stat", refusing)
    calls: list[Callable[[], Awaitable[object]]] = [
        lambda: aiockpt.read(ckpt_path),
        lambda: aiockpt.load(state(0), ckpt_path),
    ]
    await assert_cannot_read(ckpt_path, calls, errno.EACCES)


async def test_a_manifest_the_system_refuses_to_read_is_a_storage_error_naming_it(
    ckpt_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It was a FormatError ("cannot read ...: Input/output error"), as of a manifest of another format."""
    from aiockpt import _fs

    await aiockpt.save(state(), ckpt_path)
    manifest = ckpt_path / "manifest.msgpack"
    real = _fs.open_regular

    def refusing(path: Path) -> int:
        if path == manifest:
            raise eio()
        return real(path)

    monkeypatch.setattr(_fs, "open_regular", refusing)
    calls: list[Callable[[], Awaitable[object]]] = [
        lambda: aiockpt.read(ckpt_path),
        lambda: aiockpt.load(state(0), ckpt_path),
        lambda: aiockpt.read_metadata(ckpt_path),
        lambda: aiockpt.verify(ckpt_path),
    ]
    await assert_cannot_read(manifest, calls, errno.EIO)
    monkeypatch.undo()
    manifest.unlink()
    manifest.mkdir()  # something else in its place is still a FormatError
    with pytest.raises(aiockpt.FormatError, match="cannot read"):
        await aiockpt.read(ckpt_path)


async def test_a_directory_that_cannot_be_listed_for_parts_is_a_storage_error_naming_it(
    ckpt_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt_path.mkdir()  # no manifest: its parts are looked for
    real = os.listdir

    def listdir_failing(path: str | os.PathLike[str] = ".") -> list[str]:
        if os.fspath(path) == str(ckpt_path):
            raise eio()
        return real(path)

    monkeypatch.setattr(os, "listdir", listdir_failing)
    calls: list[Callable[[], Awaitable[object]]] = [
        lambda: aiockpt.read(ckpt_path),
        lambda: aiockpt.read_metadata(ckpt_path),
        lambda: aiockpt.verify(ckpt_path),
    ]
    await assert_cannot_read(ckpt_path, calls, errno.EIO)
    # A missing path is still what it always was.
    with pytest.raises(aiockpt.CheckpointNotFoundError):
        await aiockpt.read(ckpt_path.with_name("missing"))
